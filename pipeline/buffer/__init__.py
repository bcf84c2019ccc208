"""The rollout buffer: pure scheduling logic (this package's public API) and, around it, the ZeroMQ service."""

from pipeline.buffer.logic import (
    DOWNSAMPLE_POLICIES,
    EXIT_RULES,
    MIN_STD,
    downsample,
    exit_reached,
    group_advantages,
    has_signal,
    is_positive,
    pool_advantages,
)
from pipeline.buffer.scheduler import Released, Scheduler, SubmitOutcome
from pipeline.buffer.state import InFlight, PoolSample, PromptState

__all__ = [
    "DOWNSAMPLE_POLICIES",
    "EXIT_RULES",
    "MIN_STD",
    "InFlight",
    "PoolSample",
    "PromptState",
    "Released",
    "Scheduler",
    "SubmitOutcome",
    "downsample",
    "exit_reached",
    "group_advantages",
    "has_signal",
    "is_positive",
    "pool_advantages",
]
