"""Checks at the buffer's edge, in one place: every value that arrives over the network is checked here, once,
before anything acts on it. Past these checks the Scheduler and Evals trust their inputs.

The decoder (pipeline/protocol.py) already refuses anything malformed (types, array shapes and dtypes, NaN
rewards, negative token ids). What is left here:
- `role_problem`: learner-only messages (every kind not in PRODUCER_MESSAGES: a new kind is learner-only until
  listed) from a connection without the learner role;
- `check_message`: values a Struct admits that no client sends (negative counts or versions, an unknown kind or
  role, an oversized heartbeat);
- `check_result`: a result against the lease of its round (peers.py): prompt id, sample count, prompt tokens,
  completion lengths, rewards, behaviour log-probs, versions, finish reasons; `out_of_vocab` for token ids;
- `weights_problem`: a weight announcement that is not this run's (its weights directory, or its learner's
  rendezvous), or not of its version.

Invariants: a message for which `role_problem` or `check_message` returns a reason never reaches a handler; a
result for which `check_result` or `out_of_vocab` returns one is never pooled or scored (its round is re-issued).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline import protocol as P
from pipeline.auth import LEARNER, ROLES
from pipeline.buffer.leases import Lease
from pipeline.config import Config
from pipeline.weights.uris import dist_uri_problem, file_uri_problem

PRODUCER_MESSAGES = (P.WorkRequest, P.RoundResult, P.Heartbeat, P.MetricsRequest, P.SampleResults)  # every role
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FINISH_REASON_STRINGS
LOGPROB_EPS = 1e-3  # a log-prob is <= 0; float error may leave a hair above it, never more
MAX_VERSION = 1 << 40  # any version beyond this is garbage (and would overflow arithmetic downstream)
MAX_COUNT = 1 << 40  # aborted samples or tokens a streamed part may report (accounting only; beyond: garbage)
MAX_STAT_KEYS = 64  # heartbeat stats: keys at most (a producer sends about 20)
MAX_STAT_KEY_CHARS = 64
REJECT_REASONS = ("prompt_id", "samples", "prompt", "length", "reward", "logprob", "version", "finish_reason")


@dataclass(frozen=True, slots=True)
class Limits:
    """The run's bounds on a result's values (from the config)."""

    max_abs_reward: float
    max_model_len: int  # prompt + completion tokens at most
    version_slack: int  # a sample may be this many versions ahead of the buffer's learner version (0 in a run)


def role_problem(msg: Any, role: str) -> str:
    """Why the connection's `role` may not send `msg` ("" if it may)."""
    if role == LEARNER:
        return ""
    if not isinstance(msg, PRODUCER_MESSAGES):
        return f"{type(msg).__name__} is served only to the learner, and this connection holds the {role} role"
    if isinstance(msg, P.Heartbeat) and msg.role == LEARNER:
        return f"a learner's Heartbeat from a connection that holds the {role} role"
    return ""


def check_message(msg: Any) -> str:
    """Why a decoded message must not be acted on ("" if it may): values its types allow but no client sends,
    which the scheduler would reject with an exception (the loop must never see one from a client's input)."""
    if isinstance(msg, P.WorkRequest):
        if msg.max_rounds < 0 or msg.max_samples < 0 or not 0 <= msg.version <= MAX_VERSION:
            return f"WorkRequest needs max_rounds, max_samples and version >= 0, got {msg.max_rounds}, " \
                   f"{msg.max_samples} and {msg.version}"
    elif isinstance(msg, P.BatchRequest):
        if msg.num_groups < 1 or not 0 <= msg.learner_version <= MAX_VERSION:
            return f"BatchRequest needs num_groups >= 1 and learner_version >= 0, got {msg.num_groups} and " \
                   f"{msg.learner_version}"
    elif isinstance(msg, P.VersionUpdate):
        if not 0 <= msg.version <= MAX_VERSION:
            return f"VersionUpdate needs version >= 0, got {msg.version}"
    elif isinstance(msg, P.RoundResult):
        if msg.prompt_token_ids.size and int(msg.prompt_token_ids.min()) < 0:
            return "RoundResult.prompt_token_ids holds a negative token id"
        if msg.kind not in P.ROUND_KINDS:
            return f"RoundResult.kind must be one of {', '.join(P.ROUND_KINDS)}, got {msg.kind!r}"
    elif isinstance(msg, P.Heartbeat):
        return _heartbeat_problem(msg)
    elif isinstance(msg, P.SampleResults):
        return _samples_problem(msg)
    return ""


def _samples_problem(msg: P.SampleResults) -> str:
    """A streamed part's own values (those against its round's lease are checked like a result's)."""
    for part in msg.rounds:
        if part.prompt_token_ids.size and int(part.prompt_token_ids.min()) < 0:
            return f"SampleResults round {part.round_id}: prompt_token_ids holds a negative token id"
        if not (0 <= part.num_aborted <= MAX_COUNT and 0 <= part.aborted_tokens <= MAX_COUNT):
            return f"SampleResults round {part.round_id}: aborted samples and tokens must be in 0..{MAX_COUNT}, got " \
                   f"{part.num_aborted} and {part.aborted_tokens}"
        if any(i < 0 for i in part.indices) or len(set(part.indices)) != len(part.indices):
            return f"SampleResults round {part.round_id}: sample indices must be distinct and >= 0"
    return ""


def _heartbeat_problem(msg: P.Heartbeat) -> str:
    if msg.role not in ROLES or not 0 <= msg.version <= MAX_VERSION:
        return f"Heartbeat needs a role in {ROLES} and version >= 0, got {msg.role!r} and {msg.version}"
    if len(msg.stats) > MAX_STAT_KEYS:
        return f"Heartbeat carries {len(msg.stats)} stats, more than {MAX_STAT_KEYS}"
    for key, value in msg.stats.items():
        if len(key) > MAX_STAT_KEY_CHARS or not math.isfinite(value):
            return f"Heartbeat stat {key[:MAX_STAT_KEY_CHARS]!r} is too long a name or not finite ({value})"
    return ""


def check_result(msg: P.RoundResult, lease: Lease, limits: Limits, learner_version: int,
                 known_prompt: np.ndarray | None) -> tuple[str, str]:
    """(reason, explanation) when the result of `lease`'s round must not be used, else ("", "").

    `known_prompt` is the prompt's token ids: the buffer's tokenization, or without a tokenizer those of its
    earlier accepted rounds (None or empty: none yet). A result
    without samples is the producer saying it cannot serve the prompt: it has no values to check.
    """
    if msg.prompt_id != lease.prompt_id:
        return "prompt_id", f"round {msg.round_id} is of prompt {lease.prompt_id}, the result says {msg.prompt_id}"
    samples = msg.samples
    if len(samples) > lease.num_samples:
        return "samples", f"{len(samples)} samples for a round of {lease.num_samples}"
    if not samples:
        return "", ""
    prompt = msg.prompt_token_ids
    if not 1 <= prompt.size < limits.max_model_len:
        return "prompt", f"{prompt.size} prompt tokens, outside 1..{limits.max_model_len - 1} (max_model_len)"
    if known_prompt is not None and known_prompt.size and not np.array_equal(prompt, known_prompt):
        return "prompt", "the prompt tokens differ from the prompt's own (the buffer's tokenization of the prompt " \
                         "it assigned, or without a tokenizer its first accepted round's)"
    lengths = [s.token_ids.size for s in samples]
    longest = min(lease.max_new_tokens, limits.max_model_len - prompt.size)
    if min(lengths) < 1 or max(lengths) > longest:
        return "length", f"completion lengths {min(lengths)}..{max(lengths)} outside 1..{longest}"
    if max(abs(s.reward) for s in samples) > limits.max_abs_reward:
        return "reward", f"a reward beyond +-{limits.max_abs_reward:g} (buffer.max_abs_reward)"
    logprobs = np.concatenate([s.logprobs for s in samples])  # two reductions over every sample's log-probs
    top, low = float(logprobs.max()), float(logprobs.min())
    if not (top <= LOGPROB_EPS and math.isfinite(low)):  # a NaN makes both NaN, and NaN fails every comparison
        return "logprob", f"behaviour log-probs must be finite and <= {LOGPROB_EPS:g} (they span {low}..{top})"
    newest = max(s.version for s in samples)
    if newest > learner_version + limits.version_slack:
        return "version", f"sample version {newest} is ahead of the learner's {learner_version}"
    for s in samples:
        if s.finish_reason not in FINISH_REASONS:
            return "finish_reason", f"finish reason {s.finish_reason[:40]!r} is not one of {FINISH_REASONS}"
    return "", ""


def out_of_vocab(msg: P.RoundResult, vocab_size: int) -> str:
    """Why `msg` holds a token id the model cannot embed ("" if it does not); the learner would crash on it."""
    ids = msg.prompt_token_ids
    if ids.size and int(ids.max()) >= vocab_size:
        return f"prompt token id {int(ids.max())} >= vocab_size {vocab_size}"
    every = np.concatenate([s.token_ids for s in msg.samples]) if msg.samples else ids[:0]
    if not every.size or int(every.max()) < vocab_size:  # one reduction on the hot path; the culprit only if any
        return ""
    i = next(i for i, s in enumerate(msg.samples) if s.token_ids.size and int(s.token_ids.max()) >= vocab_size)
    return f"sample {i} has token id {int(msg.samples[i].token_ids.max())} >= vocab_size {vocab_size}"


def weights_problem(ann: P.WeightAnnouncement, version: int, cfg: Config) -> str:
    """Why the buffer must not pass on `ann`, announced with VersionUpdate(`version`), to the producers ("" if it
    may): weights of another version (at most the learner's new version, which is the buffer's + 1 in a run's
    sequence of steps), or a uri that is not this run's (file: directly in its weights directory; dist: its
    learner's rendezvous host and port), the checks the producers apply too (pipeline/weights/uris.py)."""
    if ann.version != version:
        return f"weights of version {ann.version} announced with version {version}"
    w = cfg.weights
    if w.transport == "dist":
        return dist_uri_problem(ann.uri, w.dist_host, w.dist_port, version)
    return file_uri_problem(ann.uri, cfg.weights_dir, version)
