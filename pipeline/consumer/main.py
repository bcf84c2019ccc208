"""`reinforce-ada learner`: ask the buffer for batches, train, publish versioned weights, checkpoint.

    reinforce-ada learner --config FILE [--connect HOST:PORT] [--resume] [--model DIR] [--section.key VALUE ...]
    torchrun --nproc-per-node 2 -m pipeline.consumer.main --config FILE ...   (several ranks)

A thin entry point: it parses the arguments and the config, then imports the loop (torch, transformers) only
when it runs, so `--help` and config errors answer at once. The loop is in loop.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pipeline import logs
from pipeline.config import ConfigError, load_config
from pipeline.trackers import TrackerError, check_trackers


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="reinforce-ada learner", allow_abbrev=False,
                                     description="Train on batches from the buffer and publish weights.")
    parser.add_argument("--config", help="TOML config file (default: all defaults)")
    parser.add_argument("--connect", help="buffer HOST:PORT (control channel on PORT+1); "
                                          "default: endpoints.host:endpoints.router_port")
    parser.add_argument("--resume", action="store_true", help="continue from run_dir/checkpoints/latest")
    parser.add_argument("--model", help="model directory (same as --model.path)")
    args, overrides = parser.parse_known_args(argv)
    if args.model:
        overrides += ["--model.path", args.model]
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    """Entry point of `reinforce-ada learner`."""
    args, overrides = parse_args(argv)
    logs.setup()
    try:
        cfg = load_config(args.config, overrides)
        logs.setup(cfg.run.log_level)
        check_trackers(cfg.run.trackers)
    except (ConfigError, TrackerError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    # the loop needs torch and transformers: imported only now that the arguments and the config are good
    from pipeline.consumer.fetch import LearnerError
    from pipeline.consumer.loop import run
    from pipeline.transport import SecurityError

    try:
        return run(cfg, args.connect, args.resume)
    except (LearnerError, SecurityError, TrackerError) as exc:
        print(f"learner error: {exc}", file=sys.stderr)
        return 1


def exit_process(code: int) -> None:
    """End the process with `code`. A rank of a distributed learner leaves its process group and exits without
    the C++ static destructors: one of them can end a rank that finished cleanly with "terminate called without
    an active exception" (SIGABRT), and torchrun then reports the whole learner as failed."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        sys.exit(code)
    try:
        dist.destroy_process_group()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    exit_process(main())
