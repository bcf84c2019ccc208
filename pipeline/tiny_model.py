"""The tiny character-level Llama that lets the whole pipeline run on a laptop CPU.

`build_tiny_model` makes a character tokenizer and a ~0.45M-parameter LlamaForCausalLM and trains it briefly
with supervised learning on the built-in arithmetic task (`"12+34="` -> `"46</s>"`): a bounded number of
steps, stopping early once its held-out pass rate at temperature 1.0 reaches `target_pass_rate`. The result
(~0.3 at T=1.0 on two-digit addition and subtraction) leaves RL room to improve.

Invariants:
- Deterministic for a seed: data come from `random.Random(seed)`, weights and dropout-free training from
  `torch.manual_seed(seed)`, evaluation sampling from its own `torch.Generator`, and torch runs on ONE
  thread during the build (multi-threaded CPU kernels may sum in a different order). The stop rule counts
  steps, never seconds; `max_train_seconds` is only a safety net and the stats say when it fired.
- The tokenizer maps each character to one token, adds `<s>` in front of every encoded text when
  `add_special_tokens=True` (what both transformers and vLLM do for a plain prompt), and decodes by plain
  concatenation, so `decode(encode(x, add_special_tokens=False)) == x` for printable ASCII `x` (unless `x`
  contains a literal special-token string such as "<s>", which encodes as that one special token).
- A finished directory always holds `tiny_model.json` with `builder_version`; `ensure_tiny_model` rebuilds
  when it differs and publishes by atomic rename under a file lock.
- Seed 0's build ships with the package (`SHIPPED`, 1.8 MB, built on the machine the README's tiny-model results
  come from); `ensure_tiny_model` copies it instead of spending ~100 s of CPU on the same build, as long as it is
  of this builder's version (a test holds it so). `--force` builds from scratch.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.data import Example, arithmetic_problem, make_arithmetic

BUILDER_VERSION = 2  # bump whenever the tokenizer, architecture or training recipe changes
# The task the tiny model is made for: two-digit addition and subtraction (operands 0-99). It learns these to a
# pass rate of about 0.3 at T = 1.0, with per-problem rates spread between 0 and 1: what adaptive sampling
# feeds on. (Mixing in one-digit problems gives a bimodal model: ~all of those right, ~none of the others.)
TASK_LEVELS = (2,)
STATS_FILE = "tiny_model.json"
SHIPPED = Path(__file__).resolve().parent / "assets" / "tiny-model"  # seed 0's build (rebuild it: see main())
PROMPT_TEMPLATE = "{problem}="
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHARS = tuple(chr(c) for c in range(32, 127))  # printable ASCII: digits, + - = \ {} letters, space...
# head_dim 32: vLLM's CPU attention rejects 16. Untied lm_head: every tensor loads and reloads on its own.
MODEL_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
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


def _train_batch(rng: random.Random, batch_size: int, levels: tuple[int, ...], weights: tuple[float, ...]):
    """Input ids and labels (-100 outside the answer and EOS) for `batch_size` fresh problems."""

    seqs, starts = [], []
    for _ in range(batch_size):
        ex = arithmetic_problem(rng, rng.choices(levels, weights)[0])
        prompt = _encode(ex.problem)
        seqs.append(prompt + [len(SPECIAL_TOKENS) + CHARS.index(c) for c in ex.answer] + [EOS_ID])
        starts.append(len(prompt))
    return completion_batch(seqs, starts, PAD_ID)


def completion_batch(seqs: list[list[int]], starts: list[int], pad_id: int):
    """Right-padded token ids [B, T] and labels [B, T] that are -100 everywhere but at each sequence's
    completion (from its start index on): the batch of supervised completion training."""
    import torch

    width = max(len(s) for s in seqs)
    ids_BT = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels_BT = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        ids_BT[i, : len(seq)] = torch.tensor(seq)
        labels_BT[i, start: len(seq)] = torch.tensor(seq[start:])
    return ids_BT, labels_BT


def measure_pass_rate(model, examples: list[Example], temperature: float = 1.0, seed: int = 0,
                      max_new_tokens: int = 8) -> float:
    """Fraction of `examples` whose sampled completion (full vocabulary, top_p 1) is exactly the answer + EOS."""
    flags = sample_correct(model, examples, temperature, seed, max_new_tokens)
    return sum(flags) / len(flags)


def sample_correct(model, examples: list[Example], temperature: float = 1.0, seed: int = 0,
                   max_new_tokens: int = 8) -> list[bool]:
    """For each example (in order), whether one sampled completion is exactly its answer followed by EOS.

    Samples with a private torch.Generator, so it neither reads nor disturbs the global RNG. Prompts are
    grouped by length, so a batch needs no padding and no attention mask.
    """
    import torch

    if not examples:
        raise ValueError("sample_correct needs at least one example")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    gen = torch.Generator().manual_seed(seed)
    by_len: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        by_len.setdefault(len(_encode(ex.problem)), []).append(i)
    was_training = model.training
    model.eval()
    correct = [False] * len(examples)
    with torch.no_grad():
        for length in sorted(by_len):
            group = by_len[length]
            ids_BT = torch.tensor([_encode(examples[i].problem) for i in group])
            for _ in range(max_new_tokens):
                logits_BV = model(input_ids=ids_BT, use_cache=False).logits[:, -1].float()
                probs_BV = torch.softmax(logits_BV / temperature, dim=-1)
                ids_BT = torch.cat([ids_BT, torch.multinomial(probs_BV, 1, generator=gen)], dim=1)
            for i, row in zip(group, ids_BT[:, length:].tolist()):
                if EOS_ID in row:
                    text = "".join(CHARS[t - len(SPECIAL_TOKENS)] if t >= len(SPECIAL_TOKENS) else "\0"
                                   for t in row[: row.index(EOS_ID)])
                    correct[i] = text == examples[i].answer
    model.train(was_training)
    return correct


def _lr_factor(step: int, max_steps: int, warmup: int = 20) -> float:
    """Linear warmup, then cosine decay to 10%: the late small steps sharpen the answer distribution."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def build_tiny_model(out_dir: str | Path, seed: int = 0, *, max_steps: int = 3200, batch_size: int = 64,
                     lr: float = 3e-3, weight_decay: float = 0.1, eval_every: int = 100, num_eval: int = 300,
                     target_pass_rate: float | None = 0.3, pass_window: tuple[float, float] | None = (0.2, 0.6),
                     max_train_seconds: float | None = None, levels: tuple[int, ...] = TASK_LEVELS,
                     level_weights: tuple[float, ...] = (1.0,),
                     log=print) -> dict[str, Any]:
    """Build, train and save the tiny model into `out_dir` (created; existing files are overwritten).

    Trains until the held-out pass rate at T=1.0 reaches `target_pass_rate` (checked every `eval_every`
    steps) or `max_steps` is spent; `target_pass_rate=None` trains exactly `max_steps` steps. Raises
    RuntimeError if the final pass rate lies outside `pass_window` (None skips that check). Training draws
    levels with `level_weights` (easy problems first gives a useful model in fewer steps); evaluation draws
    `levels` uniformly, like `make_arithmetic`. `max_train_seconds` is an optional wall-clock safety net
    that breaks determinism when it fires. Returns the stats written to `tiny_model.json`: params, steps,
    build_seconds, pass_rate (T=1.0 on `num_eval` held-out problems) and the recipe.
    """
    import torch

    if max_steps < 1 or batch_size < 1 or eval_every < 1 or num_eval < 1:
        raise ValueError("max_steps, batch_size, eval_every and num_eval must all be >= 1")
    if len(level_weights) != len(levels):
        raise ValueError(f"level_weights {level_weights} needs one weight per level in {levels}")
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
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, max_steps))
        step, pass_rate, evaluated_at, stopped_by = 0, None, -1, "max_steps"
        while step < max_steps:
            ids_BT, labels_BT = _train_batch(data_rng, batch_size, levels, level_weights)
            loss = model(input_ids=ids_BT, labels=labels_BT).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if target_pass_rate is not None and step % eval_every == 0:
                flags, evaluated_at = sample_correct(model, eval_set, 1.0, seed=seed), step
                pass_rate = sum(flags) / len(flags)
                log(f"tiny model | step {step} | loss {loss.item():.3f} | pass@T1 {pass_rate:.3f} | "
                    f"{time.monotonic() - t0:.1f} s")
                if pass_rate >= target_pass_rate:
                    stopped_by = "target_pass_rate"
                    break
            if max_train_seconds is not None and time.monotonic() - t0 > max_train_seconds:
                stopped_by = "max_train_seconds"  # not deterministic: the stats flag it
                break
        if evaluated_at != step:
            flags = sample_correct(model, eval_set, 1.0, seed=seed)
            pass_rate = sum(flags) / len(flags)
        model.eval()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        torch.set_num_threads(old_threads)
    _write_tokenizer_extras(out)
    for path in out.iterdir():  # save_pretrained writes model.safetensors as 0600; callers may be other users
        path.chmod(0o644)
    out.chmod(0o755)
    stats = dict(builder_version=BUILDER_VERSION, seed=seed, params=sum(p.numel() for p in model.parameters()),
                 steps=step, stopped_by=stopped_by, pass_rate=pass_rate, pass_rate_temperature=1.0,
                 pass_rate_by_level=_by_level(eval_set, flags),
                 num_eval=num_eval, eval_seed=seed + EVAL_SEED_OFFSET, final_loss=loss.item(),
                 build_seconds=round(time.monotonic() - t0, 2), prompt_template=PROMPT_TEMPLATE,
                 batch_size=batch_size, lr=lr, weight_decay=weight_decay, max_steps=max_steps,
                 levels=list(levels), level_weights=list(level_weights), num_threads=1)
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    if pass_window is not None and not pass_window[0] <= pass_rate <= pass_window[1]:
        raise RuntimeError(f"tiny model pass rate {pass_rate:.3f} at T=1.0 is outside {pass_window} after "
                           f"{step} steps ({stopped_by}); change max_steps, lr or target_pass_rate")
    return stats


def _by_level(examples: list[Example], flags: list[bool]) -> dict[str, float]:
    """Pass rate per arithmetic level: a big problem set holds fewer easy problems (there are only 200 L1)."""
    groups: dict[str, list[bool]] = {}
    for ex, ok in zip(examples, flags):
        groups.setdefault(ex.source.rsplit(":", 1)[-1], []).append(ok)
    return {level: round(sum(oks) / len(oks), 4) for level, oks in sorted(groups.items())}


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


def is_current(model_dir: Path, seed: int) -> bool:
    """`model_dir` holds a finished build of this builder's version for `seed`."""
    stats = read_stats(model_dir)
    return stats is not None and stats.get("builder_version") == BUILDER_VERSION and stats.get("seed") == seed


def ensure_tiny_model(out_dir: str | Path, seed: int = 0, *, force: bool = False, log=print) -> Path:
    """Return `out_dir` holding a current tiny model for `seed`, building it first if missing or stale (seed 0:
    copied from the shipped build when that is current, unless `force`)."""

    def make(tmp: Path) -> None:
        if seed == 0 and not force and is_current(SHIPPED, 0):
            import shutil

            for path in SHIPPED.iterdir():
                shutil.copy2(path, tmp / path.name)
            log(f"tiny model: copied the shipped build of seed 0 ({SHIPPED})")
        else:
            build_tiny_model(tmp, seed=seed, log=log)

    return build_once(out_dir, lambda d: is_current(d, seed), make, STATS_FILE, "tiny-model", force=force)


def build_once(out_dir: str | Path, is_current: Callable[[Path], bool], build: Callable[[Path], Any],
               stats_file: str, kind: str, *, force: bool = False) -> Path:
    """Return `out_dir` after `build(tmp_dir)` made it, unless `is_current(out_dir)` already holds.

    Safe for concurrent callers: an exclusive lock on a sibling `.NAME.lock` file serialises builders (the
    second waits, then finds the finished build), and a build is published by renaming a finished temp
    directory into place, so nobody ever sees a half-written model directory. `stats_file` marks a finished
    build: a non-empty directory without it is refused (named as a `kind` directory) rather than replaced.
    """
    import fcntl
    import shutil
    import tempfile

    out = Path(out_dir).absolute()
    if not force and is_current(out):
        return out
    if out.exists() and not (out.is_dir() and ((out / stats_file).is_file() or not any(out.iterdir()))):
        raise ValueError(f"{out} exists and is not a {kind} directory (no {stats_file}); "
                         f"pass an empty or new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not force and is_current(out):
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            build(tmp)
            if out.exists():  # rename cannot replace a non-empty directory: move the old one aside first
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                out.rename(old)  # onto an empty directory: allowed
                tmp.rename(out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a no-op after a successful rename
    return out


def main(argv: list[str] | None = None) -> int:
    """`reinforce-ada make-tiny-model --out DIR [--seed S] [--force]`: build (or reuse) the tiny model."""
    parser = argparse.ArgumentParser(
        prog="reinforce-ada make-tiny-model",
        description="Build the tiny character-level Llama for the arithmetic task (CPU, about a minute).")
    parser.add_argument("--out", required=True, help="model directory to create (reused when current)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, data and evaluation")
    parser.add_argument("--force", action="store_true", help="rebuild from scratch even when a current build exists "
                        "(after a BUILDER_VERSION bump: --out pipeline/assets/tiny-model --force refreshes the "
                        "shipped build)")
    args = parser.parse_args(argv)
    path = ensure_tiny_model(args.out, seed=args.seed, force=args.force)
    print(json.dumps({"model_dir": str(path), **(read_stats(path) or {})}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
