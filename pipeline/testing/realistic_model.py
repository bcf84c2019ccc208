"""A small model of realistic shape, built locally, so tests and benches meet what real models bring.

What the tiny character model never shows, this one has: a byte-level BPE tokenizer trained with `tokenizers` on
local text (vocabulary 8192, digits split one per token as in Qwen2.5), a ChatML chat template with a default
system prompt, tied input/output embeddings, grouped-query attention (4 query heads, 2 KV heads, head_dim 32)
and prompts of 50-500 tokens: a distractor passage of math text in front of each question.

The task: "{passage}\n\nWhat is A+B?" (A < 20, B < 10) answered as "The answer is \\boxed{S}."
It is trained briefly with supervised learning on the completion tokens until its pass rate at T = 1.0 lies
in a middle band, so RL runs on it see both right and wrong answers.

Invariants: the directory is a normal Hugging Face model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template, generation_config.json) that transformers and vLLM
load as they are; `ensure_realistic_model` rebuilds it when `BUILDER_VERSION` changes and publishes it by atomic
rename under a file lock; the build is deterministic for a seed (one torch thread, seeded data).
"""

from __future__ import annotations

import json
import math
import random
import sysconfig
import time
from pathlib import Path
from typing import Any

BUILDER_VERSION = 2
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / ".cache" / "realistic-model"
BENCHMARKS = ROOT.parent / "shared" / "data" / "benchmarks"
VOCAB_SIZE = 8192
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SYSTEM_PROMPT = "You are a helpful assistant."
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."  # = pipeline.data's
MODEL_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   intermediate_size=384, max_position_embeddings=1024, tie_word_embeddings=True,
                   rope_theta=10000.0)
STATS_FILE = "realistic_model.json"


# ---------------------------------------------------------------- text


def corpus_texts() -> list[str]:
    """Local text for the BPE: the benchmark problems and solutions, plus docstrings of the standard library."""
    texts = []
    for path in sorted(BENCHMARKS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            texts += [str(v) for k, v in row.items() if isinstance(v, str) and len(v) > 20]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:400]:
        texts.append(path.read_text(errors="replace")[:20000])
    return texts


def passages(seed: int = 0) -> list[str]:
    """Distractor passages (benchmark problem texts) to put in front of questions."""
    if not any(BENCHMARKS.glob("*.jsonl")):
        raise FileNotFoundError(f"no benchmark files in {BENCHMARKS}: the realistic model's text comes from the "
                                "shared data beside the checkout (../shared/data/benchmarks)")
    out = []
    for path in sorted(BENCHMARKS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            problem = json.loads(line).get("problem") or json.loads(line).get("question") or ""
            if problem:
                out.append(problem.strip())
    random.Random(seed).shuffle(out)
    return out


CHARS_PER_TOKEN = 2.6  # of the benchmark texts under this tokenizer (measured)


def make_problem(rng: random.Random, pool: list[str], passage_tokens: int) -> tuple[str, str]:
    """(problem text, answer): "What is A+B?" (A < 20, B < 10) after about `passage_tokens` tokens of math text."""
    a, b = rng.randint(0, 19), rng.randint(0, 9)
    budget = int(passage_tokens * CHARS_PER_TOKEN)
    context = ""
    while len(context) < budget:
        context += ("\n\n" if context else "") + rng.choice(pool)
    context = context[:budget].rsplit(" ", 1)[0] if budget else ""
    question = f"What is {a}+{b}?"
    return (f"{context}\n\n{question}" if context else question), str(a + b)


def write_problems(path: str | Path, num: int, seed: int = 0, min_tokens: int = 0,
                   max_tokens: int = 420) -> Path:
    """A JSONL file of `num` problems whose rendered prompts span about 50-500 tokens."""
    rng = random.Random(seed)
    pool = passages(seed)
    rows = []
    for _ in range(num):
        problem, answer = make_problem(rng, pool, rng.randint(min_tokens, max_tokens))
        rows.append(json.dumps({"problem": problem, "answer": answer}))
    path = Path(path)
    path.write_text("\n".join(rows) + "\n")
    return path


# ---------------------------------------------------------------- tokenizer and model


def make_tokenizer(texts: list[str]):
    """A byte-level BPE (digits split singly) with the ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False, model_max_length=MODEL_SHAPE[
                                      "max_position_embeddings"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(tokenizer):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
                         **MODEL_SHAPE)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    return model


def render(tokenizer, problem: str) -> str:
    """The prompt text exactly as the pipeline renders it (`data.template = "auto"`)."""
    messages = [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def completion(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}.<|im_end|>"


# ---------------------------------------------------------------- training


def _batch(rng, pool, tokenizer, size: int, lo: int, hi: int):
    """`size` training sequences (prompt + completion; labels on the completion) with passages of lo-hi tokens."""
    from pipeline.tiny_model import completion_batch

    seqs, starts = [], []
    for _ in range(size):
        problem, answer = make_problem(rng, pool, rng.randint(lo, hi))
        prompt = tokenizer(render(tokenizer, problem), add_special_tokens=True)["input_ids"]
        target_ids = tokenizer(completion(answer), add_special_tokens=False)["input_ids"]
        seqs.append(prompt + target_ids)
        starts.append(len(prompt))
    return completion_batch(seqs, starts, tokenizer.pad_token_id)


def _completion_loss(model, ids, labels):
    """Cross-entropy on the completion tokens only, with logits computed only where a label is (the LM head
    over every prompt position would cost more than the whole rest of the model)."""
    import torch

    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.lm_head(hidden[keep]).float()
    return torch.nn.functional.cross_entropy(logits, targets[keep])


def pass_rate(model, tokenizer, problems: list[tuple[str, str]], seed: int = 0, max_new_tokens: int = 16) -> float:
    """Share of problems whose one sample at T = 1.0 boxes the right answer (transformers; all problems in one
    left-padded batch with a KV cache: one forward pass per new token)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompts = [tokenizer(render(tokenizer, problem))["input_ids"] for problem, _ in problems]
    n, width, pad, eos = len(prompts), max(map(len, prompts)), tokenizer.pad_token_id, tokenizer.eos_token_id
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(n, dtype=torch.bool)
    model.eval()
    with torch.no_grad():
        step_ids, past = ids, None
        for _ in range(max_new_tokens):
            positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            o = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                      use_cache=True, logits_to_keep=1)
            past = o.past_key_values
            nxt = torch.multinomial(torch.softmax(o.logits[:, -1].float(), -1), 1, generator=gen)[:, 0]
            for i in torch.nonzero(~done).flatten().tolist():
                out[i].append(int(nxt[i]))
            done |= nxt == eos
            if bool(done.all()):
                break
            step_ids = torch.where(done, pad, nxt)[:, None]
            mask = torch.cat([mask, (~done).long()[:, None]], 1)
    model.train()
    ok = sum(f"\\boxed{{{answer}}}" in tokenizer.decode(o) for o, (_, answer) in zip(out, problems))
    return ok / len(problems)


def build(out_dir: str | Path, seed: int = 0, steps: int = 1000, batch_size: int = 16, lr: float = 3e-3,
          target: tuple[float, float] = (0.25, 0.6), log=print, check_every: int = 25) -> dict[str, Any]:
    """Train until the pass rate at T = 1 reaches target[0] (checked every `check_every` steps). Raises
    RuntimeError, saving nothing, when the last check lies outside `target` (never reached its floor in `steps`, or
    overshot its ceiling between two checks): RL on a model that is always or never right has nothing to learn.

    The cost is the training steps (~0.1 s of one core each at batch 16; the tokenizer takes ~2 s, a pass-rate
    check ~0.7 s): the model sits near chance (~0.05) for a few hundred steps, then learns to read A and B.
    So the batches are cheap: 16 questions after 0-10 passage tokens (the fixed chat template, system prompt
    and instruction are most of a prompt), and every 8th step 8 questions after 40-420 tokens so long prompts
    (and positions up to ~500) are seen in training too (a batch pads to its longest sequence: mixing lengths
    would make every batch long). Batches of 32 with passages of 0-40 tokens cost 3x as much per step
    and took about as many steps. One torch thread, so a seed always builds the same model.
    """
    import torch

    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        tokenizer = make_tokenizer(corpus_texts())
        model = make_model(tokenizer)
        rng, pool = random.Random(seed), passages(seed)
        eval_rng = random.Random(seed + 1_000_003)
        evals = [make_problem(eval_rng, pool, eval_rng.randint(0, 60)) for _ in range(100)]
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.1)
        warm = 30
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / warm if s < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))
        rate, step = 0.0, 0
        for step in range(1, steps + 1):
            if step % 8 == 0:
                ids, labels = _batch(rng, pool, tokenizer, max(1, batch_size // 2), 40, 420)
            else:
                ids, labels = _batch(rng, pool, tokenizer, batch_size, 0, 10)
            loss = _completion_loss(model, ids, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % check_every == 0:
                rate = pass_rate(model, tokenizer, evals, seed)
                if step % 100 == 0 or rate >= target[0]:
                    log(f"realistic model | step {step} | loss {loss.item():.3f} | pass@T1 {rate:.2f} | "
                        f"{time.monotonic() - t0:.0f} s")
                if rate >= target[0]:
                    break
    finally:
        torch.set_num_threads(threads)
    if not target[0] <= rate <= target[1]:
        raise RuntimeError(f"realistic model (seed {seed}): pass rate {rate:.2f} at T=1.0 after {step} steps is "
                           f"outside {target}; change steps, lr or check_every, or try another seed")
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():  # save_pretrained writes model.safetensors as 0600
        path.chmod(0o644)
    stats = dict(builder_version=BUILDER_VERSION, seed=seed, steps=step, pass_rate=rate, vocab_size=len(tokenizer),
                 params=sum(p.numel() for p in model.parameters()), seconds=round(time.monotonic() - t0, 1))
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def read_stats(model_dir: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(model_dir) / STATS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_current(model_dir: str | Path, seed: int = 0) -> bool:
    """`model_dir` holds a finished build of this builder's version for `seed`."""
    stats = read_stats(model_dir)
    return stats is not None and stats.get("builder_version") == BUILDER_VERSION and stats.get("seed") == seed


def ensure_realistic_model(out_dir: str | Path = DEFAULT_DIR, seed: int = 0, *, force: bool = False,
                           log=print) -> Path:
    """`out_dir` holding a current realistic model for `seed` (built once, about 95 s of one core)."""
    from pipeline.tiny_model import build_once

    return build_once(out_dir, lambda d: is_current(d, seed), lambda d: build(d, seed=seed, log=log), STATS_FILE,
                      "realistic-model", force=force)


def save_untrained(out_dir: str | Path, seed: int = 0) -> Path:
    """The same tokenizer and shape with random weights: it almost never emits EOS, so every sample runs to
    max_new_tokens (a generation-bound workload for throughput benchmarks; its reward is always 0)."""
    import torch

    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = make_tokenizer(corpus_texts())
    make_model(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
