"""`reinforce-ada train`: start the buffer, the producers and the learner from one config, watch them, show the
run, and stop everything cleanly.

The run goes through named stages: plan (`plan.py`: run directory, commands, ports), start and wait until ready,
watch and restart, stop (`lifecycle.py`, deciding restarts with `restarts.py`), and summarise (`live.py`).
Policy: a producer that dies is restarted; a learner or buffer that dies is restarted with --resume; a process
that dies too often, or `restarts.SAME_ERROR_LIMIT` times in a row with the same error, ends the run with exit
code 1 and the cause. The learner finishing (exit 0) ends the run; Ctrl-C stops everything
(exit code 130), the learner checkpointing first. No child outlives the supervisor.

A run directory holds one run: `--resume RUN_DIR` continues a stopped run from its latest checkpoint and buffer
snapshot (its config.toml, with the command line's overrides, e.g. a higher --learner.num_steps); a fresh run in a
non-empty directory is an error unless `--overwrite` (plan.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from pipeline.auth import supervisor_role
from pipeline.config import Config, ConfigError, load_config
from pipeline.rewards.base import check_reward_config
from pipeline.supervisor.lifecycle import PLACEMENT, RunFailed, Watch, buffer_metrics, start_all, stop_run
from pipeline.supervisor.live import Display, RunState, summarise
from pipeline.supervisor.plan import RunPlan, check_data_files, checkpoint_version, plan_run, prepare_run_dir
from pipeline.trackers import TrackerError, check_trackers
from pipeline.transport import BufferClient, unique_identity
from pipeline.weights.private import open_private_dir

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
FINAL_EVAL_GRACE_S = 30.0  # on top of buffer.lease_s: the buffer's final evaluation after the last step


class Interrupts:
    """SIGINT / SIGTERM set a reason the watch loop turns into a clean stop; the old handlers come back after."""

    def __init__(self) -> None:
        self.reason = ""
        self.count = 0  # signals so far: one more while stopping means "now"
        self.old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, signum: int, frame: object) -> None:
        self.count += 1
        self.reason = self.reason or ("interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated")

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


def run(cfg: Config, resume: bool = False) -> int:
    """Plan, start, watch and summarise one run (`resume`: continue the one in cfg.run_dir); the exit code of
    `reinforce-ada train`."""
    t0 = time.monotonic()
    try:
        plan = plan_run(cfg, resume)
    except ConfigError as exc:  # the launcher's: no Ray cluster, say
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:  # a process no node can take
        print(f"run stopped: {exc}", file=sys.stderr)
        return 1
    display = Display(RunState(cfg.run.name, cfg.learner.num_steps), sys.stdout.isatty() and cfg.run.live)
    client = BufferClient(plan.router_url, plan.control_url, unique_identity("supervisor"), cfg.endpoints.keys_dir,
                          role=supervisor_role(cfg.endpoints.keys_dir), subscribe=False)  # metrics only
    interrupts = Interrupts()
    watch = Watch(plan, display, lambda: buffer_metrics(client, 0.5), interrupts.pending)
    exit_code = 0
    try:
        start_all(plan, client, interrupts.pending)
        where = "" if plan.launcher.name == "local" else f" on {plan.launcher.name} ({plan.log_dir / PLACEMENT})"
        print(f"run {cfg.run.name}: {len(plan.producers)} producer(s), learner x{cfg.learner.num_ranks}{where}; logs "
              f"in {plan.log_dir}", flush=True)
        display.start()
        watch.run()
        wait_for_buffer_exit(plan, interrupts)
    except RunFailed as exc:
        print(f"\nrun stopped: {exc}", file=sys.stderr, flush=True)
        exit_code = 130 if "interrupted" in str(exc) else 1
    finally:
        display.stop()
        client.close()
        signals_before = interrupts.count
        stop_run(plan, lambda: interrupts.count > signals_before)
        plan.launcher.close()
        release_weights(cfg)
        interrupts.restore()
    watch.read_tails()
    summarise(display.state, plan.run_dir, time.monotonic() - t0)
    return exit_code


def release_weights(cfg: Config) -> None:
    """Delete the default weights folder (in /dev/shm: memory) once the run is finished: checkpoints hold the
    model. A stopped run keeps it: the buffer's snapshot names its newest file, which producers of a resumed run
    load before the resumed learner publishes it again."""
    if cfg.weights.dir or not cfg.weights_dir.is_dir():
        return
    version = checkpoint_version(cfg.run_dir)
    if version is None or version >= cfg.learner.num_steps:
        shutil.rmtree(cfg.weights_dir, ignore_errors=True)
        return
    size = sum(p.stat().st_size for p in cfg.weights_dir.iterdir() if p.is_file())
    print(f"kept the latest weights in {cfg.weights_dir} ({size / 2**20:,.0f} MiB of memory) for `reinforce-ada train "
          f"--resume {cfg.run_dir}`; delete that folder if you will not resume", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML config (default: configs/tiny.toml's settings, the CPU run)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint "
                                                            "and buffer snapshot, with its config.toml")
    parser.add_argument("--overwrite", action="store_true", help="delete the run directory of a previous run first")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_run_config(args, overrides)
        check_data_files(cfg)
        check_trackers(cfg.run.trackers)
        check_reward_config(cfg)  # a reward.fn that cannot load fails here once, not in every producer
        prepare_run_dir(cfg, resume=bool(args.resume), overwrite=args.overwrite)  # last: it may delete a run
        if cfg.weights.transport == "file":  # a folder another user made first is refused now, not at a publish
            os.close(open_private_dir(cfg.weights_dir, create=True))
    except (ConfigError, TrackerError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except PermissionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.resume:
        version = checkpoint_version(cfg.run_dir)
        print(f"resuming {cfg.run_dir} " + (f"from its checkpoint at version {version}" if version is not None else
                                            "(no checkpoint: the learner starts from the model)"), flush=True)
    return run(cfg, resume=bool(args.resume))


def load_run_config(args: argparse.Namespace, overrides: list[str]) -> Config:
    """The config of a fresh run (--config, else configs/tiny.toml), or of the run --resume names: its own
    config.toml with the command line's overrides, in that directory wherever it was moved."""
    if not args.resume:
        return load_config(args.config or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None), overrides)
    if args.config or args.overwrite:
        raise ConfigError(f"--resume {args.resume} continues that run with its own config.toml: give changes as "
                          "--section.key overrides, without --config or --overwrite")
    run_dir = Path(args.resume)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"--resume {run_dir}: not a run directory (no config.toml)")
    cfg = load_config(str(run_dir / "config.toml"),
                      ["--run.dir", str(run_dir.parent), "--run.name", run_dir.name, *overrides])
    if cfg.run_dir.resolve() != run_dir.resolve():
        raise ConfigError(f"run.name / run.dir: --resume {run_dir} continues that directory; do not override them")
    return cfg


if __name__ == "__main__":
    sys.exit(main())
