"""The Scheduler's whole state as msgpack bytes, and back (`Scheduler.snapshot` / `Scheduler.restore`).

Numpy arrays travel as [dtype, shape, bytes] (`state.enc_hook`), never pickled. Fields are only appended, with
defaults, so a snapshot written before a field existed still restores (FORMAT changes only when that is not
possible).

Invariant: `decode(encode(state), ...)` equals `state` for a scheduler over the same prompts and sampling.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.buffer.pools import Released
from pipeline.buffer.state import History, PromptState, dec_hook, enc_hook
from pipeline.config import SamplingConfig

FORMAT = 1


class State(msgspec.Struct):
    format: int
    num_prompts: int
    group_size: int
    exit_rule: str
    rng_state: list[Any]
    cursor: int
    next_prompt_id: int
    next_round_id: int
    learner_version: int
    groups_consumed: int
    active: list[PromptState]
    waiting: list[Released]
    counts: dict[str, int]
    ignored: dict[str, int]
    rounds_to_exit: dict[int, int]
    history: dict[int, History] = {}  # per training example, across epochs (allocation policies read it)
    observed: tuple[float, float] = (0.0, 0.0)  # positives and samples seen (the population prior)
    exit_rule_params: dict[str, Any] = {}  # the rule's settings (sampling.exit_rule_params)


def encode(state: State) -> bytes:
    return msgspec.msgpack.encode(state, enc_hook=enc_hook)


def decode(data: bytes, sampling: SamplingConfig, num_prompts: int) -> State:
    """The State in `data`, checked against the run resuming it. Raises ValueError naming what to change."""
    try:
        snap = msgspec.msgpack.decode(data, type=State, dec_hook=dec_hook)
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"not a buffer snapshot (or a corrupt one): {exc}") from None
    if snap.format != FORMAT:
        raise ValueError(f"snapshot format {snap.format} is not {FORMAT}; start a fresh buffer")
    if snap.num_prompts != num_prompts:
        raise ValueError(f"the snapshot was taken over {snap.num_prompts} prompts but {num_prompts} were given; "
                         "resume with the same data config and seed")
    if ((snap.group_size, snap.exit_rule, snap.exit_rule_params)
            != (sampling.group_size, sampling.exit_rule, dict(sampling.exit_rule_params))):
        raise ValueError(f"the snapshot used group_size={snap.group_size}, exit_rule={snap.exit_rule!r}, "
                         f"exit_rule_params={snap.exit_rule_params}; resume with the same sampling.group_size, "
                         "sampling.exit_rule and sampling.exit_rule_params")
    return snap
