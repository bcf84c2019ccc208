"""`reinforce-ada` command line: a thin dispatcher. Each subcommand's module is imported only when used, so
`--help` and `check-config` answer instantly without loading torch or vLLM."""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from pathlib import Path

from pipeline.config import ConfigError, dumps_toml, load_config, reference_markdown, update_readme

# subcommand -> (module with a `main(argv) -> int | None`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("pipeline.supervisor.main", "launch buffer, producers and learner from one config (the default run)"),
    "slurm": ("pipeline.supervisor.slurm", "write (--submit: and submit) an sbatch script for a run over --nodes N "
                                           "of a Slurm allocation"),
    "buffer": ("pipeline.buffer.main", "run the rollout buffer service"),
    "producer": ("pipeline.producer.main", "run one vLLM producer: --connect HOST:PORT"),
    "learner": ("pipeline.consumer.main", "run the learner (under torchrun for several ranks): --connect HOST:PORT"),
    "eval": ("pipeline.evaluate", "Ave@k of a model (or a run directory's latest export) on benchmark files with "
                                  "vLLM"),
    "export": ("pipeline.export", "write a checkpoint (or a run's latest) as a Hugging Face model directory: "
                                  "CKPT [--out DIR]"),
    "select-prompts": ("pipeline.select_prompts", "keep prompts whose base-model pass rate lies in a range"),
    "plot": ("pipeline.plots", "draw (or overlay) the PNG plots of one or more runs"),
    "check-config": ("pipeline.cli", "print the resolved config of FILE [overrides], or the error; --markdown: "
                                     "the configuration reference"),
    "make-tiny-model": ("pipeline.tiny_model", "build the tiny character-level arithmetic model"),
    "keys": ("pipeline.cli", "create CurveZMQ keys, one pair per role (server, producer, learner): --out DIR, with "
                             "--producer NAME a pair per producer (or added to DIR); or "
                             "a learner token for a loopback run: --learner-token FILE"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: reinforce-ada COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `reinforce-ada COMMAND --help` for a command's options."]
    return "\n".join(lines)


CHECK_CONFIG_USAGE = """\
usage: reinforce-ada check-config [FILE] [--section.key VALUE ...]
       reinforce-ada check-config --markdown          print the configuration reference (markdown)
       reinforce-ada check-config --readme README.md  rewrite that section of README.md"""


def check_config_main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(CHECK_CONFIG_USAGE)
        return 0
    if argv == ["--markdown"]:
        print(reference_markdown(), end="")
        return 0
    if len(argv) == 2 and argv[0] == "--readme":
        changed = update_readme(argv[1])
        print(f"{argv[1]}: configuration reference {'rewritten' if changed else 'already up to date'}")
        return 0
    path = argv[0] if argv and not argv[0].startswith("--") else None
    overrides = argv[1:] if path else argv
    try:
        cfg = load_config(path, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    print(dumps_toml(cfg), end="")
    return 0


KEYS_DONE = """wrote CurveZMQ keys to {root}: the buffer's machine needs server.key* and authorized/; a producer's
machine server.key and {producer}; the learner's machine server.key and learner.key*. Set endpoints.keys_dir
to the directory on each (`reinforce-ada train` on one machine can use {root} as it is)."""
ADDED = """added producer keys to {root}: {names}. Copy server.key and NAME.key* to producer NAME's machine (started
with --id NAME), and restart the buffer with the directory's authorized/ so that it admits them."""


def keys_main(argv: list[str]) -> int:
    from pipeline.auth import SERVER_KEY, SecurityError, add_producer_keys, create_token, make_keys  # pyzmq

    parser = argparse.ArgumentParser(prog="reinforce-ada keys", description=COMMANDS["keys"][1])
    parser.add_argument("--out", help="directory for the key files (server, producer, learner, authorized/)")
    parser.add_argument("--producer", metavar="NAME", action="append", default=[],
                        help="a key pair of its own for producer NAME (its --id), in place of the shared producer "
                             "pair, so that each producer is one client; repeat for each. On a directory that "
                             "holds keys already: add NAME's pair to it, leaving every other key as it is")
    parser.add_argument("--learner-token", metavar="FILE",
                        help="write a fresh learner token (mode 0600) for a buffer and learner on loopback without "
                             "keys, e.g. RUN_DIR/learner.token (`reinforce-ada train` keys its runs instead)")
    args = parser.parse_args(argv)
    if not args.out and not args.learner_token:
        parser.error("give --out DIR (CurveZMQ keys) or --learner-token FILE")
    if args.producer and not args.out:
        parser.error("--producer needs --out DIR")
    try:
        if args.out and (Path(args.out) / f"{SERVER_KEY}.key_secret").exists():
            if not args.producer:
                raise SecurityError(f"{args.out} holds keys already; new ones would lock out every machine that has "
                                    "a copy. Use an empty directory, or --producer NAME to add a producer's key")
            print(ADDED.format(root=add_producer_keys(args.out, args.producer), names=", ".join(args.producer)))
        elif args.out:
            owned = (f"NAME.key* for producer NAME ({', '.join(args.producer)}; started with --id NAME)"
                     if args.producer else "producer.key*")
            print(KEYS_DONE.format(root=make_keys(args.out, args.producer), producer=owned))
        if args.learner_token:
            print(f"wrote a learner token to {create_token(args.learner_token)}")
    except (SecurityError, OSError) as exc:
        print(f"keys: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        print(f"unknown command {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name == "check-config":
        return check_config_main(rest)
    if name == "keys":
        return keys_main(rest)
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
