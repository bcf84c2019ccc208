"""The learner's ranks over several Ray nodes (`learner.num_nodes` > 1 with `run.launcher = "ray"`).

One torchrun per node, each under its own ProcessHost actor; the actors sit in one placement group with a bundle
per node (STRICT_SPREAD: never two on one node), each bundle reserving what the learner role reserves
(`run.ray_resources.learner`). The rendezvous is torchrun's static one: the first bundle's node runs node rank 0
(so global rank 0, the rank that talks to the buffer) and hosts the rendezvous at a port free on that node,
chosen again at every start.

To the supervisor the gang is one Child named after the role: it runs while every node's torchrun runs, it has
finished when all of them exited 0, and it has died with the first non-zero exit code (-9 for a node that was
lost). A restart starts every node's torchrun again with the same command (`--resume` included); if a node was
lost, the whole gang is placed anew first. The rank-0 node's log is `NAME.log`, the others `NAME-nodeI.log`.
"""

from __future__ import annotations

import signal
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipeline.supervisor.launchers import MASTER_ADDR, MASTER_PORT, NODE_RANK
from pipeline.supervisor.lifecycle import RunFailed
from pipeline.supervisor.ray_launcher import CALL_S, PLACE_S, RayChild, RayLauncher


class RayGang(RayChild):
    """`cmd` (a torchrun command with NODE_RANK, MASTER_ADDR and MASTER_PORT to fill in) on `nodes` Ray nodes."""

    def __init__(self, launcher: RayLauncher, name: str, role: str, cmd: list[str], log_dir: Path,
                 nodes: int) -> None:
        super().__init__(launcher, name, role, cmd, log_dir)
        self.members = [RayChild(launcher, name if i == 0 else f"{name}-node{i}", role, [], log_dir)
                        for i in range(nodes)]
        self.group = None

    def place(self) -> None:
        """Reserve a bundle on each of `nodes` distinct nodes and put a member's actor on each."""
        if self.group is None:
            need = self.launcher.need(self.role)
            self.launcher.check_nodes(self, need, len(self.members))
            self.group = placement_group([dict(need) for _ in self.members], strategy="STRICT_SPREAD",
                                         name=f"{self.name}-{self.restarts}")
            try:
                ray.get(self.group.ready(), timeout=PLACE_S)
            except GetTimeoutError:
                self.release()
                raise RunFailed(f"{self.name}: {len(self.members)} distinct nodes that each offer {need} were not "
                                f"free within {PLACE_S:.0f} s (free now: {ray.available_resources()}): free them, "
                                f"add nodes, or change learner.num_nodes or run.ray_resources.{self.role}") from None
        for i, member in enumerate(self.members):
            member.scheduling = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=i)}
            member.place()
        self.actor, self.where = self.members[0].actor, self.members[0].where

    def start(self) -> None:
        if any(m.actor is None for m in self.members) and self.group is not None:  # a node was lost: place anew
            self.release()
        self.place()
        rank0 = self.members[0]
        port = ray.get(rank0.actor.free_port.remote(), timeout=CALL_S)
        for i, member in enumerate(self.members):
            fill = {f"--node-rank={NODE_RANK}": f"--node-rank={i}",
                    f"--master-addr={MASTER_ADDR}": f"--master-addr={rank0.where['node_ip']}",
                    f"--master-port={MASTER_PORT}": f"--master-port={port}"}
            member.restarts = self.restarts
            member.cmd = [fill.get(a, a) for a in self.cmd]
            member.start_process()
        self._pid, self._lost = rank0.pid, None
        self.started_at = rank0.started_at
        self.launcher.check_reach(rank0)  # only rank 0 talks to the buffer

    def poll(self) -> int | None:
        codes = [m.poll() for m in self.members]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        return 0 if all(c == 0 for c in codes) else None

    def signal(self, sig: int) -> None:
        for member in self.members:
            member.signal(sig)

    def signal_children(self, sig: int) -> bool:
        return any([member.signal_children(sig) for member in self.members])  # a list: every member is signalled

    def kill_group(self) -> None:
        for member in self.members:
            member.kill_group()

    def stop(self, grace_s: float = 10.0) -> int | None:
        self.signal(signal.SIGTERM)  # to every node first, so they stop together
        codes = [member.stop(grace_s) for member in self.members]
        return next((c for c in codes if c not in (None, 0)), codes[0])

    def _log_end(self, max_bytes: int) -> bytes:
        return self.members[0]._log_end(max_bytes)

    def describe(self) -> dict:
        """Rank 0's node as the gang's, and every node's torchrun."""
        return {**self.members[0].describe(), "restarts": self.restarts,
                "nodes": [m.describe() for m in self.members]}

    def release(self) -> None:
        for member in self.members:
            member.release()
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
        self.actor = None
