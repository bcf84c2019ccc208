"""Generation speed inside a real `reinforce-ada train` run against vLLM offline on the same model and cores.

    .venv/bin/python -m bench.train_throughput [--steps 12] [--max-new-tokens 48] [--prompts 400]

The model has the realistic test model's shape and tokenizer (pipeline/testing/realistic_model.py: BPE 8k
vocabulary, chat template, tied embeddings, GQA) and the prompts are 50-500 tokens long. Two parts, one run:

1. Generation throughput, generation-bound as a real run is (a 1.5B model decodes 2048 tokens per sample):
   the model's weights are random, so every sample runs to max_new_tokens, and the run is GRPO (`fixed`, zero-
   variance groups kept: its reward is always 0). Side by side:
   - offline: `vllm.LLM.generate` on every prompt (n = round size, T = 1, the same max_new_tokens), as one engine
     with both cores and as two engines with one core each, running at the same time;
   - train: `reinforce-ada train` (buffer, producers, learner and reward workers on the same machine) with one
     producer on two cores and with two producers on one core each; the producers' generated tokens/s comes
     from the heartbeat gauges the buffer records in metrics.jsonl (`producers/tokens_per_s`, steps after the
     first).
2. Time to the first learner step, with the trained realistic model and Reinforce-Ada-balance: engine start-up
   and the time from the engines being ready to the first learner step, from the run's logs.
Ratios are train / best offline. Writes bench/results/train_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench.output import RESULTS, ROOT, write

OFFLINE = """
import json, os, sys, time
from vllm import LLM, SamplingParams
from transformers import AutoTokenizer
from pipeline.data import load_dataset, render_prompt
from pipeline.producer.engine import UNIPROC_EXECUTOR
if __name__ == "__main__":
    model, data, k, new_tokens, part, parts, eager = sys.argv[1:8]
    k, new_tokens, part, parts = int(k), int(new_tokens), int(part), int(parts)
    tok = AutoTokenizer.from_pretrained(model)
    exs = load_dataset(data)[part::parts]
    prompts = [render_prompt(ex.problem, "auto", tok) for ex in exs]
    llm = LLM(model=model, max_model_len=1024, seed=0, enable_chunked_prefill=False, max_num_batched_tokens=4096,
              enforce_eager=eager == "1", distributed_executor_backend=UNIPROC_EXECUTOR)  # as a producer's engine
    llm.generate(prompts[:8], SamplingParams(n=k, max_tokens=new_tokens, seed=1), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [SamplingParams(n=k, max_tokens=new_tokens, seed=i) for i in range(len(prompts))],
                        use_tqdm=False)
    dt = time.perf_counter() - t0
    print("RESULT " + json.dumps({"tokens": sum(len(c.token_ids) for o in outs for c in o.outputs), "seconds": dt}))
"""


def split_cores() -> tuple[str, str]:
    """(the learner's cores, the producer's cores) of the pinned arms: the lower half and the upper half."""
    from pipeline.cores import compact

    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return compact(cores[:half]), compact(cores[half:] or cores[:half])


def offline(model: Path, data: Path, k: int, new_tokens: int, engines: int, eager: bool = False,
            cores: str = "") -> dict:
    """Generated tokens/s of `engines` offline engines run at once, the cores split evenly between them (or one
    engine pinned to `cores`, with one thread per core)."""
    from pipeline.cores import parse_cores

    pin = parse_cores(cores) if cores else None
    threads = len(pin) if pin else max(1, (os.cpu_count() or 2) // engines)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    # each engine's stderr goes to a file (a pipe read only after the other engine finished could stall it), and
    # its end is shown when the engine fails: the error says why (it used to be thrown away)
    errs = [tempfile.TemporaryFile("w+") for _ in range(engines)]
    procs = [subprocess.Popen([sys.executable, "-c", OFFLINE, str(model), str(data), str(k), str(new_tokens),
                               str(i), str(engines), "1" if eager else "0"], env=env, stdout=subprocess.PIPE,
                              stderr=errs[i], text=True, cwd=ROOT,
                              preexec_fn=(lambda: os.sched_setaffinity(0, pin)) if pin else None)
             for i in range(engines)]
    results = []
    for i, p in enumerate(procs):
        out, _ = p.communicate(timeout=1800)
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            errs[i].seek(0)
            raise RuntimeError(f"offline engine {i + 1} of {engines} failed with exit code {p.returncode}"
                               f"{' and no RESULT line' if line is None else ''}; its output ends:\n"
                               f"{out[-1000:]}\n{errs[i].read()[-3000:]}")
        results.append(json.loads(line[len("RESULT "):]))
    for f in errs:
        f.close()
    tokens = sum(r["tokens"] for r in results)
    seconds = max(r["seconds"] for r in results)  # they run at the same time: the pair is done when both are
    return {"engines": engines, "threads": threads, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "cores": cores}


def _stamp(line: str) -> float | None:
    m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)", line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def train(model: Path, data: Path, run_dir: Path, producers: int, steps: int, new_tokens: int,
          *extra: str, pinned: tuple[str, str] | None = None) -> dict:
    """One `train` run; `pinned` = (learner cores, producer cores): the learner (one thread per core) and the one
    producer's engine each on their own cores (the buffer and the reward workers float)."""
    from pipeline.cores import parse_cores

    threads = len(parse_cores(pinned[1])) if pinned else max(1, (os.cpu_count() or 2) // producers)
    if pinned:
        extra = (*extra, "--learner.cpu_cores", pinned[0], "--learner.cpu_threads", str(len(parse_cores(pinned[0]))),
                 "--producers.engine.cpu_cores", pinned[1],
                 # the buffer never holds the producer back for the learner: its tokens/s is its own rate
                 "--buffer.max_staleness", "1000")
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--config", str(ROOT / "configs" / "tiny.toml"),
           "--model.path", str(model), "--data.train_files", json.dumps([str(data)]), "--data.template", "auto",
           "--learner.eval_every", "0", "--sampling.max_new_tokens", str(new_tokens),
           "--producers.engine.max_model_len", "1024", "--producers.count", str(producers),
           "--producers.engine.cpu_threads", str(threads), "--learner.num_steps", str(steps),
           "--learner.checkpoint_every", "0", "--run.dir", str(run_dir), "--run.name", f"p{producers}{len(extra)}",
           "--endpoints.router_port", "0", "--run.live", "false", *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.time() - t0
    run = run_dir / f"p{producers}{len(extra)}"
    if proc.returncode != 0:
        raise RuntimeError(f"train with {producers} producer(s) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ready = []
    for i in range(producers):
        for line in (run / "logs" / f"producer-{i}.log").read_text(errors="replace").splitlines():
            if "ready (model" in line and _stamp(line) is not None:
                ready.append(_stamp(line))
                break
    steady = [r["producers/tokens_per_s"] for r in rows[1:]] or [rows[0]["producers/tokens_per_s"]]
    return {"producers": producers, "threads": threads, "steps": len(rows), "wall_s": wall,
            "pinned": list(pinned) if pinned else None, "learner_busy": learner_busy(rows),
            "engines_ready_s": max(ready) - t0 if ready else float("nan"),
            "first_step_after_ready_s": rows[0]["time"] - max(ready) if ready else float("nan"),
            "tokens_per_s": statistics.median(steady),
            "step_seconds": statistics.median(r["step_seconds"] + r["wait_seconds"] for r in rows[1:] or rows)}


def learner_busy(rows: list[dict]) -> float:
    """The learner's share of the run's time spent training (the rest it waited for batches), steps after the
    first."""
    rows = rows[1:] or rows
    train_s = sum(r["step_seconds"] for r in rows)
    return train_s / max(1e-9, train_s + sum(r["wait_seconds"] for r in rows))


def render(res: dict) -> str:
    best = max([r for r in res["offline"] if not r.get("cores")] or res["offline"], key=lambda r: r["tokens_per_s"])
    lines = ["# Generation inside `reinforce-ada train` vs vLLM offline (realistic test model)", "",
             f"`{res['command']}`: {res['prompts']} prompts of 50-500 tokens, {res['k']} samples each at T = 1, "
             f"max_new_tokens {res['max_new_tokens']}, {res.get('cpu_count', os.cpu_count())} CPU cores, all "
             "measured in one run.", "",
             "| setup | engines x threads | generated tokens/s | / best offline |", "|---|---|---:|---:|"]
    for r in res["offline"]:
        if not r.get("cores"):
            lines.append(f"| offline `LLM.generate` | {r['engines']} x {r['threads']} | {r['tokens_per_s']:.0f} | "
                         f"{r['tokens_per_s'] / best['tokens_per_s']:.2f} |")
    for r in res["train"]:
        if not r.get("pinned"):
            lines.append(f"| `train` (buffer, learner and reward workers share the cores) | {r['producers']} x "
                         f"{r['threads']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / best['tokens_per_s']:.2f} |")
    pinned_off = [r for r in res["offline"] if r.get("cores")]
    pinned_train = [r for r in res["train"] if r.get("pinned")]
    if pinned_off and pinned_train:
        off, tr = pinned_off[0], pinned_train[0]
        lines += ["", f"Each role on its own cores (`learner.cpu_cores = \"{tr['pinned'][0]}\"`, "
                  "`learner.cpu_threads` = its core count; "
                  f"`producers.engine.cpu_cores = \"{tr['pinned'][1]}\"`), against an offline engine pinned "
                  "to the producer's cores: what the pipeline costs generation when the learner does not take "
                  "the producer's cores (the buffer is not pinned; the producer's reward workers share its cores), "
                  "with "
                  "`buffer.max_staleness` 1000 so that the buffer never holds the producer back while the learner "
                  "trains (learner busy = its share of the run spent training rather than waiting for a batch).", "",
                  "| setup | cores | generated tokens/s | / offline on the same cores | learner busy |",
                  "|---|---|---:|---:|---:|",
                  f"| offline `LLM.generate`, 1 engine x {off['threads']} thread(s) | {off['cores']} | "
                  f"{off['tokens_per_s']:.0f} | 1.00 | |",
                  f"| `train`, 1 producer x {tr['threads']} thread(s) | producer {tr['pinned'][1]}, learner "
                  f"{tr['pinned'][0]} | {tr['tokens_per_s']:.0f} | {tr['tokens_per_s'] / off['tokens_per_s']:.2f} | "
                  f"{tr['learner_busy']:.0%} |"]
    lines += ["", "Time to the first learner step (trained realistic model, Reinforce-Ada-balance):", "",
              "| train setup | engines ready after | first learner step after engines ready | s per step "
              "(steady) | steps |", "|---|---:|---:|---:|---:|"]
    for r in res["first_step"]:
        lines.append(f"| {r['producers']} producer(s) x {r['threads']} thread(s) | {r['engines_ready_s']:.0f} s | "
                     f"{r['first_step_after_ready_s']:.1f} s | {r['step_seconds']:.1f} s | {r['steps']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="samples per prompt offline (= sampling.group_size, GRPO's n)")
    p.add_argument("--out", default=str(RESULTS / "train_throughput"))
    p.add_argument("--smoke", action="store_true", help="the pinned pair only (one offline engine, one 1-producer "
                   "run), eager engines, 4 groups per learner step, no time-to-first-step part (no trained model "
                   "needed): checks every path runs")
    args = p.parse_args(argv)
    from pipeline.testing.realistic_model import ensure_realistic_model, save_untrained, write_problems

    counts = () if args.smoke else (1, 2)  # the smoke runs the pinned pair only: the same code paths and more
    pinned = split_cores()
    trained = None if args.smoke else ensure_realistic_model()
    with tempfile.TemporaryDirectory() as tmp:
        untrained = save_untrained(Path(tmp) / "untrained")
        data = write_problems(Path(tmp) / "addition.jsonl", args.prompts, seed=5)
        runs = Path(tmp) / "runs"
        # random weights never earn a reward: the run must not stop for it (buffer.stop_without_signal)
        grpo = ("--sampling.exit_rule", "fixed", "--buffer.unresolved", "keep", "--buffer.stop_without_signal", "0")
        # the smoke: eager engines (no compilation: they start faster) and 4 groups per learner step, not
        # tiny.toml's 32 (the learner's steps on 32 x 4 prompts of 50-500 tokens were most of its train run)
        eager = ("--producers.engine.enforce_eager", "true", "--learner.batch_prompts", "4") if args.smoke else ()
        res = {"command": "python -m bench.train_throughput " + " ".join(argv or sys.argv[1:]),
               "prompts": args.prompts, "k": args.k, "max_new_tokens": args.max_new_tokens, "cpu_count": os.cpu_count(),
               "offline": [offline(untrained, data, args.k, args.max_new_tokens, n, args.smoke) for n in counts]
               + [offline(untrained, data, args.k, args.max_new_tokens, 1, args.smoke, cores=pinned[1])],
               "train": [train(untrained, data, runs, n, args.steps, args.max_new_tokens, *grpo, *eager)
                         for n in counts]
               + [train(untrained, data, runs, 1, args.steps, args.max_new_tokens, *grpo, *eager, pinned=pinned)],
               "first_step": [] if trained is None else [train(trained, data, runs, n, 3, 48) for n in counts]}
    text = render(res)
    write(Path(args.out).with_suffix(".md"), text, res, indent=2)
    print(text)
    return 0


if __name__ == "__main__":
    from bench import guard

    guard.main(main)
