"""`reinforce-ada producer`: one vLLM engine serving rounds to a buffer.

    reinforce-ada producer --connect HOST:PORT [--config FILE] [--id NAME] [--model DIR] [--section.key VALUE ...]

Unknown arguments are dotted config overrides (e.g. `--sampling.temperature 0.8`). Heavy libraries (vLLM,
torch) load only once the arguments and the config are valid, so `--help` and config errors are instant.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from pipeline import logs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="reinforce-ada producer",
        description="Run one producer: a vLLM engine that generates and scores rounds for the buffer.",
        epilog="Other --section.key VALUE arguments override the config (e.g. --sampling.temperature 0.8).",
    )
    p.add_argument("--connect", required=True, metavar="HOST:PORT",
                   help="the buffer's router endpoint (its control channel is PORT+1 unless --control-port)")
    p.add_argument("--control-port", type=int, default=0, help="the buffer's control (PUB) port")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML config (default: all defaults)")
    p.add_argument("--id", default="", metavar="NAME", help="producer id (default: producer-HOST-PID)")
    p.add_argument("--model", default="", metavar="DIR",
                   help="model directory (default: model.path; 'tiny' builds the tiny model in .cache/)")
    p.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, how long running rounds may take to finish before they are aborted")
    p.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="overrides run.log_level for this producer")
    p.add_argument("--timeline", default="", metavar="FILE",
                   help="write every work request, assignment and weight load (wall-clock start and end) here as "
                        "JSONL when the producer stops: where its time went (bench.pipeline reads it)")
    return p


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import ConfigError, load_config
    from pipeline.models import resolve_model_path
    from pipeline.transport import parse_connect

    args, overrides = build_parser().parse_known_args(argv)
    logs.setup(args.log_level or "INFO")
    try:
        cfg = load_config(args.config, overrides)
        logs.setup(args.log_level or cfg.run.log_level)
        router_url, control_url = parse_connect(args.connect, args.control_port or None)
        if args.grace < 0:
            raise ValueError(f"--grace must be >= 0 seconds, got {args.grace}")
        if args.model:
            cfg.model.path = args.model
        model_path = resolve_model_path(cfg)
    except (ConfigError, ValueError) as exc:
        print(f"reinforce-ada producer: error: {exc}", file=sys.stderr)
        return 2
    producer_id = args.id or f"producer-{socket.gethostname()}-{os.getpid()}"

    import asyncio

    from pipeline.producer.worker import run_producer

    return asyncio.run(run_producer(cfg, router_url, control_url, producer_id, model_path, grace_s=args.grace,
                                    timeline=args.timeline))


if __name__ == "__main__":
    sys.exit(main())
