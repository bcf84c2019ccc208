"""One dataset row -> one Example: where its problem, answer and extras are, and what a bad row is told.

A key is a column name or a dotted path into nested columns ("reward_model.ground_truth", "extra_info.question";
a number indexes a list: "prompt.0.content"); a column whose own name contains the dot wins over the path.
The problem is a string or a chat prompt: a list of {"role", "content"} messages (verl's `prompt` column).

Invariants:
- every Example has a non-empty `problem` and a non-empty `answer` (the gold final answer as a string that the
  reward can read); for a chat prompt, `problem` is the content of its last user message (what dedup compares);
- `messages` holds only {"role": str, "content": str} dicts, at least one of them a user message;
- `extras` maps the last dotted part of each data.extra_keys entry to the row's value, which is plain data
  (None, bool, int, float, str, bytes, lists and string-keyed dicts of them) so it travels over msgpack unchanged;
- a row that breaks any of these is a DatasetError naming file:line, what was looked for, and the setting to fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from pipeline.data.answers import last_boxed, normalize_answer

Message = dict[str, str]

PROBLEM_KEYS = ("problem", "question", "prompt")
ANSWER_KEYS = ("answer", "final_answer", "reward_model.ground_truth")
SOLUTION_KEY = "solution"
_MISSING = object()
_INT_RANGE = (-(2**63), 2**64 - 1)  # what msgpack can carry


class Example(msgspec.Struct, frozen=True):
    """One training or evaluation problem."""

    problem: str  # the question text, without any template (a chat prompt: its last user message)
    answer: str  # the gold final answer (e.g. "42", "\\frac{1}{2}")
    source: str = ""  # where it came from: "file.jsonl:17" or "arithmetic"
    messages: tuple[Message, ...] = ()  # the row's chat prompt as given; () = a plain-text problem
    extras: dict[str, Any] = {}  # data.extra_keys values, passed to reward.fn as keyword arguments


class DatasetError(ValueError):
    """A dataset file or one of its rows cannot be used; the message names file:line and the fix."""


def lookup(row: dict, key: str) -> Any:
    """The value at `key` (a column, or a dotted path into nested dicts and lists) of `row`, else _MISSING."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if hasattr(node, "tolist") and not isinstance(node, (str, bytes)):  # numpy arrays from pandas
            node = node.tolist()
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def extra_name(key: str) -> str:
    """The keyword under which the reward function gets data.extra_keys entry `key`: its last dotted part."""
    return key.rsplit(".", 1)[-1]


def _is_chat(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], dict)


def parse_messages(value: Sequence[Any], where: str, key: str) -> tuple[Message, ...]:
    """A chat prompt's messages, checked: each a {"role", "content"} dict of strings, at least one user turn."""
    out = []
    for i, m in enumerate(value, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"]
                and isinstance(m.get("content"), str)):
            raise DatasetError(
                f"{where}: {key!r} is a chat prompt, but its message {i} is {str(m)[:200]}; each message must be "
                '{"role": "system" | "user" | "assistant", "content": "text"} with string values'
            )
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise DatasetError(f"{where}: the chat prompt in {key!r} has no user message with text; every prompt needs "
                           "one (the problem)")
    return tuple(out)


def _problem(row: dict, where: str, problem_key: str | None) -> tuple[str, tuple[Message, ...]]:
    pkeys = (problem_key,) if problem_key else PROBLEM_KEYS
    for key in pkeys:
        value = lookup(row, key)
        if hasattr(value, "tolist") and not isinstance(value, str):
            value = value.tolist()
        if isinstance(value, str) and value.strip():
            return value.strip(), ()
        if _is_chat(value):
            messages = parse_messages(value, where, key)
            return next(m["content"] for m in reversed(messages) if m["role"] == "user" and m["content"].strip()
                        ).strip(), messages
    raise DatasetError(
        f"{where}: no problem text (looked for {' or '.join(map(repr, pkeys))} among the keys {sorted(row)}: a "
        "string, or a list of chat messages); set data.problem_key to the key that holds the problem (a dotted "
        "path such as \"extra_info.question\" reaches into nested columns)"
    )


def _answer(row: dict, where: str, answer_key: str | None, solution_key: str | None) -> str:
    akeys = (answer_key,) if answer_key else ANSWER_KEYS
    found = (lookup(row, k) for k in akeys)
    answer = next((a for a in (normalize_answer(v) for v in found if v is not _MISSING) if a is not None), None)
    skey = solution_key or SOLUTION_KEY
    solution = lookup(row, skey)
    if answer is None and not answer_key and isinstance(solution, str):
        answer = last_boxed(solution)
    if answer is None:
        looked = " or ".join(map(repr, akeys))
        if not answer_key:
            looked += f", or a \\boxed{{}} in {skey!r}"
        raise DatasetError(
            f"{where}: no answer found (looked for {looked} among the keys {sorted(row)}); "
            "set data.answer_key to the key that holds the final answer (dotted paths reach into nested columns), "
            "or data.solution_key to a solution that ends in \\boxed{...}"
        )
    return answer


def _plain(value: Any, path: str) -> Any:
    """`value` as plain msgpack data (numpy -> lists, tuples -> lists); raises TypeError naming what is not."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return value
    if isinstance(value, int):
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise TypeError(f"{path} is an integer outside 64 bits")
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{path} is a dict with non-string keys")
        return {k: _plain(v, f"{path}.{k}") for k, v in value.items()}
    raise TypeError(f"{path} is a {type(value).__name__}")


def _extras(row: dict, where: str, extra_keys: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in extra_keys:
        value = lookup(row, key)
        if value is _MISSING:
            raise DatasetError(f"{where}: no {key!r} in the row (its keys: {sorted(row)}); fix the row, or remove "
                               f"{key!r} from data.extra_keys")
        try:
            out[extra_name(key)] = _plain(value, key)
        except TypeError as e:
            raise DatasetError(
                f"{where}: {e}, which cannot travel to the reward workers; data.extra_keys values must be None, "
                "booleans, numbers, strings, bytes, or lists and string-keyed dicts of them"
            ) from None
    return out


def row_to_example(row: Any, where: str, problem_key: str | None = None, answer_key: str | None = None,
                   solution_key: str | None = None, extra_keys: Sequence[str] = ()) -> Example:
    """The Example of one decoded row; `where` ("file.jsonl:17") names it in every error."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object per row, got {type(row).__name__}")
    problem, messages = _problem(row, where, problem_key)
    answer = _answer(row, where, answer_key, solution_key)
    return Example(problem=problem, answer=answer, source=where, messages=messages,
                   extras=_extras(row, where, extra_keys))
