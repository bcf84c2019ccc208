"""The learner: batching, log-probs, weight files, training direction, resume, backends, and the main loop."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline import protocol as P
from pipeline.auth import create_token, learner_token_path
from pipeline.consumer import batching
from pipeline.consumer import model as model_mod
from pipeline.consumer.backends import LearnerBackend, make_backend
from pipeline.consumer.learner import Learner
from pipeline.consumer.loop import _step_line
from pipeline.consumer.main import main
from pipeline.consumer.model import load_model, token_logprobs
from pipeline.testing.doubles import LearnerBuffer
from pipeline.testing.learner import load_groups, main_args, make_cfg, make_groups, make_tiny_model, poison, save_groups
from pipeline.testing.models import save_random_llama
from pipeline.testing.processes import buffer_command, scripted_command, start, wait_for_buffer
from pipeline.transport import free_port, free_port_pair
from pipeline.weights.file import iter_file, publish_weights, published_versions
from tests.learner_worker import run_setups

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def groups(tiny):
    return make_groups(tiny)


# ---------------------------------------------------------------- batching


def test_collate_aligns_behaviour_logprobs_to_predicting_positions():
    g = P.Group(7, np.array([5, 6, 7], np.int32),
                       [P.Sample(np.array([9, 10], np.int32), np.array([-0.1, -0.2], np.float32), 1.0, 3,
                                        "stop"),
                        P.Sample(np.array([11], np.int32), np.array([-0.3], np.float32), 0.0, 2, "length")],
                       [0.5, -0.5], 8, 2, True)
    mb = batching.collate(batching.flatten([g]))
    assert mb.input_ids_BT.tolist() == [[5, 6, 7, 9, 10], [5, 6, 7, 11, 0]]
    # position 2 (token 7) predicts the first completion token
    assert mb.mask_BT.tolist() == [[False, False, True, True, False], [False, False, True, False, False]]
    assert mb.old_logp_BT[0, 2:4].tolist() == pytest.approx([-0.1, -0.2])
    assert mb.old_logp_BT[1, 2].item() == pytest.approx(-0.3)
    assert mb.adv_B.tolist() == [0.5, -0.5] and mb.version_B.tolist() == [3, 2] and mb.num_tokens == 3
    stats = batching.batch_stats([g], learner_version=4)
    assert stats["staleness_max"] == 2 and stats["truncated_frac"] == 0.5 and stats["reward_mean"] == 0.5


def test_plan_covers_every_sequence_once_with_equal_micro_counts(groups):
    seqs = batching.flatten(groups)
    for world in (1, 2, 3):
        seen, counts = [], set()
        for rank in range(world):
            micro, total = batching.plan_minibatch(groups, rank, world, micro_batch_tokens=64)
            counts.add(len(micro))
            assert total == sum(s.logp.size for s in seqs)
            for mb in micro:
                assert mb.input_ids_BT.numel() <= 64 or mb.input_ids_BT.shape[0] == 1
                for row, m in zip(mb.input_ids_BT.tolist(), mb.mask_BT.tolist()):
                    if any(m):  # the last predicting position + 1 is the sequence's last token
                        seen.append(tuple(row[: max(i for i, x in enumerate(m) if x) + 2]))
        assert len(counts) == 1  # every rank runs the same number of micro-batches
        assert sorted(seen) == sorted(tuple(s.ids.tolist()) for s in seqs)


def test_split_minibatches_and_empty_prompt_error(groups):
    runs = batching.split_minibatches(groups, 3)
    assert [len(r) for r in runs] == [1, 2, 1] and sum(runs, []) == groups
    bad = P.Group(0, np.zeros(0, np.int32), groups[0].samples, groups[0].advantages, 4, 1, True)
    with pytest.raises(ValueError, match="empty prompt"):
        batching.flatten([bad])


# ---------------------------------------------------------------- model


def test_token_logprobs_match_full_log_softmax(tiny):
    model = load_model(tiny)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[:, 4:9] = True
    logp, ent = token_logprobs(model, ids, None, 0.7, mask_BT=mask)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float() / 0.7
    ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp[:, :-1], torch.where(mask[:, :-1], ref, 0.0), atol=1e-5, rtol=1e-5)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ent, torch.where(mask, -(p * p.log()).sum(-1), 0.0), atol=1e-5, rtol=1e-5)
    padded = torch.cat([ids, torch.zeros(3, 4, dtype=torch.long)], 1)
    logp_pad, _ = token_logprobs(model, padded, None, 0.7, torch.cat([mask, torch.zeros(3, 4, dtype=torch.bool)], 1))
    torch.testing.assert_close(logp_pad[:, :12], logp, atol=1e-6, rtol=1e-6)


def test_chunked_head_matches_one_pass(tiny, monkeypatch):
    model = load_model(tiny)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 2:9] = True
    results = []
    for chunk in (1 << 27, 64 * 3):  # one pass; then 3 rows per checkpointed chunk
        monkeypatch.setattr(model_mod, "CHUNK_ELEMENTS", chunk)
        model.zero_grad()
        logp, ent = token_logprobs(model, ids, None, 1.0, mask, entropy_grad=True)
        (logp.sum() + ent.sum()).backward()
        results.append((logp.detach(), ent.detach(), model.lm_head.weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_tied_embeddings_publish_once(tmp_path, groups):
    save_random_llama(tmp_path / "tied", vocab=64, hidden=64, layers=1, heads=2, kv_heads=2, head_dim=32,
                      intermediate=128, tied=True, seed=None)
    learner = Learner(make_cfg(tmp_path / "tied", tmp_path))
    learner.train_step(groups)
    state = learner.state_dict_for_publish()
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state
    ann = learner.publish()
    assert ann.version == 1 and dict(iter_file(ann.uri)).keys() == state.keys()


def test_load_model_names_a_bad_path(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path / "nope")


# ---------------------------------------------------------------- weights


def test_publish_is_atomic_prunes_and_round_trips(tmp_path):
    state = {"a.weight": torch.randn(4, 3), "b.bias": torch.randn(5).to(torch.bfloat16)}
    for v in range(1, 5):
        ann = publish_weights(state, tmp_path, v, keep=2)
    assert ann.version == 4 and ann.uri == str(tmp_path / "v000004.safetensors")
    assert ann.num_bytes == Path(ann.uri).stat().st_size
    assert published_versions(tmp_path) == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000003.safetensors", "v000004.safetensors"]
    back = dict(iter_file(ann.uri))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="keep"):
        publish_weights(state, tmp_path, 5, keep=0)


# ---------------------------------------------------------------- training


def _completion_logp(model, groups):
    """Mean log-prob per completion, and whether its advantage is positive."""
    out = []
    for g in groups:
        for s, a in zip(g.samples, g.advantages):
            ids = torch.from_numpy(np.concatenate([g.prompt_token_ids, s.token_ids]).astype(np.int64))[None]
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[0, g.prompt_token_ids.size - 1: ids.shape[1] - 1] = True
            with torch.no_grad():
                lp, _ = token_logprobs(model, ids, None, 1.0, mask, with_entropy=False)
            out.append((lp[mask].mean().item(), a > 0))
    return out


def test_training_raises_positive_and_lowers_negative_completions(tiny, groups, tmp_path):
    learner = Learner(make_cfg(tiny, tmp_path))
    before = _completion_logp(learner.policy.lm, groups)
    for _ in range(4):
        m = learner.train_step(groups)
    assert learner.version == 4 and m["optimizer_steps"] == 8 and np.isfinite(m["loss"])
    after = _completion_logp(learner.policy.lm, groups)
    up = [a - b for (a, pos), (b, _) in zip(after, before) if pos]
    down = [a - b for (a, pos), (b, _) in zip(after, before) if not pos]
    assert np.mean(up) > 0.05 and np.mean(down) < -0.05
    assert sum(d > 0 for d in up) >= 0.75 * len(up) and sum(d < 0 for d in down) >= 0.75 * len(down)


def test_learner_backend_protocol_and_choice(tiny, tmp_path):
    learner = Learner(make_cfg(tiny, tmp_path))
    assert isinstance(learner.backend, LearnerBackend) and learner.backend.name == "torch"
    assert learner.backend.zero_stage is None  # full replicas: a checkpoint resumes on any number of ranks
    cfg = SimpleNamespace(learner=SimpleNamespace(backend="jax"))  # past the config check
    with pytest.raises(ValueError, match="use 'torch' or 'deepspeed'"):
        make_backend(cfg, learner.policy)


def test_decoupled_step_uses_proximal_logprobs(tiny, groups, tmp_path):
    learner = Learner(make_cfg(tiny, tmp_path, "torch", 2, "--learner.decoupled", "true",
                               "--learner.tis_cap", "1.2", "--learner.mini_batches", "1"))
    m = learner.train_step(groups)
    # one mini-batch: the proximal policy is the current one, so every ratio is 1 and nothing clips, while
    # the behaviour weights exp(prox - behaviour) carry the noise of the behaviour log-probs (capped at 1.2)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clip_frac"] == 0.0
    assert m["behaviour_weight"] != pytest.approx(1.0, abs=1e-3) and m["behaviour_weight"] <= 1.2
    assert m["kl_behaviour"] > 0 and np.isfinite(m["loss"])


def test_resume_continues_with_the_same_next_loss(tiny, groups, tmp_path):
    a = Learner(make_cfg(tiny, tmp_path / "a"))
    a.train_step(groups)
    a.train_step(groups)
    path = a.save_checkpoint(extra=b"data-position-42")
    expected = a.train_step(groups)
    assert (tmp_path / "a" / "test" / "checkpoints" / "latest").read_text() == path.name == "step_000002"

    b = Learner(make_cfg(tiny, tmp_path / "a"))
    assert b.load_checkpoint() == b"data-position-42" and b.version == 2 and b.optimizer_steps == 4
    got = b.train_step(groups)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-9)
    assert got["lr"] == expected["lr"] and got["version"] == expected["version"] == 3
    sa, sb = a.state_dict_for_publish(), b.state_dict_for_publish()
    assert all(torch.allclose(sa[k], sb[k], atol=1e-7) for k in sa)


def test_nonfinite_batch_is_skipped_and_nothing_is_applied(tiny, groups, tmp_path, caplog):
    """A NaN behaviour log-prob in each mini-batch: both optimizer steps are skipped, counted and logged with
    their prompt ids; weights, optimizer and lr schedule stay as they were, so the next clean batch trains
    exactly like a fresh learner's first one."""
    a = Learner(make_cfg(tiny, tmp_path / "a"))
    before = {k: v.clone() for k, v in a.state_dict_for_publish().items()}
    with caplog.at_level(logging.WARNING, logger="pipeline.consumer.learner"):
        m = a.train_step(poison(groups, [(0, 1), (3, 0)]))
    assert m["skipped_steps"] == 2 and m["skipped_steps_total"] == 2 and m["optimizer_steps"] == 0
    assert m["version"] == 1 and math.isnan(m["loss"])
    after = a.state_dict_for_publish()
    assert all(torch.equal(before[k], after[k]) for k in before)
    skips = [r.getMessage() for r in caplog.records if "skipped optimizer step" in r.getMessage()]
    assert len(skips) == 2 and "the loss is not finite" in skips[0]
    assert f"[{groups[0].prompt_id}, {groups[1].prompt_id}]" in skips[0]
    assert f"[{groups[2].prompt_id}, {groups[3].prompt_id}]" in skips[1]

    got = a.train_step(groups)
    expected = Learner(make_cfg(tiny, tmp_path / "b")).train_step(groups)
    assert got["skipped_steps"] == 0 and got["optimizer_steps"] == expected["optimizer_steps"] == 2
    assert (got["loss"], got["grad_norm"], got["lr"]) == (expected["loss"], expected["grad_norm"], expected["lr"])


def test_step_line_says_when_steps_were_skipped():
    m = {"step": 4, "reward_mean": 0.5, "staleness_max": 1, "step_seconds": 2.0, "loss": float("nan"),
         "kl_behaviour": 0.01, "wait_seconds": 0.5, "skipped_steps": 0}
    assert _step_line(m, 4, 4) == ("step 4 | reward 0.50 | kept 4/4 | stale 1 | 2.0 s | loss nan | kl 1.00e-02 | "
                                   "wait 0.5 s")
    m["skipped_steps"] = 2
    assert _step_line(m, 4, 4).endswith("| wait 0.5 s | skipped 2 optimizer step(s)")


def test_one_nonfinite_minibatch_skips_only_its_step(tiny, groups, tmp_path):
    learner = Learner(make_cfg(tiny, tmp_path))
    m = learner.train_step(poison(groups, [(2, 3)]))  # the second mini-batch (groups 2 and 3)
    assert m["skipped_steps"] == 1 and m["optimizer_steps"] == 1
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    assert all(torch.isfinite(t).all() for t in learner.state_dict_for_publish().values())


NAN_SETUPS = ("ddp_nan", "zero0_nan", "zero2_nan", "zero3_nan")
BACKEND_SETUPS = ("ddp", "zero2", "zero3", "zero3_resume")


@pytest.fixture(scope="module")
def two_ranks(tiny, groups, tmp_path_factory):
    """learner_worker.py's two-rank setups (the backends, the NaN skips, the rank messages) in one torchrun: each
    launch costs two ranks' imports of torch and DeepSpeed. (out_dir, the launch's CompletedProcess)."""
    out = tmp_path_factory.mktemp("two-ranks")
    gfile = out / "groups.bin"
    save_groups(groups, gfile)
    return out, _torchrun(tiny, gfile, out, *BACKEND_SETUPS, *NAN_SETUPS, "ranks")


@pytest.mark.slow
def test_nonfinite_batch_is_skipped_on_every_rank_ddp_zero(two_ranks):
    """The NaN sits in one sample, so on one rank only: every rank must skip the same steps (DDP, ZeRO-0/2/3),
    and the next clean batch trains exactly (loss, gradient norm, lr) like a fresh learner's first."""
    out, proc = two_ranks
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in NAN_SETUPS:
        m = json.loads((out / name / "metrics.json").read_text())
        assert m["skipped_steps"] == 2 and m["optimizer_steps"] == 0 and m["unchanged"], (name, m)
        assert m["got"] == m["expected"], name


@pytest.mark.slow
def test_rank_messages_reach_every_rank(two_ranks):
    """Rank 0's batch (as protocol frames), error and stop arrive typed on rank 1, through tensors (no pickle)."""
    out, proc = two_ranks
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((out / "ranks.json").read_text())
    assert got == {"kinds": ["BatchFrames", "RankError", "Stop"], "same_batch": True,
                   "error": "no batch arrived: check the buffer", "stop": "done"}


def _torchrun(tiny, gfile, out_dir, *setups):
    """learner_worker.py's setups on two ranks, 2 steps each."""
    return _torchrun2("-m", "tests.learner_worker", str(tiny), str(gfile), str(out_dir), "2", *setups)


def _torchrun2(*args: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 ARGS` in the repository root (so `-m` finds this checkout's modules), one CPU
    thread per rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_backends_agree_torch_ddp_zero2_zero3(tiny, groups, two_ranks, tmp_path):
    """One process, DDP (2 ranks, gloo) and DeepSpeed ZeRO-2/3 (2 ranks): same losses and published weights;
    and a ZeRO-3 learner resumed from its checkpoint repeats the next loss."""
    out, proc = two_ranks
    gfile = out / "groups.bin"
    run_setups(tiny, gfile, tmp_path, 2, ["torch"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref_losses = json.loads((tmp_path / "torch" / "metrics.json").read_text())["losses"]
    ref = dict(iter_file(tmp_path / "torch" / "v000002.safetensors"))
    for name in ("ddp", "zero2", "zero3"):
        meta = json.loads((out / name / "metrics.json").read_text())
        assert meta["world_size"] == 2
        assert meta["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-7), name
        got = dict(iter_file(out / name / "v000002.safetensors"))
        assert got.keys() == ref.keys(), name
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], atol=2e-6, rtol=1e-5, msg=f"{name}: {k}")
    assert load_groups(gfile)[0].prompt_id == groups[0].prompt_id
    resumed = json.loads((out / "zero3_resume" / "metrics.json").read_text())
    assert resumed["got"] == pytest.approx(resumed["expected"], rel=1e-6, abs=1e-9)
    assert resumed["extra"] == "blob" and resumed["version"] == 2




# ---------------------------------------------------------------- the main loop against a scripted buffer


def test_main_trains_publishes_announces_and_shuts_down(tiny, groups, tmp_path, capsys):
    buf = LearnerBuffer([groups, groups[:3]])
    try:
        rc = main(main_args(tiny, tmp_path, buf.port, "--learner.num_steps", "2", "--learner.checkpoint_every",
                            "1", "--learner.batch_timeout_s", "30"))
    finally:
        buf.close()
    assert rc == 0
    updates = [m for m in buf.received if isinstance(m, P.VersionUpdate)]
    assert [u.version for u in updates] == [0, 1, 2] and updates[0].weights is None
    assert updates[2].weights.uri == str(tmp_path / "w" / "v000002.safetensors")
    assert Path(updates[2].weights.uri).stat().st_size == updates[2].weights.num_bytes
    requests = [m for m in buf.received if isinstance(m, P.BatchRequest)]
    assert [r.learner_version for r in requests] == [0, 1] and requests[0].num_groups == 4
    assert isinstance(buf.received[-1], P.Shutdown)
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[0]["eval/acc"] == 0.25
    assert lines[1]["num_groups"] == 3
    out = capsys.readouterr().out
    assert "step 1 | reward 0.50 | kept 4/4 | stale 0 |" in out and "kept 3/4 | stale 1 |" in out
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "step_000002"

    # --resume: republish version 2 for fresh producers, then go on at 2 (a buffer at the checkpoint's version, that
    # answers the learner's question for it: a silent one costs the 30 s the learner waits for its answer)
    buf = LearnerBuffer([groups], version=2)
    try:
        rc = main(main_args(tiny, tmp_path, buf.port, "--learner.num_steps", "3", "--resume"))
    finally:
        buf.close()
    assert rc == 0
    updates = [m for m in buf.received if isinstance(m, P.VersionUpdate)]
    assert [u.version for u in updates] == [2, 3] and updates[0].weights.version == 2
    assert [m.learner_version for m in buf.received if isinstance(m, P.BatchRequest)] == [2]
    assert "resumed at version 2" in capsys.readouterr().out


def test_main_gives_up_after_batch_timeout(tiny, tmp_path, capsys):
    buf = LearnerBuffer([])
    try:
        rc = main(main_args(tiny, tmp_path, buf.port, "--learner.batch_timeout_s", "1.5"))
    finally:
        buf.close()
    assert rc == 1
    assert "no batch arrived for 2 s (learner.batch_timeout_s)" in capsys.readouterr().err


def test_main_keeps_waiting_while_producers_make_progress(tiny, groups, tmp_path, capsys):
    """learner.batch_timeout_s counts only time without progress: samples keep arriving for twice the timeout
    before the batch is ready, and the learner waits for it and trains."""
    buf = LearnerBuffer([groups], progress_s=3.0)
    try:
        rc = main(main_args(tiny, tmp_path, buf.port, "--learner.num_steps", "1", "--learner.batch_timeout_s", "1.5"))
    finally:
        buf.close()
    assert rc == 0, capsys.readouterr().err
    requests = [m for m in buf.received if isinstance(m, P.BatchRequest)]
    assert len(requests) > 5 and "step 1 | reward 0.50 | kept 4/4" in capsys.readouterr().out


@pytest.mark.slow
def test_main_under_torchrun_shares_batches_and_errors_with_every_rank(tiny, groups, tmp_path):
    """Two learner ranks: rank 0 fetches, both train on the same batches; a timeout ends both with the error."""
    buf = LearnerBuffer([groups, groups[:2]])
    try:
        ok = _torchrun2("-m", "pipeline.consumer.main",
                        *main_args(tiny, tmp_path / "ok", buf.port, "--learner.num_steps", "2"))
    finally:
        buf.close()
    assert ok.returncode == 0, ok.stderr[-4000:]
    assert "step 1 | reward 0.50 | kept 4/4" in ok.stdout and "step 2 | reward 0.50 | kept 2/4" in ok.stdout
    assert [m.version for m in buf.received if isinstance(m, P.VersionUpdate)] == [0, 1, 2]

    buf = LearnerBuffer([])
    try:
        err = _torchrun2("-m", "pipeline.consumer.main",
                         *main_args(tiny, tmp_path / "err", buf.port, "--learner.batch_timeout_s", "2"))
    finally:
        buf.close()
    assert err.returncode == 1
    assert err.stderr.count("learner error: no batch arrived for 2 s (learner.batch_timeout_s)") == 2  # both ranks


@pytest.mark.slow
def test_main_trains_against_the_real_buffer_with_its_learner_token(tiny, tmp_path, procs, capsys):
    """The real buffer (learner-only requests need the run's token) and two scripted producers: the learner
    presents the token, trains two steps on released groups and logs the buffer's counters with them."""
    create_token(learner_token_path(tmp_path / "r"))
    port = free_port_pair()
    buf = start(buffer_command(port, tmp_path, "--run.name", "r", "--sampling.max_new_tokens", "8", batch=4),
                tmp_path / "buffer.log")
    procs.append(buf)
    wait_for_buffer(port, proc=buf)
    for i in range(2):
        procs.append(start(scripted_command("producer", port, "--id", f"p{i}", "--round-seconds", "0.2",
                                            "--tokens", "8"), tmp_path / f"p{i}.log"))
    rc = main(main_args(tiny, tmp_path, port, "--learner.num_steps", "2", "--learner.mini_batches", "1",
                        "--learner.batch_timeout_s", "60"))
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["num_groups"] == 4 for r in rows)
    assert rows[1]["buffer/samples_received"] > rows[0]["buffer/samples_received"] > 0
    assert buf.wait(30) == 0  # the learner's Shutdown (a learner-only message) was accepted


def test_main_reports_config_errors(capsys):
    assert main(["--learner.lrr", "1"]) == 2
    assert "did you mean `learner.lr`" in capsys.readouterr().err
