"""Wire protocol: every kind round-trips, arrays travel as zero-copy frames, and malformed input raises
ProtocolError (never anything else)."""

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import protocol as P


def sample(n=5, version=0, reward=1.0):
    return P.Sample(np.arange(n, dtype=np.int32), -np.linspace(0, 1, n, dtype=np.float32), reward, version, "stop")


def group():
    return P.Group(7, np.arange(4, dtype=np.int32), [sample(3), sample(0)], [0.5, -0.5], 16, 2, True, "42")


ALL = [
    P.WorkRequest("p0", 8, 3),
    P.Assignments([P.RoundAssignment(1, 2, "1+1=", "2", 8, 30.0)], 4),
    P.Assignments([P.RoundAssignment(3, 0, "2+2=", "4", 4, 30.0, "eval", 4096)], 4),
    P.RoundResult("p0", 1, 2, np.arange(3, dtype=np.int32), [sample(), sample(0)], 0.25),
    P.RoundResult("p0", 3, 0, np.arange(3, dtype=np.int32), [sample()], 0.25, "eval"),
    P.Heartbeat("p0", "producer", 3, {"tokens_per_s": 10.0}),
    P.BatchRequest("learner", 3, 64, 1000),
    P.Batch(3, [group(), group()], {"active": 4.0}),
    P.VersionUpdate(4, P.WeightAnnouncement(4, "/dev/shm/x/v000004.safetensors", 1024)),
    P.VersionUpdate(5),
    P.Abort([1, 2, 3], "prompt exited"),
    P.Shutdown("done"),
    P.MetricsRequest("cli"),
    P.MetricsSnapshot({"released": 3, "hist": {"1": 2}}),
    P.Ack(True),
]


def _eq(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and all(_eq(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    if isinstance(a, list):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("msg", ALL, ids=lambda m: type(m).__name__)
def test_round_trip_every_kind(msg):
    frames = P.Encoder().encode(msg)
    assert isinstance(frames[0], bytes)
    out = P.Decoder(P.AnyMessage).decode(frames)
    assert _eq(msg, out)


def test_arrays_travel_as_extra_frames_not_inline():
    big = P.Sample(np.arange(100_000, dtype=np.int32), np.zeros(100_000, np.float32), 0.0, 0, "length")
    frames = P.Encoder().encode(big)
    assert len(frames) == 3
    assert len(frames[0]) < 100  # the header holds only descriptors
    assert sum(len(memoryview(f)) for f in frames[1:]) == 800_000


def test_appended_fields_have_defaults_so_older_peers_still_decode():
    """RoundAssignment.kind / max_new_tokens and RoundResult.kind were appended: a message from a peer that does not
    know them decodes with the defaults (a training round, the producer's own max_new_tokens)."""
    old = msgspec.msgpack.encode(["RoundResult", "p0", 1, 2, ["int32", [3], 1], [], 0.5])
    out = P.Decoder(P.ToBuffer).decode([old, np.arange(3, dtype=np.int32).tobytes()])
    assert out.kind == "train" and out.round_id == 1
    a = P.RoundAssignment(1, 2, "q", "a", 8, 30.0)
    assert (a.kind, a.max_new_tokens) == ("train", 0) and P.ROUND_KINDS == ("train", "eval")
    fields = P.RoundAssignment.__struct_fields__
    assert fields[-5:-3] == ("kind", "max_new_tokens") and P.RoundResult.__struct_fields__[-1] == "kind"
    # later appends: RoundAssignment.stream and WorkRequest.max_samples, which an older peer leaves at their defaults
    assert fields[-3] == "stream" and not a.stream and P.WorkRequest.__struct_fields__[-1] == "max_samples"
    # and RoundAssignment.extras (reward.fn's keyword arguments): an assignment without them has none
    assert fields[-2] == "extras" and a.extras == {}
    short = msgspec.msgpack.encode(["RoundAssignment", 1, 2, "q", "a", 8, 30.0, "eval", 5, True])
    assert P.Decoder(P.RoundAssignment).decode([short]).extras == {}
    # and RoundAssignment.seed_key (evaluation rounds' common random numbers): without it, seeds follow the round id
    assert fields[-1] == "seed_key" and a.seed_key == -1 and P.Decoder(P.RoundAssignment).decode([short]).seed_key == -1
    old_request = msgspec.msgpack.encode(["WorkRequest", "p0", 4, 0])
    assert P.Decoder(P.ToBuffer).decode([old_request]).max_samples == 0


def test_empty_non_contiguous_and_million_token_arrays():
    ids = np.arange(2_000_000, dtype=np.int32)[::2]  # non-contiguous view, 1M tokens
    assert not ids.flags.c_contiguous
    lp = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
    msg = P.RoundResult("p", 1, 1, np.zeros(0, np.int32), [P.Sample(ids, lp, 1.0, 0, "stop"), sample(0)], 1.0)
    out = P.Decoder(P.ToBuffer).decode(P.Encoder().encode(msg))
    assert np.array_equal(out.samples[0].token_ids, ids) and np.array_equal(out.samples[0].logprobs, lp)
    assert out.prompt_token_ids.shape == (0,) and out.samples[1].token_ids.shape == (0,)


def test_zero_copy_over_real_zmq_sockets():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://t")
    b.connect("inproc://t")
    ids = np.arange(1_000_000, dtype=np.int32)
    a.send_multipart(P.Encoder().encode(P.Sample(ids, ids.astype(np.float32), 1.0, 2, "stop")), copy=False)
    out = P.Decoder(P.Sample).decode(b.recv_multipart(copy=False))
    assert np.array_equal(out.token_ids, ids) and out.version == 2
    assert not out.token_ids.flags.owndata  # a view on the received frame, not a copy
    a.close(), b.close(), ctx.term()


def test_disallowed_dtype_is_refused_at_encode():
    with pytest.raises(TypeError):
        P.Encoder().encode(P.MetricsSnapshot({"x": np.array(["a"], dtype=object)}))


def _frames(msg):
    return list(P.Encoder().encode(msg))


def _patched_header(msg, patch):
    frames = _frames(msg)
    header = msgspec.msgpack.decode(frames[0])
    patch(header)
    frames[0] = msgspec.msgpack.encode(header)
    return frames


RR = P.RoundResult("p0", 1, 2, np.arange(3, dtype=np.int32), [sample(4)], 0.1)


def _set(path, value):
    def patch(h):
        node = h
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return patch


MALFORMED = {
    "no frames": [],
    "truncated header": [_frames(RR)[0][:7]] + _frames(RR)[1:],
    "garbage header": [b"\xc1\xff\x00garbage"] + _frames(RR)[1:],
    "not a list": [msgspec.msgpack.encode({"a": 1})],
    "unknown kind": _patched_header(RR, _set([0], "Exploit")),
    "missing frame": _frames(RR)[:-1],
    "extra frame": _frames(RR) + [b"\x00" * 12],
    "truncated array frame": _frames(RR)[:2] + [_frames(RR)[2][:5]] + _frames(RR)[3:],
    "wrong dtype for field": _patched_header(RR, _set([5, 0, 1, 0], "float32")),
    "disallowed dtype": _patched_header(RR, _set([4, 0], "object")),
    "wrong rank": _patched_header(RR, _set([4, 1], [1, 3])),
    "negative dim": _patched_header(RR, _set([4, 1], [-3])),
    "shape/frame size mismatch": _patched_header(RR, _set([4, 1], [4])),
    "frame index out of range": _patched_header(RR, _set([4, 2], 99)),
    "frame index zero": _patched_header(RR, _set([4, 2], 0)),
    "frame used twice": _patched_header(RR, _set([5, 0, 2, 2], 1)),
    "lengths disagree": _patched_header(RR, _set([5, 0, 2, 1], [3])),
    "nan reward": _patched_header(RR, _set([5, 0, 3], float("nan"))),
    "wrong field type": _patched_header(RR, _set([2], "one")),
    "too few fields": [msgspec.msgpack.encode(["RoundResult", "p0"])],
    "array not a triple": _patched_header(RR, _set([4], "abc")),
    "not bytes": [object()],
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_input_raises_protocol_error(name):
    with pytest.raises(P.ProtocolError):
        P.Decoder(P.ToBuffer).decode(MALFORMED[name])


def test_negative_token_id_is_rejected():
    good = P.Sample(np.array([1, 5], np.int32), np.zeros(2, np.float32), 1.0, 0, "stop")
    good.token_ids = np.array([1, -5], np.int32)  # structs are mutable: put a bad value on the wire
    with pytest.raises(P.ProtocolError, match="negative"):
        P.Decoder(P.Sample).decode(P.Encoder().encode(good))


def test_kind_not_expected_on_this_socket():
    with pytest.raises(P.ProtocolError):
        P.Decoder(P.ToBuffer).decode(_frames(P.Batch(0, [], {})))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_random_frames_only_ever_raise_protocol_error(frames):
    try:
        P.Decoder(P.ToBuffer).decode(frames)
    except P.ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(_frames(RR)[0]) - 1), st.integers(0, 255))
def test_flipped_header_bytes_only_ever_raise_protocol_error(pos, value):
    frames = _frames(RR)
    header = bytearray(frames[0])
    header[pos] = value
    frames[0] = bytes(header)
    try:
        P.Decoder(P.ToBuffer).decode(frames)
    except P.ProtocolError:
        pass
