"""Whole-run resume through the real supervisor (issue #14 part 4): a run stopped with SIGINT mid-way checkpoints
the version it reached, and `reinforce-ada train --resume RUN_DIR` (with a raised --learner.num_steps) continues
it: versions and metrics.jsonl rows go on without a gap or a repeat."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_e2e import _assert_no_orphans, _logs

pytestmark = pytest.mark.slow
REPO = Path(__file__).parents[1]


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _train(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "train", *args]


def test_stopped_run_resumes_without_gaps_or_repeats(tmp_path, tiny_model_dir):
    run = tmp_path / "resume"
    first = _train("--config", str(REPO / "configs" / "tiny.toml"), "--run.dir", str(tmp_path), "--run.name",
                   "resume", "--learner.num_steps", "40", "--learner.batch_prompts", "16",
                   "--learner.checkpoint_every", "0", "--learner.eval_every", "0", "--endpoints.router_port", "0",
                   "--run.live", "false",
                   # one producer, eager: each engine start costs about 30 s of CPU (vLLM's imports in three
                   # processes, and compilation unless eager); the run starts twice
                   "--producers.count", "1", "--producers.engine.enforce_eager", "true")
    proc = subprocess.Popen(first, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 300
        while len(_rows(run)) < 3:
            assert proc.poll() is None and time.monotonic() < end, _logs(run)
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the learner checkpoints the version it reached, then all stop
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-3000:]
    stopped = [r["step"] for r in _rows(run)]
    assert stopped == list(range(1, len(stopped) + 1)) and 3 <= len(stopped) < 40
    # checkpoint_every 0: the only checkpoint is the one the stop wrote, at the last version trained
    assert (run / "checkpoints" / "latest").read_text() == f"step_{stopped[-1]:06d}"
    assert (run / "buffer" / "snapshot.msgpack").is_file()
    assert "kept the latest weights in" in out
    _assert_no_orphans(run)

    again = subprocess.run(first, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and f"--resume {run}" in again.stderr and "--overwrite" in again.stderr
    assert [r["step"] for r in _rows(run)] == stopped  # the refused start touched nothing

    total = stopped[-1] + 3  # raised on the command line: the first run asked for 40, this one for 3 more steps
    resumed = subprocess.run(_train("--resume", str(run), "--learner.num_steps", str(total)), cwd=REPO,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:] + _logs(run)
    assert f"resuming {run} from its checkpoint at version {stopped[-1]}" in resumed.stdout
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, total + 1))  # no gap, no repeat
    assert all(r["num_groups"] == 16 and r["staleness_max"] <= 1 for r in rows)
    learner_log = (run / "logs" / "learner.log").read_text(errors="replace")
    assert f"resumed at version {stopped[-1]}" in learner_log and "ahead of the checkpoint" not in learner_log
    assert (run / "checkpoints" / "latest").read_text() == f"step_{total:06d}"
    assert f"trained model (Hugging Face format, loads in transformers and vLLM): {run}" in resumed.stdout
    # the stopped run kept the weights its buffer snapshot names
    log = (run / "logs" / "producer-0.log").read_text(errors="replace").rsplit("\n==== ", 1)[-1]
    assert "loaded weights version" in log and "could not load weights" not in log
    _assert_no_orphans(run)
