"""The producer process: asks the buffer for rounds, generates and scores them, streams the results back.

One asyncio loop runs everything: the vLLM engine's output handler, the request loop (at most ONE WorkRequest
outstanding, for up to producers.max_rounds rounds and the engine's free samples), one task per round
(generate -> score in the reward workers (the scorer) -> send), the control channel (weights, aborts, shutdown),
the flusher and a 1 s heartbeat. Nothing blocking runs on the loop: scoring happens in worker processes (or a
thread).

A round whose assignment says `stream` is reported sample by sample: each sample is scored the moment it
finishes and queued; the flusher sends everything queued, of any rounds, as one SampleResults every FLUSH_S (so
samples that finish in the same engine steps travel together, never one message per token). When the buffer
aborts such a round (its prompt exited), the rest of its samples are aborted in the engine, and the next flush
reports how many were cut and the tokens they had generated (samples queued but not sent yet are dropped and
counted the same way). Other rounds (evaluation, or a buffer that checks whole rounds) get one RoundResult.

Ledger (pipeline/buffer/ledger.py): every sample that leaves the engine is counted once in the heartbeat counters
(`gen_samples` / `gen_tokens`, or `gen_eval_*`): a streamed one when it finishes (`on_sample`) or is cut, a whole
round's when it completes or is aborted. Of a training round, each such sample is then sent, or reported as
aborted with its tokens (streamed or not), so the buffer can give it a fate. The first heartbeat goes out before
the first WorkRequest and the final one (`final` = 1) after the last flush: the buffer waits for it at the end.

Invariants:
- every round this producer accepted gets exactly one RoundResult, or each of its samples once in a
  SampleResults, unless it was aborted (by the buffer, or by us at shutdown after the grace period) or the
  engine died: then what is left is not sent (an abort is reported as counts) and the buffer re-issues the
  round when its lease runs out;
- every sample carries the weight version its request was submitted under (see engine.py);
- a WorkRequest without a reply within `request_timeout_s` is sent again (the buffer may have restarted;
  ZeroMQ reconnects by itself).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import protocol as P
from pipeline.config import Config
from pipeline.producer.outbox import Outbox
from pipeline.producer.ports import BufferLink, RoundEngine, Scorer
from pipeline.producer.stats import ProducerStats
from pipeline.weights import make_loader, uri_problem, version_problem

log = logging.getLogger(__name__)

MAX_EARLY_ABORTS = 4096  # remembered aborts of rounds this producer has not (yet) started
FLUSH_S = 0.005  # streamed samples are sent at most this long after they finish, batched
RETRY_S = 2.0  # a failed weight load is tried again after this long (unless newer weights come first)


class Producer:
    """The producer's state and loops; `run_producer` builds one and runs it."""

    def __init__(self, cfg: Config, client: BufferLink, engine: RoundEngine, scorer: Scorer, producer_id: str,
                 grace_s: float = 10.0, request_timeout_s: float = 5.0, heartbeat_s: float = 1.0,
                 timeline: bool = False) -> None:
        self.cfg, self.client, self.engine, self.scorer = cfg, client, engine, scorer
        self.id = producer_id
        self.grace_s, self.request_timeout_s, self.heartbeat_s = grace_s, request_timeout_s, heartbeat_s
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._capacity = asyncio.Event()  # set whenever a sample slot may have freed up
        self._reply: asyncio.Future | None = None
        self._rounds: dict[int, asyncio.Task] = {}
        self._aborted: set[int] = set()
        # aborts of rounds not started yet (an Abort can overtake the Assignments it refers to)
        self._early_aborts: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._outbox = Outbox()  # streamed samples and abort counts not sent yet
        self._outbox_ready = asyncio.Event()
        self._pending_weights: P.WeightAnnouncement | None = None
        self._weights_ready = asyncio.Event()
        self._load_lock = asyncio.Lock()  # the one load lock: a version check and its load are one step
        self._load_failed: tuple[int, float] | None = None  # (version, monotonic time) of the last failed load
        self.loader = make_loader(cfg, engine, producer_id)  # weights.transport: file or dist
        self.learner_version = 0
        self.stats = ProducerStats()
        self.counts = self.stats.counts
        # with `timeline`: every WorkRequest (sent, answered), every assignment (its rounds' first start to last
        # end) and every weight load, in wall-clock seconds (bench.pipeline's timeline; `--timeline FILE`)
        self.timeline: list[dict] | None = [] if timeline else None
        engine.on_sample_done = self._capacity.set

    # ---- entry ----

    async def run(self) -> int:
        """Serve rounds until stopped; then drain (see `stop`) and return the exit code (0, or 1: engine died)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop, f"signal {sig.name}")
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests)
                pass
        helpers = [asyncio.create_task(c) for c in (self._recv_loop(), self._control_loop(),
                                                     self._heartbeat_loop(), self._weights_loop(),
                                                     self._flush_loop())]
        for t in helpers:
            t.add_done_callback(self._check_task)
        await self._send_heartbeat()  # the counters' start, before any result (the ledger needs it first)
        try:
            await self._request_loop()
        finally:
            await self._drain()
            for t in helpers:
                t.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            await self._flush()
            await self._send_heartbeat(final=True)
        return self.exit_code

    def stop(self, reason: str, grace_s: float | None = None, exit_code: int = 0) -> None:
        """Stop asking for work; running rounds get `grace_s` (default: the configured grace) to finish."""
        if not self._stop.is_set():
            log.info("producer %s stopping: %s", self.id, reason)
            if grace_s is not None:
                self.grace_s = grace_s
            self.exit_code = exit_code
            self._stop.set()

    def _check_task(self, task: asyncio.Task) -> None:
        """A loop or round that died of a bug stops the producer (exit 1) instead of failing silently."""
        if not task.cancelled() and task.exception() is not None:
            log.error("producer task failed", exc_info=task.exception())
            self.stop(f"internal error: {task.exception()!r}", grace_s=0.0, exit_code=1)

    # ---- work requests ----

    async def _request_loop(self) -> None:
        max_rounds = self.cfg.producers.max_rounds
        while not self._stop.is_set():
            samples = self.engine.free_samples()
            num = min(samples, max_rounds)
            if num <= 0:
                self._capacity.clear()
                await _wait_first(self._capacity.wait(), self._stop.wait(), timeout=1.0)
                continue
            self._reply = asyncio.get_running_loop().create_future()
            sent, asked = time.monotonic(), time.time()
            await self.client.send(P.WorkRequest(self.id, num, self.engine.version, samples))
            await _wait_first(self._reply, self._stop.wait(), timeout=self.request_timeout_s)
            if self.timeline is not None:
                self.timeline.append({"kind": "request", "start": asked, "end": time.time(),
                                      "rounds": len(self._reply.result().rounds) if self._reply.done() else 0})
            if self._stop.is_set():
                break
            if not self._reply.done():
                self.counts["request_timeouts"] += 1
                log.warning("no reply to a WorkRequest within %.1f s; asking again", self.request_timeout_s)
                continue
            reply = self._reply.result()
            await self._accept(reply)
            if not reply.rounds and time.monotonic() - sent < 0.05:
                # an instant empty reply: the buffer does not long-poll (or has nothing at all); back off
                await asyncio.sleep(random.uniform(0.05, 0.2))

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.client.recv()
            if not isinstance(msg, P.Assignments):
                continue  # Ack / MetricsSnapshot: nothing to do for a producer
            self.learner_version = max(self.learner_version, msg.learner_version)
            if self._reply is not None and not self._reply.done():
                self._reply.set_result(msg)
            elif not self._stop.is_set():
                await self._accept(msg)  # a late reply to a request we re-sent: its rounds are ours too

    async def _accept(self, reply: P.Assignments) -> None:
        """Load the weights a reply names (the buffer sends them to a producer that missed an update), then
        start its rounds, so they run on those weights."""
        self.learner_version = max(self.learner_version, reply.learner_version)
        if reply.weights is not None:
            await self._load_weights(reply.weights)
        started, tasks = time.time(), []
        for a in reply.rounds:
            if a.round_id in self._rounds:
                continue  # a duplicate assignment
            if a.round_id in self._early_aborts:
                del self._early_aborts[a.round_id]
                self.counts["rounds_aborted"] += 1
                continue
            self.stats.set_busy(True)
            self._rounds[a.round_id] = task = asyncio.create_task(self._run_round(a))
            task.add_done_callback(self._check_task)
            tasks.append(task)
        if self.timeline is not None and tasks:
            event = {"kind": "generate", "start": started, "end": started, "rounds": len(tasks),
                     "version": self.engine.version}
            self.timeline.append(event)
            asyncio.gather(*tasks, return_exceptions=True).add_done_callback(
                lambda _: event.__setitem__("end", time.time()))
        # let the new tasks reach the engine (it counts a round from its first step) before capacity is read
        await asyncio.sleep(0)

    # ---- one round ----

    async def _run_round(self, a: P.RoundAssignment) -> None:
        from pipeline.producer.engine import RoundAborted

        start = time.monotonic()
        scoring: list[asyncio.Task] = []

        def on_sample(index: int, c: Any, prompt_ids: np.ndarray) -> None:
            self.stats.generated(a.kind, 1, len(c.token_ids))
            scoring.append(asyncio.create_task(self._score_sample(a, index, c, prompt_ids)))

        try:
            try:
                out = await self.engine.generate_round(a, on_sample if a.stream else None)
            except RoundAborted as exc:
                self.counts["rounds_aborted"] += 1
                self.stats.generated(a.kind, exc.num_aborted, exc.aborted_tokens)
                await asyncio.gather(*scoring)
                if a.kind == "train":  # streamed or not: the buffer's ledger counts them
                    self._outbox.aborted(a.round_id, a.prompt_id, exc.num_aborted, exc.aborted_tokens)
                    self._outbox_ready.set()
                return
            except Exception as exc:  # noqa: BLE001 - decide below whether the engine is gone
                if self.engine.is_dead:
                    self.counts["engine_errors"] += 1
                    self.stop(f"the engine died: {exc!r}", grace_s=0.0, exit_code=1)
                    return
                # vLLM rejected this prompt (e.g. longer than max_model_len): report a round with no samples
                log.error("sending round %d back without samples: %s", a.round_id, exc)
                self.counts["rounds_failed"] += 1
                await self.client.send(P.RoundResult(self.id, a.round_id, a.prompt_id, P.empty_array("int32"),
                                                     [], time.monotonic() - start, a.kind))
                return
            gen_seconds = time.monotonic() - start
            self._capacity.set()
            num_tokens = sum(len(c.token_ids) for c in out.completions)
            if a.stream:
                await asyncio.gather(*scoring)
                self.stats.round_done(len(out.completions), num_tokens)
                return
            self.stats.generated(a.kind, len(out.completions), num_tokens)
            rewards = await self._score([c.text for c in out.completions], a)
            if a.round_id in self._aborted:
                self.counts["rounds_aborted"] += 1
                if a.kind == "train":  # generated, never sent: reported as aborted
                    self._outbox.aborted(a.round_id, a.prompt_id, len(out.completions), num_tokens)
                    self._outbox_ready.set()
                return
            samples = [P.Sample(c.token_ids, c.logprobs, float(r), c.version, c.finish_reason)
                       for c, r in zip(out.completions, rewards)]
            await self.client.send(P.RoundResult(self.id, a.round_id, a.prompt_id, out.prompt_token_ids,
                                                 samples, gen_seconds, a.kind))
            self.stats.round_done(len(samples), num_tokens)
        finally:
            for t in scoring:
                t.cancel()
            self._rounds.pop(a.round_id, None)
            self._aborted.discard(a.round_id)
            self._capacity.set()
            if not self._rounds:
                self.stats.set_busy(False)

    # ---- streamed samples ----

    async def _score_sample(self, a: P.RoundAssignment, index: int, c: Any, prompt_ids: np.ndarray) -> None:
        """Score one finished sample of streamed round `a` and queue it (or count it, if the round was aborted)."""
        (reward,) = await self._score([c.text], a)
        if a.round_id in self._aborted:
            self._outbox.aborted(a.round_id, a.prompt_id, 1, len(c.token_ids))
        else:
            sample = P.Sample(c.token_ids, c.logprobs, float(reward), c.version, c.finish_reason)
            self._outbox.add(a.round_id, a.prompt_id, index, sample, prompt_ids)
        self._outbox_ready.set()

    async def _flush_loop(self) -> None:
        while True:
            await self._outbox_ready.wait()
            await asyncio.sleep(FLUSH_S)  # what finishes in the next engine steps travels in the same message
            await self._flush()

    async def _flush(self) -> None:
        """Send everything queued as one SampleResults."""
        self._outbox_ready.clear()
        if len(self._outbox):
            await self.client.send(P.SampleResults(self.id, self._outbox.take()))

    async def _score(self, completions: list[str], a: P.RoundAssignment) -> list[float]:
        """reward.fn of each completion against the round's answer and extras (data.extra_keys)."""
        answers, extras = [a.answer] * len(completions), [a.extras] * len(completions)
        if self.scorer.num_workers > 0:
            return await self.scorer.ascore(completions, answers, extras)
        # inline scoring would block the loop: run it in a thread (the reward then uses its own process)
        return await asyncio.get_running_loop().run_in_executor(None, self.scorer.score, completions, answers, extras)

    # ---- control channel ----

    async def _control_loop(self) -> None:
        while True:
            msg = await self.client.recv_control()
            if isinstance(msg, P.VersionUpdate):
                self.learner_version = max(self.learner_version, msg.version)
                w = msg.weights
                if w is not None and w.version > max(self.engine.version, self._pending_version()):
                    self._pending_weights = w  # the newest wins: intermediate versions are skipped
                    self._weights_ready.set()
            elif isinstance(msg, P.Abort):
                for rid in msg.round_ids:
                    if rid in self._rounds:
                        if rid not in self._aborted:
                            self._aborted.add(rid)
                            if self._outbox.has_samples(rid):  # queued, not sent: aborted as well
                                self._outbox.aborted(rid, self._outbox.parts[rid].prompt_id)
                            await self.engine.abort(rid)
                    else:
                        self._early_aborts[rid] = None
                        while len(self._early_aborts) > MAX_EARLY_ABORTS:
                            self._early_aborts.popitem(last=False)
            elif isinstance(msg, P.Shutdown):
                self.stop(f"Shutdown from the buffer: {msg.reason}", grace_s=0.0)

    def _pending_version(self) -> int:
        return -1 if self._pending_weights is None else self._pending_weights.version

    async def _weights_loop(self) -> None:
        while True:
            await self._weights_ready.wait()
            self._weights_ready.clear()
            w, self._pending_weights = self._pending_weights, None
            if w is not None:
                await self._load_weights(w)

    async def _load_weights(self, w: P.WeightAnnouncement) -> None:
        """Load `w` (through the run's weight transport) unless the engine already holds it or newer.

        An announcement this run's transport would not publish (another place, another transport) or beyond the
        buffer's learner version + 1 is refused and counted (`weight_load_refused`), never loaded. A failed load
        keeps the old weights (or, for a broadcast that broke midway, keeps the engine paused) and is tried again
        after RETRY_S unless a newer version comes first."""
        async with self._load_lock:
            if w.version <= self.engine.version:
                return
            failed = self._load_failed
            if failed is not None and failed[0] == w.version and time.monotonic() < failed[1] + RETRY_S:
                return  # it failed a moment ago (e.g. the buffer names it in every reply): its retry is scheduled
            problem = uri_problem(w, self.cfg) or version_problem(w, self.learner_version)
            if problem:
                self.counts["weight_load_refused"] += 1
                log.error("refused weights version %d: %s", w.version, problem)
                return
            try:
                t0 = time.time()
                seconds = await self.loader.load(w)
                if self.timeline is not None:
                    self.timeline.append({"kind": "weights", "start": t0, "end": time.time(), "version": w.version})
            except Exception as exc:  # noqa: BLE001 - keep generating with the weights we have
                if self.engine.is_dead:
                    self.stop(f"the engine died loading weights: {exc!r}", grace_s=0.0, exit_code=1)
                    return
                self.counts["weight_load_errors"] += 1
                self._load_failed = (w.version, time.monotonic())
                log.error("could not load weights version %d from %s: %s; trying again in %.0f s", w.version,
                          w.uri, exc, RETRY_S)
                asyncio.get_running_loop().call_later(RETRY_S, self._retry_weights, w)
                return
        self.counts["weight_loads"] += 1
        log.info("loaded weights version %d in %.3f s", self.engine.version, seconds)
        await self._send_heartbeat()  # tell the buffer the new version at once

    def _retry_weights(self, w: P.WeightAnnouncement) -> None:
        if not self._stop.is_set() and w.version > max(self.engine.version, self._pending_version()):
            self._pending_weights = w
            self._weights_ready.set()

    # ---- heartbeat ----

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self.engine.is_dead:  # noticed here even when no round is running
                self.counts["engine_errors"] += 1
                self.stop("the engine processes died", grace_s=0.0, exit_code=1)
            await self._send_heartbeat()

    async def _send_heartbeat(self, final: bool = False) -> None:
        """`final`: the last one, after everything this producer will ever send (the buffer's ledger waits for it)."""
        stats = self.stats.snapshot(
            running_rounds=len(self._rounds), live_samples=self.engine.live_samples,
            weight_version=self.engine.version, last_weight_load_s=self.engine.last_load_seconds,
            learner_version=self.learner_version, final=float(final), **self.scorer.metrics())
        await self.client.send(P.Heartbeat(self.id, "producer", self.engine.version, stats))

    # ---- shutdown ----

    async def _drain(self) -> None:
        """Let running rounds finish within the grace period, abort the rest, wait for their tasks."""
        tasks = list(self._rounds.values())
        if tasks and self.grace_s > 0 and not self.engine.is_dead:
            log.info("waiting up to %.1f s for %d running rounds", self.grace_s, len(tasks))
            await asyncio.wait(tasks, timeout=self.grace_s)
        for rid in list(self._rounds):
            self._aborted.add(rid)
            if not self.engine.is_dead:
                await self.engine.abort(rid)
        tasks = list(self._rounds.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=5.0)
            for t in pending:
                t.cancel()


async def _wait_first(*aws: Any, timeout: float) -> None:
    """Wait until the first of `aws` completes or `timeout` passes; cancel the coroutines still waiting."""
    tasks = [a if isinstance(a, asyncio.Future) else asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t, a in zip(tasks, aws):
            if t is not a:  # only the tasks we made; the caller owns futures it passed
                t.cancel()


async def run_producer(cfg: Config, router_url: str, control_url: str, producer_id: str, model_path: str,
                       *, grace_s: float = 10.0, request_timeout_s: float = 5.0, timeline: str = "") -> int:
    """Run one producer until SIGTERM/SIGINT, a Shutdown message or engine death. Returns the exit code.
    `timeline`: write the producer's timeline (Producer.timeline) there as JSONL when it stops."""
    from pipeline.producer.engine import Engine
    from pipeline.rewards import RewardPool
    from pipeline.transport import AsyncBufferClient

    p = cfg.producers
    stopped: list[str] = []  # a signal during the ~20 s engine start stops the producer right after it
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stopped.append, sig.name)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    scorer = RewardPool.from_config(cfg)  # reward.fn, with data.extra_keys as its keyword arguments
    engine = None
    client = AsyncBufferClient(router_url, control_url, producer_id, keys_dir=cfg.endpoints.keys_dir)
    try:
        engine = await Engine.start(model_path, cfg.model.dtype, p.engine, cfg.sampling, cfg.run.seed)
        if stopped:
            log.info("producer %s stopping before its first request: %s", producer_id, stopped[0])
            return 0
        producer = Producer(cfg, client, engine, scorer, producer_id, grace_s, request_timeout_s,
                            timeline=bool(timeline))
        log.info("producer %s ready (model %s, buffer %s)", producer_id, model_path, router_url)
        try:
            return await producer.run()
        finally:
            if timeline:
                Path(timeline).write_text("".join(json.dumps(e) + "\n" for e in producer.timeline or []))
    finally:
        client.close()  # lingers up to 1 s so the last results and heartbeat go out
        if engine is not None:
            await engine.shutdown()
        scorer.close()
