"""The simulation behind `bench.sampling`: simulated engines and learner driving the real rollout-buffer `Scheduler`.

Every strategy runs the project's `pipeline.buffer.Scheduler`; only the engines and the verifier are simulated.
- Prompts: each has a pass rate p; a sample's reward is Bernoulli(p). Early training = a fraction of unsolvable
  prompts (p = 0) plus p ~ Beta(1, b), with b and that fraction solved so that the population's mean pass@1 is
  0.265 and its pass@256 is 0.81 (the paper's base model); late training keeps the unsolvable fraction (RL sharpens
  more than it widens) and draws p ~ Beta(a, 1) with a solved so that P(all 4 samples correct) = 0.35.
- Engines: `num_engines` engines of `slots` concurrent sequences each (vLLM max_num_seqs), continuous batching: a
  sample holds one slot for prefill_s + L * decode_step_s, L ~ lognormal (mean 600 tokens, sigma 0.8) capped at
  2048 (max_new_tokens). Decode time per step is flat in the batch size (memory-bound decoding). Samples beyond
  the free slots wait in the engine's FIFO queue. Length and reward are independent.
- Round-synchronous (the reference, GRPO included): a barrier after every round across the batch; work is issued
  only when the engines are empty; max_staleness = 0, unresolved = "keep". Streaming (this project): an engine
  asks for rounds whenever it has room for one (plus one round of queue), prompts exit independently, the learner
  takes B groups as soon as B wait and is assumed instant (new weights reach the engines at once);
  max_staleness = 1, unresolved = "drop".
Time is simulated (a heap of completion times), never slept. Legend: B = prompts (groups) per learner step,
M = round size, n = group size, N = max rounds.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from pipeline.buffer import Scheduler
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.protocol import Sample

_TOK = np.array([1], np.int32)
_LP = np.zeros(1, np.float32)
_QUEUED, _RUNNING, _DONE = 0, 1, 2


@dataclass(frozen=True)
class SimConfig:
    batch_size: int = 512  # B
    num_steps: int = 16  # learner steps measured per strategy
    warmup_steps: int = 2  # streaming only: steps run before measuring (the pipeline fills up)
    num_engines: int = 4
    slots: int = 256  # concurrent sequences per engine
    mean_len: float = 600.0  # response tokens, lognormal mean before the cap
    len_sigma: float = 0.8
    max_len: int = 2048
    decode_step_s: float = 0.025  # one decode step of a full batch (1.5B model, one GPU)
    prefill_s: float = 0.03  # per sample (a ~300-token prompt)
    learner_factor: float = 1.0  # colocated learner time per step, in units of GRPO's engine time per step
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("batch_size", "num_steps", "num_engines", "slots", "mean_len", "max_len", "decode_step_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"SimConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("warmup_steps", "len_sigma", "prefill_s", "learner_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Strategy:
    name: str
    exit_rule: str  # "fixed" (GRPO), "pos", "balance"
    streaming: bool


STRATEGIES = (
    Strategy("GRPO (n=4)", "fixed", False),
    Strategy("Ada-pos round-sync", "pos", False),
    Strategy("Ada-balance round-sync", "balance", False),
    Strategy("Ada-pos streaming", "pos", True),
    Strategy("Ada-balance streaming", "balance", True),
)


# ---------------------------------------------------------------- prompt populations


def _beta_moment(a: float, b: float, k: int, j: int) -> float:
    """E[p^k (1-p)^j] for p ~ Beta(a, b)."""
    lg = math.lgamma
    return math.exp(lg(a + k) + lg(b + j) + lg(a + b) - lg(a) - lg(b) - lg(a + b + k + j))


def early_population(pass1: float = 0.265, pass256: float = 0.81, a: float = 1.0) -> tuple[float, float, float]:
    """(unsolvable fraction, a, b) with mean pass@1 = pass1 and pass@256 = pass256 for p ~ w0*delta_0 + Beta(a, b)."""
    lo, hi = 1e-3, 1e3  # bisect b on the ratio pass1 / pass256, which does not depend on w0
    for _ in range(100):
        b = math.sqrt(lo * hi)
        if (a / (a + b)) / (1 - _beta_moment(a, b, 0, 256)) > pass1 / pass256:
            lo = b
        else:
            hi = b
    return 1 - pass256 / (1 - _beta_moment(a, b, 0, 256)), a, b


def late_population(unsolvable: float, all4: float = 0.35, b: float = 1.0) -> tuple[float, float, float]:
    """(unsolvable, a, b) with P(all 4 correct) = all4 for p ~ unsolvable*delta_0 + Beta(a, b)."""
    lo, hi = 1e-3, 1e3
    for _ in range(100):
        a = math.sqrt(lo * hi)
        lo, hi = (a, hi) if (1 - unsolvable) * _beta_moment(a, b, 4, 0) < all4 else (lo, a)
    return unsolvable, a, b


def draw_pass_rates(params: tuple[float, float, float], num: int, rng: np.random.Generator) -> np.ndarray:
    """`num` pass rates: Beta(a, b) draws, each replaced by 0 (unsolvable) with probability w0."""
    w0, a, b = params
    p = rng.beta(a, b, num)
    p[rng.random(num) < w0] = 0.0
    return p


def population_stats(p: np.ndarray) -> dict[str, float]:
    """Expected pass@1, pass@256, P(all 4 correct) and P(4 samples all equal) of a drawn population."""
    return {
        "pass@1": float(p.mean()),
        "pass@256": float((1 - (1 - p) ** 256).mean()),
        "all4_correct": float((p**4).mean()),
        "zero_var@4": float((p**4 + (1 - p) ** 4).mean()),
        "unsolvable": float((p == 0).mean()),
    }


# ---------------------------------------------------------------- the simulation


class _Round:
    __slots__ = ("round_id", "engine", "p", "rewards", "versions", "state", "remaining", "cancelled")

    def __init__(self, round_id: int, engine: int, p: float, size: int) -> None:
        self.round_id, self.engine, self.p = round_id, engine, p
        self.rewards = [0.0] * size
        self.versions = [0] * size
        self.state = [_QUEUED] * size
        self.remaining = size
        self.cancelled = False


class _Sim:
    """One strategy on one prompt population: engines, the Scheduler, and the learner, in simulated time."""

    def __init__(self, strategy: Strategy, pass_rates: np.ndarray, cfg: SimConfig) -> None:
        self.cfg, self.strategy, self.pass_rates = cfg, strategy, pass_rates
        sampling = SamplingConfig(exit_rule=strategy.exit_rule)  # paper defaults: M = 8, N = 4, n = 4
        buffer = BufferConfig(
            max_staleness=1 if strategy.streaming else 0,
            unresolved="drop" if strategy.streaming else "keep",
            downsample="freshest" if strategy.streaming else "first",
            lease_s=1e9, heartbeat_timeout_s=1e9,  # no producer dies here; `expire` is never called anyway
        )
        prompts = [(str(i), "") for i in range(len(pass_rates))]
        self.sched = Scheduler(sampling, buffer, cfg.batch_size, prompts, seed=cfg.seed)
        self.M = self.sched.round_size
        self.rng = np.random.default_rng(cfg.seed + 1)
        self._durations: list[float] = []
        self._uniforms: list[float] = []
        E = cfg.num_engines
        self.names = [f"engine{e}" for e in range(E)]
        self.running, self.load = [0] * E, [0] * E  # load = assigned samples neither done nor cancelled
        self.queues: list[deque] = [deque() for _ in range(E)]
        self.rounds: dict[int, _Round] = {}
        self.heap: list[tuple[float, int, _Round, int]] = []
        self.seq = 0
        self.now = self.busy_integral = 0.0
        self.busy = self.completed = self.aborted = 0
        self.version = self.steps = 0
        self.warmup = cfg.warmup_steps if strategy.streaming else 0
        self.window: dict[str, tuple] = {}
        self.trained = {"groups": 0, "zero_adv": 0, "all_correct": 0}
        self._samples: dict[tuple[float, int], Sample] = {}
        self.rounds_of: dict[int, int] = {}  # prompt_id -> rounds issued (re-issues included)

    # -- random draws in blocks: one numpy call per 64k samples, not one per sample
    def _next_duration(self) -> float:
        if not self._durations:
            c = self.cfg
            mu = math.log(c.mean_len) - c.len_sigma**2 / 2
            lengths = np.minimum(np.rint(self.rng.lognormal(mu, c.len_sigma, 1 << 16)), c.max_len)
            self._durations = (c.prefill_s + np.maximum(lengths, 1) * c.decode_step_s).tolist()
        return self._durations.pop()

    def _next_uniform(self) -> float:
        if not self._uniforms:
            self._uniforms = self.rng.random(1 << 16).tolist()
        return self._uniforms.pop()

    def _sample(self, reward: float, version: int) -> Sample:
        key = (reward, version)  # Samples are immutable to the scheduler, so identical ones are shared
        if key not in self._samples:
            self._samples[key] = Sample(_TOK, _LP, reward, version, "stop")
        return self._samples[key]

    # -- engines
    def _advance(self, t: float) -> None:
        self.busy_integral += self.busy * (t - self.now)
        self.now = t

    def _start(self, rnd: _Round, k: int) -> None:
        rnd.state[k] = _RUNNING
        rnd.versions[k] = self.version  # the weights the engine holds when the sample starts
        rnd.rewards[k] = float(self._next_uniform() < rnd.p)
        self.running[rnd.engine] += 1
        self.busy += 1
        self.seq += 1
        heapq.heappush(self.heap, (self.now + self._next_duration(), self.seq, rnd, k))

    def _fill(self, e: int) -> None:
        q = self.queues[e]
        while q and self.running[e] < self.cfg.slots:
            rnd, k = q.popleft()
            if not rnd.cancelled:
                self._start(rnd, k)

    def _assign(self, e: int, a) -> None:
        rnd = _Round(a.round_id, e, float(self.pass_rates[int(a.prompt)]), a.num_samples)
        self.rounds[a.round_id] = rnd
        self.rounds_of[a.prompt_id] = self.rounds_of.get(a.prompt_id, 0) + 1
        self.load[e] += a.num_samples
        self.queues[e].extend((rnd, k) for k in range(a.num_samples))
        self._fill(e)

    def _cancel(self, round_id: int) -> None:
        rnd = self.rounds.pop(round_id)
        rnd.cancelled = True  # its queued samples and heap entries are skipped lazily
        running = sum(s == _RUNNING for s in rnd.state)
        self.running[rnd.engine] -= running
        self.busy -= running
        self.aborted += running
        self.load[rnd.engine] -= rnd.remaining
        self._fill(rnd.engine)

    # -- scheduler side
    def _feed_streaming(self) -> None:
        for e, name in enumerate(self.names):
            room = self.cfg.slots + self.M - self.load[e]  # one round of queue: a freed slot never waits for work
            if room >= self.M:
                for a in self.sched.request_work(name, room // self.M, self.now):
                    self._assign(e, a)

    def _feed_barrier(self) -> None:
        while True:  # the least-loaded engine takes the next round, as a reference trainer splits its batch
            e = min(range(len(self.names)), key=self.load.__getitem__)
            got = self.sched.request_work(self.names[e], 1, self.now)
            if not got:
                return
            self._assign(e, got[0])

    def _mark(self, key: str) -> None:
        self.window[key] = (self.now, self.busy_integral, self.completed, self.aborted, self.sched.flat_metrics())

    def _take(self) -> None:
        groups = self.sched.take_batch(self.version, self.cfg.batch_size, self.now)
        assert groups is not None and len(groups) == self.cfg.batch_size
        if self.steps >= self.warmup:
            t = self.trained
            for g in groups:
                t["groups"] += 1
                t["zero_adv"] += all(a == 0.0 for a in g.advantages)
                t["all_correct"] += all(s.reward > 0.5 for s in g.samples)
        self.version += 1
        self.steps += 1
        for round_id in self.sched.set_learner_version(self.version, self.now) + self.sched.pop_aborts():
            self._cancel(round_id)
        if self.steps == self.warmup:
            self._mark("start")

    def _finish(self, rnd: _Round, k: int) -> bool:
        """A sample is done; True when its round is complete and was submitted."""
        e = rnd.engine
        rnd.state[k] = _DONE
        rnd.remaining -= 1
        self.running[e] -= 1
        self.load[e] -= 1
        self.busy -= 1
        self.completed += 1
        self._fill(e)
        if rnd.remaining:
            return False
        del self.rounds[rnd.round_id]
        samples = [self._sample(r, v) for r, v in zip(rnd.rewards, rnd.versions)]
        out = self.sched.submit_result(self.names[e], rnd.round_id, _TOK, samples, self.now)
        assert out.accepted, (out.status, rnd.round_id)
        return True

    def run(self) -> dict[str, float]:
        total = self.warmup + self.cfg.num_steps
        streaming, B = self.strategy.streaming, self.cfg.batch_size
        if self.warmup == 0:
            self._mark("start")
        while self.steps < total:
            if not any(self.load):  # idle fleet: a barrier (round-sync), or a start
                if not streaming and self.sched.groups_waiting >= B:
                    self._take()
                    continue
                self._feed_streaming() if streaming else self._feed_barrier()
                if not any(self.load):
                    raise RuntimeError(f"{self.strategy.name}: the scheduler gave no work to idle engines")
            t, _, rnd, k = heapq.heappop(self.heap)
            if rnd.cancelled:
                continue
            self._advance(t)
            if self._finish(rnd, k) and streaming:
                while self.sched.groups_waiting >= B and self.steps < total:
                    self._take()
            if streaming:
                self._feed_streaming()
        self._mark("end")
        self.sched.check_invariants()
        return self._summary()

    def _summary(self) -> dict[str, float]:
        (t0, b0, c0, a0, m0), (t1, b1, c1, a1, m1) = self.window["start"], self.window["end"]
        S, tr = self.cfg.num_steps, self.trained
        d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
        samples = (c1 - c0) / S
        useful = tr["groups"] - tr["zero_adv"]
        return {
            "max_rounds_per_prompt": max(self.rounds_of.values()),
            "samples_per_step": samples,
            "time_per_step": (t1 - t0) / S,
            "utilisation": (b1 - b0) / (self.cfg.num_engines * self.cfg.slots * (t1 - t0)),
            "zero_adv_share": tr["zero_adv"] / tr["groups"],
            "all_correct_share": tr["all_correct"] / tr["groups"],
            "unresolved_per_step": (d["released_partial"] + d["dropped_unresolved"]) / S,
            "dropped_per_step": (d["dropped_unresolved"] + d["dropped_zero_variance"]) / S,
            "admitted_per_step": d["admitted"] / S,
            "aborted_per_step": (a1 - a0) / S,
            "evicted_per_step": d["stale_evictions"] / S,
            "samples_per_useful_group": samples * S / useful if useful else math.inf,
            "time_per_useful_group": (t1 - t0) / useful if useful else math.inf,
        }


def simulate(strategy: Strategy, pass_rates: np.ndarray, cfg: SimConfig) -> dict[str, float]:
    """Run one strategy for cfg.warmup_steps (streaming only) + cfg.num_steps learner steps; per-step metrics."""
    return _Sim(strategy, pass_rates, cfg).run()


def run_regime(params: tuple[float, float, float], cfg: SimConfig) -> tuple[dict, dict[str, dict]]:
    """Population stats and every strategy's metrics (ratios to GRPO added) for one prompt population."""
    num = 4 * cfg.batch_size * (cfg.num_steps + cfg.warmup_steps + 2)  # enough that no prompt is seen twice
    pass_rates = draw_pass_rates(params, num, np.random.default_rng(cfg.seed))
    results = {s.name: simulate(s, pass_rates, cfg) for s in STRATEGIES}
    base = results[STRATEGIES[0].name]
    learner_s = cfg.learner_factor * base["time_per_step"]
    for r in results.values():
        r["samples_ratio"] = r["samples_per_step"] / base["samples_per_step"]
        r["time_ratio"] = r["time_per_step"] / base["time_per_step"]
        # a colocated learner adds the same time to every round-sync step (every step trains B groups of n)
        r["time_ratio_with_learner"] = (r["time_per_step"] + learner_s) / (base["time_per_step"] + learner_s)
        r["useful_time_ratio"] = r["time_per_useful_group"] / base["time_per_useful_group"]
    return population_stats(pass_rates), results
