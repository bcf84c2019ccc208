"""Whole-run resume (issue #14 part 4): the run directory check, the learner stopping on a signal (checkpoint
first, no Shutdown to the buffer; under torchrun too), resuming without repeating or skipping a version, and the
readers of a rewritten metrics.jsonl. The test through the real supervisor is in test_faults_e2e.py."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline import protocol as P
from pipeline.config import ConfigError, load_config
from pipeline.consumer.learner import Learner
from pipeline.consumer.main import main as learner_main
from pipeline.consumer.runlog import RunLog
from pipeline.consumer.stopping import Stopped, StopSignals
from pipeline.jsonl import JsonlTail, keep_rows, read_rows
from pipeline.supervisor.main import main as train_main
from pipeline.supervisor.plan import prepare_run_dir
from pipeline.supervisor.procs import Child
from pipeline.testing.doubles import LearnerBuffer
from pipeline.testing.learner import main_args, make_groups, make_tiny_model
from pipeline.transport import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def learner_setup(tmp_path_factory):
    """A tiny random Llama (pipeline.testing.learner) and fixed groups of its own log-probs."""
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    return model, make_groups(model)


def steps(run: Path) -> list[int]:
    return [r["step"] for r in read_rows(run / "metrics.jsonl")]


def kill_when(buf: LearnerBuffer, ready, sig: int = signal.SIGTERM) -> threading.Thread:
    """Send `sig` to this process once `ready(messages the buffer received)` holds."""
    def watch():
        while not buf.stop.is_set():
            if ready(list(buf.received)):
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.01)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------- the learner stops without losing a step


def test_learner_stopped_while_waiting_checkpoints_and_resumes_without_gaps(learner_setup, tmp_path, capsys):
    tiny, groups = learner_setup
    buf = LearnerBuffer([groups, groups])  # two batches, then the learner waits for a third
    kill_when(buf, lambda got: any(isinstance(m, P.BatchRequest) and m.learner_version == 2 for m in got))
    try:
        rc = learner_main(main_args(tiny, tmp_path, buf.port, "--learner.num_steps", "5",
                                    "--learner.checkpoint_every", "0", "--learner.batch_timeout_s", "30"))
    finally:
        buf.close()
    assert rc == 128 + signal.SIGTERM
    run = tmp_path / "r"
    assert steps(run) == [1, 2]
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"  # checkpoint_every 0: the stop's own
    assert (run / "checkpoints" / "step_000002" / "hf" / "model.safetensors").is_file()
    assert not any(isinstance(m, P.Shutdown) for m in buf.received)  # a stopped learner does not end the run
    assert "checkpoint " in capsys.readouterr().out

    buf = LearnerBuffer([groups] * 3, version=2)  # a buffer resumed from its snapshot at the same version
    try:
        rc = learner_main(main_args(tiny, tmp_path, buf.port, "--learner.num_steps", "5", "--resume"))
    finally:
        buf.close()
    assert rc == 0
    assert steps(run) == [1, 2, 3, 4, 5]
    assert [m.version for m in buf.received if isinstance(m, P.VersionUpdate)] == [2, 3, 4, 5]


def test_a_signal_during_a_step_lets_it_finish_and_checkpoint(learner_setup, tmp_path, monkeypatch):
    tiny, groups = learner_setup
    train_step = Learner.train_step

    def signalled_on_second_step(self, batch_groups):
        if self.version == 1:
            os.kill(os.getpid(), signal.SIGINT)  # handled at once: only recorded, the step goes on
        return train_step(self, batch_groups)

    monkeypatch.setattr(Learner, "train_step", signalled_on_second_step)
    buf = LearnerBuffer([groups] * 4)
    try:
        rc = learner_main(main_args(tiny, tmp_path, buf.port, "--learner.num_steps", "4"))
    finally:
        buf.close()
    assert rc == 128 + signal.SIGINT
    assert steps(tmp_path / "r") == [1, 2]
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "step_000002"
    assert [m.version for m in buf.received if isinstance(m, P.VersionUpdate)] == [0, 1, 2]
    assert [m.learner_version for m in buf.received if isinstance(m, P.BatchRequest)] == [0, 1]


def killed_after(metrics: Path, *versions: int) -> None:
    """Rows of steps a learner made after its last checkpoint before it was killed (the last one cut short)."""
    with open(metrics, "a") as f:
        f.write("".join(json.dumps({"step": v, "version": v}) + "\n" for v in versions) + '{"st')


def test_resume_drops_rows_past_the_checkpoint(learner_setup, tmp_path):
    tiny, groups = learner_setup
    buf = LearnerBuffer([groups, groups])
    try:
        assert learner_main(main_args(tiny, tmp_path, buf.port, "--learner.num_steps", "2")) == 0
    finally:
        buf.close()
    metrics = tmp_path / "r" / "metrics.jsonl"
    killed_after(metrics, 3, 4)  # and the buffer died with it: its snapshot is at the checkpoint's version
    buf = LearnerBuffer([groups, groups], version=2)
    try:
        assert learner_main(main_args(tiny, tmp_path, buf.port, "--learner.num_steps", "4", "--resume")) == 0
    finally:
        buf.close()
    rows = read_rows(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all("loss" in r for r in rows)  # 3 and 4 trained again

    killed_after(metrics, 5, 6)  # the buffer lived on at version 6: versions go on above it, never back
    buf = LearnerBuffer([groups], version=6)
    try:
        assert learner_main(main_args(tiny, tmp_path, buf.port, "--learner.num_steps", "8", "--resume")) == 0
    finally:
        buf.close()
    assert steps(tmp_path / "r") == [1, 2, 3, 4, 8]
    assert [m.version for m in buf.received if isinstance(m, P.VersionUpdate)] == [7, 8]


@pytest.mark.slow
def test_learner_ranks_under_torchrun_stop_together_and_resume(learner_setup, tmp_path):
    """The supervisor signals torchrun's ranks themselves (torchrun would kill them 30 s after passing a signal
    on): rank 0 ends its wait, tells rank 1, and both write the checkpoint before they exit."""
    tiny, groups = learner_setup

    def torchrun(buf: LearnerBuffer, *extra: str) -> Child:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "pipeline.consumer.main", *main_args(tiny, tmp_path, buf.port, *extra)]
        child = Child("learner", "learner", cmd, tmp_path, {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        child.start()
        return child

    buf = LearnerBuffer([groups, groups])
    try:
        child = torchrun(buf, "--learner.num_steps", "5", "--learner.checkpoint_every", "0")
        end = time.monotonic() + 120
        while not any(isinstance(m, P.BatchRequest) and m.learner_version == 2 for m in buf.received):
            assert child.poll() is None and time.monotonic() < end, child.tail()
            time.sleep(0.1)
        assert child.signal_children(signal.SIGTERM)
        child.proc.wait(120)
    finally:
        buf.close()
        child.kill_group()
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "step_000002", child.tail()
    assert steps(tmp_path / "r") == [1, 2]
    assert "stopped by SIGTERM at version 2: checkpointing" in child.log_path.read_text()  # rank 0 says so
    buf = LearnerBuffer([groups] * 2, version=2)
    try:
        child = torchrun(buf, "--learner.num_steps", "4", "--resume")
        assert child.proc.wait(120) == 0, child.tail()
    finally:
        buf.close()
        child.kill_group()
    assert steps(tmp_path / "r") == [1, 2, 3, 4]


def test_stop_signals_interrupt_only_a_wait_and_give_the_second_signal_back():
    before = signal.getsignal(signal.SIGINT)
    stop = StopSignals()
    try:
        assert stop.reason == "" and stop.exit_code == 0
        with pytest.raises(Stopped, match="stopped by SIGTERM"), stop.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # never reached: the handler raises in this thread
        assert signal.getsignal(signal.SIGINT) is before  # the next Ctrl-C acts as usual
        assert stop.exit_code == 128 + signal.SIGTERM
        with pytest.raises(Stopped), stop.interruptible():  # already stopped: no wait at all
            pass
    finally:
        stop.restore()
    recorded = StopSignals()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # outside a wait: only recorded
        assert recorded.reason == "stopped by SIGINT"
    finally:
        recorded.restore()


# ---------------------------------------------------------------- metrics.jsonl readers


def test_tail_reads_a_rewritten_file_again_and_runlog_drops_rows_past_the_checkpoint(tmp_path):
    cfg = load_config(None, ["--run.dir", str(tmp_path), "--run.name", "r"])
    path = tmp_path / "r" / "metrics.jsonl"
    log = RunLog(cfg)
    tail = JsonlTail(path)
    for v in (1, 2, 3):
        log.step({"step": v, "version": v})
    assert [r["step"] for r in tail.read()] == [1, 2, 3] and tail.read() == []
    RunLog(cfg, resumed_from=1)  # rewritten without 2 and 3 (by rename: a new file)
    assert [r["step"] for r in tail.read()] == [1]
    log.step({"step": 2, "version": 2})
    assert [r["step"] for r in tail.read()] == [2]
    assert keep_rows(path, lambda r: True) == 0 and keep_rows(tmp_path / "none.jsonl", lambda r: False) == 0


# ---------------------------------------------------------------- the run directory


def _run_dir_with(tmp_path: Path, *files: str) -> Path:
    run = tmp_path / "r"
    run.mkdir(parents=True, exist_ok=True)
    for name in files:
        (run / name).write_text("")
    return run


def test_a_fresh_run_in_a_used_directory_names_resume_and_overwrite(tmp_path, capsys):
    run = _run_dir_with(tmp_path, "metrics.jsonl")
    assert train_main(["--run.dir", str(tmp_path), "--run.name", "r"]) == 2
    err = capsys.readouterr().err
    assert f"reinforce-ada train --resume {run}" in err and "--overwrite" in err and "is not empty" in err
    assert (run / "metrics.jsonl").exists()  # nothing was touched
    cfg = load_config(None, ["--run.dir", str(tmp_path), "--run.name", "r"])
    prepare_run_dir(cfg, overwrite=True)
    assert not run.exists()
    prepare_run_dir(cfg)  # absent: fine
    _run_dir_with(tmp_path, "notes.txt")
    with pytest.raises(ConfigError, match="refuses to delete"):
        prepare_run_dir(cfg, overwrite=True)
    assert (run / "notes.txt").exists()


def test_resume_reads_the_runs_config_and_needs_steps_left(tmp_path, capsys):
    run = _run_dir_with(tmp_path)
    (run / "config.toml").write_text("[learner]\nnum_steps = 2\n[run]\nname = \"elsewhere\"\ndir = \"/nowhere\"\n")
    ckpt = run / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"version": 2}))
    (run / "checkpoints" / "latest").write_text("step_000002")
    assert train_main(["--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "the run already reached version 2" in err and "--learner.num_steps 4" in err
    assert train_main(["--resume", str(run), "--config", "x.toml"]) == 2
    assert "without --config" in capsys.readouterr().err
    assert train_main(["--resume", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert train_main(["--resume", str(run), "--run.name", "other"]) == 2
    assert "do not override them" in capsys.readouterr().err
