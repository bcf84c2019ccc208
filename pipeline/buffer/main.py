"""`reinforce-ada buffer`: load the prompts, bind the sockets, serve until the learner says it is done.

    reinforce-ada buffer --config FILE [--model DIR] [--resume] [--snapshot-every N] [--section.key VALUE ...]

Exit codes (pipeline/exits.py): 0 after a Shutdown; 2 for a bad config, a refused bind (non-loopback without
CurveZMQ keys), ports in use or an unusable snapshot; 78 (EXIT_FATAL) when the buffer stopped the run itself
because it cannot learn (buffer.stop_without_signal). The message says which and how to fix it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline import logs
from pipeline.buffer.service import BufferService
from pipeline.buffer.snapshot import SNAPSHOT_EVERY
from pipeline.config import ConfigError, load_config
from pipeline.exits import EXIT_FATAL
from pipeline.models import load_tokenizer, prompt_template, resolve_model_path
from pipeline.prompts import build_prompts
from pipeline.transport import check_bind

log = logging.getLogger(__name__)


def read_vocab_size(model_dir: str) -> int | None:
    """`vocab_size` from the model directory's config.json (top level, else text_config), or None without one."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON ({exc}); point --model at a Hugging Face model "
                         "directory") from None
    for section in (config, config.get("text_config") or {}):
        size = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(size, int) and size > 0:
            return size
    return None


def prompt_tokenizer(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """A prompt's text to its token ids as the engines tokenize a text prompt (special tokens added, as
    prompts.prompt_lengths counts them), or None without a tokenizer."""
    if tokenizer is None:
        return None
    return lambda text: tokenizer(text, add_special_tokens=True)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada buffer", description="Run the rollout buffer service.")
    parser.add_argument("--config", help="TOML config (default: built-in defaults)")
    parser.add_argument("--model", help="model directory (the tokenizer's chat template, and vocab_size from its "
                                        "config.json to reject out-of-vocabulary token ids); default model.path")
    parser.add_argument("--resume", action="store_true",
                        help="continue from run_dir/buffer/snapshot.msgpack (a fresh start when there is none)")
    parser.add_argument("--snapshot-every", type=int, default=SNAPSHOT_EVERY, metavar="N",
                        help=f"write the snapshot after every N-th learner version (0 = never; default "
                             f"{SNAPSHOT_EVERY})")
    args, overrides = parser.parse_known_args(argv)
    logs.setup()
    try:
        if args.snapshot_every < 0:
            raise ValueError(f"--snapshot-every must be >= 0 (0 = never), got {args.snapshot_every}")
        cfg = load_config(args.config, overrides)
        logs.setup(cfg.run.log_level)
        check_bind(cfg.endpoints.host, cfg.endpoints.keys_dir)  # before any slow loading: refuse at once
        model_dir = args.model or resolve_model_path(cfg, build=prompt_template(cfg) == "auto")
        tokenizer = load_tokenizer(cfg, model_dir)  # None without one (a scripted run): prompt tokens unchecked
        vocab_size = read_vocab_size(model_dir)
        if vocab_size is None and tokenizer is not None:  # no vocab_size in config.json: the tokenizer's ids
            vocab_size = len(tokenizer)
        run_prompts = build_prompts(cfg, model_dir, tokenizer)
        # (prompt, answer, extras): the extras travel with every round to the producers' reward.fn
        prompts = [(p.text, p.answer, p.extras) for p in run_prompts.train]
        eval_prompts = run_prompts.evals  # Prompt objects: their benchmark names the per-benchmark scores
        # SecurityError (missing keys) and snapshot errors are ValueErrors, a port in use is an OSError
        service = BufferService(cfg, prompts, eval_prompts, snapshot_every=args.snapshot_every,
                                resume=args.resume, vocab_size=vocab_size, tokenize=prompt_tokenizer(tokenizer))
    except (ConfigError, ValueError, OSError) as exc:
        print(f"buffer: {exc}", file=sys.stderr)
        return 2
    log.info("serving %d training prompts (%d eval) on %s, control %s; token ids checked against vocab_size %s; "
             "prompt tokens checked against %s", len(prompts), len(eval_prompts), service.router_url,
             service.control_url, vocab_size if vocab_size is not None else "(unknown: not checked)",
             "the buffer's tokenizer" if tokenizer is not None else "each prompt's first round (no tokenizer)")
    try:
        reason = service.serve()
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        service.close()
    log.info("stopped: %s", reason)
    if service.core.fatal:  # the buffer stopped the run itself: restarting it cannot help (the supervisor knows)
        print(f"buffer: {service.core.fatal}", file=sys.stderr, flush=True)
        return EXIT_FATAL
    return 0


if __name__ == "__main__":
    sys.exit(main())
