"""Faults with real processes over real ZeroMQ: a producer killed, the buffer killed and resumed from its
snapshot, a producer 10x slower than the rest. Every test checks that no prompt is lost or trained twice
(beyond the documented bound) and that the counters add up. Bad input (fuzzing) is in test_fuzz_buffer.py."""

import json
import signal
import time

import pytest

from pipeline.testing.processes import (
    buffer_command,
    buffer_metrics,
    prompts_accounted,
    results_received,
    scripted_command,
    send_shutdown,
    start,
    wait_for_buffer,
)
from pipeline.transport import free_port_pair

BATCH = 8


def _stop_producers(producers, outs) -> list[dict]:
    """SIGTERM the producers (they finish the result they are sending) and read the counts they wrote."""
    for p in producers:
        p.send_signal(signal.SIGTERM)
    for p in producers:
        assert p.wait(timeout=30) == 0
    return [json.loads(out.read_text()) for out in outs]


def _check_learner(summary: dict, steps: int) -> None:
    assert summary["versions"] == list(range(1, steps + 1))
    assert summary["groups"] == steps * BATCH and summary["bad_group_size"] == 0
    assert summary["max_staleness_seen"] <= 1  # the buffer's max_staleness (1, or 0 where a test sets it)
    assert summary["late_groups"] == 0


@pytest.mark.slow
def test_killed_producer_rounds_are_reissued(tmp_path, procs):
    port = free_port_pair()
    # on-policy: admission holds one batch of prompts, so the victim's rounds block training until re-issued
    buf = start(buffer_command(port, tmp_path, "--buffer.heartbeat_timeout_s", "1.5", "--buffer.lease_s", "60",
                               "--buffer.max_staleness", "0"), tmp_path / "buffer.log")
    procs.append(buf)
    wait_for_buffer(port, proc=buf)
    # the victim takes all 8 rounds and "generates" for a minute, heartbeating all the while
    victim = start(scripted_command("producer", port, "--id", "victim", "--round-seconds", "60", "--max-rounds", "8",
                                    "--heartbeat", "0.25"))
    procs.append(victim)
    held = wait_for_buffer(port, until=lambda m: m["rounds_in_flight"] >= 8)["rounds_in_flight"]
    out_p, out_l = tmp_path / "survivor.json", tmp_path / "learner.json"
    survivor = start(scripted_command("producer", port, "--id", "survivor", "--round-seconds", "0.02",
                                      "--out", str(out_p)))
    learner = start(scripted_command("learner", port, "--steps", "6", "--batch", str(BATCH), "--no-shutdown",
                                     "--out", str(out_l)))
    procs += [survivor, learner]
    time.sleep(2.0)
    m = buffer_metrics(port)
    assert m["rounds_expired"] == 0 and m["learner_version"] == 0  # alive, heartbeating: its rounds stay with it
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert learner.wait(timeout=120) == 0
    (sent,) = _stop_producers([survivor], [out_p])
    m = wait_for_buffer(port, until=lambda m: results_received(m) >= sent["rounds"], timeout_s=10)
    send_shutdown(port)
    assert buf.wait(timeout=20) == 0

    summary = json.loads(out_l.read_text())
    print(f"producer kill: held {held}, expired {m['rounds_expired']}, reissued {m['rounds_reissued']}, "
          f"results {sent['rounds']}, steps {summary['step_seconds']}")
    _check_learner(summary, 6)
    assert summary["max_staleness_seen"] == 0
    assert len(set(summary["prompt_ids"])) == 6 * BATCH  # no prompt trained twice
    assert m["rounds_expired"] >= held  # the victim's rounds were re-issued once its heartbeats stopped
    assert m["rounds_reissued"] >= held
    assert prompts_accounted(m)  # no prompt lost
    assert results_received(m) == sent["rounds"]  # the survivor did all the work, and every result arrived


@pytest.mark.slow
def test_buffer_killed_and_resumed_from_snapshot(tmp_path, procs):
    port = free_port_pair()
    cmd = buffer_command(port, tmp_path, "--buffer.heartbeat_timeout_s", "3")
    buf = start(cmd, tmp_path / "buffer.log")
    procs.append(buf)
    wait_for_buffer(port, proc=buf)
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    producers = [start(scripted_command("producer", port, "--id", f"p{i}", "--round-seconds", "0.05",
                                        "--request-timeout", "1", "--out", str(outs[i]))) for i in range(2)]
    out_l = tmp_path / "learner.json"
    steps = 14
    learner = start(scripted_command("learner", port, "--steps", str(steps), "--batch", str(BATCH),
                                     "--train-seconds", "0.3", "--request-timeout", "3", "--no-shutdown",
                                     "--out", str(out_l)))
    procs += producers + [learner]
    # the worst moment: the learner holds a batch taken after the last snapshot (one per version) and trains on it
    before = wait_for_buffer(port, timeout_s=90, until=lambda m: m["learner_version"] >= 5 and
                             m["groups_consumed"] > BATCH * m["learner_version"])
    buf.kill()  # SIGKILL: no chance to write anything on the way out
    buf.wait()
    snapshot = tmp_path / "tiny" / "buffer" / "snapshot.msgpack"
    assert snapshot.is_file()
    time.sleep(4.0)  # longer than every client's request timeout: all of them time out and retry meanwhile
    buf2 = start(cmd + ["--resume"], tmp_path / "buffer2.log")
    procs.append(buf2)
    assert learner.wait(timeout=150) == 0
    sent = _stop_producers(producers, outs)
    m = wait_for_buffer(port, proc=buf2)
    send_shutdown(port)
    assert buf2.wait(timeout=20) == 0

    summary = json.loads(out_l.read_text())
    ids = summary["prompt_ids"]
    print(f"buffer restart: killed at version {before['learner_version']}, snapshot {m['snapshot']}, retries "
          f"{summary['retries']}, repeated prompt ids {len(ids) - len(set(ids))}, ignored {m['results_ignored']}, "
          f"reissued {m['rounds_reissued']}, results sent {[s['rounds'] for s in sent]} received "
          f"{results_received(m)}, producer timeouts {[s['request_timeouts'] for s in sent]}")
    _check_learner(summary, steps)  # versions kept increasing, 1..steps, through the restart
    assert summary["retries"] >= 1  # the learner re-sent its request on a fresh socket
    assert all(s["request_timeouts"] >= 1 for s in sent)  # so did the producers
    assert "resumed from" in (tmp_path / "buffer2.log").read_text()
    assert m["buffer/resumes"] == 1 and m["learner_version"] == steps
    # documented bound: only groups handed out after the last snapshot (one batch) may be trained again
    assert len(ids) - len(set(ids)) <= BATCH
    assert prompts_accounted(m)  # nothing admitted before the snapshot was lost
    # the producers reconnected by themselves and kept delivering to the new buffer
    assert m["samples_received"] > before["samples_received"]
    assert all(s["rounds"] > 0 for s in sent)
    # results of rounds the dead buffer handed out arrive as late (never credited to another prompt), and every
    # result sent to the new buffer is accounted for: no more than the producers sent in all
    assert results_received(m) <= sum(s["rounds"] for s in sent)


@pytest.mark.slow
def test_slow_producer_never_stalls_training(tmp_path, procs):
    port = free_port_pair()
    buf = start(buffer_command(port, tmp_path, "--buffer.lease_s", "0.5", "--buffer.heartbeat_timeout_s", "3"),
                tmp_path / "buffer.log")
    procs.append(buf)
    wait_for_buffer(port, proc=buf)
    outs = [tmp_path / f"{name}.json" for name in ("fast0", "fast1", "slow")]
    producers = [start(scripted_command("producer", port, "--id", f"fast{i}", "--round-seconds", "0.1",
                                        "--out", str(outs[i]))) for i in range(2)]
    # 10x slower, and deaf to aborts (a lagging control channel): every result it sends comes after its lease
    producers.append(start(scripted_command("producer", port, "--id", "slow", "--round-seconds", "1.0",
                                            "--max-rounds", "4", "--ignore-aborts", "--out", str(outs[2]))))
    out_l = tmp_path / "learner.json"
    learner = start(scripted_command("learner", port, "--steps", "20", "--batch", str(BATCH), "--train-seconds",
                                     "0.1", "--no-shutdown", "--out", str(out_l)))
    procs += producers + [learner]
    assert learner.wait(timeout=120) == 0
    sent = _stop_producers(producers, outs)
    total = sum(s["rounds"] for s in sent)
    m = wait_for_buffer(port, until=lambda m: results_received(m) >= total, timeout_s=10)
    send_shutdown(port)
    assert buf.wait(timeout=20) == 0

    summary = json.loads(out_l.read_text())
    print(f"slow producer: steps {[round(x, 2) for x in summary['step_seconds']]}, sent {sent}, expired "
          f"{m['rounds_expired']}, reissued {m['rounds_reissued']}, ignored {m['results_ignored']}")
    _check_learner(summary, 20)
    assert len(set(summary["prompt_ids"])) == 20 * BATCH
    assert max(summary["step_seconds"]) < 5.0, summary["step_seconds"]  # 10 leases: never waits on the slow one
    assert sent[2]["rounds"] > 0 and m["rounds_expired"] > 0 and m["rounds_reissued"] > 0
    assert m["results_ignored"]["late"] >= sent[2]["rounds"]  # each of its results came after its lease
    assert results_received(m) == total  # every result that was sent is accounted for
    assert prompts_accounted(m)


# ---------------------------------------------------------------- snapshots, in process (fast)


def _service(tmp_path, resume=False, **kw):
    """The buffer's socket-free core, as `reinforce-ada buffer` builds it."""
    from pipeline.buffer.core import BufferCore
    from pipeline.config import load_config

    cfg = load_config(None, ["--run.dir", str(tmp_path), "--learner.batch_prompts", "4", "--learner.mini_batches",
                             "1", "--learner.eval_every", "0"])
    prompts = [(f"{i}+{i}=", str(2 * i)) for i in range(50)]
    return BufferCore(cfg, prompts, [], now=0.0, resume=resume, **kw)


def _submit(svc, rnd, now: float, reward=None, producer: str = "p") -> None:
    import numpy as np

    from pipeline import protocol as P

    samples = [P.Sample(np.arange(3, dtype=np.int32), np.zeros(3, np.float32),
                        float(i % 2) if reward is None else reward, svc.learner_version, "stop")
               for i in range(rnd.num_samples)]
    svc.handle(producer.encode(), P.RoundResult(producer, rnd.round_id, rnd.prompt_id, np.arange(2, dtype=np.int32),
                                                samples, 0.0), now)


def _work(svc, producer: str, n: int, now: float) -> list:
    """Rounds for `producer`, asked for as a producer does (so they are leased to it)."""
    from pipeline import protocol as P

    (out,) = svc.handle(producer.encode(), P.WorkRequest(producer, n, svc.learner_version), now)
    return out.msg.rounds


def _weights(svc, version: int):
    from pipeline import protocol as P

    return P.WeightAnnouncement(version, str(svc.cfg.weights_dir / f"v{version:06d}.safetensors"), 9)


def _drive(svc, steps: int, now: float = 0.0) -> None:
    """Producer and learner events straight into the buffer's core (no sockets)."""
    from pipeline import protocol as P

    for _ in range(steps):
        while svc.scheduler.take_batch(svc.learner_version, 4) is None:
            rounds = _work(svc, "p", 8, now)
            assert rounds, "no work and no batch"
            for rnd in rounds:
                _submit(svc, rnd, now)
        version = svc.learner_version + 1
        svc.handle(b"l", P.VersionUpdate(version, _weights(svc, version)), now)
        now += 1.0


def test_snapshot_written_after_every_version_and_resumed(tmp_path):
    from pipeline.buffer.snapshot import RESUME_ROUND_ID_GAP

    svc = _service(tmp_path)
    _drive(svc, 3)
    assert svc.counters["snapshots"] == 3 and svc.snapshots.path.is_file()
    assert not list(svc.snapshots.path.parent.glob("*.tmp"))  # written via tmp + rename
    svc.counters["malformed"] = 5
    svc.write_snapshot()
    before = svc.scheduler.metrics()
    issued = _work(svc, "p0", 4, 10.0)  # handed out after the snapshot: lost with the crash
    svc = _service(tmp_path, resume=True)
    after = svc.scheduler.metrics()
    assert svc.resumed and svc.learner_version == 3 and svc.latest_weights.uri == _weights(svc, 3).uri
    assert svc.counters["malformed"] == 5 and svc.counters["resumes"] == 1
    for key in ("admitted", "released", "groups_consumed", "samples_received", "groups_waiting"):
        assert after[key] == before[key], key
    new = _work(svc, "p1", 4, 11.0)
    assert {r.prompt_id for r in new} >= {r.prompt_id for r in issued}  # the same prompts, issued again
    assert min(r.round_id for r in new) >= max(r.round_id for r in issued) + RESUME_ROUND_ID_GAP - 8
    # a late result for a round of the crashed buffer is ignored, never credited to another prompt
    _submit(svc, issued[0], 12.0, reward=1.0, producer="p0")
    assert svc.scheduler.metrics()["results_ignored"]["late"] == 1
    for rnd in new:
        _submit(svc, rnd, 12.0, producer="p1")
    _drive(svc, 2)
    svc.scheduler.check_invariants()
    assert svc.learner_version == 5


def test_resume_without_a_snapshot_starts_fresh_and_a_corrupt_one_is_refused(tmp_path):
    svc = _service(tmp_path, resume=True)
    assert not svc.resumed and svc.learner_version == 0
    path = svc.snapshots.path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a snapshot")
    with pytest.raises(ValueError, match="move it away to start fresh"):
        _service(tmp_path, resume=True)


def test_snapshot_every_n_versions(tmp_path):
    svc = _service(tmp_path, snapshot_every=2)
    _drive(svc, 5)
    assert svc.counters["snapshots"] == 2 and svc.snapshots.version == 4
    svc = _service(tmp_path / "off", snapshot_every=0)
    _drive(svc, 2)
    assert svc.counters["snapshots"] == 0 and not svc.snapshots.path.exists()
