"""Gold answers and problem keys: `\\boxed{}` extraction (shared with the rewards), answers from files as strings,
and the normalised problem text that dedup compares."""

from __future__ import annotations

import math
import re
from typing import Any

# `\boxed{`, `\fbox{` or `\framebox{` (AIME solutions use \framebox); the brace is part of the match
_BOXED_RE = re.compile(r"\\(?:boxed|fbox|framebox)\s*\{")
# structural braces only: `\\` (a LaTeX line break) and `\{` `\}` (literal braces) are skipped
_BRACE_RE = re.compile(r"\\\\|\\[{}]|[{}]")


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`) in `text`, or None.

    Braces are matched (escaped `\\{ \\}` don't count), so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`.
    A final box cut off before its closing brace is skipped in favour of the last complete one. Linear in
    len(text): one pass over the braces after the first box.
    """
    starts = [m.end() - 1 for m in _BOXED_RE.finditer(text)]  # positions of each box's opening brace
    if not starts:
        return None
    wanted = set(starts)
    closing: dict[int, int] = {}  # opening-brace position -> its closing-brace position
    stack: list[int] = []
    for m in _BRACE_RE.finditer(text, starts[0]):
        tok = m.group()
        if tok == "{":
            stack.append(m.start())
        elif tok == "}" and stack:
            opened = stack.pop()
            if opened in wanted:
                closing[opened] = m.start()
    for start in reversed(starts):
        if start in closing:
            return text[start + 1 : closing[start]].strip()
    return None


def normalize_answer(value: Any) -> str | None:
    """A gold answer from a file as a string: 27.0 -> "27", [1, 2] -> "1, 2"; None/""/NaN -> None."""
    if hasattr(value, "tolist"):  # numpy scalars and arrays (pandas rows)
        value = value.tolist()
    if value is None or isinstance(value, bool):
        return None  # a bool is never a math answer; treat it as missing so the error says so
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return None
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        parts = [normalize_answer(v) for v in value]
        if not parts or any(p is None for p in parts):
            return None
        return ", ".join(parts)
    if isinstance(value, str):
        return value.strip() or None
    return None


def normalize_problem(text: str) -> str:
    """The dedup key of a problem: whitespace collapsed, case-folded."""
    return " ".join(text.split()).casefold()
