"""Rewards: the reward seam (`reward.fn = "package.module:function"`), the built-in rewards, and the worker pool
that calls them with a time limit per sample.

`base.py` says what a reward function is (`RewardFn`: `fn(completion, answer, **extras) -> float`) and loads one
from its "module:function"; `guard.py` limits one call's time and fences its errors; `worker.py` is a worker
process, `pool.py` the pool of them, `calls.py` one guarded call from any thread; `math.py` (math-verify, the
default), `match.py` (exact match) and `code.py` (unit tests in two sandboxes: `sandbox.py`, `code_box.py`) are the
built-in rewards. A new reward is a function in any importable module plus `reward.fn` naming it.
"""

from pipeline.rewards.base import DEFAULT_REWARD_FN, RewardFn, check_reward_config, load_reward_fn
from pipeline.rewards.calls import score_guarded
from pipeline.rewards.math import math_reward, verify
from pipeline.rewards.pool import RewardPool

__all__ = ["DEFAULT_REWARD_FN", "RewardFn", "RewardPool", "check_reward_config", "load_reward_fn", "math_reward",
           "score_guarded", "verify"]
