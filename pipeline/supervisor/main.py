"""`reinforce-ada train`: start the buffer, the producers and the learner from one config, watch them, show the
run, and stop everything cleanly.

The run goes through named stages, each in its own module: plan (`plan.py`: run directory, commands, ports),
start and wait until ready (`startup.py`), watch and restart (`watch.py`, deciding with `restarts.py`), and
summarise (`live.py`). Policy: a producer that dies is restarted; a learner or buffer that dies is restarted with
--resume; a process that dies too often, or `restarts.SAME_ERROR_LIMIT` times in a row with the same error, ends
the run with exit code 1 and the cause. The learner finishing (exit 0) ends the run; Ctrl-C stops everything
(exit code 130). No child outlives the supervisor.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from pathlib import Path

from pipeline.config import Config, ConfigError, load_config
from pipeline.supervisor.lifecycle import RunFailed, Watch, buffer_metrics, start_all
from pipeline.supervisor.live import Display, RunState, summarise
from pipeline.supervisor.plan import RunPlan, check_data_files, plan_run
from pipeline.supervisor.procs import stop_all
from pipeline.transport import BufferClient

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
FINAL_EVAL_GRACE_S = 30.0  # on top of buffer.lease_s: the buffer's final evaluation after the last step


class Interrupts:
    """SIGINT / SIGTERM set a reason the watch loop turns into a clean stop; the old handlers come back after."""

    def __init__(self) -> None:
        self.reason = ""
        self.old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, signum: int, frame: object) -> None:
        self.reason = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated"

    def pending(self) -> str:
        """The reason to stop ('' while none)."""
        return self.reason

    def restore(self) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


def wait_for_buffer_exit(plan: RunPlan, interrupts: Interrupts) -> None:
    """After the last step the buffer runs the final evaluation, then shuts down on the learner's request."""
    end = time.monotonic() + plan.cfg.buffer.lease_s + FINAL_EVAL_GRACE_S
    while plan.buffer.poll() is None and time.monotonic() < end and not interrupts.pending():
        time.sleep(0.2)


def run(cfg: Config) -> int:
    """Plan, start, watch and summarise one run; the exit code of `reinforce-ada train`."""
    t0 = time.monotonic()
    plan = plan_run(cfg)
    display = Display(RunState(cfg.run.name, cfg.learner.num_steps), sys.stdout.isatty() and cfg.run.live)
    client = BufferClient(plan.router_url, plan.control_url, "supervisor", cfg.endpoints.keys_dir)  # metrics only
    interrupts = Interrupts()
    watch = Watch(plan, display, lambda: buffer_metrics(client, 0.5), interrupts.pending)
    exit_code = 0
    try:
        start_all(plan, client, interrupts.pending)
        print(f"run {cfg.run.name}: {len(plan.producers)} producer(s), learner x{cfg.learner.num_ranks}; logs in "
              f"{plan.log_dir}", flush=True)
        display.start()
        watch.run()
        wait_for_buffer_exit(plan, interrupts)
    except RunFailed as exc:
        print(f"\nrun stopped: {exc}", file=sys.stderr, flush=True)
        exit_code = 130 if "interrupted" in str(exc) else 1
    finally:
        display.stop()
        client.close()
        stop_all(plan.children)
        if not cfg.weights.dir:  # the default weights folder lives in /dev/shm (RAM): checkpoints hold the model
            shutil.rmtree(cfg.weights_dir, ignore_errors=True)
        interrupts.restore()
    watch.read_tails()
    summarise(display.state, plan.run_dir, time.monotonic() - t0)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML config (default: configs/tiny.toml's settings, the CPU run)")
    args, overrides = parser.parse_known_args(argv)
    config_path = args.config or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None)
    try:
        cfg = load_config(config_path, overrides)
        check_data_files(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
