"""Typed configuration for a whole run: TOML files plus dotted command-line overrides.

Every field has a default (the paper's settings; configs/tiny.toml is the CPU run). Loading validates everything
up front: an unknown key, a wrong type or a value out of range raises `ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import msgspec


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and how to fix it."""


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    path: str = "tiny"  # Hugging Face model directory; "tiny" = build the tiny arithmetic model in .cache/
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights dtype in the engines and the learner
    tokenizer: str = ""  # tokenizer directory when it differs from `path`


class DataConfig(_Section):
    # JSONL/Parquet files; "arithmetic" = the built-in generated task
    train_files: list[str] = msgspec.field(default_factory=lambda: ["arithmetic"])
    # held-out sets for accuracy during training
    eval_files: list[str] = msgspec.field(default_factory=lambda: ["arithmetic"])
    problem_key: str = ""  # column of the problem ("" = auto: problem, question)
    answer_key: str = ""  # column of the answer ("" = auto: answer, final_answer, else \boxed{} of solution)
    template: str = "auto"  # "auto" (chat template if any, else plain), "plain", "raw", or "...{problem}..."
    shuffle: bool = True  # shuffle the training prompts once, with the run seed
    num_arithmetic_train: int = 4000  # problems drawn for the built-in task
    num_arithmetic_eval: int = 200  # held-out problems drawn for the built-in task (never in the training set)
    # operand digits drawn for the built-in task (the tiny model is made for 2: two-digit operands)
    arithmetic_levels: list[int] = msgspec.field(default_factory=lambda: [2])
    max_prompts: int = 0  # use only the first N training prompts (0 = all)
    # training prompts longer than max_model_len - max_new_tokens are left out (with a warning) while they are at
    # most this share of the data; more is an error (a context length that does not suit the data)
    max_overlong_share: float = 0.5

    def __post_init__(self) -> None:
        _require(bool(self.train_files), "data.train_files", "give at least one file or \"arithmetic\"")
        _require(self.num_arithmetic_train > 0, "data.num_arithmetic_train", "must be > 0")
        _require(self.num_arithmetic_eval >= 0, "data.num_arithmetic_eval", "must be >= 0")
        _require(
            bool(self.arithmetic_levels) and all(lv in (1, 2, 3) for lv in self.arithmetic_levels),
            "data.arithmetic_levels", "use a non-empty subset of [1, 2, 3]",
        )
        _require(self.max_prompts >= 0, "data.max_prompts", "must be >= 0 (0 = all)")
        _require(0 <= self.max_overlong_share <= 1, "data.max_overlong_share", "must be in [0, 1]")


class SamplingConfig(_Section):
    round_size: int = 8  # M: samples per round of one prompt
    max_rounds: int = 4  # N: rounds before a prompt is given up on (so at most M*N samples)
    group_size: int = 4  # n: samples kept per released group
    exit_rule: Literal["balance", "pos", "fixed"] = "balance"  # "fixed" = GRPO: one round of n samples
    positive_threshold: float = 0.5  # a sample is positive when its reward exceeds this
    temperature: float = 1.0  # sampling temperature (the learner computes log-probs at the same one)
    top_p: float = 1.0  # nucleus sampling; < 1 renormalises the engine's log-probs, not the learner's: keep 1
    max_new_tokens: int = 2048

    def __post_init__(self) -> None:
        _require(self.round_size >= 1, "sampling.round_size", "must be >= 1")
        _require(self.max_rounds >= 1, "sampling.max_rounds", "must be >= 1")
        _require(self.group_size >= 2, "sampling.group_size", "must be >= 2 (advantages need a comparison)")
        _require(
            self.exit_rule == "fixed" or self.round_size * self.max_rounds >= self.group_size,
            "sampling.round_size", f"round_size * max_rounds must be >= group_size ({self.group_size})",
        )
        _require(self.temperature > 0, "sampling.temperature", "must be > 0 (greedy sampling has no log-probs "
                 "the learner can match)")
        _require(0 < self.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
        _require(self.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1")


class BufferConfig(_Section):
    max_staleness: int = 1  # learner version minus sample version may be at most this (0 = on-policy)
    max_rounds_in_flight: int = 0  # cap on rounds out at producers at once (0 = no cap beyond admission control)
    unresolved: Literal["drop", "keep"] = "drop"  # zero-variance pools: drop (counted) or train them (reference)
    downsample: Literal["freshest", "first", "random"] = "freshest"  # which samples of the pool to keep
    normalize_std: bool = False  # divide advantages by the pool's std
    lease_s: float = 120.0  # a round not returned within this is re-issued to another producer
    heartbeat_timeout_s: float = 15.0  # a producer silent this long loses its rounds
    max_message_bytes: int = 256 << 20  # ZeroMQ maxmsgsize on the buffer's sockets

    def __post_init__(self) -> None:
        _require(self.max_staleness >= 0, "buffer.max_staleness", "must be >= 0 (0 = on-policy)")
        _require(self.max_rounds_in_flight >= 0, "buffer.max_rounds_in_flight", "must be >= 0 (0 = no cap)")
        _require(self.lease_s > 0, "buffer.lease_s", "must be > 0 seconds")
        _require(self.heartbeat_timeout_s > 0, "buffer.heartbeat_timeout_s", "must be > 0 seconds")
        _require(self.max_message_bytes >= 1 << 16, "buffer.max_message_bytes", "must be >= 65536")


class LearnerConfig(_Section):
    lr: float = 1e-6  # AdamW learning rate (the paper: 1e-6)
    warmup_steps: int = 0  # linear warm-up of the learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28  # upper clip (clip-higher, as in DAPO and the paper)
    dual_clip: float = 10.0  # dual-clip bound c for negative advantages (0 = off)
    entropy_coef: float = 0.0  # entropy bonus (the paper: 1e-4)
    tis_cap: float = 0.0  # truncated importance sampling cap on rho (0 = off)
    decoupled: bool = False  # recompute proximal log-probs before the update (AReaL's decoupled PPO)
    batch_prompts: int = 512  # B: groups per learner step (B * n sequences)
    mini_batches: int = 4  # optimizer steps per batch
    micro_batch_tokens: int = 16384  # padded tokens per forward/backward pass (gradient accumulation)
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    backend: Literal["torch", "deepspeed"] = "torch"  # torch (one process or DDP) or DeepSpeed ZeRO
    zero_stage: int = 2  # DeepSpeed ZeRO stage (2 or 3)
    num_ranks: int = 1  # learner processes (torchrun --nproc-per-node)
    num_steps: int = 100  # learner steps (batches) before the run ends
    checkpoint_every: int = 50  # steps between checkpoints (0 = only at the end)
    eval_every: int = 10  # steps between held-out evaluations (0 = never)
    batch_timeout_s: float = 600.0  # give up (fatal error) when no batch arrives for this long
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory, ~30% slower)
    cpu_threads: int = 0  # torch threads of a CPU learner (0 = torch's default: all cores)

    def __post_init__(self) -> None:
        _require(self.lr > 0, "learner.lr", "must be > 0")
        _require(self.warmup_steps >= 0, "learner.warmup_steps", "must be >= 0")
        _require(0 <= self.clip_low < 1, "learner.clip_low", "must be in [0, 1)")
        _require(self.clip_high >= 0, "learner.clip_high", "must be >= 0")
        _require(self.dual_clip == 0 or self.dual_clip > 1, "learner.dual_clip", "must be > 1, or 0 to turn off")
        _require(self.tis_cap == 0 or self.tis_cap >= 1, "learner.tis_cap", "must be >= 1, or 0 to turn off")
        _require(self.batch_prompts >= 1, "learner.batch_prompts", "must be >= 1")
        _require(self.mini_batches >= 1, "learner.mini_batches", "must be >= 1")
        _require(self.batch_prompts % self.mini_batches == 0, "learner.mini_batches",
                 f"must divide learner.batch_prompts ({self.batch_prompts})")
        _require(self.micro_batch_tokens >= 64, "learner.micro_batch_tokens", "must be >= 64")
        _require(self.grad_clip >= 0, "learner.grad_clip", "must be >= 0 (0 = off)")
        _require(self.zero_stage in (0, 1, 2, 3), "learner.zero_stage", "must be 0, 1, 2 or 3")
        _require(self.num_ranks >= 1, "learner.num_ranks", "must be >= 1")
        _require(self.num_steps >= 1, "learner.num_steps", "must be >= 1")
        _require(self.checkpoint_every >= 0, "learner.checkpoint_every", "must be >= 0")
        _require(self.eval_every >= 0, "learner.eval_every", "must be >= 0")
        _require(self.batch_timeout_s > 0, "learner.batch_timeout_s", "must be > 0")
        _require(self.cpu_threads >= 0, "learner.cpu_threads", "must be >= 0 (0 = torch's default)")


class EngineConfig(_Section):
    dtype: str = "auto"  # vLLM dtype ("auto" = model.dtype)
    max_model_len: int = 4096  # prompt + completion tokens per sequence (clamped to the model's)
    gpu_memory_utilization: float = 0.85  # share of GPU memory vLLM may take (weights + KV cache)
    tensor_parallel_size: int = 1  # GPUs per engine
    enforce_eager: bool = False  # no CUDA graphs / compilation (faster start, slower decode)
    max_num_seqs: int = 256  # concurrent sequences per engine
    cpu_kv_cache_gb: float = 1.0  # KV cache size on the CPU backend (VLLM_CPU_KVCACHE_SPACE)
    cpu_threads: int = 0  # torch threads per CPU engine (0 = let vLLM choose)
    extra: dict[str, Any] = {}  # further vllm.AsyncEngineArgs keyword arguments, passed as they are

    def __post_init__(self) -> None:
        _require(self.max_model_len >= 16, "producers.engine.max_model_len", "must be >= 16")
        _require(0 < self.gpu_memory_utilization <= 1, "producers.engine.gpu_memory_utilization",
                 "must be in (0, 1]")
        _require(self.tensor_parallel_size >= 1, "producers.engine.tensor_parallel_size", "must be >= 1")
        _require(self.max_num_seqs >= 1, "producers.engine.max_num_seqs", "must be >= 1")
        _require(self.cpu_kv_cache_gb > 0, "producers.engine.cpu_kv_cache_gb", "must be > 0")


class ProducersConfig(_Section):
    count: int = 1  # producer processes (one engine each)
    max_rounds: int = 64  # rounds a producer asks for at most at once
    reward_workers: int = 1  # math-verify worker processes per producer (0 = score inline)
    reward_timeout_s: float = 5.0  # per-sample verification time limit
    devices: list[str] = []  # CUDA_VISIBLE_DEVICES per producer, e.g. ["0", "1"] (empty: inherit)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        _require(self.count >= 0, "producers.count", "must be >= 0 (0: start producers yourself)")
        _require(self.max_rounds >= 1, "producers.max_rounds", "must be >= 1")
        _require(self.reward_workers >= 0, "producers.reward_workers", "must be >= 0")
        _require(self.reward_timeout_s > 0, "producers.reward_timeout_s", "must be > 0")
        _require(not self.devices or len(self.devices) == self.count, "producers.devices",
                 f"give one entry per producer ({self.count}) or none")


class WeightsConfig(_Section):
    dir: str = ""  # where rank 0 writes weight files ("" = /dev/shm/reinforce-ada-<run name>)
    keep: int = 2  # weight files kept (older ones are deleted once no producer can still need them)


class EndpointsConfig(_Section):
    host: str = "127.0.0.1"  # interface the buffer binds; a non-loopback address needs CurveZMQ keys
    router_port: int = 5555  # requests and results (0 = let `train` pick a free pair of ports)
    control_port: int = 5556  # broadcast of versions, aborts and shutdown: always router_port + 1
    keys_dir: str = ""  # CurveZMQ keys made by `reinforce-ada keys` (needed for non-loopback hosts)

    def __post_init__(self) -> None:
        for name in ("router_port", "control_port"):
            port = getattr(self, name)
            _require(0 <= port < 65536, f"endpoints.{name}", "must be a TCP port in [0, 65535]")
        # clients are told only HOST:PORT and find the control channel on PORT + 1
        _require(self.control_port == (self.router_port + 1 if self.router_port else 0), "endpoints.control_port",
                 f"must be router_port + 1 ({self.router_port + 1 if self.router_port else 0}): clients connect "
                 "to HOST:router_port and find the control channel on the next port")


class RunConfig(_Section):
    name: str = "tiny"  # run directory name under `dir`
    dir: str = "runs"  # parent directory of run directories
    seed: int = 0  # seeds the data order, the scheduler, the engines and the learner
    live: bool = True  # rich live view when stdout is a terminal

    def __post_init__(self) -> None:
        _require(bool(self.name) and "/" not in self.name, "run.name", "must be a non-empty name without '/'")


class EvalConfig(_Section):
    k: int = 4  # samples per problem for Ave@k during training
    num_problems: int = 200  # held-out problems of each eval file evaluated during training (0 = all)
    max_new_tokens: int = 0  # 0 = sampling.max_new_tokens

    def __post_init__(self) -> None:
        _require(self.k >= 1, "eval.k", "must be >= 1")
        _require(self.num_problems >= 0, "eval.num_problems", "must be >= 0")


class Config(_Section):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    producers: ProducersConfig = msgspec.field(default_factory=ProducersConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    endpoints: EndpointsConfig = msgspec.field(default_factory=EndpointsConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name

    @property
    def weights_dir(self) -> Path:
        """weights.dir, else a folder in /dev/shm unique to this run directory (two runs never share one)."""
        if self.weights.dir:
            return Path(self.weights.dir)
        import hashlib

        tag = hashlib.blake2b(str(self.run_dir.resolve()).encode(), digest_size=4).hexdigest()
        return Path("/dev/shm") / f"reinforce-ada-{self.run.name}-{tag}"


# ---------------------------------------------------------------- loading


def _check_keys(data: dict, cls: type, where: str) -> None:
    """Unknown keys are errors with a did-you-mean (msgspec alone names the key but suggests nothing)."""
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean `{(where + '.') if where else ''}{close[0]}`?)" if close else ""
            raise ConfigError(f"{path}: unknown key{hint}; known keys here: {', '.join(sorted(fields))}")
        ftype = fields[key].type
        if isinstance(ftype, type) and issubclass(ftype, _Section):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: must be a table ([{path}] section), got {type(value).__name__}")
            _check_keys(value, ftype, path)


def _parse_value(text: str) -> Any:
    """A command-line value as TOML (numbers, booleans, lists, quoted strings), else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `--a.b value` / `--a.b=value` pairs to the nested dict `data` (in place) and return it."""
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"override {arg!r}: expected --section.key VALUE (e.g. --sampling.round_size 8)")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(overrides):
                raise ConfigError(f"override {arg}: missing value (e.g. {arg} 8)")
            key, text = arg[2:], overrides[i + 1]
            i += 2
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key}: {part} is not a section")
        node[parts[-1]] = _parse_value(text)
    return data


def _error_field(exc: msgspec.ValidationError) -> str:
    msg = str(exc)
    if " - at `$." not in msg:
        return msg
    body, path = msg.rsplit(" - at `$.", 1)
    path = path.rstrip("`")
    if body.startswith("Invalid enum value"):
        choices = _literal_choices(path)
        if choices:
            body += f"; choose one of {', '.join(map(repr, choices))}"
    return f"{path}: {body}"


def _literal_choices(path: str) -> tuple:
    """The allowed values of a Literal field at dotted `path`, or () if it is not one."""
    cls: Any = Config
    ftype: Any = None
    for part in path.split("."):
        fields = {f.name: f.type for f in msgspec.structs.fields(cls)} if isinstance(cls, type) else {}
        if part not in fields:
            return ()
        ftype = cls = fields[part]
    return get_args(ftype) if get_origin(ftype) is Literal else ()


def from_dict(data: dict) -> Config:
    """Validate a nested dict into a Config, or raise ConfigError naming the field and the fix."""
    _check_keys(data, Config, "")
    try:
        return msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise ConfigError(_error_field(exc)) from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML file (None = all defaults) and apply dotted overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (shipped configs live in configs/)")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    apply_overrides(data, list(overrides or []))
    return from_dict(data)


def to_toml_dict(cfg: Config) -> dict:
    """The resolved config as plain data (for printing and for the run directory)."""
    return msgspec.to_builtins(cfg)


def dumps_toml(cfg: Config) -> str:
    """Resolved config as TOML text (no external writer: the format is simple enough)."""
    lines: list[str] = []

    def emit(table: dict, prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) or k == "extra"}
        if prefix:
            lines.append(f"\n[{prefix}]")
        for k, v in scalars.items():
            lines.append(f"{k} = {_toml_value(v)}")
        for k, v in table.items():
            if isinstance(v, dict) and k != "extra":
                emit(v, f"{prefix}.{k}" if prefix else k)

    emit(to_toml_dict(cfg), "")
    return "\n".join(lines).lstrip() + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")
