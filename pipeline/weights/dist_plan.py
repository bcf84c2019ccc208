"""What both sides of the dist transport agree on (besides the URI, uris.py): the rendezvous store's keys, the bucket
layout of a version, and the plan a member receives for one broadcast. Pure data; no process group here.

Store keys (all under `ra/`):
    ra/requests               queue: a member asks for the newest version (JSON `Request`)
    ra/plan/<member>/<seq>    the learner's answer to request <seq> of <member> (JSON `Plan`, or {"error": ...})
    ra/group/<session>/<gen>/ prefix of the rendezvous of weight group <gen> of learner process <session>

Buckets: a version's tensors, in the publisher's order, are packed into flat uint8 buffers of about `bucket_bytes`
(a tensor larger than that travels alone); each entry starts at a multiple of ALIGN bytes so it can be viewed in
its dtype in place. The layout travels in the plan, the bytes in the broadcast.
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

REQUESTS = "ra/requests"
ALIGN = 64
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def plan_key(member: str, seq: int) -> str:
    return f"ra/plan/{member}/{seq}"


def group_prefix(session: str, gen: int) -> str:
    return f"ra/group/{session}/{gen}/"


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to host:port (what a peer there can reach us at); no packet is sent."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), port))
        return s.getsockname()[0]


@dataclass
class Bucket:
    """One broadcast buffer: `nbytes` bytes holding `entries` [name, dtype, shape, offset]."""

    nbytes: int
    entries: list[list] = field(default_factory=list)


def layout(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """The buckets `state` travels in, in its order."""
    buckets: list[Bucket] = []
    cur = Bucket(0)
    for name, t in state.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which the dist transport does not carry")
        size = t.numel() * t.element_size()
        start = math.ceil(cur.nbytes / ALIGN) * ALIGN
        if cur.entries and start + size > bucket_bytes:
            buckets.append(cur)
            cur, start = Bucket(0), 0
        cur.entries.append([name, dtype, list(t.shape), start])
        cur.nbytes = start + size
    if cur.entries:
        buckets.append(cur)
    return buckets


def pack(state: dict[str, torch.Tensor], buckets: list[Bucket]) -> list[torch.Tensor]:
    """The buckets' bytes (flat uint8 CPU tensors, a copy: `state` may change afterwards)."""
    out = []
    for b in buckets:
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        for name, _, _, offset in b.entries:
            t = state[name].detach().contiguous().reshape(-1)
            raw = t.view(torch.uint8)
            buf[offset: offset + raw.numel()].copy_(raw)
        out.append(buf)
    return out


def unpack(buf: torch.Tensor, bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a received bucket (no copy; on buf's device)."""
    for name, dtype, shape, offset in bucket.entries:
        d = DTYPES[dtype]
        numel = math.prod(shape)
        size = numel * torch.empty((), dtype=d).element_size()
        yield name, buf[offset: offset + size].view(d).reshape(shape)


@dataclass
class Request:
    """A member's request for the newest version (at least `version`); `workers` engine processes join."""

    member: str
    seq: int
    version: int
    workers: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Request:
        d = json.loads(raw)
        req = cls(str(d["member"]), int(d["seq"]), int(d["version"]), int(d["workers"]))
        if not req.member or "/" in req.member or req.workers < 1 or req.seq < 0:
            raise ValueError(f"malformed weight request {d!r}")
        return req


@dataclass
class Plan:
    """One broadcast as a member sees it: join group `gen` of learner process `session` (the same one as last time
    means: reuse it) as ranks rank .. rank + workers - 1 of `world_size`, then receive `version` in `buckets`."""

    session: str
    gen: int
    rank: int
    world_size: int
    version: int
    backend: str
    host: str
    port: int
    timeout_s: float
    buckets: list[Bucket]

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Plan:
        d = json.loads(raw)
        if "error" in d:
            raise RuntimeError(f"the learner refused the weight request: {d['error']}")
        d["buckets"] = [Bucket(int(b["nbytes"]), [list(e) for e in b["entries"]]) for b in d["buckets"]]
        return cls(**d)

    @property
    def num_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)
