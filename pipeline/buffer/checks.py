"""Checks on decoded messages, at the buffer's edge: values their types allow but that no client sends.

The decoder (pipeline/protocol.py) already refuses anything malformed; what is left here are values a Struct
admits that the buffer must not act on (the Scheduler would raise on them, or the learner would crash on them).

Invariant: a message for which `check_message` returns a reason never reaches a handler; a training result for
which `out_of_vocab` returns one is rejected (its round re-issued), never pooled.
"""

from __future__ import annotations

from typing import Any

from pipeline import protocol as P


def check_message(msg: Any) -> str:
    """Why a decoded message must not be acted on ("" if it may): values its types allow but no client sends,
    which the scheduler would reject with an exception (the loop must never see one from a client's input)."""
    if isinstance(msg, P.WorkRequest):
        if msg.max_rounds < 0 or msg.version < 0:
            return f"WorkRequest needs max_rounds >= 0 and version >= 0, got {msg.max_rounds} and {msg.version}"
    elif isinstance(msg, P.BatchRequest):
        if msg.num_groups < 1 or msg.learner_version < 0:
            return f"BatchRequest needs num_groups >= 1 and learner_version >= 0, got {msg.num_groups} and " \
                   f"{msg.learner_version}"
    elif isinstance(msg, P.VersionUpdate):
        if msg.version < 0:
            return f"VersionUpdate needs version >= 0, got {msg.version}"
    elif isinstance(msg, P.RoundResult):
        if msg.prompt_token_ids.size and int(msg.prompt_token_ids.min()) < 0:
            return "RoundResult.prompt_token_ids holds a negative token id"
        if msg.kind not in P.ROUND_KINDS:
            return f"RoundResult.kind must be one of {', '.join(P.ROUND_KINDS)}, got {msg.kind!r}"
    return ""


def out_of_vocab(msg: P.RoundResult, vocab_size: int) -> str:
    """Why `msg` holds a token id the model cannot embed ("" if it does not); the learner would crash on it."""
    ids = msg.prompt_token_ids
    if ids.size and int(ids.max()) >= vocab_size:
        return f"prompt token id {int(ids.max())} >= vocab_size {vocab_size}"
    for i, sample in enumerate(msg.samples):
        ids = sample.token_ids
        if ids.size and int(ids.max()) >= vocab_size:
            return f"sample {i} has token id {int(ids.max())} >= vocab_size {vocab_size}"
    return ""
