"""The Ray launcher (`run.launcher = "ray"`): the run's processes on the nodes of an existing Ray cluster.

Each planned process gets one actor, a `ProcessHost`, placed by the resources its role reserves
(`run.ray_resources`, 1 CPU by default); the actor starts the process's exact command on its node as the local
launcher would (procs.Child: its own process group, its log, killed with the actor), and answers the supervisor's
polls and signals. Ray decides where; the supervisor still decides when (restarts.py): a process that exits is a
death with its exit code, an actor that dies with its node is a death with code -9, and a restart places a new
actor, on the same node or another one offering the resources.

What the nodes need: the same checkout and Python environment at the same paths as the machine running `train`
(the commands are the local ones), and the run directory on a shared filesystem or on the node of the buffer and
the learner (they share the learner token; logs and checkpoints are written where each process runs). Clients
reach the buffer at endpoints.host; with the wildcard "0.0.0.0" (CurveZMQ keys required) they are given the
buffer node's address. Pin the buffer with a custom resource on a multi-node cluster: a buffer restarted on
another node would leave the producers' addresses stale.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from pipeline.config import Config, ConfigError
from pipeline.supervisor.launchers import Launcher
from pipeline.supervisor.lifecycle import RunFailed
from pipeline.supervisor.procs import Child
from pipeline.transport import free_port

WILDCARD = ("0.0.0.0", "::", "[::]", "*")
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
PLACE_S = 120.0  # an actor that no node can take within this is a RunFailed naming the missing resources
CALL_S = 30.0  # a poll or a signal that gets no answer within this: the process counts as running (node slow)
NODE_LOST = -9  # the exit code of a process whose actor (node) died


def reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ConnectionError at once when nothing listens at a HOST:PORT (or ray://HOST:PORT) address."""
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"nothing listens at {hostport}: {exc}") from None


class ProcessHost:
    """The actor that runs one process of the run on its node (one method call at a time)."""

    def __init__(self) -> None:
        self.child: Child | None = None

    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "host_pid": os.getpid()}

    def free_port(self) -> int:
        """A TCP port free on this node now (the learner's rendezvous, when its rank 0 runs here)."""
        return free_port()

    def start(self, name: str, role: str, cmd: list[str], log_dir: str, env: dict[str, str], cwd: str) -> int:
        if not Path(cwd).is_dir():
            raise FileNotFoundError(f"{cwd} does not exist on this node: Ray nodes need the checkout at the same path")
        if self.child is None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.child = Child(name, role, cmd, Path(log_dir), env, cwd)
        self.child.cmd = cmd
        self.child.start()
        return self.child.pid

    def poll(self) -> int | None:
        return None if self.child is None else self.child.poll()

    def signal(self, sig: int) -> None:
        if self.child is not None:
            self.child.signal(sig)

    def signal_children(self, sig: int) -> bool:
        return self.child is not None and self.child.signal_children(sig)

    def kill_group(self) -> None:
        if self.child is not None:
            self.child.kill_group()

    def stop(self, grace_s: float) -> int | None:
        return None if self.child is None else self.child.stop(grace_s)

    def log_end(self, max_bytes: int) -> bytes:
        return b"" if self.child is None else self.child._log_end(max_bytes)


class RayChild(Child):
    """A planned process that runs under a ProcessHost actor; the supervisor sees the same Child interface."""

    def __init__(self, launcher: RayLauncher, name: str, role: str, cmd: list[str], log_dir: Path,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(name, role, cmd, log_dir, env, launcher.cwd)
        self.launcher = launcher
        self.actor = None
        self.where: dict = {}
        self._pid: int | None = None
        self._lost: int | None = None  # NODE_LOST once the actor died, until the next start
        self.scheduling: dict = {}  # extra actor options: a bundle of a placement group (RayGang)

    @property
    def pid(self) -> int | None:
        return self._pid

    def place(self) -> None:
        """Put this process's actor on a node (before its first start; again after its node was lost)."""
        if self.actor is None:
            self.actor, self.where = self.launcher.place(self)

    def _call(self, method: str, *args, timeout_s: float = CALL_S):
        """A call on the actor; None when it has none or did not answer, and a dead actor is remembered as lost."""
        if self.actor is None:
            return None
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout_s)
        except GetTimeoutError:
            return None
        except RayActorError:
            self.actor, self._lost = None, NODE_LOST
            return None

    def start(self) -> None:
        self.place()
        self.start_process()
        self.launcher.check_reach(self)

    def start_process(self) -> None:
        """Run `cmd` under the placed actor (whatever the actor ran before is killed first)."""
        self._lost = None
        try:
            self._pid = ray.get(self.actor.start.remote(self.name, self.role, self.cmd, str(self.log_path.parent),
                                                        self.env, self.cwd), timeout=PLACE_S)
        except (RayActorError, GetTimeoutError, FileNotFoundError) as exc:
            raise RunFailed(f"{self.name} could not start on node {self.where.get('node_ip')}: {exc}") from exc
        self.started_at = time.monotonic()

    def describe(self) -> dict:
        """Where it runs, for placement.json."""
        return {"node": self.where.get("node_id"), "node_ip": self.where.get("node_ip"), "pid": self.pid,
                "actor_pid": self.where.get("host_pid"), "restarts": self.restarts}

    def release(self) -> None:
        """Kill the actor (after the process was stopped)."""
        if self.actor is not None:
            try:
                ray.kill(self.actor)
            except RayActorError:
                pass
            self.actor = None

    def poll(self) -> int | None:
        if self.actor is None:
            return self._lost
        code = self._call("poll")
        return self._lost if self.actor is None else code

    def signal(self, sig: int) -> None:
        self._call("signal", sig)

    def signal_children(self, sig: int) -> bool:
        return bool(self._call("signal_children", sig))

    def kill_group(self) -> None:
        self._call("kill_group")

    def stop(self, grace_s: float = 10.0) -> int | None:
        return self._call("stop", grace_s, timeout_s=grace_s + CALL_S)

    def _log_end(self, max_bytes: int) -> bytes:
        data = self._call("log_end", max_bytes)
        return data if data is not None else super()._log_end(max_bytes)  # the actor is gone: a shared file system


class RayLauncher(Launcher):
    name = "ray"

    def __init__(self, cfg: Config) -> None:
        address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "") or "auto"
        try:
            reachable(address)  # ray.init retries an address nobody listens on for minutes
            ray.init(address=address, namespace=f"reinforce-ada-{cfg.run.name}", log_to_driver=False,
                     logging_level=logging.WARNING)
        except ConnectionError as exc:
            raise ConfigError(f"run.ray_address: no Ray cluster at {address!r} ({exc}); start one with `ray start "
                              "--head` (and `ray start --address HEAD:6379` on each other node), or set "
                              "RAY_ADDRESS / run.ray_address, or use run.launcher = \"local\"") from exc
        self.cfg = cfg
        self.cwd = os.getcwd()
        self.host_class = ray.remote(ProcessHost)
        self.children: list[RayChild] = []

    def child(self, name: str, role: str, cmd: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Child:
        child = RayChild(self, name, role, cmd, log_dir, env)
        self.children.append(child)
        return child

    def options(self, role: str) -> dict:
        """Ray actor options for a role's process: its CPU and GPU counts and custom resources."""
        res = dict(self.cfg.run.ray_resources.get(role, {}))
        return {"num_cpus": res.pop("CPU", 1.0), "num_gpus": res.pop("GPU", 0.0), "resources": res,
                "max_restarts": 0, "max_concurrency": 1}

    def need(self, role: str) -> dict[str, float]:
        """What one process of `role` reserves on its node (Ray resource names, nothing of zero)."""
        options = self.options(role)
        need = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **options["resources"]}
        return {k: v for k, v in need.items() if v > 0}

    def check_nodes(self, child: RayChild, need: dict[str, float], count: int) -> None:
        """A RunFailed at once when fewer than `count` live nodes each offer `need` in all (busy or not)."""
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        if sum(all(res.get(k, 0.0) >= v for k, v in need.items()) for res in nodes) < count:
            where = "no node" if count == 1 else f"fewer than {count} nodes"
            raise RunFailed(f"{child.name}: {where} of the Ray cluster {'has' if count == 1 else 'have'} what it "
                            f"reserves ({need}{' on each' if count > 1 else ''}; the nodes have "
                            f"{[{k: v for k, v in res.items() if not k.startswith('node:')} for res in nodes]}): add "
                            f"a node or resources (`ray start --resources ...`), or change "
                            f"run.ray_resources.{child.role}")

    def gang(self, name: str, role: str, cmd: list[str], log_dir: Path, nodes: int) -> Child:
        from pipeline.supervisor.ray_gang import RayGang

        child = RayGang(self, name, role, cmd, log_dir, nodes)
        self.check_nodes(child, self.need(role), nodes)  # at once, not when the learner starts
        self.children.append(child)
        return child

    def place(self, child: RayChild):
        """A new ProcessHost for `child` on a node that offers its role's resources, and where that node is."""
        options, need = self.options(child.role), self.need(child.role)
        self.check_nodes(child, need, 1)
        actor = self.host_class.options(name=f"{child.name}-{os.getpid()}-{child.restarts}", **options,
                                        **child.scheduling).remote()
        try:
            where = ray.get(actor.where.remote(), timeout=PLACE_S)
        except GetTimeoutError:
            ray.kill(actor)
            raise RunFailed(f"{child.name}: no node of the Ray cluster took it within {PLACE_S:.0f} s (it reserves "
                            f"{need}; free now: {ray.available_resources()}): the nodes that could are busy; free "
                            f"them, add nodes, or change run.ray_resources.{child.role}") from None
        return actor, where

    def buffer_host(self, cfg: Config, buffer: Child) -> str:
        if cfg.endpoints.host not in WILDCARD:
            return cfg.endpoints.host
        assert isinstance(buffer, RayChild)
        buffer.place()
        return buffer.where["node_ip"]

    def check_reach(self, child: RayChild) -> None:
        """A child placed on another node than the buffer's cannot reach a loopback buffer: a RunFailed."""
        buffer = next((c for c in self.children if c.role == "buffer"), None)
        if self.cfg.endpoints.host in LOOPBACK and buffer is not None and buffer.where and child.where and \
                child.where["node_ip"] != buffer.where["node_ip"]:
            raise RunFailed(f"{child.name} runs on node {child.where['node_ip']} and the buffer on "
                            f"{buffer.where['node_ip']}, but endpoints.host = {self.cfg.endpoints.host!r} is this "
                            "machine only: set endpoints.host = \"0.0.0.0\" with CurveZMQ keys (`reinforce-ada "
                            "keys`, endpoints.keys_dir), or pin every role to one node with run.ray_resources")

    def placement(self, children: list[Child]) -> dict[str, dict]:
        out = {}
        for c in children:
            if isinstance(c, RayChild):
                opts = self.options(c.role)
                out[c.name] = {**c.describe(),
                               "reserves": {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"], **opts["resources"]}}
        return out

    def close(self) -> None:
        for child in self.children:
            child.release()
        ray.shutdown()
