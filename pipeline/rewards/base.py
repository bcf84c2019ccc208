"""The reward seam: what a reward function is, and how `reward.fn = "package.module:function"` becomes one.

A reward function is `fn(completion: str, answer: str, **extras) -> float`: the completion's text, the prompt's
gold answer (a string, as the dataset gave it), and the prompt's data.extra_keys values as keyword arguments
(named by each key's last dotted part). It returns a number: higher is better, 1.0 / 0.0 for a verifier; any
value is allowed (continuous rewards too: sampling.positive_threshold splits positives from negatives for the
exit rule). A bool counts as a number; NaN, infinities and non-numbers are errors.

It runs in a reward worker process (`pool.py`) under the producer's time limit, so it need not guard itself: a
sample whose function raises, returns a non-number, runs past the limit or kills its process scores 0.0 and is
counted. It must be importable by its "module:function" in a fresh process (spawned workers import it again).
A function may carry `fn.warmup`, a callable that a worker runs once before its first sample (to import heavy
dependencies outside any time limit; the math reward does).

TRL's form is accepted as it is: a function with a `completions` parameter is a TRL `reward_funcs` function
(`f(prompts, completions, **columns) -> list[float | None]`, batched) and is called with one-element lists:
prompts=[None] (the reward runs where the prompt text is not kept), completions=[completion], answer=[answer] and
each extra as a one-element list; a None score is 0.0. So a TRL user brings their reward over unchanged, and a
bench gives both trainers the very same function.

A new reward is a function in a module plus `reward.fn` naming it. Built in: `math.py` (math-verify, the default),
`match.py` (exact match on a normalised string), `code.py` (unit tests run in sandboxes).

Invariant: `load_reward_fn` returns a callable that accepts (completion, answer, **extras) for the given extra
names, or raises ConfigError naming reward.fn and the fix; it never returns something that fails at call time
for a reason visible at start.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import Any, Protocol

from pipeline.config import Config, ConfigError
from pipeline.data import extra_name

DEFAULT_REWARD_FN = "pipeline.rewards.math:verify"


class RewardFn(Protocol):
    """`fn(completion, answer, **extras) -> float`; see the module docstring."""

    def __call__(self, completion: str, answer: str, /, **extras: Any) -> float: ...


def describe(fn: Any) -> str:
    """"module:function" of a reward function (for messages)."""
    if isinstance(fn, str):
        return fn
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def check_signature(fn: Any, extra_names: Sequence[str] = (), spec: str = "") -> None:
    """Raise ConfigError unless `fn` can be called as fn(completion, answer, **{name: ... for extra_names})."""
    spec = spec or describe(fn)
    if not callable(fn):
        raise ConfigError(f"reward.fn: {spec} is a {type(fn).__name__}, not a function; name a function "
                          "`def f(completion: str, answer: str, **extras) -> float`")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: they can only be checked by a call
        return
    try:
        sig.bind("completion", "answer", **{name: None for name in extra_names})
    except TypeError as e:
        call = ", ".join(["completion", "answer", *(f"{n}=..." for n in extra_names)])
        raise ConfigError(
            f"reward.fn: {spec} cannot be called as {spec.rpartition(':')[2]}({call}): {e}; define it as "
            "`def f(completion: str, answer: str, **extras) -> float` (data.extra_keys names the extras)"
        ) from None


def is_trl_form(fn: Any) -> bool:
    """Whether `fn` is a TRL reward function (batched: it takes `completions`) rather than a per-sample one."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "completions" in params and "completion" not in params


class TrlReward:
    """A TRL `reward_funcs` function called per sample: fn(prompts=[None], completions=[c], answer=[a],
    **{k: [v]})[0], None -> 0.0. Picklable by its spec, so spawned reward workers import it again."""

    def __init__(self, fn: Any, spec: str) -> None:
        self.fn, self.spec = fn, spec
        self.__name__ = getattr(fn, "__name__", "trl_reward")
        self.__module__ = getattr(fn, "__module__", __name__)

    def __call__(self, completion: str, answer: str, /, **extras: Any) -> float:
        scores = self.fn(prompts=[None], completions=[completion], answer=[answer],
                         **{k: [v] for k, v in extras.items()})
        if not isinstance(scores, (list, tuple)) or len(scores) != 1:
            raise TypeError(f"{self.spec} returned {type(scores).__name__} for one completion; a TRL reward "
                            "function returns a list with one score per completion")
        return 0.0 if scores[0] is None else scores[0]

    def __reduce__(self):
        return load_reward_fn, (self.spec,)


def check_trl_signature(fn: Any, extra_names: Sequence[str], spec: str) -> None:
    try:
        inspect.signature(fn).bind(prompts=[None], completions=["c"], answer=["a"], **{n: [None] for n in extra_names})
    except TypeError as e:
        call = ", ".join(f"{n}=..." for n in ["prompts", "completions", "answer", *extra_names])
        raise ConfigError(f"reward.fn: {spec} looks like a TRL reward function (it takes `completions`) but cannot be "
                          f"called as f({call}): {e}; give it **kwargs") from None


def load_reward_fn(spec: str, extra_names: Sequence[str] = ()) -> RewardFn:
    """Import "package.module:function" and check that it takes (completion, answer, **extras), or wrap a TRL
    reward function (see the module docstring)."""
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise ConfigError(f"reward.fn: {spec!r} must be \"package.module:function\", e.g. \"{DEFAULT_REWARD_FN}\"")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 -- an import runs arbitrary code; whatever it raises, name the cause
        raise ConfigError(
            f"reward.fn: cannot import {module_name!r} ({type(e).__name__}: {e}); the module must be importable by "
            "every producer (an installed package, or a directory on PYTHONPATH)"
        ) from None
    fn = module
    for part in attr.split("."):  # "module:Class.method" reaches a static method
        fn = getattr(fn, part, None)
        if fn is None:
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ConfigError(f"reward.fn: module {module_name!r} has no {attr!r}; its functions: "
                              f"{', '.join(names) or 'none'}")
    if is_trl_form(fn):
        check_trl_signature(fn, extra_names, spec)
        return TrlReward(fn, spec)
    check_signature(fn, extra_names, spec)
    return fn


def check_reward_config(cfg: Config) -> RewardFn:
    """reward.fn of `cfg`, imported and checked against data.extra_keys: call it at start so that a bad reward is
    a ConfigError before any process starts."""
    return load_reward_fn(cfg.reward.fn, [extra_name(k) for k in cfg.data.extra_keys])
