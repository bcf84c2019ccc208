"""What `bench.e2e` compares, as data: strategies (a name and its config overrides on top of configs/tiny.toml)
and settings (which training prompts).

A new variant is one more row here (e.g. an allocation policy: `Strategy("ada-alloc", "Ada + alloc",
("--sampling.allocation", "NAME"), ...)`), or one `--strategy NAME=OVERRIDES` on the command line; nothing else
changes. `s_per_step` is only used to estimate the sweep's duration before it starts.

Invariants: names are unique and contain no '/' or '='; GRPO is `fixed` + `keep` (zero-variance groups trained with
zero advantage, as GRPO does; `fixed` + `drop` is DAPO-style filtering, the row `grpo-drop`); the baseline that
every other strategy is compared to, paired by seed, is `BASELINE`.
"""

from __future__ import annotations

from dataclasses import dataclass

CONFIG = "configs/tiny.toml"
BASELINE = "grpo"


@dataclass(frozen=True)
class Strategy:
    name: str  # run name and key in the JSON
    label: str  # what tables and plots call it
    overrides: tuple[str, ...]  # `reinforce-ada train` overrides on top of CONFIG
    semantics: str  # one line for the report
    s_per_step: float = 1.1  # learner seconds per step on 2 shared cores (tiny task), for the time estimate


STRATEGY_ROWS = (
    Strategy("grpo", "GRPO", ("--sampling.exit_rule", "fixed", "--buffer.unresolved", "keep"),
             "fixed + keep: one round of n = 4, zero-variance groups trained (advantage 0)", 0.5),
    Strategy("ada-pos", "Ada-pos", ("--sampling.exit_rule", "pos", "--buffer.unresolved", "drop"),
             "pos + drop: rounds of M = 8, the exit rule checked after each sample in arrival order "
             "(exit_check prefix) until one positive (N = 4 rounds at most), no-signal pools dropped", 0.9),
    Strategy("ada-balance", "Ada-balance", ("--sampling.exit_rule", "balance", "--buffer.unresolved", "drop"),
             "balance + drop: rounds of M = 8, the exit rule checked after each sample in arrival order (exit_check "
             "prefix) until 2 positives and 2 negatives, no-signal pools dropped", 1.1),
    Strategy("ada-balance-mincost", "Ada-balance + min_cost",
             ("--sampling.exit_rule", "balance", "--buffer.unresolved", "drop", "--sampling.allocation", "min_cost"),
             "balance + drop with the min_cost allocation: each round sized from the prompt's pass-rate posterior, "
             "low-yield examples deferred (sampling.yield_floor)", 1.1),
    Strategy("ada-pos-keep", "Ada-pos (keep)", ("--sampling.exit_rule", "pos", "--buffer.unresolved", "keep"),
             "pos + keep: the reference's handling of unresolved prompts", 0.9),
    Strategy("ada-balance-keep", "Ada-balance (keep)",
             ("--sampling.exit_rule", "balance", "--buffer.unresolved", "keep"),
             "balance + keep: the reference's handling of unresolved prompts", 1.1),
    Strategy("grpo-drop", "GRPO + drop", ("--sampling.exit_rule", "fixed", "--buffer.unresolved", "drop"),
             "fixed + drop: DAPO-style filtering of zero-variance groups (not GRPO)", 0.5),
)
STRATEGIES = {s.name: s for s in STRATEGY_ROWS}
DEFAULT_STRATEGIES = ("grpo", "ada-pos", "ada-balance", "ada-balance-mincost")


def parse_strategy(text: str) -> Strategy:
    """A strategy from the command line: `NAME=--section.key VALUE ...` (label = NAME)."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or "/" in name or not rest.split():
        raise ValueError(f"--strategy {text!r}: write NAME=OVERRIDES, e.g. "
                         "'ada-alloc=--sampling.exit_rule balance --sampling.allocation NAME'")
    if name in STRATEGIES:
        raise ValueError(f"--strategy {name!r}: that name is a built-in row; pick another name")
    return Strategy(name, name, tuple(rest.split()), f"custom: {rest.strip()}")


def pick_strategies(names: list[str], extra: list[Strategy]) -> list[Strategy]:
    """The strategies to run, the baseline first; ValueError naming the choices for an unknown name."""
    table = {**STRATEGIES, **{s.name: s for s in extra}}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown strategy {unknown}: pick from {sorted(table)}, or add one with --strategy")
    wanted = list(dict.fromkeys(names + [s.name for s in extra]))
    if BASELINE not in wanted:
        wanted.insert(0, BASELINE)  # every comparison is paired with the baseline's run of the same seed
    wanted.sort(key=lambda n: n != BASELINE)
    return [table[n] for n in wanted]


@dataclass(frozen=True)
class Setting:
    name: str
    description: str


SETTINGS = {
    "normal": Setting("normal", "training prompts: the built-in two-digit task (data.num_arithmetic_train "
                                "problems drawn with seed run.seed + 1)"),
    "hard": Setting("hard", "training prompts: generated two-digit problems the tiny model solves MIN-MAX times of "
                            "16 (`reinforce-ada select-prompts`), a low pass rate as in the paper's selection (which "
                            "keeps >= 1 of 16 and at most 0.125 for its hard set, 0.313 for its easy one)"),
}
