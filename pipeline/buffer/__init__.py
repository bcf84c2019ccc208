"""The rollout buffer: pure scheduling logic (this package's public API) and, around it, the ZeroMQ service.

Where things are: `logic.py` (downsampling, advantages), `exit_rules.py` (when a prompt stops sampling: a new
rule goes there), `allocation.py` (how many samples a round gets, which examples wait: a new policy goes there),
`state.py` (a prompt's pool, round ids), `pools.py` (active and waiting prompts, release), `scheduler.py` (rounds,
leases, versions), `sampler.py` (the scheduler in your own training loop), `evals.py` (held-out evaluation rounds),
`core.py` (every message, without sockets), `service.py` (the sockets), `snapshot.py` (--resume), `metrics.py` and
`progress.py` (what the buffer reports).
"""

from pipeline.buffer.exit_rules import EXIT_RULES, ExitRule, exit_reached, make_exit_rule
from pipeline.buffer.logic import (
    DOWNSAMPLE_POLICIES,
    MIN_STD,
    downsample,
    group_advantages,
    has_signal,
    is_positive,
    pool_advantages,
)
from pipeline.buffer.pools import Released, SubmitOutcome
from pipeline.buffer.sampler import AdaptiveSampler, Rollout
from pipeline.buffer.scheduler import Scheduler
from pipeline.buffer.state import InFlight, PoolSample, PromptState, RoundIds

__all__ = [
    "AdaptiveSampler",
    "DOWNSAMPLE_POLICIES",
    "EXIT_RULES",
    "MIN_STD",
    "ExitRule",
    "InFlight",
    "PoolSample",
    "PromptState",
    "Released",
    "Rollout",
    "RoundIds",
    "Scheduler",
    "SubmitOutcome",
    "downsample",
    "exit_reached",
    "group_advantages",
    "has_signal",
    "is_positive",
    "make_exit_rule",
    "pool_advantages",
]
