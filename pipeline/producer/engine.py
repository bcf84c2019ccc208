"""One vLLM engine (v1 `AsyncLLM`) that generates rounds, aborts them, and loads new weights in place.

A round of `num_samples` completions of one prompt runs as `num_samples` single-sample requests (ids
`r{round_id}.{i}`, sample seed = round seed + i, the same as vLLM's own n > 1 fan-out). Single-sample requests
let the engine wrapper see each sample finish: `free_samples` counts sequences really running, not rounds held
up by one long sample, and `generate_round(on_sample=...)` hands each sample over the moment it finishes (the
buffer may then end the round early). Rounds are independent: a long completion never holds back another round.
An aborted round raises RoundAborted with how many of its samples it cut and the tokens they had generated.

Version semantics: a request records the weight version the engine held when it was submitted, and every
sample of a round carries it. A sample whose tokens span a weight update thus carries the OLDEST version that
produced any of its tokens (conservative for the staleness bound). After a load, `version` is the new one and
every request submitted later carries it. A load runs between two engine steps (vLLM serves collective RPCs
there); afterwards the prefix cache is reset and running sequences are preempted and recomputed, so no KV
computed by the old weights is ever reused (neither by new prompts nor by the rest of running samples).

Log-probs: `logprobs_mode="processed_logprobs"` makes the returned log-prob of each sampled token
log_softmax(logits / T) (renormalised over the nucleus when top_p < 1), what the learner computes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pipeline.config import EngineConfig, SamplingConfig
from pipeline.cores import pin_cores
from pipeline.models import model_max_len
from pipeline.protocol import RoundAssignment

log = logging.getLogger(__name__)

WORKER_EXTENSION = "pipeline.producer.worker_ext.WeightReloadExtension"
# vLLM's in-process executor, named by its qualified name (vLLM resolves it) so that building the arguments imports
# nothing. vLLM's CPU platform turns the name "uni" into "mp" (a worker process beside the engine core process).
UNIPROC_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
CPU_BATCHED_TOKENS = 4096  # tokens per engine step on the CPU backend (vLLM's own CPU default)


class RoundAborted(Exception):
    """generate_round's signal that the round was aborted: its samples must not be sent anywhere. It carries
    the samples the abort cut (unfinished, or never started) and the tokens they had generated (waste)."""

    def __init__(self, message: str, num_aborted: int = 0, aborted_tokens: int = 0) -> None:
        super().__init__(message)
        self.num_aborted, self.aborted_tokens = num_aborted, aborted_tokens


@dataclass
class Completion:
    """One finished sample: its tokens, the sampled tokens' log-probs, decoded text and weight version."""

    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    version: int


class RoundOutput(NamedTuple):
    prompt_token_ids: np.ndarray  # int32 [P]
    completions: list[Completion]


@dataclass
class _Round:
    request_ids: list[str]
    num_live: int
    aborted: bool = False
    done_ids: set[str] = field(default_factory=set)
    num_cut: int = 0  # samples the abort stopped (or kept from starting)
    cut_tokens: int = 0  # tokens those had generated


SampleCallback = Callable[[int, "Completion", np.ndarray], None]  # (index in round, sample, prompt token ids)


def round_seed(run_seed: int, round_id: int, seed_key: int = -1) -> int:
    """A reproducible 31-bit seed for one round (sample i uses seed + i), well mixed across round ids.

    `seed_key` >= 0 (an evaluation round's problem) replaces the round id, in a space of its own: every evaluation
    then samples a problem with the same seeds, whatever round ids it got (common random numbers)."""
    key = f"{run_seed}:{round_id}" if seed_key < 0 else f"{run_seed}:key:{seed_key}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 4096)


def engine_kwargs(model_path: str, model_dtype: str, engine_cfg: EngineConfig, seed: int,
                  cpu: bool = False) -> dict[str, Any]:
    """The `AsyncEngineArgs` keyword arguments for one producer engine (`engine_cfg.extra` wins).

    `cpu`: the engine runs on vLLM's CPU backend. Every sample carries its own seed (reproducible sampling); the
    CPU backend cannot rewind a request's generator after a partial prefill (chunked prefill of a long prompt:
    "CPU Generator does not use offset", and the engine dies), so there chunked prefill is off and one step's
    token budget holds any whole prompt. A one-rank CPU engine runs its model inside the engine core process
    (vLLM's in-process executor, its default for one GPU): vLLM's CPU default adds a worker process, which costs
    a second import of vLLM at every start (~10 s of CPU) and reserves one core for the engine core's loop.
    """
    max_len = engine_cfg.max_model_len
    model_max = model_max_len(model_path)
    if model_max is not None and max_len > model_max:
        # vLLM refuses a max_model_len above the model's; the default 4096 exceeds the tiny model's 128
        log.warning("producers.engine.max_model_len %d > the model's %d: using %d", max_len, model_max,
                    model_max)
        max_len = model_max
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=model_dtype if engine_cfg.dtype == "auto" else engine_cfg.dtype,
        max_model_len=max_len,
        gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
        tensor_parallel_size=engine_cfg.tensor_parallel_size,
        enforce_eager=engine_cfg.enforce_eager,
        seed=seed,
        max_num_seqs=engine_cfg.max_num_seqs,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
    )
    if cpu:
        kwargs.update(enable_chunked_prefill=False,
                      max_num_batched_tokens=max(max_len, engine_cfg.max_num_seqs, CPU_BATCHED_TOKENS))
        if runs_in_process(engine_cfg):
            kwargs.update(distributed_executor_backend=UNIPROC_EXECUTOR)
    kwargs.update(engine_cfg.extra)
    if cpu and kwargs.get("enable_chunked_prefill"):
        raise ValueError("producers.engine.extra: enable_chunked_prefill = true crashes vLLM's CPU backend with "
                         "per-sample seeds (\"CPU Generator does not use offset\"); remove it from the config")
    return kwargs


def runs_in_process(engine_cfg: EngineConfig) -> bool:
    """A CPU engine runs its model in the engine core process (engine_kwargs), unless it has several ranks or
    `producers.engine.extra` names an executor of its own."""
    return engine_cfg.tensor_parallel_size == 1 and "distributed_executor_backend" not in engine_cfg.extra


CPU_SHUTDOWN_S = 1.0  # how long a CPU engine core may take to exit before it is killed (Engine.shutdown)


def configure_cpu_env(engine_cfg: EngineConfig) -> None:
    """Environment the CPU backend reads when the engine process starts (set before it is spawned)."""
    # vLLM reads a whole number of GiB; round up so a fractional setting never yields 0 (= auto-size).
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(engine_cfg.cpu_kv_cache_gb)))
    if pin_cores(engine_cfg.cpu_cores, "producers.engine.cpu_cores"):
        # the engine core process inherits this process's pin; vLLM's own binding would override it
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if engine_cfg.cpu_threads > 0:
        # no core pinning: several producers on one machine would otherwise pin the same cores
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(engine_cfg.cpu_threads)
    elif runs_in_process(engine_cfg):
        # the in-process executor (engine_kwargs) runs torch with 1 thread unless told: give it the threads vLLM's
        # worker process would have had (every core this process may use but one, left to the engine core's loop)
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) - 1)))


class Engine:
    """A vLLM AsyncLLM driven by rounds. Use from one asyncio loop; create it with `await Engine.start(...)`."""

    def __init__(self, llm: Any, engine_cfg: EngineConfig, sampling_cfg: SamplingConfig, seed: int) -> None:
        self.llm = llm
        self.engine_cfg = engine_cfg
        self.sampling_cfg = sampling_cfg
        self.seed = seed
        self.version = 0  # weight version the engine holds now
        self.last_load_seconds = 0.0
        self._rounds: dict[int, _Round] = {}
        self.weights_incomplete = False  # a dist transfer broke midway: paused until a full load
        self.on_sample_done: Callable[[], None] | None = None  # called when a sequence slot frees up

    @classmethod
    async def start(cls, model_path: str | os.PathLike, model_dtype: str, engine_cfg: EngineConfig,
                    sampling_cfg: SamplingConfig, seed: int) -> Engine:
        """Start an engine on `model_path` (a Hugging Face model directory). Takes ~20 s on a CPU."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json; pass a Hugging Face model directory "
                             "(model.path, or --model DIR)")
        if current_platform.is_cpu():
            configure_cpu_env(engine_cfg)
        args = AsyncEngineArgs(**engine_kwargs(str(path), model_dtype, engine_cfg, seed, current_platform.is_cpu()))
        llm = AsyncLLM.from_engine_args(args)
        await llm.get_supported_tasks()  # cached from now on: `generate` then never suspends before registering
        engine = cls(llm, engine_cfg, sampling_cfg, seed)
        # vLLM's import machinery keeps this frame alive; a local `llm` would outlive shutdown() and make
        # AsyncLLM.__del__ run at interpreter exit, where it fails noisily
        del llm
        return engine

    # ---- capacity ----

    @property
    def running_rounds(self) -> int:
        return len(self._rounds)

    @property
    def live_samples(self) -> int:
        """Sequences submitted and not finished (running or waiting in the engine)."""
        return sum(r.num_live for r in self._rounds.values())

    def free_samples(self) -> int:
        """Samples to ask for now: enough to fill max_num_seqs plus a queue (rounds vary in size).

        Counted in live sequences, not rounds (a round whose last sample still runs holds one slot, not M).
        The queue (max(M, max_num_seqs / 4) sequences) waits inside vLLM and takes slots the moment samples
        finish, as vLLM's offline batching does with all its requests queued, instead of leaving slots idle for
        the round trip to the buffer. It is kept short: a queued request carries the version it was queued
        under even if it starts after a weight update.
        """
        m, max_seqs = self.sampling_cfg.round_size, self.engine_cfg.max_num_seqs
        return max(0, max_seqs + max(m, max_seqs // 4) - self.live_samples)

    # ---- generation ----

    def _sampling_params(self, seed: int, max_new_tokens: int = 0) -> Any:
        """One sample's parameters; `max_new_tokens` > 0 overrides sampling.max_new_tokens (eval rounds)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling_cfg
        return SamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=max_new_tokens or s.max_new_tokens, seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,  # a few flat lists instead of one dict per token (less GC)
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per sample, when it finishes
        )

    async def generate_round(self, assignment: RoundAssignment, on_sample: SampleCallback | None = None
                             ) -> RoundOutput:
        """Generate `assignment.num_samples` completions of its prompt. Raises RoundAborted if aborted.

        The round completes when its last sample finishes; `on_sample(index, completion, prompt_token_ids)` is
        called as each one finishes (never for a sample the abort cut). Raises ValueError for a round id already
        running and for a prompt vLLM rejects (e.g. longer than max_model_len).
        """
        from vllm.exceptions import VLLMClientError

        rid = assignment.round_id
        if rid in self._rounds:
            raise ValueError(f"round {rid} is already running on this engine")
        if assignment.num_samples < 1:
            raise ValueError(f"round {rid}: num_samples must be >= 1, got {assignment.num_samples}")
        base_seed = round_seed(self.seed, rid, assignment.seed_key)
        request_ids = [f"r{rid}.{i}" for i in range(assignment.num_samples)]
        state = _Round(request_ids, assignment.num_samples)
        self._rounds[rid] = state
        version = self.version  # recorded at submission: see the module docstring
        try:
            engine_input = self._render(assignment.prompt)
            params = [self._sampling_params(base_seed + i, assignment.max_new_tokens) for i in range(len(request_ids))]
            outs = await asyncio.gather(*(
                self._one(engine_input, req_id, p, state, i, version, on_sample)
                for i, (req_id, p) in enumerate(zip(request_ids, params))))
        except BaseException as exc:
            # a failed (or cancelled) sample: stop its siblings too, then re-raise
            await self._abort_ids([r for r in request_ids if r not in state.done_ids])
            if isinstance(exc, VLLMClientError):
                raise ValueError(f"round {rid} (prompt {assignment.prompt_id}): vLLM rejected it: {exc}") from exc
            raise
        finally:
            del self._rounds[rid]
        if state.aborted:
            if on_sample is None:  # its finished samples are never sent either: waste too
                done = [o for o in outs if o is not None]
                state.num_cut += len(done)
                state.cut_tokens += sum(len(o.outputs[0].token_ids) for o in done)
            raise RoundAborted(f"round {rid} was aborted", state.num_cut, state.cut_tokens)
        prompt_ids = np.asarray(outs[0].prompt_token_ids, dtype=np.int32)
        return RoundOutput(prompt_ids, [_completion(o.outputs[0], version) for o in outs])

    def _render(self, prompt: str) -> dict:
        """Tokenize once per round, on the loop (a prompt takes well under a millisecond; a thread hop would
        cost more). A rendered input also makes `generate` register its request before its first suspension,
        so an abort can never slip between submission and registration."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        parsed = parse_model_prompt(self.llm.model_config, {"prompt": prompt})
        (engine_input,) = self.llm.renderer.render_cmpl([parsed])
        return engine_input

    async def _one(self, engine_input: dict, request_id: str, params: Any, state: _Round, index: int,
                   version: int, on_sample: SampleCallback | None) -> Any:
        final = None
        try:
            if not state.aborted:  # else: aborted before this sample was submitted
                async for out in self.llm.generate(dict(engine_input), params, request_id):
                    final = out
        finally:
            state.num_live -= 1
            state.done_ids.add(request_id)
            if self.on_sample_done is not None:
                self.on_sample_done()
        if state.aborted:
            state.num_cut += 1
            state.cut_tokens += len(final.outputs[0].token_ids) if final is not None else 0
            return None
        assert final.finished, f"request {request_id} ended without a final output"
        if on_sample is not None:
            on_sample(index, _completion(final.outputs[0], version), np.asarray(final.prompt_token_ids, np.int32))
        return final

    async def abort(self, round_id: int) -> bool:
        """Abort a running round; its generate_round raises RoundAborted. False if it is not running here."""
        state = self._rounds.get(round_id)
        if state is None:
            return False
        state.aborted = True
        await self._abort_ids([r for r in state.request_ids if r not in state.done_ids])
        return True

    async def _abort_ids(self, request_ids: list[str]) -> None:
        if request_ids:
            await self.llm.abort(request_ids)

    # ---- weights ----

    async def load_weights(self, path: str | os.PathLike, version: int) -> float:
        """Load the safetensors file `path` in place as weight `version`; returns the seconds it took.

        The caller runs loads one at a time (the producer's worker holds its load lock around the version check
        and the load). Requests submitted while a load runs carry the old version (they may produce tokens with
        either weights: the older label is the safe one).
        """
        start = time.perf_counter()
        await self.llm.collective_rpc("reload_from_file", args=(str(path),))
        return await self._loaded(version, start)

    async def receive_weights(self, plan: Any) -> float:
        """Receive weight version `plan.version` from the learner's broadcast (the dist transport, a
        pipeline.weights.dist_plan.Plan) in place; returns the seconds it took. Raises if the transfer failed.

        The engine is paused (requests kept, no step runs) while its workers receive. If the transfer broke after
        a tensor reached the model, the engine stays paused (`weights_incomplete`): it generates again only once
        a complete version is in, so no token ever comes from a mix of two versions.
        """
        start = time.perf_counter()
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            results = await self.llm.collective_rpc("receive_weights", args=(plan.encode(),))
        except Exception:
            self.weights_incomplete = True  # the workers may have loaded part of it
            raise
        failed = [r for r in results if not r["ok"]]
        if failed:
            self.weights_incomplete = self.weights_incomplete or any(r["touched"] for r in results)
            if not self.weights_incomplete:
                await self.llm.resume_generation()
            raise RuntimeError(f"receiving weights version {plan.version}: {failed[0]['error']}"
                               + (" (the engine stays paused until a complete version is in)"
                                  if self.weights_incomplete else ""))
        seconds = await self._loaded(plan.version, start)
        self.weights_incomplete = False
        await self.llm.resume_generation()
        return seconds

    async def _loaded(self, version: int, start: float) -> float:
        # Old-weight KV must not be reused: clear the prefix cache, and preempt running sequences so
        # their KV is recomputed with the new weights (vLLM's own pause(clear_cache=True) does the same).
        if not await self.llm.reset_prefix_cache(reset_running_requests=True):
            log.warning("vLLM could not reset its prefix cache after loading weights %d", version)
        await self.llm.update_weight_version(str(version))
        self.version = version
        self.last_load_seconds = time.perf_counter() - start
        return self.last_load_seconds

    @property
    def num_workers(self) -> int:
        """The engine's worker processes (tensor x pipeline parallel): each one joins a dist weight group."""
        return int(self.llm.vllm_config.parallel_config.world_size)

    @property
    def is_dead(self) -> bool:
        """True once the engine processes died: nothing more can be generated (the producer must exit)."""
        return self.llm is None or bool(self.llm.errored)

    async def shutdown(self) -> None:
        """Abort everything running and stop the engine processes. Safe to call twice."""
        if self.llm is None:
            return
        if not self.is_dead:
            for rid in list(self._rounds):
                await self.abort(rid)
        from vllm.platforms import current_platform

        llm, self.llm = self.llm, None
        # Every round is aborted and nothing of the engine outlives it. vLLM's default waits 5 s for the engine
        # core to exit on its own before killing it (it lingers after its workers have gone); on a GPU that time
        # releases device memory, on the CPU there is none to release.
        llm.shutdown(timeout=CPU_SHUTDOWN_S if current_platform.is_cpu() else None)
        # drop the last reference now: AsyncLLM.__del__ at interpreter exit would log a spurious TypeError
        del llm


def _completion(out: Any, version: int) -> Completion:
    token_ids = np.asarray(out.token_ids, dtype=np.int32)
    return Completion(token_ids, _sampled_logprobs(out.logprobs, token_ids), out.text,
                      str(out.finish_reason or "abort"), version)


def _sampled_logprobs(lps: Any, token_ids: np.ndarray) -> np.ndarray:
    """The log-prob of each sampled token from vLLM's (flat) logprobs; the sampled entry comes first."""
    n = len(token_ids)
    if lps is None or len(lps) != n:
        raise RuntimeError(f"vLLM returned {0 if lps is None else len(lps)} log-prob positions for {n} tokens")
    if hasattr(lps, "start_indices"):  # FlatLogprobs
        starts = np.asarray(lps.start_indices, dtype=np.int64)
        values = np.asarray(lps.logprobs, dtype=np.float32)
        ids = np.asarray(lps.token_ids, dtype=np.int64)
        if n and not np.array_equal(ids[starts], token_ids):
            raise RuntimeError("vLLM's first log-prob entry per position is not the sampled token")
        return values[starts] if n else np.zeros(0, np.float32)
    return np.asarray([pos[int(t)].logprob for pos, t in zip(lps, token_ids)], dtype=np.float32)
