"""The buffer's socket-free core (pipeline/buffer/core.py), driven message by message on a fake clock: the one
dispatch, parking, evaluation rounds interleaved with training, eval.jsonl rows, draining after a Shutdown,
lost rounds re-issued, batch metrics, and the progress line and its warnings."""

import json
import logging

import numpy as np
import pytest

from pipeline import protocol as P
from pipeline.buffer.core import WORK_POLL_S, BufferCore, Out
from pipeline.buffer.progress import PROGRESS_EVERY_S, WARN_AFTER_SAMPLES
from pipeline.config import load_config
from pipeline.prompts import Prompt

TRAIN = [(f"{i}+{i}=", str(2 * i)) for i in range(200)]
EVALS = [Prompt(f"e{i}", str(i), "small" if i < 4 else "large") for i in range(12)]
BATCH_KEYS = ("buffer/samples_received", "buffer/positive_rate_step", "buffer/samples_per_released_group",
              "eval/accuracy", "eval/version", "producers/tokens_per_s", "producers/busy")


def make(tmp_path, *overrides, evals=EVALS, **kw):
    cfg = load_config(None, ["--run.dir", str(tmp_path), "--learner.batch_prompts", "4", "--learner.mini_batches",
                             "1", "--learner.eval_every", "2", "--learner.num_steps", "3", "--eval.k", "2",
                             "--eval.max_new_tokens", "96", "--buffer.lease_s", "10", *overrides])
    return BufferCore(cfg, TRAIN, evals, now=0.0, **kw)


def sample(reward, version=0):
    return P.Sample(np.arange(3, dtype=np.int32), np.zeros(3, np.float32), float(reward), version, "stop")


def result(a, rewards, producer="p0", kind=None, version=0):
    return P.RoundResult(producer, a.round_id, a.prompt_id, np.arange(2, dtype=np.int32),
                         [sample(r, version) for r in rewards], 0.1, a.kind if kind is None else kind)


def mixed(a):
    return [i % 2 for i in range(a.num_samples)]  # releases a balance group in one round


def work(core, now, n=8, producer="p0", version=0):
    """A WorkRequest; returns the rounds of the Assignments reply (None when it was parked)."""
    outs = core.handle(producer.encode(), P.WorkRequest(producer, n, version), now)
    replies = [o.msg for o in outs if o.to == producer.encode() and isinstance(o.msg, P.Assignments)]
    return replies[0].rounds if replies else None


def answer(core, rounds, now, rewards=mixed, producer="p0"):
    for a in rounds:
        assert core.handle(producer.encode(), result(a, rewards(a), producer), now) == []


def rows(tmp_path):
    path = tmp_path / "tiny" / "eval.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------- dispatch


def test_every_message_kind_goes_through_one_dispatch(tmp_path):
    core = make(tmp_path, evals=[])
    rounds = work(core, 0.0, n=2)
    assert len(rounds) == 2 and all(a.kind == "train" and a.max_new_tokens == 0 for a in rounds)
    assert core.handle(b"p0", P.Heartbeat("p0", "producer", 0, {"tokens_per_s": 50.0}), 0.1) == []
    assert core.producer_stats["p0"]["tokens_per_s"] == 50.0
    answer(core, rounds, 0.2)
    assert core.scheduler.metrics()["samples_received"] == 16
    (out,) = core.handle(b"cli", P.MetricsRequest("cli"), 0.3)
    assert out.to == b"cli" and out.msg.metrics["samples_received"] == 16
    assert core.handle(b"l", P.BatchRequest("l", 0, 4, 1000), 0.4) == []  # parked: 2 groups of 4 released
    answer(core, work(core, 0.5, n=2), 0.5)
    (out,) = core.tick(0.6)
    assert out.to == b"l" and len(out.msg.groups) == 4 and out.msg.learner_version == 0
    outs = core.handle(b"l", P.VersionUpdate(1, P.WeightAnnouncement(1, "/w/1", 9)), 0.7)
    assert outs == [Out(None, outs[0].msg)] and outs[0].msg.version == 1 and core.learner_version == 1
    with pytest.raises(TypeError, match="no handler for Ack"):
        core.handle(b"x", P.Ack(True), 0.8)


def test_bad_input_is_counted_per_sender_and_never_handled(tmp_path):
    core = make(tmp_path, evals=[], vocab_size=32)
    assert core.handle(b"evil", P.WorkRequest("evil", -1, 0), 0.0) == []
    assert core.handle(b"evil", P.VersionUpdate(-3), 0.0) == []
    (a,) = work(core, 0.0, n=1)
    bad_kind = result(a, mixed(a), kind="bogus")
    assert core.handle(b"p0", bad_kind, 0.0) == [] and core.counters["invalid"] == 3
    core.malformed(b"evil", "garbage")
    oov = result(a, mixed(a))
    oov.samples[0].token_ids = np.array([0, 40, 1], np.int32)
    core.handle(b"p0", oov, 0.1)
    assert core.counters["rejected_oov"] == 1 and core.scheduler.metrics()["results_rejected"] == 1
    assert core.scheduler.metrics()["active"] == 1  # re-issued, not given up on
    (again,) = work(core, 0.2, n=1)
    assert again.prompt_id == a.prompt_id and again.round_id != a.round_id
    m = core.metrics(1.0)
    assert m["buffer/malformed"] == 1 and m["malformed_by_sender"] == {"evil": 1}
    assert m["rejected_by_sender"] == {"evil": 2, "p0": 2} and core.learner_version == 0


def test_idle_work_requests_are_parked_then_answered_empty(tmp_path):
    core = make(tmp_path, "--buffer.max_staleness", "0", evals=[])
    assert len(work(core, 0.0, n=100)) == 4  # admission: one batch of prompts at max_staleness 0
    assert work(core, 0.0, n=4, producer="p1") is None  # nothing to give: parked
    assert core.tick(WORK_POLL_S / 2) == []
    (out,) = core.tick(WORK_POLL_S + 0.01)
    assert out.to == b"p1" and out.msg.rounds == [] and not core.parked_work


def test_stale_weights_are_announced_and_stale_producers_get_no_rounds(tmp_path):
    core = make(tmp_path, "--buffer.max_staleness", "0", evals=[])
    uri = str(core.cfg.weights_dir / "v000002.safetensors")  # announced only from the run's weights directory
    core.handle(b"l", P.VersionUpdate(2, P.WeightAnnouncement(2, uri, 9)), 0.0)
    (out,) = core.handle(b"p0", P.WorkRequest("p0", 4, 1), 0.0)
    assert out.msg.rounds == [] and out.msg.weights.uri == uri


# ---------------------------------------------------------------- evaluation and training share producers


def test_evaluation_takes_at_most_half_while_training_has_rounds(tmp_path):
    core = make(tmp_path)
    rounds = work(core, 0.0, n=8)
    kinds = [a.kind for a in rounds]
    assert kinds.count("eval") == 4 and kinds.count("train") == 4
    evals = [a for a in rounds if a.kind == "eval"]
    assert all(a.max_new_tokens == 96 and a.num_samples == 2 and a.lease_s == 10.0 for a in evals)
    # a request for one round: evaluation and training take turns
    singles = [work(core, 0.1, n=1)[0].kind for _ in range(4)]
    assert singles == ["train", "eval", "train", "eval"]
    # half of 8 to evaluation; training fills 2 before admission closes (2 batches of 4 at max_staleness 1),
    # and evaluation takes what training cannot use
    rest = work(core, 0.2, n=8)
    assert [a.kind for a in rest] == ["eval"] * 4 + ["train"] * 2 + ["eval"] * 2 and core.evals.available == 0
    assert core.counters["eval_rounds"] == 12
    core = make(tmp_path / "closed", "--buffer.max_staleness", "0")  # admission holds one batch of 4
    assert [a.kind for a in work(core, 0.0, n=8)].count("train") == 4
    assert [a.kind for a in work(core, 0.0, n=8)] == ["eval"] * 8


def test_the_learner_gets_its_first_batch_while_a_long_evaluation_runs(tmp_path):
    big = [Prompt(f"e{i}", str(i), "big") for i in range(400)]
    core = make(tmp_path, evals=big)
    core.handle(b"l", P.BatchRequest("l", 0, 4, 60_000), 0.0)
    batch, now = None, 0.0
    while batch is None:
        now += 0.1
        for producer in ("p0", "p1"):
            answer(core, work(core, now, n=4, producer=producer), now, producer=producer)
        batch = next((o.msg for o in core.tick(now) if isinstance(o.msg, P.Batch)), None)
    assert len(batch.groups) == 4 and core.evals.outstanding == 1  # the evaluation is still running
    assert core.evals.in_progress()[0]["done"] <= 8


# ---------------------------------------------------------------- eval.jsonl


def test_each_evaluation_writes_one_row_in_version_order(tmp_path):
    core = make(tmp_path, "--buffer.max_staleness", "3")
    v0 = [a for a in work(core, 0.0, n=24) if a.kind == "eval"]  # version 0 starts with the core
    assert len(v0) == 12
    for version in (1, 2):
        core.handle(b"l", P.VersionUpdate(version), 1.0)
    v2 = [a for a in work(core, 1.0, n=24) if a.kind == "eval"]
    core.handle(b"l", P.VersionUpdate(3), 2.0)  # the last step (num_steps 3): evaluated too
    v3 = [a for a in work(core, 2.0, n=24) if a.kind == "eval"]
    assert (len(v2), len(v3)) == (12, 12)
    answer(core, v3, 3.0, rewards=lambda a: [1, 1])
    answer(core, v2, 3.5, rewards=lambda a: [1, 0])
    assert rows(tmp_path) == []  # held: version 0 started first and is not finished
    answer(core, v0, 4.0, rewards=lambda a: [0, 0] if a.prompt_id < 4 else [1, 1])
    got = rows(tmp_path)
    assert [r["version"] for r in got] == [0, 2, 3]
    r0 = got[0]
    assert {"version", "accuracy", "k", "problems", "seconds", "time", "pass_at_k", "benchmarks"} <= set(r0)
    assert (r0["accuracy"], r0["pass_at_k"], r0["k"], r0["problems"]) == (8 / 12, 8 / 12, 2, 12)
    assert r0["benchmarks"] == {"small": {"problems": 4, "ave_at_k": 0.0, "pass_at_k": 0.0},
                                "large": {"problems": 8, "ave_at_k": 1.0, "pass_at_k": 1.0}}
    assert (got[1]["accuracy"], got[1]["pass_at_k"]) == (0.5, 1.0) and got[2]["accuracy"] == 1.0
    (out,) = core.handle(b"l", P.BatchRequest("l", 3, 100, 0), 5.0)  # timeout 0: answered at once
    assert set(BATCH_KEYS) <= set(out.msg.metrics)
    assert out.msg.metrics["eval/version"] == 3.0 and out.msg.metrics["eval/large/pass_at_k"] == 1.0


def test_a_result_without_the_kind_is_still_scored_and_counted(tmp_path):
    core = make(tmp_path)
    evals = [a for a in work(core, 0.0, n=24) if a.kind == "eval"]
    for a in evals:  # an older producer that does not echo the kind: every result says "train"
        core.handle(b"p0", result(a, [1, 1], kind="train"), 1.0)
    assert [r["accuracy"] for r in rows(tmp_path)] == [1.0]
    assert core.counters["results_wrong_kind"] == 12 and core.scheduler.metrics()["results_ignored"]["late"] == 0


def test_lost_eval_rounds_are_aborted_and_reissued(tmp_path):
    core = make(tmp_path, "--buffer.heartbeat_timeout_s", "5")
    taken = [a for a in work(core, 0.0, n=8, producer="gone") if a.kind == "eval"]
    assert len(taken) == 4
    core.handle(b"p1", P.Heartbeat("p1", "producer", 0, {}), 6.0)
    aborts = [o.msg for o in core.tick(6.0) if isinstance(o.msg, P.Abort)]
    lost = {a.round_id for a in taken}
    assert len(aborts) == 1 and lost <= set(aborts[0].round_ids)  # "gone" is silent: its rounds are lost
    again = [a for a in work(core, 6.0, n=24, producer="p1") if a.kind == "eval"]
    assert len(again) == 12 and {a.prompt_id for a in again} == set(range(12))
    assert not lost & {a.round_id for a in again}  # new ids
    for a in taken:  # the lost rounds' results arrive after all: ignored, never counted twice
        core.handle(b"gone", result(a, [0, 0]), 7.0)
    answer(core, again, 7.0, rewards=lambda a: [1, 1], producer="p1")
    assert [r["accuracy"] for r in rows(tmp_path)] == [1.0]
    counts = core.metrics(8.0)["eval_counts"]
    assert (counts["rounds_issued"], counts["rounds_reissued"], counts["results_late"]) == (16, 4, 4)


def test_one_book_holds_every_round_out_and_a_holder_of_eval_rounds_alone_is_kept(tmp_path):
    core = make(tmp_path)
    rounds = work(core, 0.0, n=8)
    evals = [a for a in rounds if a.kind == "eval"]
    train = [a for a in rounds if a.kind == "train"]
    assert evals and train and set(core.leases.leases) == {a.round_id for a in rounds}
    assert core.leases.rounds_held == {"p0": len(train)} and core.leases.leases_held == {"p0": len(rounds)}
    answer(core, train, 1.0)  # the Scheduler ends its rounds' leases
    assert set(core.leases.leases) == {a.round_id for a in evals} and not core.leases.rounds_held
    core.peers.max_peers = 1  # p0 holds evaluation rounds only: a newcomer is refused rather than p0 forgotten
    assert core.handle(b"newcomer", P.WorkRequest("newcomer", 1, 0), 1.0) == []
    assert core.counters["peers_refused"] == 1 and b"p0" in core.peers.last_seen
    answer(core, evals, 2.0, rewards=lambda a: [1] * a.num_samples)
    assert not core.leases.leases and not core.leases.leases_held
    core.leases.check()
    core.scheduler.check_invariants()
    core.handle(b"newcomer", P.WorkRequest("newcomer", 1, 0), 3.0)  # now p0, holding nothing, makes room
    assert core.counters["peers_evicted"] == 1 and b"newcomer" in core.peers.last_seen


# ---------------------------------------------------------------- draining


def test_shutdown_drains_the_final_evaluation_then_finishes(tmp_path):
    core = make(tmp_path, "--buffer.max_staleness", "5")
    first = work(core, 0.0, n=8) + work(core, 0.0, n=16)
    train = [a for a in first if a.kind == "train"]
    answer(core, [a for a in first if a.kind == "eval"], 0.5)  # version 0 evaluated
    core.handle(b"l", P.VersionUpdate(3), 1.0)  # the last step: the final evaluation starts
    assert core.handle(b"l", P.Shutdown("learner finished"), 1.0) == []
    assert core.stop_reason == "learner finished" and not core.finished(1.0)
    rounds = work(core, 1.1, n=100, version=3)
    assert len(rounds) == 12 and all(a.kind == "eval" for a in rounds)  # draining: no more training
    assert work(core, 1.2, n=8, version=3) is None  # nothing left to hand out
    answer(core, train, 1.3)  # training results still count
    assert core.scheduler.metrics()["samples_received"] == 8 * len(train)
    answer(core, rounds[:-1], 1.4)
    assert not core.finished(1.5) and core.metrics(1.5)["draining"]
    answer(core, rounds[-1:], 1.6)
    assert core.finished(1.6) and [r["version"] for r in rows(tmp_path)] == [0, 3]


def test_shutdown_without_evaluations_finishes_at_once_and_a_stuck_one_after_the_lease(tmp_path):
    core = make(tmp_path, evals=[])
    core.handle(b"l", P.Shutdown("done"), 0.0)
    assert core.finished(0.0)
    core = make(tmp_path / "stuck")
    core.handle(b"l", P.Shutdown("done"), 1.0)  # version 0's evaluation has no producer at all
    assert not core.finished(10.9) and core.finished(11.0)  # buffer.lease_s = 10
    core = make(tmp_path / "limit")
    core.stop("time limit")
    assert core.finished(0.0)


# ---------------------------------------------------------------- metrics and progress


def test_batch_metrics_have_no_hidden_side_effect(tmp_path):
    core = make(tmp_path, evals=[])
    answer(core, work(core, 0.0, n=8), 0.0, rewards=lambda a: [1, 0, 0, 0, 1, 0, 0, 0])
    for _ in range(3):
        core.metrics(0.1)  # reading metrics never moves the per-step pass rate
    (out,) = core.handle(b"l", P.BatchRequest("l", 0, 4, 0), 0.2)
    m = out.msg.metrics
    assert set(BATCH_KEYS) - {"eval/accuracy", "eval/version"} <= set(m)
    assert m["buffer/positive_rate_step"] == 0.25 and m["buffer/samples_received"] == 64
    (out,) = core.handle(b"l", P.BatchRequest("l", 0, 4, 0), 0.3)
    assert out.msg.metrics["buffer/positive_rate_step"] == 0.0  # nothing generated since the last batch


def test_progress_line_every_interval_with_per_producer_numbers(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.buffer")
    core = make(tmp_path, evals=[])
    core.handle(b"p0", P.Heartbeat("p0", "producer", 0, {"tokens_per_s": 123.0}), 0.0)
    answer(core, work(core, 0.0, n=2), 0.0)
    core.tick(PROGRESS_EVERY_S - 1)
    assert "progress:" not in caplog.text
    core.tick(PROGRESS_EVERY_S)
    (line,) = [r.getMessage() for r in caplog.records if "progress:" in r.getMessage()]
    assert "16 samples (p0 16 at 123 tok/s)" in line and "pass rate 0.500" in line
    assert "0 dropped" in line and "learner version 0" in line
    p = core.metrics(PROGRESS_EVERY_S)["progress"]
    assert p["producers"] == {"p0": {"samples_received": 16, "tokens_per_s": 123.0}} and p["warnings"] == []
    core.tick(PROGRESS_EVERY_S + 1)
    assert sum("progress:" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("reward,kind", [(0, "never"), (1, "always")])
def test_a_reward_that_never_or_always_fires_is_warned_about(tmp_path, caplog, reward, kind):
    core = make(tmp_path, "--buffer.unresolved", "keep", "--buffer.max_staleness", "100", evals=[])
    now = 0.0
    while core.scheduler.metrics()["samples_received"] + 32 < WARN_AFTER_SAMPLES:
        answer(core, work(core, now, n=4), now, rewards=lambda a: [reward] * a.num_samples)
        now += PROGRESS_EVERY_S
        core.tick(now)  # a progress report, still below the threshold: no warning yet
        assert "never fires" not in caplog.text and "always fires" not in caplog.text
    answer(core, work(core, now, n=4), now, rewards=lambda a: [reward] * a.num_samples)
    assert core.scheduler.metrics()["samples_received"] >= WARN_AFTER_SAMPLES
    core.tick(now + PROGRESS_EVERY_S)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and f"{kind} fires" in r.getMessage()]
    assert len(warned) == 1 and "data.template" in warned[0].getMessage()
    assert any(f"{kind} fires" in w for w in core.metrics(now)["progress"]["warnings"])
    core.tick(now + 2 * PROGRESS_EVERY_S)
    assert sum(f"{kind} fires" in r.getMessage() for r in caplog.records) == 1  # once, not every interval


def test_almost_every_prompt_dropped_is_warned_about(tmp_path, caplog):
    core = make(tmp_path, "--sampling.max_rounds", "1", "--buffer.max_staleness", "100", evals=[])
    now = 0.0
    for _ in range(60):  # 1 prompt in 20 has a mixed round; the others all fail and are dropped
        answer(core, work(core, now, n=1), now, rewards=lambda a: mixed(a) if a.prompt_id % 20 == 0 else [0] * 8)
        now += 1.0
    core.tick(now + PROGRESS_EVERY_S)
    m = core.scheduler.metrics()
    assert m["dropped_unresolved"] == 57 and m["released"] == 3
    (warned,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "57 of 60 settled prompts were dropped" in warned and "buffer.unresolved" in warned
    assert core.metrics(now)["progress"]["warnings"] == [warned]


def test_a_run_whose_reward_never_fires_is_stopped_by_the_buffer(tmp_path, caplog):
    limit = 96
    core = make(tmp_path, "--buffer.stop_without_signal", str(limit), "--buffer.max_staleness", "100", evals=[])
    now = 0.0
    while core.scheduler.metrics()["samples_received"] < limit:
        assert core.stop_reason is None and not core.fatal
        answer(core, work(core, now, n=2), now, rewards=lambda a: [0] * a.num_samples)
        now += 2.0
        core.tick(now)
    assert core.fatal and core.stop_reason == core.fatal and core.finished(now)
    assert "reward never fired in" in core.fatal and "buffer.stop_without_signal" in core.fatal
    assert any(r.levelno == logging.ERROR and "stopping the run" in r.getMessage() for r in caplog.records)
    # with a signal, or with the stop turned off, the same run goes on
    for overrides, rewards in (([str(limit)], mixed), (["0"], lambda a: [0] * a.num_samples)):
        core = make(tmp_path, "--buffer.stop_without_signal", *overrides, "--buffer.max_staleness", "100", evals=[])
        for i in range(8):
            answer(core, work(core, float(i), n=2), float(i), rewards=rewards)
            core.tick(float(i) + 2)
        assert core.scheduler.metrics()["samples_received"] >= limit and not core.fatal
