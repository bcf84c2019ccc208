"""Stages 2-4 of `reinforce-ada train`: start the children in order, wait until each stage is ready, then watch
them and restart the dead ones.

Start: the buffer, then every producer, then the learner once every producer's engine is up (a learner started
earlier only waits, and a short run would otherwise finish on the first engine alone). A child that exits while
its stage starts ends the run at once, with its last exception line and log: a process that cannot start will
not start on a second try either.

Watch: every exit the supervisor sees is recorded in the child's history (`Child.deaths`) before anything else,
and `restarts.decide` alone says whether the child starts again; a restarted learner or buffer gets `--resume`
(its last checkpoint or snapshot), a producer starts fresh (the buffer re-issues its rounds once its heartbeats
stop). The watch ends when the learner exits 0, or when the buffer exits 0 after the learner's Shutdown and the
learner follows within LEARNER_EXIT_S; a RunFailed ends the run.

Stop: the learner and the producers get SIGTERM first; the learner finishes the step in progress, checkpoints it
and exits (up to LEARNER_STOP_S, or until the person presses Ctrl-C again), and only then does the buffer stop,
so its last snapshot holds the learner's last version. A stopped run resumes (`--resume`) where it stopped.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from pipeline import protocol as P
from pipeline.exits import EXIT_FATAL
from pipeline.jsonl import JsonlTail
from pipeline.supervisor.launchers import write_placement
from pipeline.supervisor.live import Display
from pipeline.supervisor.plan import RunPlan
from pipeline.supervisor.procs import Child, stop_all
from pipeline.supervisor.restarts import POLICIES, Death, GiveUp, decide, last_error_line
from pipeline.transport import BufferClient

BUFFER_START_S = 60.0
PRODUCERS_START_S = 600.0
RESUME = {"learner": "--resume", "buffer": "--resume", "producer": None}
LEARNER_EXIT_S = 60.0
LEARNER_STOP_S = 600.0  # a stopped learner finishes its step and checkpoints within this (a real model's step)
METRICS_EVERY_S = 1.0
PLACEMENT = "placement.json"  # in the log folder: where each process runs now (node, pid), rewritten on restarts
TICK_S = 0.2


class RunFailed(RuntimeError):
    """The run cannot go on; the message says which process, why, and where its log is."""


def exited_while_starting(child: Child) -> RunFailed:
    code = child.poll()
    if code == EXIT_FATAL:  # it stopped the run on purpose (the reward never fires, say) before all were up
        deaths = (Death(code, last_error_line(child.log_since_start())),)
        return RunFailed(GiveUp(False, deaths, fatal=True).describe(child.name, child.log_path, child.tail()))
    error = last_error_line(child.log_since_start())
    cause = f"\n    {error}" if error else ""
    return RunFailed(f"{child.name} exited with code {child.poll()} while starting:{cause}\n"
                     f"  last lines of {child.log_path}:\n{child.tail()}")


def wait_until(ready: Callable[[], bool], children: list[Child], timeout_s: float, what: str,
               stopping: Callable[[], str], poll_s: float = 0.5) -> None:
    """Call `ready()` until it is true; a child of `children` exiting meanwhile, `stopping()` returning a reason
    (Ctrl-C) or the timeout is a RunFailed."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if stopping():
            raise RunFailed(stopping())
        for child in children:
            if child.poll() is not None:
                raise exited_while_starting(child)
        if ready():
            return
        time.sleep(poll_s)
    raise RunFailed(f"{what} did not come up within {timeout_s:.0f} s; see the logs in {children[0].log_path.parent}")


def start_all(plan: RunPlan, client: BufferClient, stopping: Callable[[], str],
              buffer_start_s: float = BUFFER_START_S, producers_start_s: float = PRODUCERS_START_S) -> None:
    """Start the buffer, then the producers, then the learner, each once the previous stage answers."""
    plan.buffer.start()
    wait_until(lambda: buffer_metrics(client) is not None, [plan.buffer], buffer_start_s, "the buffer", stopping,
               poll_s=0.0)
    for child in plan.producers:
        child.start()
    num = len(plan.producers)
    wait_until(lambda: (buffer_metrics(client) or {}).get("producers_alive", 0) >= num,
               [plan.buffer, *plan.producers], producers_start_s, f"the {num} producer(s)", stopping)
    plan.learner.start()
    write_placement(plan.log_dir / PLACEMENT, plan.launcher, plan.children)


def stop_run(plan: RunPlan, forced: Callable[[], bool], learner_stop_s: float = LEARNER_STOP_S) -> None:
    """Stop every child so that no trained step is lost (see the module docstring); `forced()` turning true (a
    second Ctrl-C) ends the wait for the learner at once."""
    learner = plan.learner
    if not (plan.cfg.learner.num_ranks > 1 and learner.signal_children(signal.SIGTERM)):  # torchrun: its ranks
        learner.signal(signal.SIGTERM)
    for child in plan.producers:
        child.signal(signal.SIGTERM)
    end, said = time.monotonic() + learner_stop_s, False
    while learner.pid is not None and learner.poll() is None and time.monotonic() < end and not forced():
        if not said and time.monotonic() > end - learner_stop_s + 2.0:
            print(f"stopping: the learner finishes its step and saves a checkpoint (up to {learner_stop_s:.0f} s; "
                  "Ctrl-C again kills it, losing the steps since its last checkpoint)", flush=True)
            said = True
        time.sleep(0.1)
    stop_all(plan.children)


def buffer_metrics(client: BufferClient, timeout_s: float = 1.0) -> dict | None:
    """The buffer's MetricsSnapshot as a dict, or None when it did not answer within `timeout_s`."""
    snap = client.request(P.MetricsRequest("supervisor"), P.MetricsSnapshot, timeout_s)
    return None if snap is None else snap.metrics


def restart_or_fail(child: Child, code: int, display: Display | None = None) -> None:
    """Record the death of `child`, then start it again (with its role's resume flag), or raise RunFailed."""
    child.deaths.append(Death(code, last_error_line(child.log_since_start())))
    verdict = decide(child.deaths, POLICIES[child.role])
    if verdict is not None:
        raise RunFailed(verdict.describe(child.name, child.log_path, child.tail()))
    child.restarts += 1
    flag = RESUME[child.role]
    if flag and flag not in child.cmd:
        child.cmd = child.cmd + [flag]
    if display is not None:
        display.event(f"{child.name} exited with code {code}; restarting it ({child.restarts})")
    child.start()


def wait_exit(child: Child, timeout_s: float) -> int | None:
    end = time.monotonic() + timeout_s
    while child.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
    return child.poll()


class Watch:
    """The watch-and-restart loop of one run; `metrics()` asks the buffer for its snapshot (None: no answer)."""

    def __init__(self, plan: RunPlan, display: Display, metrics: Callable[[], dict | None],
                 stopping: Callable[[], str]) -> None:
        self.plan = plan
        self.display = display
        self.metrics = metrics
        self.stopping = stopping
        self.steps_tail = JsonlTail(plan.run_dir / "metrics.jsonl")
        self.eval_tail = JsonlTail(plan.run_dir / "eval.jsonl")
        # a resumed run shows only what this run adds
        self.last_step = max((row.get("step", 0) for row in self.steps_tail.read()), default=0)
        self.eval_tail.read()
        self.last_metrics = 0.0

    def run(self) -> None:
        """Until the learner finished; RunFailed when a child may not be restarted or the run is interrupted."""
        while True:
            reason = self.stopping()
            if reason:
                raise RunFailed(reason)
            if self.check_children():
                return
            self.refresh()
            time.sleep(TICK_S)

    def check_children(self) -> bool:
        """Restart what died; True when the run is finished."""
        restarts = sum(c.restarts for c in self.plan.children)
        try:
            return self._check_children()
        finally:
            if sum(c.restarts for c in self.plan.children) != restarts:
                write_placement(self.plan.log_dir / PLACEMENT, self.plan.launcher, self.plan.children)

    def _check_children(self) -> bool:
        learner, buffer = self.plan.learner, self.plan.buffer
        code = learner.poll()
        if code == 0:
            if buffer.poll() == EXIT_FATAL:  # the learner stopped because the buffer stopped the run
                restart_or_fail(buffer, EXIT_FATAL, self.display)
            return True
        if code is not None:  # the buffer kept its state meanwhile
            restart_or_fail(learner, code, self.display)
        code = buffer.poll()
        if code is not None:
            # a clean buffer exit follows the learner's Shutdown: give the learner time to exit on its own
            if code == 0 and wait_exit(learner, LEARNER_EXIT_S) == 0:
                return True
            restart_or_fail(buffer, code, self.display)  # clients reconnect by themselves
        for producer in self.plan.producers:
            code = producer.poll()
            if code is not None:
                restart_or_fail(producer, code, self.display)
        return False

    def refresh(self) -> None:
        """Pull the buffer's metrics (once a second), new learner steps and evaluations, and redraw."""
        now = time.monotonic()
        if now - self.last_metrics >= METRICS_EVERY_S:
            self.last_metrics = now
            snap = self.metrics()
            if snap is not None:
                self.display.state.buffer = snap
        self.read_tails()
        self.display.state.children = [(p.name, "running" if p.poll() is None else "down", str(p.restarts))
                                       for p in self.plan.producers]
        self.display.refresh()

    def read_tails(self) -> None:
        for row in self.steps_tail.read():
            # a restarted learner rewrites metrics.jsonl without the rows past its checkpoint: the tail reads the
            # file again from its start, and the versions already shown are skipped
            if row.get("step", 0) > self.last_step:
                self.last_step = row.get("step", 0)
                self.display.step(row)
        for row in self.eval_tail.read():
            self.display.eval(row)
