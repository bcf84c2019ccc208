"""The built-in math reward: 1.0 or 0.0 from math-verify (`reward.fn = "pipeline.rewards.math:verify"`).

`verify` is the reward function the pool calls (unguarded: the pool's workers limit its time); `math_reward`
is the same score with its own time limit, for callers outside a pool (any thread).

Invariants: `math_reward` never raises, and returns within its time limit unless it is stuck in C code that
never returns to Python (then only a pool worker can be stopped: it is killed).

Why the care: math-verify bounds its own work with `signal.alarm`, which only works in the main thread and only
in whole seconds. Its timers are switched off here (`parsing_timeout=None`, `timeout_seconds=None`) and one
`setitimer` deadline around the whole call replaces them (`guard.py`).
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction

import math_verify
import math_verify.grader
import math_verify.parser

from pipeline.data import last_boxed
from pipeline.rewards.calls import score_guarded

TAIL_CHARS = 8000  # only the tail of a completion is searched for its answer: bounds the time on huge ones

# math-verify warns once that its own timers are off; ours replace them, so the warning is noise
math_verify.grader.TIMEOUT_WARNING_SHOWN = True
math_verify.parser.TIMEOUT_WARNING_SHOWN = True


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    # boxing takes the whole answer as one expression, whatever `$` or text it contains
    text = answer if last_boxed(answer) is not None else "\\boxed{" + answer + "}"
    return tuple(math_verify.parse(text, parsing_timeout=None))


def verify(completion: str, answer: str) -> float:
    """1.0 if `completion`'s final answer equals the gold `answer` by math-verify, else 0.0 (no time limit).

    The gold answer is parsed as `\\boxed{answer}`. The prediction is the last complete \\boxed{} of the
    completion's tail (its last TAIL_CHARS = 8000 characters, where the final answer is; earlier text is
    ignored so a 1 MB completion costs no more than an 8 kB one); without a box, math-verify reads the tail
    itself (so a plain "46" scores). A gold answer math-verify cannot read is compared as text with the box.
    """
    if not (isinstance(completion, str) and isinstance(answer, str)):
        return 0.0
    answer = answer.strip()
    if not answer or not completion:
        return 0.0
    tail = completion[-TAIL_CHARS:]
    boxed = last_boxed(tail)
    pred_text = tail if boxed is None else "\\boxed{" + boxed + "}"
    gold = list(_parse_gold(answer))
    if not gold:  # math-verify cannot read the gold answer: fall back to comparing the text
        return float(boxed is not None and "".join(boxed.split()) == "".join(answer.split()))
    pred = math_verify.parse(pred_text, parsing_timeout=None)
    return float(bool(pred) and math_verify.verify(gold, pred, timeout_seconds=None))


# a worker imports sympy's parsers on this first call, before any deadline runs
verify.warmup = functools.partial(verify, "\\boxed{1}", "1")  # type: ignore[attr-defined]


_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def _as_number(text: str) -> Fraction | None:
    """The value of `text` if it is one plain number ("46", "-3", "1,024", "2.50", "$46$"), else None."""
    text = text.strip().strip("$").replace(",", "").replace("\\!", "").strip()
    if not _NUMBER.fullmatch(text):
        return None
    return Fraction(text)


def boxed_number(completion: str, answer: str) -> float:
    """1.0 if the completion's last \\boxed{} holds one plain number equal to the numeric gold `answer`, else 0.0.

    For tasks whose answer is a number that the prompt itself spells as an expression (the arithmetic task:
    "What is 12 + 34?"). `verify` evaluates expressions, so restating the question ("\\boxed{12 + 34}", or an
    unboxed "12 + 34 = 48") scores there: a policy finds and farms that. Here only a number counts, only in the
    box the instruction asks for, and only the last box (its TAIL_CHARS tail)."""
    if not (isinstance(completion, str) and isinstance(answer, str)):
        return 0.0
    gold = _as_number(answer)
    boxed = last_boxed(completion[-TAIL_CHARS:])
    pred = _as_number(boxed) if boxed is not None else None
    return float(gold is not None and pred is not None and pred == gold)


_LAST_NUMBER = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?")


def final_number(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer, its last \\boxed{} or else the last number in its tail, is one plain
    number equal to the numeric gold `answer`, else 0.0 (GSM8K's rule, with boxes honoured).

    For small chat models that state an answer ("2 + 9 = 11") but rarely box it. Nothing is evaluated, so
    restating the question ("What is 12 + 34?") ends on 34, not 46; a problem whose answer is its own last operand
    ("0 + 7") is the one case a restatement scores."""
    if not (isinstance(completion, str) and isinstance(answer, str)):
        return 0.0
    gold = _as_number(answer)
    tail = completion[-TAIL_CHARS:]
    boxed = last_boxed(tail)
    if boxed is not None:
        pred = _as_number(boxed)
    else:
        numbers = _LAST_NUMBER.findall(tail)
        pred = _as_number(numbers[-1]) if numbers else None
    return float(gold is not None and pred is not None and pred == gold)


def math_reward(completion: str, answer: str, timeout_s: float = 5.0) -> float:
    """`verify` limited to `timeout_s` seconds; errors and timeouts give 0.0. Never raises.

    In the main thread a SIGALRM timer limits the call; from another thread it runs in a worker process.
    """
    if not (isinstance(completion, str) and isinstance(answer, str) and isinstance(timeout_s, (int, float))):
        return 0.0
    return score_guarded(verify, completion, answer, timeout_s)
