"""What both sides of the dist transport agree on (besides the URI, uris.py): the rendezvous store's keys, the bucket
layout of a version, and the plan a member receives for one broadcast. Pure data; no process group here.

Store keys (all under `ra/`):
    ra/learner                the learner process's session id (signed): a member holding another process's key
                              (an announcement from before a learner restart) learns so at once
    ra/requests               queue: a member asks for the newest version (JSON `Request`, sealed)
    ra/plan/<member>/<seq>    the learner's answer to request <seq> of <member> (JSON `Plan`, or {"error": ...},
                              signed)
    ra/group/<session>/<gen>/ prefix of the rendezvous of weight group <gen> of learner process <session>

Sealed (requests: the run learner's secret, which every producer holds) or signed (the learner's values: its Ed25519
key, which no producer holds), dist_sign.py; whoever reaches the store can read everything in it, so nothing here is
secret, and a value is believed only once its seal or signature checks out. A decoded request or plan is also
bounded field by field (a plan's sizes again by the receiver's own model, dist_receive.py), so even a sealed value
cannot make a side allocate or wait without limit.

Buckets: a version's tensors, in the publisher's order, are packed into flat uint8 buffers of about `bucket_bytes`
(a tensor larger than that travels alone); each entry starts at a multiple of ALIGN bytes so it can be viewed in
its dtype in place. The layout and each bucket's SHA-256 travel in the plan, the bytes in the broadcast: a
receiver hands a bucket's tensors to its model only once the bytes it received match the digest, so whoever joins
or takes over the weight group, a producer included, cannot put a tensor of theirs into an engine.
"""

from __future__ import annotations

import hashlib
import json
import math
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

LEARNER = "ra/learner"
REQUESTS = "ra/requests"
ALIGN = 64
# bounds on what a request or plan may say (a sealed one included): far beyond any real run, small enough that
# nothing a value says can exhaust a side's memory or time before the receiver's own check (dist_receive.py)
MAX_WORKERS = 64  # engine processes of one member (its tensor-parallel workers)
MAX_WORLD = 1 + 4096
MAX_BUCKETS = 1 << 16
MAX_ENTRIES = 1 << 20
MAX_NAME = 64  # a member's name
MAX_TIMEOUT_S = 86400.0
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


def digest(buf: torch.Tensor) -> str:
    """SHA-256 (hex) of a bucket's bytes (a CUDA bucket is copied to the CPU to hash it)."""
    return hashlib.sha256(buf.cpu().numpy()).hexdigest()


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
        try:
            d = json.loads(raw)
            req = cls(str(d["member"]), int(d["seq"]), int(d["version"]), int(d["workers"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed weight request ({type(exc).__name__}: {str(exc)[:200]})") from None
        if not 0 < len(req.member) <= MAX_NAME or "/" in req.member or not 1 <= req.workers <= MAX_WORKERS \
                or req.seq < 0 or req.version < 0:
            raise ValueError(f"malformed weight request {str(d)[:300]}: a member name of 1-{MAX_NAME} characters "
                             f"without '/', 1-{MAX_WORKERS} workers, seq and version >= 0")
        return req


@dataclass
class Plan:
    """One broadcast as a member sees it: join group `gen` of learner process `session` (the same one as last time
    means: reuse it) as ranks rank .. rank + workers - 1 of `world_size`, then receive `version` in `buckets`,
    bucket i's bytes having SHA-256 `digests[i]`."""

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
    digests: list[str]

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Plan:
        """The plan `raw` holds; RuntimeError for the learner's refusal, ValueError for a malformed or unbounded
        plan."""
        try:
            d = json.loads(raw)
            if isinstance(d, dict) and "error" in d:
                raise RuntimeError(f"the learner refused the weight request: {str(d['error'])[:300]}")
            d["buckets"] = [Bucket(int(b["nbytes"]), [list(e) for e in b["entries"]]) for b in d["buckets"]]
            plan = cls(**d)
            problem = plan_problem(plan)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            problem = f"{type(exc).__name__}: {str(exc)[:200]}"
        if problem:
            raise ValueError(f"refusing a malformed weight plan: {problem}")
        return plan

    @property
    def num_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def plan_problem(p: Plan) -> str:
    """Why plan `p` is out of bounds ("" if it is not): a field outside its range, a tensor outside its bucket."""
    fields = [
        (isinstance(p.session, str) and 0 < len(p.session) <= 16, "session"),
        (isinstance(p.gen, int) and p.gen >= 1, "gen"),
        (isinstance(p.world_size, int) and 2 <= p.world_size <= MAX_WORLD, f"world_size (2-{MAX_WORLD})"),
        (isinstance(p.rank, int) and 1 <= p.rank < p.world_size, "rank (1 to world_size - 1)"),
        (isinstance(p.version, int) and p.version >= 1, "version"),
        (p.backend in ("gloo", "nccl"), "backend"),
        (isinstance(p.host, str) and 0 < len(p.host) <= 255, "host"),
        (isinstance(p.port, int) and 0 < p.port < 65536, "port"),
        (isinstance(p.timeout_s, (int, float)) and 0 < p.timeout_s <= MAX_TIMEOUT_S, "timeout_s"),
        (0 < len(p.buckets) <= MAX_BUCKETS, f"buckets (1-{MAX_BUCKETS})"),
        (sum(len(b.entries) for b in p.buckets) <= MAX_ENTRIES, f"tensors (at most {MAX_ENTRIES})"),
        (isinstance(p.digests, list) and len(p.digests) == len(p.buckets)
         and all(isinstance(x, str) and len(x) == 64 for x in p.digests), "digests (one SHA-256 per bucket)"),
    ]
    bad = [name for ok, name in fields if not ok]
    if bad:
        return f"field {bad[0]} out of range"
    return next((f"bucket {i}: {why}" for i, b in enumerate(p.buckets) if (why := _bucket_problem(b))), "")


def _bucket_problem(b: Bucket) -> str:
    if b.nbytes < 1:
        return f"size {b.nbytes}"
    for e in b.entries:
        if len(e) != 4 or not isinstance(e[0], str) or e[1] not in DTYPES or not isinstance(e[2], list):
            return f"entry {str(e)[:100]} is not [name, dtype, shape, offset]"
        name, dtype, shape, offset = e
        if len(shape) > 8 or not all(isinstance(n, int) and n >= 0 for n in shape) or not isinstance(offset, int):
            return f"tensor {name[:100]!r} has shape {str(shape)[:100]}, offset {offset!r}"
        size = math.prod(shape) * DTYPES[dtype].itemsize
        if offset < 0 or offset % ALIGN or offset + size > b.nbytes:
            return f"tensor {name[:100]!r} ({size} bytes at {offset}) lies outside the bucket of {b.nbytes} bytes"
    return ""
