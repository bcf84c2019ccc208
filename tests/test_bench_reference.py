"""bench/pipeline/reference_buffer.py: the reference's round-synchronous dispatch on the real Scheduler
(bench.pipeline's reference arm). Producers ask for work at random while results come back one at a time in random
order: a prompt gets its next round only once every round issued before its result came back is back too (the
barrier), and each step trains exactly the B prompts it admitted, after at most N rounds each."""

from __future__ import annotations

import numpy as np
import pytest

from bench.pipeline.reference_buffer import BarrierScheduler
from pipeline import protocol as P
from pipeline.buffer.scheduler import Scheduler
from pipeline.config import BufferConfig, SamplingConfig

B, N = 8, 4


def _sample(reward: float, version: int) -> P.Sample:
    return P.Sample(np.array([1, 2], np.int32), np.array([-0.5, -0.5], np.float32), reward, version, "stop")


def _run(cls, steps: int = 4, seed: int = 0) -> None:
    sched = cls(SamplingConfig(exit_check="round", exit_rule="balance"),
                BufferConfig(max_staleness=0, unresolved="keep", downsample="first"), B,
                [(f"p{i}", "") for i in range(200)], seed=0)
    rng = np.random.default_rng(seed)
    pass_rate = {f"p{i}": [0.0, 1.0, 0.5, 0.2][i % 4] for i in range(200)}
    event = 0
    for step in range(steps):
        out: dict[int, tuple[str, P.RoundAssignment, int]] = {}  # round id -> producer, assignment, issued at
        back: dict[int, int] = {}  # prompt id -> when its last result came back
        admitted: set[int] = set()
        while (groups := sched.take_batch(step, B, event)) is None:
            for producer in ("a", "b"):
                if rng.random() < 0.5:
                    continue
                event += 1
                for a in sched.request_work(producer, 3, event):
                    if a.prompt_id in back:  # the barrier: nothing issued before that result is still out
                        assert all(at > back[a.prompt_id] for _, _, at in out.values()), "a round before the barrier"
                    out[a.round_id] = (producer, a, event)
                    admitted.add(a.prompt_id)
            if not out:
                continue
            event += 1
            round_id = list(out)[rng.integers(len(out))]  # any round comes back next
            producer, a, _ = out.pop(round_id)
            samples = [_sample(float(rng.random() < pass_rate[a.prompt]), step) for _ in range(a.num_samples)]
            assert sched.submit_result(producer, round_id, np.array([7], np.int32), samples, event).accepted
            back[a.prompt_id] = event
            sched.check_invariants()
        assert not out and len(groups) == B and {g.prompt_id for g in groups} == admitted
        assert all(g.num_rounds <= N and len(g.samples) == 4 for g in groups)
        sched.set_learner_version(step + 1, event)
    assert sched.metrics()["rounds_to_exit"].get(N), "the always-wrong prompts ran all N rounds (and were kept)"


def test_barrier_scheduler_waits_for_every_round_of_a_barrier_round():
    for seed in range(3):
        _run(BarrierScheduler, seed=seed)


def test_the_streaming_scheduler_has_no_barrier():
    """The check above is not vacuous: the streaming scheduler, same events, breaks it."""
    with pytest.raises(AssertionError, match="a round before the barrier"):
        _run(Scheduler)


def test_timeline_summary_splits_the_learner_wait_into_engine_time_and_tail():
    """bench/pipeline/timeline.py on a hand-made timeline: steps of 1 s (0.6 s wait, 0.3 s train, 0.1 s publish);
    producer a generates for the first 0.4 s of each wait, b for all of it: the tail is 0.2 s a step."""
    from bench.pipeline.timeline import summarize

    rows = [{"time": t + 1.0, "wait_seconds": 0.6, "step_seconds": 0.4, "publish_seconds": 0.1} for t in range(4)]
    producers = {"a": [{"kind": "generate", "start": t, "end": t + 0.4, "rounds": 4} for t in range(4)],
                 "b": [{"kind": "generate", "start": t + 0.02, "end": t + 0.6, "rounds": 8} for t in range(4)]}
    s = summarize(rows, producers, warmup=1, max_rounds=8)
    assert s["steps"] == 3 and abs(s["window_s"] - 3.0) < 1e-9
    assert abs(s["per_step_s"]["wait"] - 0.6) < 1e-9 and abs(s["per_step_s"]["train"] - 0.3) < 1e-9
    assert abs(s["per_step_s"]["publish"] - 0.1) < 1e-9
    assert abs(s["per_step_s"]["tail"] - 0.22) < 1e-9  # a idle from 0.4, b from 0 to 0.02 of each wait
    assert abs(s["producer_busy_share"]["a"] - 0.4) < 1e-9 and abs(s["slots_used"] - 0.75) < 1e-9
    assert abs(s["handoff_s_median"] - 0.01) < 1e-9  # a starts at each step's end, b 0.02 s later
