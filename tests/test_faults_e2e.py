"""Faults in a real run: the supervisor restarts a SIGKILLed producer, learner and buffer, and training goes on
with versions that only increase."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def _steps(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_steps(run: Path, n: int, proc, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while len(_steps(run)) < n:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < end, f"stuck below {n} steps"
        time.sleep(0.5)


def test_killed_processes_are_restarted_and_training_continues(tmp_path, tiny_model_dir):
    run = tmp_path / "faults"
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--config", str(REPO / "configs" / "tiny.toml"),
           "--run.dir", str(tmp_path), "--run.name", "faults", "--learner.num_steps", "12",
           "--learner.batch_prompts", "16", "--learner.checkpoint_every", "2", "--learner.eval_every", "0",
           "--buffer.heartbeat_timeout_s", "5", "--endpoints.router_port", "0",
           # one producer, eager: each engine start costs about 30 s of CPU (vLLM's imports in three processes, and
           # compilation unless eager), the suite's main cost; one producer's kill and restart is what is tested
           "--producers.count", "1", "--producers.engine.enforce_eager", "true"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_steps(run, 3, proc)
        os.kill(_pid_of(run, "producer --connect"), signal.SIGKILL)
        os.kill(_pid_of(run, " learner "), signal.SIGKILL)
        _wait_steps(run, 5, proc)
        os.kill(_pid_of(run, " buffer "), signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    assert proc.returncode == 0, out[-4000:]
    for pattern in ("producer-0 exited with code -9; restarting it", r"learner exited with code -9; restarting it",
                    r"buffer exited with code -9; restarting it"):
        assert re.search(pattern, out), (pattern, out[-3000:])
    versions = [r["step"] for r in _steps(run)]
    assert versions == sorted(set(versions)), versions  # strictly increasing, across both restarts
    assert versions[-1] >= 12
    assert all(r["num_groups"] == 16 and r["group_size_min"] == 4 for r in _steps(run))
