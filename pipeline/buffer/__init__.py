"""The rollout buffer: pure scheduling logic (this package's public API) and, around it, the ZeroMQ service.

Where things are (every module; tests/test_layout.py holds this list complete):
- the algorithm, pure: `policy/` (the sampler's policy: exit rules, allocation, the posterior behind it,
  advantages and downsampling; its own map is in policy/__init__.py: a new rule or policy goes there);
- the scheduler and its state: `scheduler.py` (rounds, versions, what the learner gets), `admission.py` (which
  example comes next, what is remembered across visits), `pools.py` (active and waiting prompts, release),
  `state.py` (a prompt's pool, round ids), `leases.py` (the one book of rounds out at producers, training and
  evaluation, and their liveness), `intake.py` (results on their way in), `counters.py` (the scheduler's
  counters), `ledger.py` (every generated token by fate), `state_codec.py` and `snapshot.py` (--resume);
- held-out evaluation: `evals.py`;
- the service: `core.py` (every message, without sockets), `checks.py` (every value from the network, checked
  once), `peers.py` (producer connections), `incidents.py` (bad input, counted and logged), `service.py` (the
  sockets), `main.py` (`reinforce-ada buffer`);
- what it reports: `metrics.py`, `progress.py`;
- outside the trainer: `sampler.py` (the scheduler in your own training loop).
"""

from pipeline.buffer.policy import (
    DOWNSAMPLE_ORDERS,
    EXIT_RULES,
    MIN_STD,
    ExitRule,
    downsample,
    exit_reached,
    group_advantages,
    has_signal,
    is_positive,
    make_exit_rule,
    pool_advantages,
)
from pipeline.buffer.pools import Released, SubmitOutcome
from pipeline.buffer.sampler import AdaptiveSampler, Rollout
from pipeline.buffer.scheduler import Scheduler
from pipeline.buffer.state import InFlight, PoolSample, PromptState, RoundIds

__all__ = [
    "AdaptiveSampler",
    "DOWNSAMPLE_ORDERS",
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
