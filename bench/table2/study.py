"""Table 2 of Reinforce-Ada, reproduced in a cost model, and this project's setups in the same model:
`python -m bench.table2 [--quick]`.

Reference rows: round-synchronous, colocated GRPO, Ada-pos and Ada-balance with the paper's semantics (max_staleness
0, unresolved "keep", downsample "first", N = 4, M = 8, n = 4) on 8 GPUs that generate and then train, over the
selected population at six phases of a 600-step run (`bench.sim.population`), every constant stated in
`bench.sim.costmodel`. The paper: GRPO 102 s, Ada-pos 228 s (2.2x), Ada-balance 290 s (2.8x) per update.
Then: a check of the population against the paper's Fig. 5, the sensitivity of both ratios to each constant
(+-50%, by replaying the reference runs' traces), what it would take to match the paper's absolute seconds, and the
streaming rows: GRPO, Ada-pos and Ada-balance, each with unresolved "keep" and "drop", on 4+4 and 6+2 splits of the
8 GPUs (weight sync included), per step and per useful group (a group holding both rewards) relative to
round-synchronous GRPO and to streaming GRPO (fixed + keep) on the same split.
Writes bench/results/table2.json and table2.md (rendered from the JSON by `bench.table2.report`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from bench import output
from bench.sim.costmodel import SENSITIVITY, SOURCES, Constants, derived
from bench.sim.population import FIG5_EXTRA, FIG5_UNRESOLVED, TABLE2_STEPS, curve_at, pass_rates
from bench.sim.run import SimConfig, Strategy, simulate
from bench.sim.trace import Trace
from bench.table2.report import render
from pipeline.config import SamplingConfig

RULES = ("fixed", "pos", "balance")
NAMES = {"fixed": "GRPO", "pos": "Ada-pos", "balance": "Ada-balance"}
PAPER_S = {"fixed": 102.0, "pos": 228.0, "balance": 290.0}  # Table 2, Qwen2.5-Math-1.5B, 8 x H100
SPLITS = ((4, 4), (6, 2))  # (generation GPUs, training GPUs)


@dataclass(frozen=True)
class Table2Config:
    batch_size: int = 512  # B: prompts per step
    phases: tuple[int, ...] = TABLE2_STEPS  # training steps at which the population is taken
    steps_per_phase: int = 2  # reference steps simulated per phase
    stream_warmup: int = 2  # streaming steps run before measuring, per phase
    stream_steps: int = 3  # streaming steps measured per phase
    band_draws: int = 400  # draws of every constant at once (joint_band)
    gpus: int = 8
    reference_slots: int = 1024  # verl's vLLM max_num_seqs
    project_slots: int = 512  # configs/qwen2.5-math-1.5b.toml producers.engine.max_num_seqs
    seed: int = 0


def _population(rule: str, step: int, num: int, seed: int) -> np.ndarray:
    # GRPO's run follows its own (lower) reward curve; Ada-pos and Ada-balance share prompts at a phase
    return pass_rates(step, "fixed" if rule == "fixed" else "ada", num, np.random.default_rng([seed, step]))


def _mean(rows: list[dict]) -> dict:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def run_reference(cfg: Table2Config, c: Constants) -> tuple[dict, dict]:
    """Per rule: metrics averaged over the phases (with the per-phase rows), and the traces for replays."""
    sim = SimConfig(cfg.batch_size, cfg.steps_per_phase, 0, cfg.gpus, cfg.reference_slots, cfg.gpus, c, cfg.seed)
    out, traces = {}, {}
    for rule in RULES:
        phases, traces[rule] = [], []
        for step in cfg.phases:
            trace = Trace()
            p = _population(rule, step, cfg.batch_size * (cfg.steps_per_phase + 1), cfg.seed)
            phases.append({"step": step, **simulate(Strategy(NAMES[rule], rule, False), p, sim, trace)})
            traces[rule].append(trace)
        out[rule] = {**_mean([{k: v for k, v in r.items() if k != "step"} for r in phases]), "phases": phases}
    return out, traces


def replay_seconds(traces: dict, cfg: Table2Config, c: Constants) -> dict[str, float]:
    """Mean seconds per step of each rule's reference runs under constants `c`."""
    return {rule: float(np.mean([s for t in traces[rule] for s in t.replay(c, cfg.gpus, cfg.batch_size, 4,
                                                                            cfg.reference_slots)]))
            for rule in RULES}


def ratios(seconds: dict[str, float]) -> dict[str, float]:
    return {rule: seconds[rule] / seconds["fixed"] for rule in ("pos", "balance")}


def sensitivity(traces: dict, cfg: Table2Config, c: Constants) -> list[dict]:
    """Both ratios with each constant at 0.5x and 1.5x of its value (all others fixed)."""
    rows = []
    for name in SENSITIVITY:
        row = {"constant": name, "value": getattr(c, name)}
        for label, factor in (("low", 0.5), ("high", 1.5)):
            varied = replace(c, **{name: getattr(c, name) * factor})
            row[label] = ratios(replay_seconds(traces, cfg, varied))
        rows.append(row)
    return rows


_GENERATION = ("t0", "t1", "tkv", "prefill_s_per_token")
ABSOLUTE_FITS = {  # where the paper's extra seconds could be: which constants scale together
    "per-update constant (step_overhead_s)": ("step_overhead_s",),
    "learner (1 / learner_mfu)": ("learner_mfu",),
    "generation (t0, t1, tkv, prefill)": _GENERATION,
    "per-round overhead (round_overhead_s)": ("round_overhead_s",),
    "driver scoring (reward_s_per_sample)": ("reward_s_per_sample",),
    "every time constant alike": _GENERATION + ("round_overhead_s", "reward_s_per_sample", "step_overhead_s",
                                                "learner_mfu"),
}
ABLATIONS = {  # which parts of the model make the ratios (and the gap between them)
    "as derived": {},
    "no per-sample scoring in the driver": {"reward_s_per_sample": 0.0},
    "decode step flat in batch and context (t1 = tkv = 0)": {"t1": 0.0, "tkv": 0.0},
    "both (the old model's engine)": {"reward_s_per_sample": 0.0, "t1": 0.0, "tkv": 0.0},
    "lengths independent of correctness and difficulty": {"len_correct": 700.0, "len_wrong": 700.0,
                                                          "len_difficulty": 0.0, "trunc_wrong": 0.0},
    "no per-round overhead": {"round_overhead_s": 0.0},
}


def _scaled(c: Constants, names: tuple[str, ...], k: float) -> Constants:
    """`c` with the time constants `names` k times larger (learner_mfu k times smaller: k times slower)."""
    return replace(c, **{n: getattr(c, n) / k if n == "learner_mfu" else getattr(c, n) * k for n in names})


def ablations(traces: dict, cfg: Table2Config, c: Constants) -> list[dict]:
    """Both ratios with parts of the model switched off (replaying the same reference runs)."""
    rows = []
    for label, overrides in ABLATIONS.items():
        seconds = replay_seconds(traces, cfg, replace(c, **overrides))
        rows.append({"variant": label, "seconds": seconds, "ratios": ratios(seconds)})
    return rows


def absolute_fits(traces: dict, cfg: Table2Config, c: Constants) -> list[dict]:
    """For each place the missing seconds could be: the scale that makes GRPO take the paper's 102 s, and the
    ratios that then follow (bisection on the scale, replaying the traces)."""
    rows = []
    for label, names in ABSOLUTE_FITS.items():
        lo, hi = 1.0, 1.0
        while replay_seconds(traces, cfg, _scaled(c, names, hi))["fixed"] < PAPER_S["fixed"] and hi < 1e4:
            lo, hi = hi, hi * 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if replay_seconds(traces, cfg, _scaled(c, names, mid))["fixed"] < PAPER_S["fixed"] \
                else (lo, mid)
        seconds = replay_seconds(traces, cfg, _scaled(c, names, hi))
        rows.append({"where": label, "scale": hi, "seconds": seconds, "ratios": ratios(seconds)})
    return rows


BAND_SPREAD = 2.0  # a plausible constant lies within 1/2x..2x of its derived value (log-uniform)


def joint_band(traces: dict, cfg: Table2Config, c: Constants, draws: int | None = None,
               spread: float = BAND_SPREAD) -> dict:
    """The ratios that plausible constants give, all varied at once: every constant of the sensitivity table drawn
    log-uniformly within 1/spread..spread of its value, `draws` times (replaying the reference traces). Reports the
    5-95% band of each ratio, whether the paper's ratio is inside it, and the share of draws within +-20% of the
    paper: a share near 1 says the +-20% check could hardly have failed."""
    draws = cfg.band_draws if draws is None else draws
    rng = np.random.default_rng([cfg.seed, 2])
    paper = ratios(PAPER_S)
    got: dict[str, list[float]] = {"pos": [], "balance": []}
    for _ in range(draws):
        k = np.exp(rng.uniform(-np.log(spread), np.log(spread), len(SENSITIVITY)))
        r = ratios(replay_seconds(traces, cfg, replace(c, **{n: getattr(c, n) * f for n, f in zip(SENSITIVITY, k)})))
        for rule in got:
            got[rule].append(r[rule])
    out: dict = {"draws": draws, "spread": spread}
    for rule, vals in got.items():
        lo, mid, hi = (float(x) for x in np.percentile(vals, [5, 50, 95]))
        out[rule] = {"p5": lo, "p50": mid, "p95": hi, "paper": paper[rule], "paper_inside": lo <= paper[rule] <= hi,
                     "within_20pct_share": float(np.mean([abs(v / paper[rule] - 1) <= 0.2 for v in vals]))}
    return out


OUT_OF_SAMPLE_KNOB = ("learner_mfu",)  # the constant the ratios move most with (the sensitivity table)


def out_of_sample(traces: dict, cfg: Table2Config, c: Constants, knob: tuple[str, ...] = OUT_OF_SAMPLE_KNOB) -> list:
    """Calibrate on one column, predict the other: the scale of `knob` that makes one rule's ratio the paper's
    (bisection over 1/16..16, replaying the traces), then the other rule's ratio at that scale against the paper's.
    None where no scale in range reaches the paper's ratio."""
    paper = ratios(PAPER_S)
    rows = []
    for fit, predict in (("pos", "balance"), ("balance", "pos")):
        def at(k: float) -> dict[str, float]:
            return ratios(replay_seconds(traces, cfg, _scaled(c, knob, k)))
        lo, hi = 1 / 16, 16.0
        f_lo, f_hi = at(lo)[fit] - paper[fit], at(hi)[fit] - paper[fit]
        if f_lo * f_hi > 0:
            rows.append({"fit": fit, "predict": predict, "knob": list(knob), "scale": None})
            continue
        for _ in range(40):
            mid = (lo * hi) ** 0.5
            f_mid = at(mid)[fit] - paper[fit]
            lo, hi, f_lo = (mid, hi, f_mid) if f_mid * f_lo > 0 else (lo, mid, f_lo)
        r = at(hi)
        rows.append({"fit": fit, "predict": predict, "knob": list(knob), "scale": hi, "fitted": r[fit],
                     "predicted": r[predict], "paper": paper[predict], "error": r[predict] / paper[predict] - 1})
    return rows


def fig5_check(reference: dict) -> list[dict]:
    """The model's samples beyond the first round and Ada-balance's unresolved prompts next to the paper's Fig. 5."""
    rows, M = [], SamplingConfig().round_size
    scale = 512 / reference["pos"]["phases"][0]["admitted_per_step"]  # the paper's counts are per 512 prompts
    unresolved = {"no_pos": tuple((s, a) for s, a, _ in FIG5_UNRESOLVED),
                  "no_neg": tuple((s, b) for s, _, b in FIG5_UNRESOLVED)}
    for i, step in enumerate(reference["pos"]["phases"]):
        s = step["step"]
        row = {"step": s}
        for rule in ("pos", "balance"):
            ph = reference[rule]["phases"][i]
            row[f"{rule}_extra"] = scale * (ph["samples_per_step"] - ph["admitted_per_step"] * M)  # rounds 2-4
            last = FIG5_EXTRA[rule][-1][0]
            row[f"{rule}_extra_paper"] = curve_at(FIG5_EXTRA[rule], s) if s <= last else None
        bal = reference["balance"]["phases"][i]
        for kind in ("no_pos", "no_neg"):
            row[f"unresolved_{kind}"] = scale * bal[f"unresolved_{kind}_per_step"]
            last = unresolved[kind][-1][0]
            row[f"unresolved_{kind}_paper"] = curve_at(unresolved[kind], s) if s <= last else None
        rows.append(row)
    return rows


def run_streaming(cfg: Table2Config, c: Constants, reference: dict) -> list[dict]:
    """Every streaming setup on every split, averaged over the phases, with its costs relative to both GRPOs."""
    ref_useful = reference["fixed"]["time_per_step"] / reference["fixed"]["useful_per_step"]
    rows = []
    for engines, trainers in SPLITS:
        sim = SimConfig(cfg.batch_size, cfg.stream_steps, cfg.stream_warmup, engines, cfg.project_slots, trainers,
                        c, cfg.seed)
        split = []
        for rule in RULES:
            for unresolved in ("keep", "drop"):
                strategy = Strategy(f"{NAMES[rule]} {unresolved}", rule, True, unresolved=unresolved)
                num = 3 * cfg.batch_size * (cfg.stream_warmup + cfg.stream_steps + 2)
                per_phase = [simulate(strategy, _population(rule, s, num, cfg.seed), sim) for s in cfg.phases]
                m = _mean(per_phase)
                split.append({"split": f"{engines}+{trainers}", "rule": rule, "unresolved": unresolved, **m,
                              "s_per_useful": m["time_per_step"] / m["useful_per_step"]})
        grpo = next(r for r in split if r["rule"] == "fixed" and r["unresolved"] == "keep")["s_per_useful"]
        for r in split:
            r["vs_reference_grpo"] = r["s_per_useful"] / ref_useful
            r["vs_streaming_grpo"] = r["s_per_useful"] / grpo
        rows += split
    return rows


def run(cfg: Table2Config, c: Constants) -> dict:
    """Everything `bench.table2` reports, as one JSON-able dict."""
    started = time.perf_counter()
    reference, traces = run_reference(cfg, c)
    seconds = {rule: reference[rule]["time_per_step"] for rule in RULES}
    model = ratios(seconds)
    paper = ratios(PAPER_S)
    return {
        "config": asdict(cfg),
        "constants": asdict(c),
        "sources": SOURCES,
        "derived": derived(c),
        "paper_seconds": PAPER_S,
        "paper_ratios": paper,
        "reference": reference,
        "ratios": model,
        "within_20pct": {rule: abs(model[rule] / paper[rule] - 1) <= 0.2 for rule in model},
        "fig5": fig5_check(reference),
        "sensitivity": sensitivity(traces, cfg, c),
        "joint_band": joint_band(traces, cfg, c),
        "out_of_sample": out_of_sample(traces, cfg, c),
        "absolute_fits": absolute_fits(traces, cfg, c),
        "ablations": ablations(traces, cfg, c),
        "streaming": run_streaming(cfg, c, reference),
        "elapsed_s": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="B = 64, two phases, one step each (seconds; for tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(output.RESULTS), help="directory for table2.json and table2.md")
    args = ap.parse_args(argv)
    cfg = Table2Config(seed=args.seed)
    if args.quick:
        cfg = replace(cfg, batch_size=64, phases=(50, 450), steps_per_phase=1, stream_warmup=1, stream_steps=1,
                      band_draws=40)
    data = run(cfg, Constants())
    data["command"] = ("python -m bench.table2 " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    dest = Path(args.out)
    md = render(data)
    output.write(dest / "table2.md", md, data)
    print(md)
    print(f"ratios to GRPO: Ada-pos {data['ratios']['pos']:.2f}x (paper 2.2x), Ada-balance "
          f"{data['ratios']['balance']:.2f}x (paper 2.8x); wrote {dest / 'table2.json'} and {dest / 'table2.md'}")
    return data

