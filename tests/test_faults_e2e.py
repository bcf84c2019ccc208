"""Faults, a stop and a resume in one real run (one run, so that the engines start twice and not four times):

1. The supervisor restarts a SIGKILLed producer, learner and buffer, and training goes on with versions that only
   increase.
2. The run stopped with SIGINT checkpoints the version it reached; a second `train` with the same arguments is
   refused (it names --resume and --overwrite) and touches nothing; `reinforce-ada train --resume RUN_DIR` (with a
   raised --learner.num_steps) continues it: versions and metrics.jsonl rows go on without a gap or a repeat.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_e2e import _assert_no_orphans, _logs

pytestmark = pytest.mark.slow
REPO = Path(__file__).parents[1]


def _pid_of(run: Path, role_args: str) -> int | None:
    marker = str(run / "config.toml")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and role_args in cmd and "pipeline.cli" in cmd:
            return int(proc.name)
    return None


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _wait_steps(run: Path, n: int, proc, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while len(_rows(run)) < n:
        assert proc.poll() is None, (proc.stdout.read() if proc.stdout else "") + _logs(run)
        assert time.monotonic() < end, f"stuck below {n} steps" + _logs(run)
        time.sleep(0.2)


def _train(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "train", *args]


def test_killed_processes_are_restarted_and_a_stopped_run_resumes_without_gaps_or_repeats(tmp_path, tiny_model_dir):
    run = tmp_path / "faults"
    first = _train("--config", str(REPO / "configs" / "tiny.toml"), "--run.dir", str(tmp_path), "--run.name",
                   "faults", "--learner.num_steps", "40", "--learner.batch_prompts", "16",
                   "--learner.checkpoint_every", "2", "--learner.eval_every", "0", "--buffer.heartbeat_timeout_s", "5",
                   "--endpoints.router_port", "0", "--run.live", "false",
                   # one producer, eager: each engine start costs about 30 s of CPU (vLLM's imports in three
                   # processes, and compilation unless eager), the suite's main cost
                   "--producers.count", "1", "--producers.engine.enforce_eager", "true")
    proc = subprocess.Popen(first, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_steps(run, 3, proc)
        os.kill(_pid_of(run, "producer --connect"), signal.SIGKILL)
        os.kill(_pid_of(run, " learner "), signal.SIGKILL)
        _wait_steps(run, 5, proc)
        os.kill(_pid_of(run, " buffer "), signal.SIGKILL)
        _wait_steps(run, 7, proc)  # steps after the buffer's restart too
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the learner checkpoints the version it reached, then all stop
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-4000:]
    for pattern in ("producer-0 exited with code -9; restarting it", r"learner exited with code -9; restarting it",
                    r"buffer exited with code -9; restarting it"):
        assert re.search(pattern, out), (pattern, out[-3000:])
    stopped = [r["step"] for r in _rows(run)]
    assert stopped == sorted(set(stopped)) and 7 <= stopped[-1] < 40, stopped  # strictly increasing, across restarts
    assert all(r["num_groups"] == 16 and r["group_size_min"] == 4 for r in _rows(run))
    # the stop wrote a checkpoint at the last version trained
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
    assert [r["step"] for r in rows] == stopped + list(range(stopped[-1] + 1, total + 1))  # no gap, no repeat
    assert all(r["num_groups"] == 16 and r["staleness_max"] <= 1 for r in rows)
    learner_log = (run / "logs" / "learner.log").read_text(errors="replace").rsplit("\n==== ", 1)[-1]
    assert f"resumed at version {stopped[-1]}" in learner_log and "ahead of the checkpoint" not in learner_log
    assert (run / "checkpoints" / "latest").read_text() == f"step_{total:06d}"
    assert f"trained model (Hugging Face format, loads in transformers and vLLM): {run}" in resumed.stdout
    # the stopped run kept the weights its buffer snapshot names
    log = (run / "logs" / "producer-0.log").read_text(errors="replace").rsplit("\n==== ", 1)[-1]
    assert "loaded weights version" in log and "could not load weights" not in log
    _assert_no_orphans(run)
