"""Simulated engines and learner around the real `Scheduler`: the run behind `bench.sampling`, `bench.allocation`
and `bench.table2`.

Every strategy runs the project's `pipeline.buffer.Scheduler` through its public methods (`request_work`,
`submit_result`, `set_learner_version`, `take_batch`, `metrics`); only the engines, the verifier and the learner
are simulated, in simulated time (events, never sleeps).
- Prompts: each has a pass rate p; a sample's reward is Bernoulli(p) and its length follows
  `bench.sim.costmodel.response_length` (longer when wrong and when the prompt is hard). Draws happen when a round is
  assigned, in assignment order, so a barrier run sees the same samples whatever the time constants.
- Engines: `bench.sim.engine.Engine`, one per GPU (continuous batching, step time growing with batch and context).
- Round-synchronous (the reference, GRPO included; max_staleness = 0): every round is a barrier across the batch;
  a round's samples are split into contiguous chunks over the engines, as verl splits a batch over its DP ranks.
  With a learner (learner_gpus > 0) the same GPUs then train (colocated): each round also pays
  round_overhead_s and, for Ada, reward_s_per_sample per sample (verl's driver scores one sample at a time), and
  the step pays the scoring of the kept batch (both GRPO and Ada) plus `learner_s` with the old-log-prob
  recompute.
- Streaming (this project): an engine asks for rounds whenever it has room for one (plus one round of queue),
  counted in samples (`request_work(max_samples=...)`) when the allocation policy sizes rounds itself; prompts
  exit independently; the learner on its own learner_gpus GPUs takes B groups as soon as B wait and it is
  idle, trains (no recompute: behaviour log-probs), publishes, and every engine then pauses to load the weights.
  Rewards are scored by producer worker processes off the critical path. With exit_check "prefix" or "sample"
  each sample is reported the moment it finishes (`submit_samples`), and when the exit rule cuts a round its
  running samples are aborted on the engine (their tokens counted as wasted and reported back, as producers do).
- learner_gpus = 0: engine time only (no learner, no weight sync, no reference overheads), bench.sampling's view.
Legend: B = prompts (groups) per learner step, M = round size, n = group size, N = max rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from bench.sim.costmodel import Constants, learner_s, response_lengths
from bench.sim.engine import Engine, Seq
from bench.sim.trace import Trace
from pipeline.buffer import Scheduler
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.protocol import Sample

_BLOCK = 1 << 15


@dataclass(frozen=True)
class SimConfig:
    batch_size: int = 512  # B
    num_steps: int = 16  # learner steps measured per strategy
    warmup_steps: int = 2  # streaming only: steps run before measuring (the pipeline fills up)
    num_engines: int = 4  # generation GPUs (round-sync with a learner: the colocated GPUs, which also train)
    slots: int = 512  # concurrent sequences per engine (vLLM max_num_seqs)
    learner_gpus: int = 0  # streaming: training GPUs; 0 = engine time only (see the module docstring)
    constants: Constants = field(default_factory=Constants)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_steps", "num_engines", "slots"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SimConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("warmup_steps", "learner_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Strategy:
    name: str
    exit_rule: str  # "fixed" (GRPO), "pos", "balance"
    streaming: bool
    unresolved: str = ""  # "" = the mode's default: "keep" round-sync (reference), "drop" streaming
    downsample: str = ""  # "" = the mode's default: "first" round-sync (reference), "freshest" streaming
    allocation: str = "uniform"  # sampling.allocation
    exit_check: str = "round"  # sampling.exit_check ("round": whole rounds, as before per-sample exit existed)
    round_size: int = 8  # M
    max_rounds: int = 4  # N
    yield_floor: float = SamplingConfig().yield_floor  # min_cost's deferral and give-up threshold

    def sampling_config(self) -> SamplingConfig:
        return SamplingConfig(exit_rule=self.exit_rule, allocation=self.allocation, exit_check=self.exit_check,
                              round_size=self.round_size, max_rounds=self.max_rounds,
                              yield_floor=self.yield_floor)  # n = 4, the paper's

    def buffer_config(self) -> BufferConfig:
        return BufferConfig(
            max_staleness=1 if self.streaming else 0,
            unresolved=self.unresolved or ("drop" if self.streaming else "keep"),
            downsample=self.downsample or ("freshest" if self.streaming else "first"),
            lease_s=1e9, heartbeat_timeout_s=1e9,  # no producer dies here
        )


STRATEGIES = (
    Strategy("GRPO (n=4)", "fixed", False),
    Strategy("Ada-pos round-sync", "pos", False),
    Strategy("Ada-balance round-sync", "balance", False),
    Strategy("Ada-pos streaming", "pos", True),
    Strategy("Ada-balance streaming", "balance", True),
)


class _Round:
    __slots__ = ("round_id", "engine", "version", "rewards", "lengths", "first", "seqs", "remaining", "live")

    def __init__(self, round_id: int, engine: int, version: int, rewards: list, lengths: list, first: int) -> None:
        self.round_id, self.engine, self.version = round_id, engine, version
        self.rewards, self.lengths, self.first = rewards, lengths, first  # first: trace index of sample 0
        self.seqs = [Seq(n, (self, k)) for k, n in enumerate(lengths)]
        self.remaining = len(lengths)
        self.live = True


class _Sim:
    """One strategy on one prompt population: engines, the Scheduler and the learner, in simulated time."""

    def __init__(self, strategy: Strategy, pass_rates: np.ndarray, cfg: SimConfig, trace: Trace | None = None):
        self.cfg, self.strategy, self.pass_rates, self.c = cfg, strategy, pass_rates, cfg.constants
        self.sampling = strategy.sampling_config()
        prompts = [(str(i), "") for i in range(len(pass_rates))]
        self.sched = Scheduler(self.sampling, strategy.buffer_config(), cfg.batch_size, prompts, seed=cfg.seed)
        self.M = self.sampling.group_size if strategy.exit_rule == "fixed" else self.sampling.round_size
        self.per_sample = strategy.streaming and self.sched.pools.exit_check != "round"
        self.sized = strategy.allocation != "uniform"  # the policy sizes rounds: engines ask in samples
        self.rng = np.random.default_rng(cfg.seed + 1)
        self._u = self._z = self._v = np.zeros(0)
        self._pos = 0
        self.trace = trace  # round-sync only: what the run did, for `Trace.replay`
        self._index: dict[int, int] = {}  # id(Sample) -> trace index, until its step is taken
        self.engines = [Engine(cfg.slots, self.c) for _ in range(cfg.num_engines)]
        self.names = [f"engine{e}" for e in range(cfg.num_engines)]
        self.engine_version = [0] * cfg.num_engines
        self._next = [math.inf] * cfg.num_engines
        self.rounds: dict[int, _Round] = {}
        self.rounds_of: dict[int, int] = {}
        self.now = 0.0
        self.version = self.steps = 0
        self.waiting = 0  # groups released and not taken (resynced from metrics() after version changes)
        self.learner_done = math.inf  # streaming: when the step in progress ends
        self.batch_tokens = 0.0
        self.warmup = cfg.warmup_steps if strategy.streaming else 0
        self.acc = dict.fromkeys(("groups", "useful", "all_correct", "kept_len", "gen_len", "gen", "aborted",
                                  "wasted_tokens", "learner_busy", "round_s", "overhead_s", "learner_s",
                                  "unresolved_no_pos", "unresolved_no_neg", "resolved_by_round_2"), 0.0)
        self._arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.window: dict[str, tuple] = {}

    # -- draws: rewards and lengths of a round's samples, from blocks of random numbers
    def _draw_round(self, p: float, k: int) -> tuple[list[float], list[int], int]:
        if self._pos + k > len(self._u):
            n = max(_BLOCK, k)
            self._u, self._z, self._v = self.rng.random(n), self.rng.standard_normal(n), self.rng.random(n)
            self._pos = 0
        sl = slice(self._pos, self._pos + k)
        self._pos += k
        ps, correct = np.full(k, p), self._u[sl] < p
        lengths = response_lengths(ps, correct, self._z[sl], self._v[sl], self.c)
        first = self.trace.add_samples(ps, correct, self._z[sl], self._v[sl]) if self.trace is not None else 0
        return correct.astype(float).tolist(), lengths.tolist(), first

    def _sample(self, reward: float, version: int, length: int) -> Sample:
        if length not in self._arrays:  # Samples only need their length; arrays are shared between them
            self._arrays[length] = (np.zeros(length, np.int32), np.zeros(length, np.float32))
        tokens, logprobs = self._arrays[length]
        finish = "length" if length >= self.c.max_new_tokens else "stop"
        return Sample(tokens, logprobs, reward, version, finish)

    # -- engines
    def _pass_rate(self, a) -> float:
        return float(self.pass_rates[int(a.prompt)])

    def _assign(self, e: int, a) -> _Round:
        rewards, lengths, first = self._draw_round(self._pass_rate(a), a.num_samples)
        rnd = _Round(a.round_id, e, self.engine_version[e], rewards, lengths, first)
        self.rounds[a.round_id] = rnd
        self.rounds_of[a.prompt_id] = self.rounds_of.get(a.prompt_id, 0) + 1
        self.engines[e].add_round(rnd.seqs, self.now)
        self._next[e] = self.engines[e].next_event()
        return rnd

    def _cancel(self, round_id: int) -> None:
        rnd = self.rounds.pop(round_id)
        rnd.live = False
        eng = self.engines[rnd.engine]
        running = wasted = 0
        for s in rnd.seqs:
            running += s.state == 1
            wasted += eng.cancel(s, self.now)
        self.acc["aborted"] += running
        self.acc["wasted_tokens"] += wasted
        self.sched.report_aborted(round_id, running, wasted)  # what a producer reports of what it aborted
        self._next[rnd.engine] = eng.next_event()

    def _finish(self, e: int) -> None:
        eng = self.engines[e]
        s = eng.pop_finished(self.now)
        self._next[e] = eng.next_event()
        rnd, k = s.payload
        self.acc["gen"] += 1
        self.acc["gen_len"] += s.length
        rnd.remaining -= 1
        if self.per_sample and rnd.live:
            sample = self._sample(rnd.rewards[k], rnd.version, s.length)
            out = self.sched.submit_samples(self.names[e], rnd.round_id, [k], [sample], np.zeros(1, np.int32),
                                            self.now)
            assert out.status in ("accepted", "late"), (out.status, rnd.round_id)
            self.waiting += out.group is not None
            if out.aborted:
                self._cancel(rnd.round_id)
            elif not rnd.remaining:
                del self.rounds[rnd.round_id]
            return
        if rnd.remaining or not rnd.live:
            return
        del self.rounds[rnd.round_id]
        samples = [self._sample(r, rnd.version, n) for r, n in zip(rnd.rewards, rnd.lengths)]
        if self.trace is not None:
            self._index.update((id(s), rnd.first + k) for k, s in enumerate(samples))
        out = self.sched.submit_result(self.names[e], rnd.round_id, np.zeros(1, np.int32), samples, self.now)
        assert out.accepted, (out.status, rnd.round_id)
        self.waiting += out.group is not None

    def _run_until_idle(self) -> None:
        while True:
            t = min(self._next)
            if t == math.inf:
                return
            self.now = t
            self._finish(self._next.index(t))

    # -- learner
    def _take(self) -> None:
        """Hand B groups to the learner at the current version and count what they hold."""
        self.sched.set_learner_version(self.version, self.now)  # the refactored take_batch no longer sets it
        groups = self.sched.take_batch(self.version, self.cfg.batch_size, self.now)
        assert groups is not None and len(groups) == self.cfg.batch_size
        self.waiting = self.sched.metrics()["groups_waiting"]
        tokens = 0
        if self.trace is not None:
            self.trace.set_kept(np.array([self._index[id(s)] for g in groups for s in g.samples], np.int64))
            self._index.clear()  # a reference step trains every prompt it admitted: no sample outlives it
        for g in groups:
            lengths = [len(s.token_ids) for s in g.samples]
            tokens += sum(lengths) + len(lengths) * self.c.prompt_tokens
            if self.steps >= self.warmup:
                self.acc["groups"] += 1
                self.acc["useful"] += any(a != 0.0 for a in g.advantages)
                positives = sum(s.reward > 0.5 for s in g.samples)
                self.acc["all_correct"] += positives == len(g.samples)
                self.acc["kept_len"] += sum(lengths)
                # a group keeps min(n/2, #pos) positives, so an unresolved one lacking a class shows it (Fig. 5)
                half = len(g.samples) // 2
                self.acc["unresolved_no_pos"] += not g.resolved and positives < half
                self.acc["unresolved_no_neg"] += not g.resolved and len(g.samples) - positives < len(g.samples) - half
                self.acc["resolved_by_round_2"] += g.resolved and g.num_rounds <= 2
        if self.steps >= self.warmup:
            self._observe(groups)
        self.batch_tokens = tokens

    def _observe(self, groups: list) -> None:
        """A measured step's groups, for subclasses that report more (bench.allocation)."""

    def _new_version(self) -> None:
        self.version += 1
        self.steps += 1
        for round_id in self.sched.set_learner_version(self.version, self.now):
            self._cancel(round_id)
        self.waiting = self.sched.metrics()["groups_waiting"]
        if not self.strategy.streaming:  # the reference syncs weights into its engines before every round
            self.engine_version = [self.version] * len(self.engines)
        if self.steps == self.warmup:
            self._mark("start")

    def _mark(self, key: str) -> None:
        busy = sum(e.busy_seq_s + e.running * (self.now - e.t) for e in self.engines)
        self.window[key] = (self.now, busy, dict(self.acc), self.sched.metrics())

    # -- the two modes
    def _barrier_step(self) -> None:
        c, trains = self.c, self.cfg.learner_gpus > 0
        if self.trace is not None:
            self.trace.begin_step()
        while True:
            work = self.sched.request_work("reference", 1 << 30, self.now)
            if not work:
                break
            start, samples = self.now, sum(a.num_samples for a in work)
            # verl splits the round's batch (prompt-major, a prompt's samples adjacent) into contiguous DP chunks
            bounds = np.linspace(0, samples, len(self.engines) + 1).round().astype(int)
            pos, indices, prompts = 0, [[] for _ in self.engines], [0] * len(self.engines)
            for a in work:
                e = int(np.searchsorted(bounds, pos, side="right") - 1)
                rnd = self._assign(e, a)
                pos += a.num_samples
                indices[e].extend(range(rnd.first, rnd.first + a.num_samples))
                prompts[e] += 1
            self._run_until_idle()
            self.acc["round_s"] += self.now - start
            # verl's GRPO path scores only the batch; the reference's rounds score every sample too
            scored = samples if self.strategy.exit_rule != "fixed" else 0
            if self.trace is not None:
                self.trace.add_round([np.array(i, np.int64) for i in indices], prompts, scored)
            if trains:
                extra = c.round_overhead_s + c.reward_s_per_sample * scored
                self.now += extra
                self.acc["overhead_s"] += extra
        self._take()
        if trains:
            extra = c.reward_s_per_sample * self.cfg.batch_size * self.sampling.group_size
            learn = learner_s(self.batch_tokens, len(self.engines), c, recompute=True)
            self.now += extra + learn
            self.acc["overhead_s"] += extra
            self.acc["learner_s"] += learn
        self._new_version()

    def _feed(self) -> None:
        for e, eng in enumerate(self.engines):
            room = self.cfg.slots + self.M - eng.load  # one round of queue: a freed slot never waits for work
            if room >= (1 if self.sized else self.M):
                rounds = 1 << 30 if self.sized else room // self.M
                for a in self.sched.request_work(self.names[e], rounds, self.now, max_samples=room):
                    self._assign(e, a)

    def _learner_event(self) -> None:
        """The step in progress ends: new version, aborts, weight loads; then maybe the next step starts."""
        self.learner_done = math.inf
        self._new_version()
        if self.cfg.learner_gpus:
            for e, eng in enumerate(self.engines):
                eng.load_weights(self.now)
                self.engine_version[e] = self.version
                self._next[e] = eng.next_event()
        else:
            self.engine_version = [self.version] * len(self.engines)

    def _maybe_train(self) -> None:
        total = self.warmup + self.cfg.num_steps
        while self.learner_done == math.inf and self.waiting >= self.cfg.batch_size and self.steps < total:
            self._take()
            if not self.cfg.learner_gpus:  # instant learner: the step ends now
                self._learner_event()
                continue
            busy = learner_s(self.batch_tokens, self.cfg.learner_gpus, self.c, recompute=False) + self.c.publish_s
            self.learner_done = self.now + busy
            if self.steps >= self.warmup:
                self.acc["learner_busy"] += busy

    def _stream(self) -> None:
        total = self.warmup + self.cfg.num_steps
        self._feed()
        while self.steps < total:
            t = min(self._next)
            if self.learner_done <= t:
                self.now = self.learner_done
                self._learner_event()
            elif t < math.inf:
                self.now = t
                self._finish(self._next.index(t))
            else:
                raise RuntimeError(f"{self.strategy.name}: deadlock, nothing runs and the learner waits")
            self._maybe_train()
            self._feed()

    def run(self) -> dict[str, float]:
        if self.warmup == 0:
            self._mark("start")
        if self.strategy.streaming:
            self._stream()
        else:
            for _ in range(self.cfg.num_steps):
                self._barrier_step()
        self._mark("end")
        return self._summary()

    def _summary(self) -> dict[str, float]:
        (t0, b0, a0, m0), (t1, b1, a1, m1) = self.window["start"], self.window["end"]
        S, span = self.cfg.num_steps, t1 - t0
        d = {k: a1[k] - a0[k] for k in a1}
        dm = {k: m1[k] - m0[k] for k in m1 if isinstance(m1[k], (int, float))}
        useful = d["useful"]
        return {
            "max_rounds_per_prompt": max(self.rounds_of.values()),
            "samples_per_step": d["gen"] / S,
            "time_per_step": span / S,
            "utilisation": (b1 - b0) / (len(self.engines) * self.cfg.slots * span),
            "useful_per_step": useful / S,
            "zero_adv_share": 1 - useful / d["groups"],
            "all_correct_share": d["all_correct"] / d["groups"],
            "unresolved_per_step": (dm["released_partial"] + dm["dropped_unresolved"]) / S,
            "dropped_per_step": (dm["dropped_unresolved"] + dm["dropped_zero_variance"]) / S,
            "admitted_per_step": dm["admitted"] / S,
            "aborted_per_step": d["aborted"] / S,
            "evicted_per_step": dm["stale_evictions"] / S,
            "unresolved_no_pos_per_step": d["unresolved_no_pos"] / S,
            "unresolved_no_neg_per_step": d["unresolved_no_neg"] / S,
            "resolved_by_round_2_per_step": d["resolved_by_round_2"] / S,
            "mean_len": d["gen_len"] / d["gen"],
            "kept_mean_len": d["kept_len"] / (d["groups"] * self.sampling.group_size),
            "round_s_per_step": d["round_s"] / S,
            "overhead_s_per_step": d["overhead_s"] / S,
            "learner_s_per_step": d["learner_s"] / S,
            "learner_busy": d["learner_busy"] / span,
            "samples_per_useful_group": d["gen"] / useful if useful else math.inf,
            "time_per_useful_group": span / useful if useful else math.inf,
        }


def simulate(strategy: Strategy, pass_rates: np.ndarray, cfg: SimConfig, trace: Trace | None = None) -> dict:
    """Run one strategy for cfg.warmup_steps (streaming only) + cfg.num_steps learner steps; per-step metrics.
    A round-sync run also records what it did into `trace` when one is given (see `bench.sim.trace`)."""
    if trace is not None and strategy.streaming:
        raise ValueError("only a round-sync run has a trace to replay; pass trace=None for streaming")
    return _Sim(strategy, pass_rates, cfg, trace).run()
