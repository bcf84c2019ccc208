"""The wire protocol: every message the processes exchange, and the one codec for them.

A message goes on the wire as ZeroMQ frames: frame 0 is the msgpack encoding of a tagged, array_like msgspec
Struct; every numpy array inside it travels as one extra frame (zero-copy on both sides) and is written in frame
0 as `[dtype, shape, frame_index]`. Nothing is ever pickled.

Invariants:
- fields are only ever appended to a Struct, never reordered or removed (array_like encodes by position);
- every extra frame is referenced by exactly one array, and every array's byte size matches dtype x shape;
- decoding anything malformed raises `ProtocolError`, and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Union

import msgspec
import numpy as np
import zmq

# dtypes allowed on the wire; anything else is a protocol error (and never an `object` array)
_WIRE_DTYPES = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "uint16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
try:  # bf16 travels when ml_dtypes is present (it comes with jax/tensorflow; optional here)
    import ml_dtypes

    _WIRE_DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    pass
_DTYPE_NAMES = {v: k for k, v in _WIRE_DTYPES.items()}
MAX_ARRAY_DIMS = 8
MAX_STATS = 64  # a Heartbeat's stats: names at most (a producer sends about 20)
MAX_STAT_NAME = 64  # characters of a stat's name at most


class ProtocolError(ValueError):
    """A message that cannot be decoded or violates the protocol. The receiver counts it and drops it."""


class _Msg(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Base of every wire message; the tag is the class name."""


# ---------------------------------------------------------------- producer <-> buffer


class WorkRequest(_Msg):
    """Producer -> buffer: give me up to `max_rounds` rounds (the engine's free capacity)."""

    producer_id: str
    max_rounds: int
    version: int  # the weight version the producer's engine holds now
    max_samples: int = 0  # samples the engine has room for (rounds vary in size); 0 = count only rounds


ROUND_KINDS = ("train", "eval")  # RoundAssignment.kind / RoundResult.kind


class RoundAssignment(_Msg):
    """One round of one prompt: generate `num_samples` completions of `prompt` and score them against `answer`."""

    round_id: int  # unique per issue, across both kinds; a re-issued round gets a new id
    prompt_id: int  # training: the admission's prompt id; eval: the problem's index in the held-out set
    prompt: str  # already templated text
    answer: str
    num_samples: int
    lease_s: float  # the buffer re-issues the round if no result arrives within this many seconds
    kind: str = "train"  # "train" | "eval" (held-out evaluation); the producer echoes it in its RoundResult
    max_new_tokens: int = 0  # completion tokens per sample at most; 0 = the producer's sampling.max_new_tokens
    stream: bool = False  # report each sample as it finishes (SampleResults), not the whole round (RoundResult)
    extras: dict[str, Any] = {}  # the example's data.extra_keys values: keyword arguments of reward.fn
    # >= 0: the samples' seeds derive from this key instead of round_id (evaluation rounds: the problem's index, so
    # every evaluation of a problem draws with the same seeds and versions differ by the weights, not the luck)
    seed_key: int = -1


class WeightAnnouncement(_Msg):
    """Where version `version` of the weights lies, per weights.transport (pipeline/weights/uris.py): a safetensors
    file in the run's weights directory, or dist://HOST:PORT/vN (the learner's rendezvous store).

    `key` (dist only): the hex secret that seals the rendezvous store's requests (weights/dist_sign.py). It travels
    only on the buffer's authenticated channel: never log or write out an announcement whole. `signer` (dist only):
    the hex Ed25519 public key of the learner process, which signs its plans (public: a producer can check them,
    not write them)."""

    version: int
    uri: str
    num_bytes: int
    key: str = ""
    signer: str = ""


class Assignments(_Msg):
    """Buffer -> producer: the reply to a WorkRequest (possibly empty: nothing to do right now)."""

    rounds: list[RoundAssignment]
    learner_version: int
    # set when the producer's weights are older than the latest published ones: load these first
    weights: WeightAnnouncement | None = None


class Sample(_Msg):
    """One completion with its behaviour log-probs and reward."""

    token_ids: np.ndarray  # int32 [T] completion tokens
    logprobs: np.ndarray  # float32 [T] log pi_behaviour(token) at the sampling temperature
    reward: float
    version: int  # the oldest weight version that produced any of its tokens
    finish_reason: str  # "stop" | "length" | "abort"

    def __post_init__(self) -> None:
        _check_array("token_ids", self.token_ids, (np.dtype(np.int32),), ndim=1)
        _check_array("logprobs", self.logprobs, (np.dtype(np.float32),), ndim=1)
        if self.token_ids.shape != self.logprobs.shape:
            raise ProtocolError(
                f"token_ids has {self.token_ids.shape[0]} tokens but logprobs has {self.logprobs.shape[0]}"
            )
        if not math.isfinite(self.reward):
            raise ProtocolError(f"reward must be a finite number, got {self.reward}")
        if self.version < 0:
            raise ProtocolError(f"version must be >= 0, got {self.version}")
        if self.token_ids.size and int(self.token_ids.min()) < 0:
            raise ProtocolError("token_ids holds a negative token id")


class RoundResult(_Msg):
    """Producer -> buffer: the scored samples of one round."""

    producer_id: str
    round_id: int
    prompt_id: int
    prompt_token_ids: np.ndarray  # int32 [P]
    samples: list[Sample]
    gen_seconds: float  # wall time from the round's start to its last sample
    kind: str = "train"  # the RoundAssignment's kind, echoed

    def __post_init__(self) -> None:
        _check_array("prompt_token_ids", self.prompt_token_ids, (np.dtype(np.int32),), ndim=1)


class Heartbeat(_Msg):
    """Any client -> buffer: I am alive. Also carries the sender's gauges for the live view."""

    sender_id: str
    role: str  # "producer" | "learner"
    version: int
    # bounded in the type: the decoder refuses a larger map from its header, before building any of it
    stats: Annotated[dict[Annotated[str, msgspec.Meta(max_length=MAX_STAT_NAME)], float],
                     msgspec.Meta(max_length=MAX_STATS)]


# ---------------------------------------------------------------- learner <-> buffer


class BatchRequest(_Msg):
    """Learner -> buffer: hand me `num_groups` released groups trainable at `learner_version` (wait up to timeout)."""

    learner_id: str
    learner_version: int
    num_groups: int
    timeout_ms: int


class Group(_Msg):
    """A released prompt: exactly n kept samples with their advantages computed from the whole pool."""

    prompt_id: int
    prompt_token_ids: np.ndarray  # int32 [P]
    samples: list[Sample]
    advantages: list[float]  # one per sample
    pool_size: int  # samples in the pool when the prompt exited (the paper's cost)
    num_rounds: int  # rounds it took
    resolved: bool  # the exit rule held (False: released after max_rounds under unresolved="keep")
    answer: str = ""

    def __post_init__(self) -> None:
        _check_array("prompt_token_ids", self.prompt_token_ids, (np.dtype(np.int32),), ndim=1)
        if len(self.advantages) != len(self.samples):
            raise ProtocolError(f"{len(self.samples)} samples but {len(self.advantages)} advantages")


class Batch(_Msg):
    """Buffer -> learner: the reply to a BatchRequest; `groups` is empty when the timeout passed first."""

    learner_version: int
    groups: list[Group]
    metrics: dict[str, float]


class VersionUpdate(_Msg):
    """Learner -> buffer (and buffer -> everyone on the control channel): the learner now holds `version`."""

    version: int
    weights: WeightAnnouncement | None = None


# ---------------------------------------------------------------- control and misc


class Abort(_Msg):
    """Buffer -> producers: stop generating these rounds (their prompt exited or their samples went stale)."""

    round_ids: list[int]
    reason: str


class Shutdown(_Msg):
    """Anyone -> everyone: stop cleanly."""

    reason: str


class MetricsRequest(_Msg):
    """Anyone -> buffer: send a MetricsSnapshot."""

    sender_id: str


class MetricsSnapshot(_Msg):
    """Buffer -> requester: counters and gauges."""

    metrics: dict[str, Any]


class Ack(_Msg):
    """A reply that carries no data; `error` is set when the request was rejected."""

    ok: bool
    error: str = ""


class RoundSamples(_Msg):
    """Samples of one training round that finished since the producer's last flush, and what it aborted of it."""

    round_id: int
    prompt_id: int
    prompt_token_ids: np.ndarray  # int32 [P]: the round's prompt (a producer sends it with every part)
    indices: list[int]  # each sample's index in its round, 0 .. num_samples - 1
    samples: list[Sample]
    num_aborted: int = 0  # samples of the round the producer aborted (cut, stale or shut down)
    aborted_tokens: int = 0  # tokens those had generated (wasted)

    def __post_init__(self) -> None:
        _check_array("prompt_token_ids", self.prompt_token_ids, (np.dtype(np.int32),), ndim=1)
        if len(self.indices) != len(self.samples):
            raise ProtocolError(f"{len(self.indices)} sample indices for {len(self.samples)} samples")


class SampleResults(_Msg):
    """Producer -> buffer: training samples as they finish, batched per flush (every few ms), of any rounds."""

    producer_id: str
    rounds: list[RoundSamples]


# What each socket receives: one decoder per socket.
ToBuffer = Union[WorkRequest, RoundResult, Heartbeat, BatchRequest, VersionUpdate, MetricsRequest, Shutdown,
                 SampleResults]
ToProducer = Union[Assignments, Ack, MetricsSnapshot]
ToLearner = Union[Batch, Ack, MetricsSnapshot]
Control = Union[VersionUpdate, Abort, Shutdown]
AnyMessage = Union[
    WorkRequest, Assignments, RoundResult, Heartbeat, BatchRequest, Batch, VersionUpdate, Abort, Shutdown,
    MetricsRequest, MetricsSnapshot, Ack, SampleResults,
]


# ---------------------------------------------------------------- codec


def _check_array(name: str, arr: Any, dtypes: tuple[np.dtype, ...], ndim: int) -> None:
    if not isinstance(arr, np.ndarray):
        raise ProtocolError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype not in dtypes:
        raise ProtocolError(f"{name} must have dtype {'/'.join(map(str, dtypes))}, got {arr.dtype}")
    if arr.ndim != ndim:
        raise ProtocolError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")


class Encoder:
    """Encodes messages to frames. Not thread-safe (it reuses one frame list)."""

    def __init__(self) -> None:
        self._frames: list[Any] = []
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, msg: _Msg) -> list[Any]:
        """Frames for `msg`: [header, *array buffers]. The buffers alias the arrays (no copy)."""
        self._frames = [b""]
        try:
            self._frames[0] = self._enc.encode(msg)
            return self._frames
        finally:
            self._frames = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            name = _DTYPE_NAMES.get(obj.dtype)
            if name is None:
                raise TypeError(f"dtype {obj.dtype} cannot go on the wire; allowed: {sorted(_WIRE_DTYPES)}")
            arr = np.ascontiguousarray(obj)  # copies only when the caller passed a non-contiguous view
            self._frames.append(memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else b"")
            return [name, list(arr.shape), len(self._frames) - 1]
        raise TypeError(f"cannot encode objects of type {type(obj).__name__}")


class Decoder:
    """Decodes frames into one of the message types `msg_type` (a Struct class or a Union of them)."""

    def __init__(self, msg_type: Any) -> None:
        self._frames: Sequence[Any] = ()
        self._used: set[int] = set()
        self._dec = msgspec.msgpack.Decoder(msg_type, dec_hook=self._dec_hook)

    def decode(self, frames: Sequence[Any]) -> Any:
        """The message in `frames` (bytes, memoryviews or zmq.Frame). Raises ProtocolError, never anything else."""
        if not frames:
            raise ProtocolError("empty message: no frames")
        self._frames = frames
        self._used = set()
        try:
            msg = self._dec.decode(_buffer(frames[0]))
        except ProtocolError:
            raise
        except msgspec.DecodeError as exc:  # ValidationError is a subclass; it wraps errors from hooks too
            raise ProtocolError(f"malformed message: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the contract is that only ProtocolError escapes
            raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from None
        finally:
            self._frames = ()
        extra = len(frames) - 1 - len(self._used)
        if extra:
            raise ProtocolError(f"{type(msg).__name__} came with {extra} frame(s) that no array refers to")
        return msg

    def _dec_hook(self, typ: type, obj: Any) -> Any:
        # hot path (one call per array): plain type checks, no generators
        if typ is not np.ndarray:
            raise ProtocolError(f"unexpected type {typ}")
        if type(obj) is not list or len(obj) != 3:
            raise ProtocolError("an array must be encoded as [dtype, shape, frame]")
        name, shape, index = obj
        dtype = _WIRE_DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            raise ProtocolError(f"array dtype {name!r} is not allowed on the wire")
        if type(shape) is not list or len(shape) > MAX_ARRAY_DIMS:
            raise ProtocolError(f"array shape {shape!r} is not a list of at most {MAX_ARRAY_DIMS} ints")
        count = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise ProtocolError(f"array shape {shape!r} is not a list of non-negative ints")
            count *= dim
        frames = self._frames
        if type(index) is not int or not 1 <= index < len(frames):
            raise ProtocolError(f"array refers to frame {index!r} but the message has {len(frames)} frames")
        used = self._used
        if index in used:
            raise ProtocolError(f"frame {index} is referenced by two arrays")
        used.add(index)
        buf = _buffer(frames[index])
        expected = count * dtype.itemsize
        if len(buf) != expected:
            raise ProtocolError(
                f"frame {index} holds {len(buf)} bytes but a {name} array of shape {tuple(shape)} needs {expected}"
            )
        arr = np.frombuffer(buf, dtype=dtype)
        return arr if len(shape) == 1 else arr.reshape(shape)


def _buffer(frame: Any) -> memoryview | bytes:
    cls = type(frame)
    if cls is bytes:
        return frame
    if cls is zmq.Frame:
        return frame.buffer
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame).cast("B") if isinstance(frame, memoryview) else frame
    buf = getattr(frame, "buffer", None)
    if buf is not None:
        return buf
    raise ProtocolError(f"a frame must be bytes-like, got {type(frame).__name__}")


_encoder = Encoder()


def encode(msg: _Msg) -> list[Any]:
    """Frames for `msg` with the module's shared encoder (single-threaded callers only)."""
    return _encoder.encode(msg)


def empty_array(dtype: Any) -> np.ndarray:
    return np.zeros(0, dtype=dtype)
