"""Exact match on a normalised string (`reward.fn = "pipeline.rewards.match:exact_match"`): for short free-text
answers (names, words, labels) where math-verify does not apply.

The completion's final answer is its last complete \\boxed{} if it has one, else the text after its last
"answer:" / "answer is", else its last non-empty line. Both sides are normalised as SQuAD's evaluation does
(Unicode NFKC, case-folded, punctuation turned into spaces, the articles a / an / the removed, whitespace
collapsed). Only the
completion's tail is read, so the time is bounded whatever its length.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from pipeline.data import last_boxed

TAIL_CHARS = 4000
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_MARKER = re.compile(r"\banswer\s*(?::|\bis\b:?)\s*", re.IGNORECASE)


def normalize_text(text: str) -> str:
    """`text` as compared: "The  Eiffel-Tower!" -> "eiffel tower" (punctuation becomes a space)."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    return " ".join(_ARTICLES.sub(" ", text).split())


def final_answer(completion: str) -> str:
    """The part of `completion` that states its answer (see the module docstring)."""
    tail = completion[-TAIL_CHARS:]
    boxed = last_boxed(tail)
    if boxed is not None:
        return boxed
    markers = list(_MARKER.finditer(tail))
    if markers:
        return tail[markers[-1].end():].split("\n", 1)[0]
    lines = [line for line in tail.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def exact_match(completion: str, answer: str, aliases: Sequence[str] | None = None) -> float:
    """1.0 if the completion's final answer equals `answer` (or one of `aliases`, e.g. from data.extra_keys =
    ["aliases"]) after normalisation, else 0.0. An answer that normalises to nothing never matches."""
    if not isinstance(completion, str):
        return 0.0
    wanted = {normalize_text(a) for a in [answer, *(aliases or [])] if isinstance(a, str)} - {""}
    return float(normalize_text(final_answer(completion)) in wanted)
