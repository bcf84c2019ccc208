"""The tiny character-level Llama that lets the whole pipeline run on a laptop CPU.

`build_tiny_model` makes a character tokenizer and a ~0.9M-parameter LlamaForCausalLM, trains it briefly with
supervised learning on the built-in arithmetic task (`"12+34="` -> `"46</s>"`), and stops as soon as its
pass rate at temperature 1.0 reaches `target_pass_rate`: weak enough that RL has room to improve it.

Invariants:
- Deterministic for a seed: data come from `random.Random(seed)`, weights and dropout-free training from
  `torch.manual_seed(seed)`, evaluation sampling from its own `torch.Generator`, and torch runs on ONE
  thread during the build (multi-threaded CPU kernels may sum in a different order). The stop rule counts
  steps, never seconds; `max_train_seconds` is only a safety net and the stats say when it fired.
- The tokenizer maps each character to one token, adds `<s>` in front of every encoded text when
  `add_special_tokens=True` (what both transformers and vLLM do for a plain prompt), and decodes by plain
  concatenation, so `decode(encode(x, add_special_tokens=False)) == x` for printable ASCII `x`.
- A finished directory always holds `tiny_model.json` with `builder_version`; `ensure_tiny_model` rebuilds
  when it differs and publishes by atomic rename under a file lock.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from pipeline.data import Example, arithmetic_problem, make_arithmetic

BUILDER_VERSION = 1  # bump whenever the tokenizer, architecture or training recipe changes
STATS_FILE = "tiny_model.json"
PROMPT_TEMPLATE = "{problem}="
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHARS = tuple(chr(c) for c in range(32, 127))  # printable ASCII: digits, + - = \ {} letters, space...
# head_dim 32: vLLM's CPU attention rejects 16. Untied lm_head: every tensor loads and reloads on its own.
MODEL_SHAPE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                   head_dim=32, intermediate_size=384, max_position_embeddings=128, tie_word_embeddings=False)
EVAL_SEED_OFFSET = 1_000_003  # the held-out problems come from a seed the training stream never uses


def make_tokenizer():
    """A Hugging Face fast tokenizer with one token per printable ASCII character and no chat template."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    # BPE with no merges and no pre-tokenizer splits text into single characters, spaces included.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.decoder = decoders.Fuse()  # concatenate; the default decoder would join tokens with spaces
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", BOS_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        clean_up_tokenization_spaces=False, model_max_length=MODEL_SHAPE["max_position_embeddings"])


def make_model(vocab_size: int):
    """A freshly initialised float32 LlamaForCausalLM of MODEL_SHAPE (seed torch before calling)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                         pad_token_id=PAD_ID, **MODEL_SHAPE)
    model = LlamaForCausalLM(config)
    # Only token ids: sampling defaults here would silently change vLLM's default SamplingParams.
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return model


def _encode(problem: str) -> list[int]:
    """Token ids of `<s>{problem}=`, computed without a tokenizer object (one id per character)."""
    text = PROMPT_TEMPLATE.format(problem=problem)
    return [BOS_ID] + [len(SPECIAL_TOKENS) + CHARS.index(c) for c in text]


def _train_batch(rng: random.Random, batch_size: int, levels: tuple[int, ...]):
    """Input ids and labels (-100 outside the answer and EOS) for `batch_size` fresh problems."""
    import torch

    seqs, starts = [], []
    for _ in range(batch_size):
        ex = arithmetic_problem(rng, rng.choice(levels))
        prompt = _encode(ex.problem)
        seqs.append(prompt + [len(SPECIAL_TOKENS) + CHARS.index(c) for c in ex.answer] + [EOS_ID])
        starts.append(len(prompt))
    width = max(len(s) for s in seqs)
    ids_BT = torch.full((batch_size, width), PAD_ID, dtype=torch.long)
    labels_BT = torch.full((batch_size, width), -100, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        ids_BT[i, : len(seq)] = torch.tensor(seq)
        labels_BT[i, start: len(seq)] = torch.tensor(seq[start:])
    return ids_BT, labels_BT


def measure_pass_rate(model, examples: list[Example], temperature: float = 1.0, seed: int = 0,
                      max_new_tokens: int = 8) -> float:
    """Fraction of `examples` whose sampled completion (full vocabulary, top_p 1) is exactly the answer + EOS.

    Samples with a private torch.Generator, so it neither reads nor disturbs the global RNG. Prompts are
    grouped by length, so a batch needs no padding and no attention mask.
    """
    import torch

    if not examples:
        raise ValueError("measure_pass_rate needs at least one example")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    gen = torch.Generator().manual_seed(seed)
    by_len: dict[int, list[Example]] = {}
    for ex in examples:
        by_len.setdefault(len(_encode(ex.problem)), []).append(ex)
    was_training = model.training
    model.eval()
    num_correct = 0
    with torch.no_grad():
        for length in sorted(by_len):
            group = by_len[length]
            ids_BT = torch.tensor([_encode(ex.problem) for ex in group])
            for _ in range(max_new_tokens):
                logits_BV = model(input_ids=ids_BT, use_cache=False).logits[:, -1].float()
                probs_BV = torch.softmax(logits_BV / temperature, dim=-1)
                ids_BT = torch.cat([ids_BT, torch.multinomial(probs_BV, 1, generator=gen)], dim=1)
            for ex, row in zip(group, ids_BT[:, length:].tolist()):
                if EOS_ID in row:
                    text = "".join(CHARS[t - len(SPECIAL_TOKENS)] if t >= len(SPECIAL_TOKENS) else "\0"
                                   for t in row[: row.index(EOS_ID)])
                    num_correct += text == ex.answer
    model.train(was_training)
    return num_correct / len(examples)


def build_tiny_model(out_dir: str | Path, seed: int = 0, *, max_steps: int = 3000, batch_size: int = 64,
                     lr: float = 3e-3, eval_every: int = 50, num_eval: int = 300,
                     target_pass_rate: float | None = 0.35, pass_window: tuple[float, float] | None = (0.2, 0.6),
                     max_train_seconds: float = 170.0, levels: tuple[int, ...] = (1, 2, 3),
                     log=print) -> dict[str, Any]:
    """Build, train and save the tiny model into `out_dir` (created; existing files are overwritten).

    Trains until the held-out pass rate at T=1.0 reaches `target_pass_rate` (checked every `eval_every`
    steps) or `max_steps` is spent; `target_pass_rate=None` trains exactly `max_steps` steps. Raises
    RuntimeError if the final pass rate lies outside `pass_window` (None skips that check). Returns the stats
    written to `tiny_model.json`: params, steps, build_seconds, pass_rate (T=1.0, `num_eval` problems).
    """
    import torch

    if max_steps < 1 or batch_size < 1 or eval_every < 1 or num_eval < 1:
        raise ValueError("max_steps, batch_size, eval_every and num_eval must all be >= 1")
    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # determinism, see the module docstring; restored below
    try:
        torch.manual_seed(seed)
        tokenizer = make_tokenizer()
        model = make_model(len(tokenizer))
        model.train()
        eval_set = make_arithmetic(num_eval, levels=levels, seed=seed + EVAL_SEED_OFFSET)
        data_rng = random.Random(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
        warmup = 20
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        step, pass_rate, stopped_by = 0, None, "max_steps"
        while step < max_steps:
            ids_BT, labels_BT = _train_batch(data_rng, batch_size, levels)
            loss = model(input_ids=ids_BT, labels=labels_BT).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if target_pass_rate is not None and step % eval_every == 0:
                pass_rate = measure_pass_rate(model, eval_set, 1.0, seed=seed)
                log(f"tiny model | step {step} | loss {loss.item():.3f} | pass@T1 {pass_rate:.3f} | "
                    f"{time.monotonic() - t0:.1f} s")
                if pass_rate >= target_pass_rate:
                    stopped_by = "target_pass_rate"
                    break
            if time.monotonic() - t0 > max_train_seconds:
                stopped_by = "max_train_seconds"  # not deterministic: the stats flag it
                break
        if pass_rate is None or stopped_by != "target_pass_rate":
            pass_rate = measure_pass_rate(model, eval_set, 1.0, seed=seed)
        model.eval()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        torch.set_num_threads(old_threads)
    _write_tokenizer_extras(out)
    stats = dict(builder_version=BUILDER_VERSION, seed=seed, params=sum(p.numel() for p in model.parameters()),
                 steps=step, stopped_by=stopped_by, pass_rate=pass_rate, pass_rate_temperature=1.0,
                 num_eval=num_eval, eval_seed=seed + EVAL_SEED_OFFSET, final_loss=loss.item(),
                 build_seconds=round(time.monotonic() - t0, 2), prompt_template=PROMPT_TEMPLATE,
                 batch_size=batch_size, lr=lr, levels=list(levels))
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    if pass_window is not None and not pass_window[0] <= pass_rate <= pass_window[1]:
        raise RuntimeError(f"tiny model pass rate {pass_rate:.3f} at T=1.0 is outside {pass_window} after "
                           f"{step} steps ({stopped_by}); raise max_steps or max_train_seconds")
    return stats


def _write_tokenizer_extras(out: Path) -> None:
    """Name a tokenizer class and write special_tokens_map.json that transformers 4.x also understands."""
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # v5 writes "TokenizersBackend", unknown to v4
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    special = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def read_stats(model_dir: str | Path) -> dict[str, Any] | None:
    """The build stats of a tiny-model directory, or None when it has none (missing or unfinished)."""
    path = Path(model_dir) / STATS_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
