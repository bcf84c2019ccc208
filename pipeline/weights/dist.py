"""The dist transport, learner side: rank 0 hosts the rendezvous store and broadcasts each version to the engines.

    publish(state, v): pack `state` into buckets (a copy: the learner trains on), keep it as the newest version,
                       return dist://HOST:PORT/v (HOST:PORT = the store). The learner goes on at once.
    sender thread:     producers that heard of a version ask for it in the store; the thread answers each with a
                       Plan, forms the weight group when its members changed, and broadcasts the newest version.

Membership: the group is the set of producers that asked for the version being sent. It is kept from one version
to the next while that set stays the same (the steady state: every producer asks as soon as the buffer relays the
announcement); a producer that starts late or restarts cannot join a formed group, so the round it asks in forms a
new generation of the group with it (alone, if it is catching up, or with everyone at the next version), and every
member that is told a new generation leaves the old one. After the first request for a new version the thread waits
up to `weights.dist_wait_s` for every producer it served lately; one that does not ask (dead, or busy) is left out,
forgotten, and served when it asks. The thread serves producers while the learner waits for a batch, so
producers that are all too stale to get work (all restarted, say) still catch up without the learner taking a step.

Failure: a broadcast or group formation that fails (a member died: connection reset at once, else the gloo time-out
`weights.dist_timeout_s`) is counted (`weight_broadcast_failures`) and logged; the group is dropped and re-forms at
the next request. The learner's training loop never waits on a producer: at most the newest version and the one
being sent are held in memory.

Trust (dist_sign.py): every request in the store is sealed with this process's secret, which reaches the producers
only inside the announcement, through the buffer's authenticated channel; every plan (and the marker) is signed with
this process's Ed25519 key, whose public half the announcement carries. The thread ignores requests whose seal does
not open (`weight_requests_refused`), so a client of the store alone can neither join a group nor make one wait for
members that never come; a plan names each bucket's SHA-256 and only the learner can sign one, so nothing but this
version's bytes reaches an engine, whoever joins the group, a producer included. Membership is bounded: at most
`max_members` producers per round (those served lately first; the rest are told the group is full,
`weight_members_refused`), requests a round reads at most MAX_POPS. A store client can still pop, delete or flood
what the store holds (a denial of service: a producer re-sends its request while it waits, dist_loader.py), and
whoever holds the secret, i.e. every producer, can do all a member can (ask, join, take up a place in a round), but
not write a plan.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass

import torch
from torch.distributed import TCPStore

from pipeline import protocol as P
from pipeline.config import WeightsConfig
from pipeline.weights.dist_group import WeightGroup, open_group
from pipeline.weights.dist_plan import (
    LEARNER,
    REQUESTS,
    Bucket,
    Plan,
    Request,
    digest,
    group_prefix,
    layout,
    pack,
    plan_key,
)
from pipeline.weights.dist_sign import new_secret, new_signing_key, open_sealed, public_hex, sign
from pipeline.weights.uris import dist_uri

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often the sender looks for requests
GATHER_MIN_S = 0.2  # a round with no members to wait for still waits this long for producers asking together
MAX_POPS = 1024  # requests read per poll: a flood of values in the queue cannot keep the thread from serving
MARK_S = 1.0  # how often the LEARNER marker is written again
ANSWERED_KEPT = 4096  # members whose last answered request is remembered (a re-sent request is not served twice)


@dataclass
class _Version:
    version: int
    buckets: list[Bucket]
    data: list[torch.Tensor]
    digests: list[str] | None = None

    @property
    def num_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def hashed(self) -> list[str]:
        """Each bucket's SHA-256 (computed once, by the sender thread: the learner never waits for it)."""
        if self.digests is None:
            self.digests = [digest(buf) for buf in self.data]
        return self.digests


def resolve_backend(name: str, device: torch.device | None) -> str:
    if name == "auto":
        return "nccl" if device is not None and device.type == "cuda" else "gloo"
    return name


class DistPublisher:
    """WeightPublisher of the dist transport (learner rank 0)."""

    def __init__(self, wc: WeightsConfig, device: torch.device | None = None, max_members: int = 64) -> None:
        self.host, self.bucket_bytes = wc.dist_host, wc.bucket_mb << 20
        self.timeout_s, self.wait_s = wc.dist_timeout_s, wc.dist_wait_s
        self.backend = resolve_backend(wc.dist_backend, device)
        self.device = device if self.backend == "nccl" else None
        self.session = secrets.token_hex(4)  # tells this process's groups from those of a learner before a restart
        self.secret = new_secret()  # only ever in announcements: never in the store, a log or a metric
        self.signing_key = new_signing_key()  # never leaves this process: its public half is in announcements
        self.max_members = max_members
        # bind the store to dist_host only (TCPStore itself would listen on every interface)
        try:
            sock = socket.create_server((self.host.strip("[]"), wc.dist_port),
                                        family=socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        except OSError as exc:
            raise ValueError(f"weights.dist_host / dist_port: cannot listen on {self.host}:{wc.dist_port} ({exc}); "
                             "dist_host must be an address of the learner rank 0's machine that producers reach, "
                             "and dist_port a free port (or 0)") from exc
        self.port = sock.getsockname()[1]
        try:
            self.store = TCPStore(self.host.strip("[]"), self.port, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s), master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        # the store owns the listening fd now and closes it when it is destroyed; closing it here as well would close
        # whatever this process had opened under that number in between (another store's socket, a member's)
        sock.detach()
        self._marked = 0.0  # when the LEARNER marker was last written
        self._mark()  # before any announcement can name this store
        self._lock = threading.Lock()
        self._latest: _Version | None = None
        self._waiting: dict[str, tuple[Request, float]] = {}  # member -> (its newest request, when it came)
        self._group: WeightGroup | None = None
        self._members: list[tuple[str, int]] = []  # the group's (member, workers), in rank order
        # members served lately -> the version each was sent: a new version waits for them (dist_wait_s at most)
        self._known: dict[str, int] = {}
        self._gen = 0
        self._old_keys: list[str] = []
        self._answered: dict[str, int] = {}  # member -> the seq of its last request answered, newest last
        self.counts = {"weight_publishes": 0, "weight_broadcasts": 0, "weight_broadcast_failures": 0,
                       "weight_group_forms": 0, "weight_requests_malformed": 0, "weight_requests_refused": 0,
                       "weight_members_refused": 0}
        self.gauges = {"weight_broadcast_seconds": 0.0, "weight_group_size": 0.0, "weight_bytes": 0.0}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-sender", daemon=True)
        self._thread.start()
        log.info("weights: dist transport (%s), rendezvous store on %s:%d", self.backend, self.host, self.port)

    # ---- the learner's side of the seam ----

    def publish(self, state: dict[str, torch.Tensor], version: int) -> P.WeightAnnouncement:
        """Stage `state` as `version` (packed copy) and return its announcement; the sender thread serves it."""
        if not state:
            raise ValueError("refusing to publish an empty state dict")
        buckets = layout(state, self.bucket_bytes)
        staged = _Version(version, buckets, pack(state, buckets))
        with self._lock:
            assert self._latest is None or version > self._latest.version, "versions only increase"
            self._latest = staged
            self.counts["weight_publishes"] += 1
            self.gauges["weight_bytes"] = float(staged.num_bytes)
        return P.WeightAnnouncement(version, dist_uri(self.host, self.port, version), staged.num_bytes,
                                    self.secret.hex(), public_hex(self.signing_key))

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**{k: float(v) for k, v in self.counts.items()}, **self.gauges}

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=self.timeout_s + 5)
        if self._group is not None:
            self._group.close()
            self._group = None
        self.store = None  # the last reference (unless a late sender still holds it): the store and its fd close now

    # ---- the sender thread ----

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._mark()
                self._collect()
                latest = self._due()
                if latest is None:
                    with self._lock:
                        newest = self._latest
                    if newest is not None:
                        newest.hashed()  # while nobody asks, not once they do
                    self._closed.wait(POLL_S)
                else:
                    self._serve(latest)
            except Exception:  # noqa: BLE001 - the sender must outlive any one bad round
                log.exception("weights: the sender thread hit an error; it goes on")
                self._closed.wait(1.0)

    def _mark(self) -> None:
        """(Re)write the signed LEARNER marker, at most every MARK_S: anyone may delete or overwrite it, and
        without it every producer's load would fail at once."""
        if time.monotonic() - self._marked >= MARK_S:
            self.store.set(LEARNER, sign(self.signing_key, LEARNER, self.session.encode()))
            self._marked = time.monotonic()

    def _collect(self) -> None:
        """Move the queued requests into `_waiting` (a member's newer request replaces its older one); drop those
        not sealed with the secret, those already answered, and members not served lately beyond the bound."""
        now = time.monotonic()
        for _ in range(MAX_POPS):
            if self.store.queue_len(REQUESTS) == 0:
                return
            req = self._open_request(self.store.queue_pop(REQUESTS, block=False))
            if req is None or req.seq <= self._answered.get(req.member, 0):
                continue  # refused, or a copy re-sent while its answer was on the way
            old = self._waiting.get(req.member)
            if old is None and req.member not in self._known and len(self._waiting) >= 4 * self.max_members:
                self._count("weight_members_refused", f"more than {4 * self.max_members} members waiting")
                continue
            self._waiting[req.member] = (req, old[1] if old else now)

    def _open_request(self, raw: bytes) -> Request | None:
        try:
            payload = open_sealed(self.secret, REQUESTS, raw)
        except ValueError as exc:
            self._count("weight_requests_refused", exc)
            return None
        try:
            return Request.decode(payload)
        except ValueError as exc:
            self._count("weight_requests_malformed", exc)
            return None

    def _count(self, name: str, why: object) -> None:
        """Count a dropped request; log the first of each kind and then every 1000th (a flood must not flood
        the log)."""
        with self._lock:
            self.counts[name] += 1
            n = self.counts[name]
        if n == 1 or n % 1000 == 0:
            log.warning("weights: dropped a request (%s, %d so far): %s", name, n, str(why)[:300])

    def _due(self) -> _Version | None:
        """The version to send now, once the members this round waits for have asked (or waited long enough)."""
        with self._lock:
            latest = self._latest
        if latest is None or not self._waiting:
            return None
        waited = time.monotonic() - min(t for _, t in self._waiting.values())
        expected = {m for m, v in self._known.items() if v < latest.version}
        if expected and expected <= self._waiting.keys():
            return latest
        return latest if waited >= max(GATHER_MIN_S, self.wait_s if expected else 0.0) else None

    def _serve(self, latest: _Version) -> None:
        for key in self._old_keys:  # the plans of the previous round were read by now (its members joined)
            self.store.delete_key(key)
        self._old_keys = []
        reqs = self._admit(latest)
        if not reqs:
            return
        members = [(r.member, r.workers) for r in reqs]
        reuse = self._group is not None and members == self._members
        if not reuse:
            self._drop_group()
            self._gen += 1
        world, rank = 1 + sum(w for _, w in members), 1
        for r in reqs:
            self._answer(r, Plan(self.session, self._gen, rank, world, latest.version, self.backend,
                                 self.host.strip("[]"), self.port, self.timeout_s, latest.buckets,
                                 latest.hashed()).encode())
            self._old_keys.append(plan_key(r.member, r.seq))
            rank += r.workers
        t0 = time.perf_counter()
        try:
            if not reuse:
                self._group = open_group(self.backend, self.store, group_prefix(self.session, self._gen), 0, world,
                                         self.timeout_s, self.host.strip("[]"), self.device)
                self._members = members
                self.counts["weight_group_forms"] += 1
            for buf in latest.data:
                self._group.broadcast(buf)
        except Exception as exc:  # noqa: BLE001 - a member died or never joined: count it, drop the group
            with self._lock:
                self.counts["weight_broadcast_failures"] += 1
            log.warning("weights: broadcasting version %d to %s failed after %.1f s: %s; the group re-forms at the "
                        "next request", latest.version, [m for m, _ in members], time.perf_counter() - t0, exc)
            self._drop_group()
            for m, _ in members:  # the survivors ask again (RETRY_S) and are served then, without waiting
                self._known.pop(m, None)
            return
        seconds = time.perf_counter() - t0
        for m in [m for m, v in self._known.items() if v < latest.version]:
            del self._known[m]  # it did not ask for this version in time (dead, or slow): it is served when it asks
        self._known.update((m, latest.version) for m, _ in members)
        with self._lock:
            self.counts["weight_broadcasts"] += 1
            self.gauges["weight_broadcast_seconds"] = seconds
            self.gauges["weight_group_size"] = float(len(members))
        log.info("weights: version %d (%.1f MiB) sent to %d producer(s) in %.3f s%s", latest.version,
                 latest.num_bytes / 2**20, len(members), seconds, "" if reuse else f" (group {self._gen})")

    def _admit(self, latest: _Version) -> list[Request]:
        """This round's members, in name order: the waiting requests the learner can serve, at most max_members,
        members served lately first, then the earliest to ask. The others are told why (signed errors)."""
        waiting = sorted(self._waiting.values(), key=lambda r: (r[0].member not in self._known, r[1], r[0].member))
        self._waiting.clear()
        admitted = []
        for req, _ in waiting:
            if req.version > latest.version:  # e.g. a request to a learner before a restart
                self._answer(req, _error(f"the learner holds version {latest.version} < {req.version}"))
            elif len(admitted) >= self.max_members:
                self._count("weight_members_refused", f"member {req.member!r} beyond {self.max_members}")
                self._answer(req, _error(f"the weight group is full ({self.max_members} producers: "
                                         "weights.dist_max_members, producers.count); ask again later"))
            else:
                admitted.append(req)
        return sorted(admitted, key=lambda r: r.member)

    def _answer(self, req: Request, payload: bytes) -> None:
        key = plan_key(req.member, req.seq)
        self.store.set(key, sign(self.signing_key, key, payload))
        self._answered.pop(req.member, None)
        self._answered[req.member] = req.seq
        if len(self._answered) > ANSWERED_KEPT:
            del self._answered[next(iter(self._answered))]

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._members = None, []


def _error(why: str) -> bytes:
    return json.dumps({"error": why}).encode()
