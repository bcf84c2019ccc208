"""Rewards: math_reward on the real benchmarks, bad and huge inputs, time limits, and the process pool."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import string
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import pytest

from pipeline.data import load_dataset
from pipeline.rewards import RewardPool, math_reward

BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "benchmarks"
TIMEOUT_S = 5.0


def boxed(answer: str) -> str:
    return f"We compute step by step ... so the answer is \\boxed{{{answer}}}."


# ---- test doubles for the pool (top-level so spawned workers can unpickle them) ----


def slow_score(completion: str, answer: str, **extras) -> float:
    """Scores like math_reward, except "hang:<file>" touches <file> and then sleeps, ignoring timers."""
    if completion.startswith("hang:"):
        Path(completion[5:]).touch()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # like C code that never checks signals
        time.sleep(120)
    return math_reward(completion, answer)


def always_crash(completion: str, answer: str, **extras) -> float:
    os._exit(3)


def _crash_now() -> None:
    os._exit(3)  # dies during warm-up, before it can say "ready"


always_crash.warmup = _crash_now


# ---- math_reward inline ----


def test_plain_and_boxed_answers_score():
    assert math_reward(boxed("46"), "46") == 1.0
    assert math_reward("46", "46") == 1.0
    assert math_reward("The answer is 46.", "46") == 1.0
    assert math_reward(boxed("\\frac{1}{2}"), "0.5") == 1.0
    assert math_reward(boxed("\\frac{14}{3}"), "\\frac{14}{3}") == 1.0
    assert math_reward("\\boxed{45} first, then corrected: \\boxed{46}", "46") == 1.0  # the last box counts
    assert math_reward("\\boxed{46} first, then corrected: \\boxed{45}", "46") == 0.0
    assert math_reward(boxed("47"), "46") == 0.0


@pytest.mark.parametrize(
    "completion",
    ["", " ", "garbage ###", "\\boxed{", "\\boxed{}", "}}}{{{", "\x00\xff", "$$$$", "\\frac{", "nan"],
)
def test_empty_and_garbage_score_zero(completion):
    assert math_reward(completion, "46") == 0.0


def test_wrong_types_and_bad_gold_score_zero():
    assert math_reward(None, "46") == 0.0  # type: ignore[arg-type]
    assert math_reward("46", None) == 0.0  # type: ignore[arg-type]
    assert math_reward("46", "") == 0.0
    assert math_reward("46", "46", timeout_s=0) == 0.0


def megabyte_completions() -> list[str]:
    rnd = random.Random(0)
    return [
        "".join(rnd.choice(string.printable) for _ in range(1_000_000)),
        "a" * 1_000_000,
        "\\boxed{" * 150_000,
        "{" * 1_000_000,
        "$" + "1+" * 500_000 + "$",
        "\\boxed{46}" + "x" * 1_000_000,  # the answer is outside the tail that is read
    ]


def test_megabyte_completions_score_zero_quickly():
    for completion in megabyte_completions():
        start = time.monotonic()
        assert math_reward(completion, "46", timeout_s=TIMEOUT_S) == 0.0
        elapsed = time.monotonic() - start
        print(f"1 MB completion {completion[:12]!r}...: {elapsed:.3f} s")
        assert elapsed < 1.0


def test_pathological_expression_stops_at_the_time_limit():
    start = time.monotonic()
    assert math_reward("\\boxed{2^{2^{40}}}", "46", timeout_s=1.0) == 0.0
    elapsed = time.monotonic() - start
    print(f"2^(2^40): stopped after {elapsed:.2f} s")
    assert elapsed < 2.0  # 1.0 s plus slack for a loaded machine
    assert math_reward(boxed("46"), "46") == 1.0  # and the next call is unaffected


def test_callers_own_timer_is_restored():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        assert math_reward(boxed("46"), "46") == 1.0
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.5
        time.sleep(0.6)
        assert fired == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.slow
def test_math_reward_from_a_thread_uses_a_worker_process():
    got: list[float] = []
    t = threading.Thread(target=lambda: got.extend([math_reward(boxed("46"), "46"), math_reward("x", "46")]))
    t.start()
    t.join(60)
    assert got == [1.0, 0.0]


# ---- the pool ----


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=TIMEOUT_S) as p:
        assert p.wait_ready(60)
        yield p


@pytest.mark.slow
@pytest.mark.parametrize("name", ["math500", "aime24"])
def test_gold_answer_in_a_box_scores_one(pool, name):
    """The acceptance test: a completion ending in \\boxed{gold} scores 1.0 for >= 99% of problems."""
    answers = [ex.answer for ex in load_dataset(BENCH / f"{name}.jsonl")]
    start = time.monotonic()
    scores = pool.score([boxed(a) for a in answers], answers)
    rate = sum(scores) / len(answers)
    print(
        f"{name}: gold in \\boxed{{}} scores 1.0 for {rate:.1%} of {len(answers)} "
        f"({time.monotonic() - start:.2f} s on 2 workers)"
    )
    missed = [a for a, s in zip(answers, scores) if s != 1.0]
    assert rate >= 0.99, f"answers that did not verify: {missed[:20]}"

    # the answer of the next problem scores 0.0, unless the two answers are mathematically equal
    others = answers[1:] + answers[:1]
    cross = pool.score([boxed(o) for o in others], answers)
    matched = [(a, o) for a, o, s in zip(answers, others, cross) if s == 1.0]
    print(f"{name}: another problem's answer scores 1.0 for {len(matched)} pairs: {matched}")
    different = [(a, o) for a, o in matched if "".join(a.split()) != "".join(o.split())]
    assert pool.score([boxed(a) for a, _ in different], [o for _, o in different]) == [1.0] * len(different)
    assert len(different) <= 0.01 * len(answers)


@pytest.mark.slow
def test_pool_bad_inputs_and_megabytes(pool):
    completions = ["", "garbage", "46", *megabyte_completions()]
    start = time.monotonic()
    scores = pool.score(completions, ["46"] * len(completions))
    assert scores == [0.0, 0.0, 1.0] + [0.0] * (len(completions) - 3)
    assert time.monotonic() - start < TIMEOUT_S
    assert asyncio.run(pool.ascore([boxed("3"), "4"], ["3", "3"])) == [1.0, 0.0]
    with pytest.raises(ValueError, match="one gold answer per completion"):
        pool.score(["1"], [])


@pytest.mark.slow
def test_pool_survives_a_hung_and_a_killed_worker(tmp_path):
    with RewardPool(num_workers=1, timeout_s=1.0, fn=slow_score) as p:
        assert p.wait_ready(60)
        # hung past the time limit: 0.0 after timeout_s + grace, the worker is replaced
        pid = p.worker_pids()[0]
        start = time.monotonic()
        assert p.submit(f"hang:{tmp_path / 'a'}", "1").result(30) == 0.0
        assert 1.0 <= time.monotonic() - start < 5.0
        assert p.worker_pids()[0] != pid and p.num_replaced == 1
        # killed in the middle of a sample: 0.0 at once, replaced, and the next samples still score
        assert p.wait_ready(60)
        fut = p.submit(f"hang:{tmp_path / 'b'}", "1", timeout_s=60)
        queued = p.submit(boxed("7"), "7")
        while not (tmp_path / "b").exists():
            time.sleep(0.01)
        os.kill(p.worker_pids()[0], signal.SIGKILL)
        assert fut.result(10) == 0.0
        assert queued.result(60) == 1.0
        assert p.score([boxed("2"), "3"], ["2", "2"]) == [1.0, 0.0]
        assert p.num_replaced == 2


@pytest.mark.slow
def test_pool_close_and_broken_workers():
    p = RewardPool(num_workers=1, timeout_s=1.0, fn=always_crash)
    fut = p.submit("1", "1")
    with pytest.raises(RuntimeError, match="died while starting"):
        fut.result(60)
    with pytest.raises(RuntimeError, match="died while starting"):
        p.submit("1", "1")
    p.close()
    p.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        p.submit("1", "1")


def test_pool_inline_and_arguments():
    with RewardPool(num_workers=0) as p:
        assert p.score([boxed("46"), "x", ""], ["46", "46", "46"]) == [1.0, 0.0, 0.0]
        assert p.submit("46", "46").done() and p.worker_pids() == []
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(num_workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(num_workers=0, timeout_s=0)
    with pytest.raises(ValueError, match="start_method"):
        RewardPool(num_workers=0, start_method="fork")


@pytest.mark.slow
def test_pool_close_cancels_queued_samples():
    p = RewardPool(num_workers=1, timeout_s=TIMEOUT_S)
    futs = [p.submit(boxed(str(i)), str(i)) for i in range(200)]
    p.close()  # most are still queued: the worker has not even started
    outcomes = []
    for f in futs:
        try:
            outcomes.append(f.result(10))
        except (CancelledError, RuntimeError):
            outcomes.append("stopped")
    assert "stopped" in outcomes and set(outcomes) <= {1.0, "stopped"}
