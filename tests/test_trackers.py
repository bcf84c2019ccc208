"""Experiment trackers (issue #14 part 3): what the learner passes on (steps, evaluations per benchmark, sample
tables, the config), that a failing tracker never stops training, that a missing package is an error naming the
pip install, and each real tracker offline: TensorBoard event files read back, wandb in offline mode, trackio's
local store. The real trackers' tests skip when their package is not installed."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time

import numpy as np
import pytest

from pipeline import protocol as P
from pipeline.config import load_config
from pipeline.consumer import main as learner_module
from pipeline.consumer import runlog as runlog_module
from pipeline.consumer.runlog import RunLog
from pipeline.testing.doubles import LearnerBuffer
from pipeline.testing.learner import main_args, make_groups, make_tiny_model
from pipeline.trackers import EVAL_AXIS, TABLE_COLUMNS, TrackerError, Trackers, check_trackers, open_trackers

EVAL_ROW = {"version": 2, "accuracy": 0.5, "pass_at_k": 0.75, "k": 4, "problems": 3, "failed": 0, "seconds": 1.0,
            "benchmarks": {"math500": {"problems": 2, "ave_at_k": 0.25, "pass_at_k": 0.5},
                           "aime24": {"problems": 1, "ave_at_k": 1.0, "pass_at_k": 1.0}}}


class Recorder:
    """A test double of a tracker: records every call; `fail_on` makes that method raise."""

    name = "recorder"

    def __init__(self, fail_on: str = "") -> None:
        self.calls: list[tuple] = []
        self.fail_on = fail_on
        self.closed = False

    def log(self, metrics, step, axis):
        if self.fail_on == "log":
            raise ConnectionError("tracker server gone")
        self.calls.append(("log", dict(metrics), step, axis))

    def table(self, key, rows, step):
        self.calls.append(("table", key, rows, step))

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def learner_setup(tmp_path_factory):
    """A tiny random Llama (pipeline.testing.learner) and fixed groups of its own log-probs."""
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    return model, make_groups(model)


def has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _cfg(tmp_path, *extra):
    return load_config(None, ["--run.dir", str(tmp_path), "--run.name", "r", *extra])


# ---------------------------------------------------------------- what the trackers get


def test_steps_evals_and_tables_reach_every_tracker_and_a_failing_one_is_dropped(learner_setup, tmp_path, caplog):
    _, groups = learner_setup
    cfg = _cfg(tmp_path, "--run.samples_every", "2", "--run.num_table_samples", "3")
    log = RunLog(cfg)
    good, bad = Recorder(), Recorder(fail_on="log")
    log.trackers = Trackers([good, bad])
    (tmp_path / "r" / "eval.jsonl").write_text(json.dumps({**EVAL_ROW, "version": 0}) + "\n")
    row = {"step": 1, "version": 1, "loss": 0.5, "lr": 1e-3, "time": 1e9, "eval/accuracy": 0.1, "note": "x",
           "skipped": True, "bad": float("nan")}
    log.step(row, groups)
    assert bad.closed and log.trackers.trackers == [good] and "tracker recorder failed to log a step" in caplog.text
    assert good.calls[0] == ("log", {"loss": 0.5, "lr": 1e-3}, 1, "version")  # numbers only; eval/* from eval.jsonl
    assert good.calls[1] == ("log", {"eval/accuracy": 0.5, "eval/pass_at_k": 0.75, "eval/math500/ave_at_k": 0.25,
                                     "eval/math500/pass_at_k": 0.5, "eval/aime24/ave_at_k": 1.0,
                                     "eval/aime24/pass_at_k": 1.0}, 0, EVAL_AXIS)
    assert len(good.calls) == 2  # version 1: no table (every 2 steps)
    with open(tmp_path / "r" / "eval.jsonl", "a") as f:
        f.write(json.dumps(EVAL_ROW) + "\n")
    log.step({"step": 2, "version": 2, "loss": 0.25}, groups)
    _, metrics, step, _ = good.calls[2]
    assert (metrics, step) == ({"loss": 0.25}, 2)
    assert good.calls[3][2:] == (2, EVAL_AXIS)
    kind, key, rows, step = good.calls[4]
    assert (kind, key, step, len(rows)) == ("table", "samples", 2, 3) and len(TABLE_COLUMNS) == 5
    g = groups[0]
    assert rows[0][0] == " ".join(str(int(t)) for t in g.prompt_token_ids)  # the test model has no tokenizer
    assert rows[0][2:] == [g.samples[0].reward, g.num_rounds, g.samples[0].version]
    assert [json.loads(x)["step"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    log.close()
    assert good.closed


def test_tables_decode_with_the_runs_tokenizer(tmp_path, tiny_model_dir):
    cfg = _cfg(tmp_path, "--model.path", str(tiny_model_dir))
    tok_ids = [1, *[ord(c) - 28 for c in "12+34="]]  # <s> then one token per character (ids 4.. = chr 32..)
    completion = np.array([ord("4") - 28, ord("6") - 28, 2], dtype=np.int32)  # "46</s>"
    group = P.Group(7, np.array(tok_ids, dtype=np.int32),
                    [P.Sample(completion, np.zeros(3, dtype=np.float32), 1.0, 3, "stop")], [0.5], 8, 2, True)
    rows = RunLog(cfg).sample_rows([group])
    assert rows == [["<s>12+34=", "46", 1.0, 2, 3]]


def test_the_learner_passes_steps_tables_and_the_final_evaluation(learner_setup, tmp_path, monkeypatch):
    """Through the learner's main: every step and a table per step reach the trackers, and after its Shutdown
    the learner waits for the buffer's evaluation of the last version."""
    tiny, groups = learner_setup
    recorder = Recorder()
    monkeypatch.setattr(learner_module, "check_trackers", lambda names: None)
    monkeypatch.setattr(runlog_module, "open_trackers", lambda *a: Trackers([recorder]))
    buf = LearnerBuffer([groups, groups])
    run = tmp_path / "r"

    def buffer_writes_the_final_evaluation():
        while not any(isinstance(m, P.Shutdown) for m in buf.received):
            time.sleep(0.05)
        time.sleep(1.0)
        with open(run / "eval.jsonl", "a") as f:
            f.write(json.dumps(EVAL_ROW) + "\n")

    threading.Thread(target=buffer_writes_the_final_evaluation, daemon=True).start()
    try:
        rc = learner_module.main(main_args(tiny, tmp_path, buf.port, "--learner.num_steps", "2",
                                           "--run.trackers", '["tensorboard"]', "--run.samples_every", "1",
                                           "--learner.eval_every", "2"))
    finally:
        buf.close()
    assert rc == 0
    kinds = [(c[0], c[-1]) for c in recorder.calls]
    assert kinds == [("log", "version"), ("table", 1), ("log", "version"), ("table", 2), ("log", EVAL_AXIS)]
    assert recorder.calls[-1][2] == 2 and recorder.closed


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "trackio"])
def test_a_missing_tracker_package_is_an_error_naming_the_install(tmp_path, capsys, monkeypatch, name):
    # the package is made missing whether or not it is installed: a None entry in sys.modules is what Python's
    # import system reads as "not importable" (find_spec returns None, import raises ImportError)
    monkeypatch.setitem(sys.modules, name, None)
    assert not has(name)
    with pytest.raises(TrackerError, match=rf"pip install 'reinforce-ada\[{name}\]'"):
        check_trackers([name])
    with pytest.raises(TrackerError, match="pip install"):
        open_trackers([name], tmp_path, "r", "p", {}, "", None)
    assert learner_module.main(["--run.trackers", json.dumps([name])]) == 2
    assert f"pip install 'reinforce-ada[{name}]'" in capsys.readouterr().err


# ---------------------------------------------------------------- the real trackers, offline


@pytest.mark.skipif(not has("tensorboard"), reason="the tensorboard package is not installed "
                                                   "(pip install 'reinforce-ada[tensorboard]')")
def test_tensorboard_event_files_read_back(learner_setup, tmp_path):
    _, groups = learner_setup
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(tmp_path, "--run.trackers", '["tensorboard"]', "--run.samples_every", "1")
    log = RunLog(cfg)
    for v in (1, 2, 3):
        log.step({"step": v, "version": v, "loss": float(v)}, groups)
    (tmp_path / "r" / "eval.jsonl").write_text(json.dumps(EVAL_ROW) + "\n")
    log.poll_evals()
    log.close()
    resumed = RunLog(cfg, resumed_from=2)  # version 3 was lost: it is purged and logged again
    resumed.step({"step": 3, "version": 3, "loss": 30.0}, groups)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "r" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/math500/ave_at_k")] == [(2, 0.25)]
    texts = events.Tags()["tensors"]
    assert "config/text_summary" in texts and "samples/text_summary" in texts


@pytest.mark.skipif(not has("wandb"), reason="the wandb package is not installed (pip install 'reinforce-ada[wandb]')")
def test_wandb_offline_run_holds_config_metrics_and_resumes_the_same_run(learner_setup, tmp_path, monkeypatch):
    _, groups = learner_setup
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, "--run.trackers", '["wandb"]', "--learner.lr", "0.125")
    log = RunLog(cfg)
    log.step({"step": 1, "version": 1, "loss": 0.5}, groups)
    (tmp_path / "r" / "eval.jsonl").write_text(json.dumps({**EVAL_ROW, "version": 1}) + "\n")
    log.step({"step": 2, "version": 2, "loss": 0.25}, groups)
    log.close()
    run_id = json.loads((tmp_path / "r" / "trackers.json").read_text())["wandb"]
    (run_dir,) = (tmp_path / "r" / "wandb").glob(f"offline-run-*-{run_id}")
    # an offline run is one record log (protobuf records; wandb >= 0.2x writes no summary or config files
    # offline, and has no reader for it in Python): the keys and JSON values it logged are in it as written
    (records,) = run_dir.glob(f"run-{run_id}.wandb")
    data = records.read_bytes()
    assert b"eval/math500/ave_at_k" in data and b"loss" in data and b"0.25" in data
    assert b"0.125" in data  # learner.lr of the resolved config
    again = RunLog(cfg, resumed_from=2)
    assert again.trackers.trackers[0].run_id == run_id
    again.close()


@pytest.mark.skipif(not has("trackio"), reason="the trackio package is not installed "
                                               "(pip install 'reinforce-ada[trackio]')")
def test_trackio_logs_locally(learner_setup, tmp_path, monkeypatch):
    _, groups = learner_setup
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    cfg = _cfg(tmp_path, "--run.trackers", '["trackio"]', "--run.project", "test-project", "--run.samples_every", "1")
    log = RunLog(cfg)
    log.step({"step": 1, "version": 1, "loss": 0.5}, groups)
    log.close()
    assert any(p.is_file() for p in (tmp_path).rglob("*test-project*"))
