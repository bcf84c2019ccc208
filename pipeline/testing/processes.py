"""Real processes for tests and benchmarks: a buffer on the built-in arithmetic prompts, the scripted producer and
learner (scripted.py), and probes of a running buffer (its metrics, waiting until it answers, stopping it)."""

from __future__ import annotations

import subprocess
import sys
import time

from pipeline import protocol as P
from pipeline.auth import LEARNER, supervisor_role
from pipeline.transport import BufferClient


def buffer_command(port: int, run_dir, *overrides: str, batch: int = 8, model: str = "unused") -> list[str]:
    """`reinforce-ada buffer` on 127.0.0.1:port (control port + 1) with the built-in arithmetic prompts, `batch`
    groups per learner step in one mini-batch and no evals; `overrides` are more config flags."""
    return [sys.executable, "-m", "pipeline.cli", "buffer", "--model", str(model),
            "--endpoints.router_port", str(port),
            "--run.dir", str(run_dir), "--data.template", "{problem}=", "--learner.batch_prompts", str(batch),
            "--learner.mini_batches", "1", "--learner.eval_every", "0", *overrides]


def scripted_command(role: str, port: int, *args: str) -> list[str]:
    """This module as a process: a scripted producer or learner connected to 127.0.0.1:port."""
    return [sys.executable, "-m", "pipeline.testing.scripted", role, "--connect", f"127.0.0.1:{port}", *args]


def start(cmd: list[str], log_path=None) -> subprocess.Popen:
    """Start `cmd` with its output in `log_path` (or discarded)."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        if log_path:
            out.close()


def buffer_metrics(port: int, timeout_s: float = 2.0, identity: str = "probe", keys_dir: str = "") -> dict | None:
    """The buffer's MetricsSnapshot at 127.0.0.1:port, or None when it does not answer within `timeout_s`."""
    client = BufferClient(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", identity, keys_dir,
                          role=supervisor_role(keys_dir))  # a run's own keys have no shared producer key
    try:
        snap = client.request(P.MetricsRequest(identity), P.MetricsSnapshot, timeout_s)
        return snap.metrics if snap is not None else None
    finally:
        client.close()


def wait_for_buffer(port: int, timeout_s: float = 30.0, until=None, proc: subprocess.Popen | None = None) -> dict:
    """Poll the buffer until it answers (and `until(metrics)` holds); returns the metrics or raises TimeoutError."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the buffer exited with code {proc.returncode}")
        m = buffer_metrics(port, 1.0)
        if m is not None and (until is None or until(m)):
            return m
        time.sleep(0.1)
    raise TimeoutError(f"the buffer on port {port} did not get there within {timeout_s} s")


def send_shutdown(port: int, reason: str = "done", token_file=None, keys_dir: str = "") -> None:
    """Stop the buffer at 127.0.0.1:port as the learner does (with the learner's token or key, if it has one)."""
    client = BufferClient(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", "stopper", keys_dir,
                          role=LEARNER, token_file=token_file)
    try:
        client.send(P.Shutdown(reason))
    finally:
        client.close()


def prompts_accounted(m: dict) -> bool:
    """The scheduler's conservation law: every admitted prompt is released, dropped or still active."""
    return m["admitted"] == m["released"] - m["reopened"] + m["dropped_unresolved"] + \
        m["dropped_zero_variance"] + m["active"]


def results_received(m: dict, round_size: int = 8) -> int:
    """Results that reached the scheduler: accepted (samples_received / round_size), ignored and rejected.
    OOV rejections reach it too (as wrong-size results), so they are already in results_rejected/ignored."""
    assert m["samples_received"] % round_size == 0, "accepted rounds all have round_size samples"
    return m["samples_received"] // round_size + sum(m["results_ignored"].values()) + m["results_rejected"]
