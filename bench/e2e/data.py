"""The prompts of `bench.e2e`: the hard setting's training file (chosen by `reinforce-ada select-prompts`, cached),
the sweep's held-out file, and the check of what each run evaluates on.

Invariants:
- the hard file is selected once per (pool, selection rule, config file, tiny model) and cached under .cache/e2e/
  by a hash of all of them; cached files are complete or absent (written to a temporary name, then renamed);
- one held-out file serves every run of a sweep and holds no training problem of any of them; each run's held-out
  set is checked before any run starts, the way the pipeline builds it (`pipeline/prompts.py` removes training
  problems): it must hold `eval.num_problems` problems and none of them may be a training problem.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.e2e.strategies import CONFIG
from pipeline.config import load_config
from pipeline.data import make_arithmetic, normalize_problem
from pipeline.models import TINY_DIR
from pipeline.prompts import load_examples

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "e2e"
POOL_SEED = 7_000_003  # the hard set's pool: neither a training draw (run.seed + 1) nor the pipeline's held-out one
HELD_OUT_SEED = 9_000_011  # the sweep's held-out set (training problems of every run left out)
MAX_TWO_DIGIT = 20_000  # distinct two-digit problems: 100 x 100 operands x 2 operators


@dataclass(frozen=True)
class HardSpec:
    """Which two-digit problems form the hard set: those of a generated pool solved min..max times of `samples`."""

    pool: int = 4000
    samples: int = 16
    min_correct: int = 1
    max_correct: int = 5
    seed: int = POOL_SEED

    def check(self) -> None:
        if not 0 <= self.min_correct <= self.max_correct <= self.samples:
            raise ValueError(f"hard set: need 0 <= min_correct ({self.min_correct}) <= max_correct "
                             f"({self.max_correct}) <= samples ({self.samples})")
        if not 1 <= self.pool <= 20_000:
            raise ValueError(f"hard set: the pool must hold 1..20,000 two-digit problems, got {self.pool}")


def shown(path: Path) -> str:
    """`path` relative to the repository when it lies inside it (what the commands and reports show)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _key(spec: HardSpec, config: str) -> str:
    model = TINY_DIR / "tiny_model.json"  # the tiny model's build record (seed, builder version, pass rate)
    blob = json.dumps({"spec": asdict(spec), "config": (ROOT / config).read_text(),
                       "model": model.read_text() if model.is_file() else ""}, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def hard_files(spec: HardSpec, config: str = CONFIG, cache: Path = CACHE) -> tuple[Path, Path]:
    """Where the hard set of `spec` is cached: (the JSONL file, its selection record)."""
    key = _key(spec, config)
    return cache / f"hard-{key}.jsonl", cache / f"hard-{key}.json"


def hard_prompts(spec: HardSpec, config: str = CONFIG, cache: Path = CACHE) -> tuple[Path, dict]:
    """(the hard training file, its selection record), selecting it first unless it is cached."""
    spec.check()
    key = _key(spec, config)
    out, meta = hard_files(spec, config, cache)
    if out.is_file() and meta.is_file():
        return out, json.loads(meta.read_text())
    cache.mkdir(parents=True, exist_ok=True)
    pool = cache / f"pool-{key}.jsonl"
    with pool.open("w") as f:
        for ex in make_arithmetic(spec.pool, (2,), seed=spec.seed):
            f.write(json.dumps({"problem": ex.problem, "answer": ex.answer}) + "\n")
    tmp = cache / f".hard-{key}.jsonl.tmp"
    cmd = [sys.executable, "-m", "pipeline.cli", "select-prompts", "--model", "tiny", "--data", str(pool),
           "--out", str(out), "--samples", str(spec.samples), "--min-rate", repr(spec.min_correct / spec.samples),
           "--max-rate", repr(spec.max_correct / spec.samples), "--config", config]
    print(f"--- hard set: selecting from {spec.pool:,} two-digit problems, {spec.samples} samples each "
          f"(cached afterwards as {shown(out)})", flush=True)
    t0 = time.monotonic()
    # written under a temporary name first: an interrupted selection leaves no file that looks complete
    proc = subprocess.run([*cmd[:cmd.index("--out") + 1], str(tmp), *cmd[cmd.index("--out") + 2:]], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"select-prompts exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    # the counts are select-prompts' last JSON line (vLLM logs to stdout as well)
    counts = next(json.loads(line) for line in reversed(proc.stdout.splitlines()) if line.startswith('{"problems"'))
    if counts["kept"] == 0:
        raise RuntimeError(f"select-prompts kept no problem of {spec.pool}: widen the rate range ({counts})")
    record = {**counts, "spec": asdict(spec), "seconds": time.monotonic() - t0, "file": shown(out),
              "command": " ".join(["python -m pipeline.cli"] + cmd[3:]).replace(str(ROOT) + "/", "")}
    tmp.replace(out)
    meta.write_text(json.dumps(record, indent=1) + "\n")  # the pool stays: the command can be rerun as it is
    return out, record


def training_problems(overrides: list[str], config: str = CONFIG) -> set[str]:
    """The training problems (normalised, as the pipeline compares them) of a run with `overrides`."""
    cfg = load_config(ROOT / config, overrides)
    return {normalize_problem(ex.problem) for name in cfg.data.train_files for ex in load_examples(cfg, name, True)}


def held_out_file(num: int, runs: list[list[str]], config: str = CONFIG, cache: Path = CACHE) -> tuple[Path, dict]:
    """One held-out set for a whole sweep: the first `num` two-digit problems (drawn with HELD_OUT_SEED) that are no
    training problem of any run in `runs` (their overrides), written to a JSONL file named by its content.

    Every run then evaluates on the same problems, so the spread over seeds is training's, not the draw's."""
    exclude: set[str] = set().union(*(training_problems(o, config) for o in runs))
    draw = 2 * num
    while True:
        pool = make_arithmetic(min(draw, MAX_TWO_DIGIT), (2,), seed=HELD_OUT_SEED)
        kept = [ex for ex in pool if normalize_problem(ex.problem) not in exclude][:num]
        if len(kept) == num:
            break
        if draw >= MAX_TWO_DIGIT:
            raise ValueError(f"only {len(kept)} two-digit problems are no run's training problem; ask for fewer "
                             f"than {num} held-out problems")
        draw *= 2
    text = "".join(json.dumps({"problem": ex.problem, "answer": ex.answer}) + "\n" for ex in kept)
    path = cache / f"held-out-{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}.jsonl"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path, {"file": shown(path), "problems": num, "seed": HELD_OUT_SEED,
                  "excluded_training_problems": len(exclude)}


def held_out_check(overrides: list[str], config: str = CONFIG) -> dict:
    """Counts of the held-out set a run with `overrides` evaluates on: drawn, removed as training problems, used.

    Mirrors `pipeline.prompts.build_prompts` (the evaluation subprocess cross-checks the count it gets from it);
    ValueError when fewer than eval.num_problems remain."""
    cfg = load_config(ROOT / config, overrides)
    train = training_problems(overrides, config)
    drawn = [ex for name in cfg.data.eval_files for ex in load_examples(cfg, name, train=False)]
    kept = [ex for ex in drawn if normalize_problem(ex.problem) not in train]
    wanted = cfg.eval.num_problems
    if wanted and len(kept) < wanted:
        raise ValueError(f"held-out set: {len(drawn)} problems drawn, {len(drawn) - len(kept)} of them are training "
                         f"problems, leaving {len(kept)} < eval.num_problems ({wanted})")
    used = kept[:wanted] if wanted else kept
    assert not {normalize_problem(ex.problem) for ex in used} & train
    return {"drawn": len(drawn), "overlap_removed": len(drawn) - len(kept), "problems": len(used),
            "train_problems": len(train)}
