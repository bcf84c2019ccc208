"""The dist transport, producer side: ask the learner's store for the newest version, then let the engine's workers
receive it (dist_receive.py) while the engine is paused.

A producer is a new member each time it starts (its name gets a random suffix): a restarted producer never takes
the place of its former self in a formed group, it asks and the learner forms a group with it. Requests and plans
go through the learner's TCPStore (dist_plan.py); the wait for a plan runs in a thread, so the producer's loop goes
on serving rounds meanwhile.

Trust: a request is sealed with the secret of the announcement, and a plan believed only once it opens with the
learner's public key the announcement names (dist_sign.py: another producer holds the secret too, but cannot sign);
a plan must also name the store the announcement named, a version at least the one asked for, and
ranks for this engine's workers inside its world. Anyone who reaches the store can pop the request before the
learner reads it, so the loader sends it again every RESEND_S while it waits (the learner answers a request once).
"""

from __future__ import annotations

import asyncio
import datetime
import re
import secrets
import threading
import time
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from torch.distributed import TCPStore

from pipeline import protocol as P
from pipeline.config import WeightsConfig
from pipeline.weights.dist_plan import LEARNER, REQUESTS, Plan, Request, plan_key
from pipeline.weights.dist_sign import open_signed, seal, secret_from_hex, verifier_from_hex
from pipeline.weights.uris import parse_dist_uri

PLAN_POLL_S = 0.02
CONNECT_TIMEOUT_S = 30.0
RESEND_S = 1.0


class DistLoader:
    """WeightLoader of the dist transport."""

    def __init__(self, wc: WeightsConfig, engine: Any, member: str) -> None:
        self.wc, self.engine = wc, engine
        self.member = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', member)[:64]}-{secrets.token_hex(3)}"
        self._store: TCPStore | None = None
        self._address: tuple[str, int] | None = None
        self._seq = 0

    async def load(self, ann: P.WeightAnnouncement) -> float:
        """Ask for `ann`'s version (the learner sends its newest), receive it in place; the seconds it took."""
        start = time.perf_counter()
        host, port, version = parse_dist_uri(ann.uri)
        secret, learner = secret_from_hex(ann.key), verifier_from_hex(ann.signer)
        cancelled = threading.Event()
        try:
            plan = await asyncio.to_thread(self._ask, host.strip("[]"), port, version, secret, learner, cancelled)
        except asyncio.CancelledError:
            cancelled.set()  # the thread stops polling (else shutdown would wait for it)
            raise
        await self.engine.receive_weights(plan)
        return time.perf_counter() - start

    def _ask(self, host: str, port: int, version: int, secret: bytes, learner: Ed25519PublicKey,
             cancelled: threading.Event) -> Plan:
        """Queue a sealed request in the learner's store and wait for its signed plan (blocking: runs in a
        thread)."""
        try:
            store = self._connect(host, port)
            _check_learner(store, learner, f"{host}:{port}")
            self._seq += 1
            request = Request(self.member, self._seq, version, self.engine.num_workers).encode()
            raw = self._await_plan(store, plan_key(self.member, self._seq), seal(secret, REQUESTS, request),
                                   learner, cancelled, f"the learner at {host}:{port} did not answer the request "
                                   f"for weights version {version} in time")
        except Exception:
            self._store = None  # reconnect next time: the learner may have restarted
            raise
        plan = Plan.decode(raw)
        problem = self._plan_problem(plan, host, port, version)
        if problem:
            raise ValueError(f"refusing the weight plan for version {version}: {problem}")
        return plan

    def _await_plan(self, store: TCPStore, key: str, request: bytes, learner: Ed25519PublicKey,
                    cancelled: threading.Event, late: str) -> bytes:
        """The learner's answer at `key`, sending `request` every RESEND_S meanwhile. A value there that the
        `learner` did not sign is someone else's: it is skipped, and the wait goes on for the learner's."""
        # the learner answers once the round's members asked (dist_wait_s) and its previous round is sent
        deadline = time.monotonic() + self.wc.dist_wait_s + 2 * self.wc.dist_timeout_s
        sent, forged = -RESEND_S, ""
        while True:
            if store.check([key]):
                try:
                    return open_signed(learner, key, store.get(key))
                except ValueError as exc:
                    forged = f"; refused a forged plan: {exc}"
            if time.monotonic() - sent >= RESEND_S:  # again: anyone who reaches the store may have popped it
                store.queue_push(REQUESTS, request)
                sent = time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(late + forged)
            if cancelled.wait(PLAN_POLL_S):
                raise TimeoutError("the weight request was cancelled")

    def _plan_problem(self, plan: Plan, host: str, port: int, version: int) -> str:
        """Why a signed plan does not fit this request ("" if it does)."""
        if (plan.host, plan.port) != (host, port):
            return f"it names {plan.host}:{plan.port}, not the announced store {host}:{port}"
        if plan.version < version:
            return f"it sends version {plan.version} < {version}"
        if plan.rank + self.engine.num_workers > plan.world_size:
            return f"ranks {plan.rank}+{self.engine.num_workers} do not fit its world of {plan.world_size}"
        return ""

    def _connect(self, host: str, port: int) -> TCPStore:
        if self._store is None or self._address != (host, port):
            self._store = TCPStore(host, port, is_master=False,
                                   timeout=datetime.timedelta(seconds=min(CONNECT_TIMEOUT_S, self.wc.dist_timeout_s)))
            self._address = (host, port)
        return self._store

    def close(self) -> None:
        self._store = None


def _check_learner(store: TCPStore, learner: Ed25519PublicKey, address: str) -> None:
    """Raise at once if the learner at `address` is not the process whose key this is (it restarted since this
    announcement: its requests would be refused, and the wait would last until the time-out)."""
    try:
        open_signed(learner, LEARNER, store.get(LEARNER) if store.check([LEARNER]) else b"")
    except ValueError:
        raise RuntimeError(f"the learner at {address} is not the process that made this weight announcement (it "
                           "restarted, or someone rewrote its store); waiting for its next announcement") from None
