"""The built-in arithmetic task (for the tiny character-level model): generated, deterministic for a seed."""

from __future__ import annotations

import random

from pipeline.data.rows import Example

ARITHMETIC_LEVELS = (1, 2, 3)  # operands have up to `level` digits
FORMAT = "{a}{op}{b}"  # "12+34": what the tiny model reads


def format_problem(fmt: str, a: int, op: str, b: int) -> str:
    """`fmt` with {a}, {op} and {b} filled in ("What is {a} {op} {b}?" -> "What is 12 + 34?")."""
    return fmt.format(a=a, op=op, b=b)


def arithmetic_problem(rng: random.Random, level: int, fmt: str = FORMAT) -> Example:
    """One addition or subtraction problem whose operands have 1..`level` digits, written with `fmt`."""
    if level not in ARITHMETIC_LEVELS:
        raise ValueError(f"arithmetic level must be one of {ARITHMETIC_LEVELS}, got {level}")
    hi = 10**level - 1
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    op = rng.choice("+-")
    value = a + b if op == "+" else a - b
    return Example(problem=format_problem(fmt, a, op, b), answer=str(value), source=f"arithmetic:L{level}")


def make_arithmetic(num: int, levels: tuple[int, ...] = ARITHMETIC_LEVELS, seed: int = 0,
                    fmt: str = FORMAT) -> list[Example]:
    """`num` distinct arithmetic problems, levels drawn uniformly from `levels`, deterministic for a seed (the
    same problems whatever `fmt` writes them as)."""
    rng = random.Random(seed)
    out: list[Example] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < num:
        attempts += 1
        if attempts > 100 * num + 1000:
            raise ValueError(f"cannot draw {num} distinct arithmetic problems at levels {levels}")
        ex = arithmetic_problem(rng, rng.choice(levels), fmt)
        if ex.problem not in seen:
            seen.add(ex.problem)
            out.append(ex)
    return out
