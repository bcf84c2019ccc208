"""Adaptive allocation at paper scale, without a model: `python -m bench.allocation [--quick]`.

Every strategy drives the real `pipeline.buffer.Scheduler` through `bench.sim.run` (simulated vLLM engines,
the cost model's constants, an instant learner: engine time only) on the selected population of the paper
(`bench.sim.population`, prompts with 1-5 of 16 correct at the start) early (step 50) and late (step 450) in
training. The data set holds DATASET_BATCHES batches, so prompts come back every few steps and the allocation
policies' per-example history matters; between two visits a prompt's pass rate drifts (a random walk of DRIFT
on the logit scale per epoch, above the selected population's own spread growth of 1.2 logits over 600 steps),
so history is informative but not exact.

Rows: round-synchronous GRPO and Ada (the reference: whole rounds, barriers, unresolved "keep"), streaming GRPO
(fixed + keep), and streaming Ada-balance / Ada-pos under each allocation policy: `uniform` at M = 4, 8, 16 (M * N
= 32 samples per visit), `est`, `min_cost` (at the default sampling.yield_floor, and at FLOORS: its trade-off
between cost and the pass-rate coverage of trained groups), with per-sample exit ("prefix", the default), and
today's whole-round exit ("round") and the length-biased "sample" exit for comparison. Also, per population, an
oracle's point for comparison (not a bound: it assumes pass rates that never drift, and min_cost, which defers
low-yield prompts, beats it): the samples per useful group of sampling that knows every pass rate and draws one
sample at a time, without deferring anything, against GRPO's. Per step and per useful group (a group with
both rewards): samples, engine time, rounds per prompt, unresolved and deferred shares, kept vs generated lengths
(and the kept / all ratio per class over the same prompts: the length bias), the pass-rate histogram of trained
groups against the population's, and the goals of issue #15 computed side by side from one run.
Writes bench/results/allocation.json and allocation.md (rendered from the JSON by `bench.allocation.report`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from bench import output
from bench.allocation.report import goals, render
from bench.sim.population import pass_rates
from bench.sim.run import SimConfig, Strategy, _Sim
from pipeline.buffer.policy.allocation import MAX_DEFERRALS
from pipeline.buffer.policy.exit_rules import make_exit_rule
from pipeline.buffer.policy.posterior import outlook

DATASET_BATCHES = 4  # the data set is this many batches: a prompt comes back every ~4 steps
DRIFT = 0.3  # logit random walk of each prompt's pass rate per epoch
PHASES = {"early": 50, "late": 450}  # training steps of the two populations
HIST_BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0001)
FLOORS = (0.0, 0.5, 1.0)  # sampling.yield_floor of min_cost's trade-off rows (the default has its own row)


def strategies() -> list[Strategy]:
    """Every row of the benchmark (names are the JSON keys)."""
    out = [Strategy("GRPO round-sync", "fixed", False), Strategy("Ada-balance round-sync", "balance", False),
           Strategy("Ada-pos round-sync", "pos", False), Strategy("GRPO streaming", "fixed", True, unresolved="keep")]
    for rule in ("balance", "pos"):
        name = f"Ada-{rule}"
        for m in (4, 8, 16):
            out.append(Strategy(f"{name} fixed M={m}", rule, True, exit_check="prefix", round_size=m,
                                max_rounds=32 // m))
        out += [Strategy(f"{name} est", rule, True, allocation="est", exit_check="prefix"),
                Strategy(f"{name} min_cost", rule, True, allocation="min_cost", exit_check="prefix")]
        out += [Strategy(f"{name} min_cost floor={f:g}", rule, True, allocation="min_cost", exit_check="prefix",
                         yield_floor=f) for f in FLOORS]
        out += [
                Strategy(f"{name} fixed M=8 round", rule, True),  # streaming before per-sample exit
                Strategy(f"{name} fixed M=8 sample", rule, True, exit_check="sample"),
                Strategy(f"{name} min_cost sample", rule, True, allocation="min_cost", exit_check="sample")]
    return out


class _AllocSim(_Sim):
    """`_Sim` that knows each prompt's pass rate at its visit and what each trained group kept."""

    def __init__(self, strategy: Strategy, table: np.ndarray, cfg: SimConfig) -> None:
        super().__init__(strategy, table[:, 0], cfg)
        self.table = table  # [example, epoch] pass rates
        self.visit_p: dict[int, float] = {}  # prompt id -> pass rate at its visit
        self.drawn: dict[int, np.ndarray] = {}  # prompt id -> [n_pos, len_pos, n_neg, len_neg] of every sample drawn
        self.kept = np.zeros(4)  # the same, over kept samples of trained groups
        self.all = np.zeros(4)  # the same, over every sample drawn for those groups' prompts
        self.trained_p: list[float] = []
        self.max_streak = 0

    def _pass_rate(self, a) -> float:
        if a.prompt_id not in self.visit_p:
            epoch = min(self.sched.admission.epoch, self.table.shape[1] - 1)
            self.visit_p[a.prompt_id] = float(self.table[int(a.prompt), epoch])
        return self.visit_p[a.prompt_id]

    def _assign(self, e: int, a):
        rnd = super()._assign(e, a)
        r, n = np.asarray(rnd.rewards) > 0.5, np.asarray(rnd.lengths, np.float64)
        acc = self.drawn.setdefault(a.prompt_id, np.zeros(4))
        acc += (r.sum(), n[r].sum(), (~r).sum(), n[~r].sum())
        return rnd

    def _observe(self, groups: list) -> None:
        for g in groups:
            r = np.array([s.reward > 0.5 for s in g.samples])
            n = np.array([len(s.token_ids) for s in g.samples], np.float64)
            self.kept += (r.sum(), n[r].sum(), (~r).sum(), n[~r].sum())
            self.all += self.drawn.pop(g.prompt_id)
            self.trained_p.append(self.visit_p[g.prompt_id])
        history = self.sched.admission.history.values()
        self.max_streak = max(self.max_streak, max((h.deferred for h in history), default=0))

    def summary(self) -> dict:
        out = self.run()
        (_, _, _, m0), (_, _, _, m1) = self.window["start"], self.window["end"]
        d = {k: m1[k] - m0[k] for k in m1 if isinstance(m1[k], (int, float))}
        admitted = max(d["admitted"], 1)
        wasted = d["tokens_aborted"] + d["tokens_discarded"]
        kept_pos, kept_neg = _ratio(self.kept[1], self.kept[0]), _ratio(self.kept[3], self.kept[2])
        all_pos, all_neg = _ratio(self.all[1], self.all[0]), _ratio(self.all[3], self.all[2])
        out.update({
            "rounds_per_prompt": d["rounds_issued"] / admitted,
            "unresolved_share": (d["released_partial"] + d["dropped_unresolved"]) / admitted,
            "deferred_share": d["deferred"] / (d["deferred"] + admitted),
            "max_deferral_streak": self.max_streak,
            "wasted_token_share": wasted / max(d["tokens_received"] + wasted, 1),
            "rounds_cut_per_step": d["rounds_cut"] / self.cfg.num_steps,
            "kept_len_pos": kept_pos, "all_len_pos": all_pos, "kept_len_neg": kept_neg, "all_len_neg": all_neg,
            "len_bias_pos": kept_pos / all_pos if all_pos else 1.0,
            "len_bias_neg": kept_neg / all_neg if all_neg else 1.0,
            "all_mean_len": _ratio(self.all[1] + self.all[3], self.all[0] + self.all[2]),
            "trained_hist": histogram(np.asarray(self.trained_p)),
        })
        return out


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b else 0.0


def histogram(p: np.ndarray) -> list[float]:
    """Shares of pass rates in HIST_BINS."""
    counts, _ = np.histogram(p, bins=HIST_BINS)
    return (counts / max(len(p), 1)).tolist()


def drift_table(p0: np.ndarray, epochs: int, rng: np.random.Generator) -> np.ndarray:
    """[example, epoch] pass rates: a logit random walk of DRIFT per epoch from `p0`."""
    logit = np.log(np.clip(p0, 1e-6, 1 - 1e-6) / (1 - np.clip(p0, 1e-6, 1 - 1e-6)))
    walk = np.cumsum(np.concatenate([np.zeros((len(p0), 1)), DRIFT * rng.standard_normal((len(p0), epochs - 1))],
                                    axis=1), axis=1)
    return 1 / (1 + np.exp(-(logit[:, None] + walk)))


def oracle_point(p: np.ndarray, budget: int = 32, n: int = 4) -> dict[str, float]:
    """Samples per useful group of sequential sampling with every pass rate known (no overshoot, no deferral),
    per rule, and of GRPO (n samples, useful when mixed), on pass rates `p`. Not a bound on the bench's policies:
    they see pass rates that drift between epochs, which this does not, and may defer prompts, which this does not."""
    grpo = n * len(p) / float((1 - p**n - (1 - p) ** n).sum())
    out = {"grpo_samples_per_useful": grpo}
    for rule in ("balance", "pos"):
        samples = useful = 0.0
        for x in p:
            look = outlook(1e6 * x + 1e-3, 1e6 * (1 - x) + 1e-3, 0, 0, budget, make_exit_rule(rule), n)
            samples += sum(j * q for j, q in enumerate(look.exit_at)) + budget * look.unresolved
            useful += look.useful
        out[f"{rule}_samples_per_useful"] = samples / useful
        out[f"{rule}_vs_grpo"] = samples / useful / grpo
    return out


@dataclass(frozen=True)
class AllocConfig:
    sim: SimConfig = SimConfig(batch_size=512, num_steps=12, warmup_steps=6, num_engines=4, slots=256)
    epochs: int = 64  # columns of the drift table (more than any run reaches)
    only: tuple[str, ...] = ()  # strategy names to run (empty: all)


def run(cfg: AllocConfig) -> dict:
    """Every strategy on both populations, with the goals; one JSON-able dict."""
    started = time.perf_counter()
    sim = cfg.sim
    chosen = [s for s in strategies() if not cfg.only or s.name in cfg.only]
    populations = {}
    for phase, step in PHASES.items():
        rng = np.random.default_rng([sim.seed, step])
        p0 = pass_rates(step, "ada", DATASET_BATCHES * sim.batch_size, rng)
        table = drift_table(p0, cfg.epochs, rng)
        rows = {}
        for s in chosen:
            t0 = time.perf_counter()
            rows[s.name] = {**_AllocSim(s, table, sim).summary(), "sim_seconds": time.perf_counter() - t0}
            print(f"{phase:5} {s.name:32} {rows[s.name]['time_per_useful_group']:.4f} s/useful group "
                  f"({rows[s.name]['sim_seconds']:.1f} s)", flush=True)
        populations[phase] = {"step": step, "mean_pass_rate": float(p0.mean()), "population_hist": histogram(p0),
                              "oracle": oracle_point(p0), "rows": rows}
    data = {"config": {**asdict(cfg.sim), "dataset_batches": DATASET_BATCHES, "drift": DRIFT,
                       "max_deferrals": MAX_DEFERRALS, "hist_bins": list(HIST_BINS)},
            "populations": populations, "elapsed_s": time.perf_counter() - started}
    data["goals"] = goals(data)
    return data


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="B = 64, 2 engines x 64 slots, 2 + 3 steps (seconds)")
    ap.add_argument("--only", nargs="*", default=(), help="run only these strategies (by name)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(output.RESULTS), help="directory for allocation.json and allocation.md")
    args = ap.parse_args(argv)
    cfg = AllocConfig(only=tuple(args.only))
    cfg = replace(cfg, sim=replace(cfg.sim, seed=args.seed))
    if args.quick:
        cfg = replace(cfg, sim=replace(cfg.sim, batch_size=64, num_engines=2, slots=64, num_steps=3, warmup_steps=2))
    data = run(cfg)
    data["command"] = ("python -m bench.allocation " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    dest = Path(args.out)
    md = render(data)
    output.write(dest / "allocation.md", md, data)
    print(md)
    print(f"wrote {dest / 'allocation.json'} and {dest / 'allocation.md'}")
    return data

