"""Offline sampling with vLLM's `LLM` for evaluation and prompt selection: k samples per prompt, scored by
reward.fn in a reward pool (the same one the producers use)."""

from __future__ import annotations

from typing import Any

from pipeline.config import Config
from pipeline.rewards import DEFAULT_REWARD_FN, RewardPool


def make_llm(cfg: Config, model_dir: str) -> Any:
    """A vLLM `LLM` built with the same engine arguments as a producer's engine."""
    from vllm import LLM
    from vllm.platforms import current_platform

    from pipeline.producer.engine import configure_cpu_env, engine_kwargs

    cpu = current_platform.is_cpu()
    if cpu:
        configure_cpu_env(cfg.producers.engine)
    kwargs = engine_kwargs(model_dir, cfg.model.dtype, cfg.producers.engine, cfg.run.seed, cpu)
    kwargs.pop("worker_extension_cls", None)  # no weight reloads offline
    return LLM(**kwargs)


def shutdown_llm(llm: Any) -> None:
    """Stop an `LLM`'s engine core process now (before another engine starts in this process, say)."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None:
        core.shutdown()


def sample_and_score(llm: Any, prompts: list[str], answers: list[str], k: int, temperature: float, top_p: float,
                     max_new_tokens: int, seed: int, reward_workers: int, reward_timeout_s: float, *,
                     reward_fn: str = DEFAULT_REWARD_FN, extras: list[dict] | None = None,
                     completions: list[list[str]] | None = None) -> list[list[float]]:
    """For each prompt, the rewards of its `k` samples at `temperature`: `reward_fn` (reward.fn; default
    math-verify) against its answer, with the prompt's `extras` (data.extra_keys) as keyword arguments.
    `completions`, when given, receives each prompt's k completion texts (in the order of the rewards)."""
    from vllm import SamplingParams

    params = SamplingParams(n=k, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    per_prompt = extras if extras is not None else [{}] * len(prompts)
    texts, golds, kwargs = [], [], []
    for out, answer, extra in zip(outputs, answers, per_prompt):
        for comp in out.outputs:
            texts.append(comp.text)
            golds.append(answer)
            kwargs.append(extra)
    names = sorted({name for extra in per_prompt for name in extra})
    with RewardPool(reward_workers, reward_timeout_s, reward_fn, extra_names=names) as pool:
        flat = pool.score(texts, golds, kwargs)
    if completions is not None:
        completions += [texts[i * k:(i + 1) * k] for i in range(len(prompts))]
    return [flat[i * k:(i + 1) * k] for i in range(len(prompts))]
