"""Where each process of a run runs (`run.launcher`).

The supervisor's plan (plan.py: which processes, each with its exact command) is one; a launcher turns each planned
process into a Child that is started, watched, signalled, stopped and restarted under the same rules (restarts.py)
wherever it runs:

- `local` (the default): a child process of `reinforce-ada train` on this machine (procs.Child).
- `ray`: each process is started and watched by a small actor on a node of an existing Ray cluster, placed by the
  resources `run.ray_resources` names for its role; the actor's death (its node lost) is the process's death, and a
  restart places it again (ray_launcher.py, imported only when chosen). A learner on several nodes
  (`learner.num_nodes`) is a gang: a torchrun on each node, watched and restarted as one (ray_gang.py).

A launcher also says which address clients connect to once the buffer is placed (`buffer_host`), and where each
process ran (`placement`, written to run_dir/logs/placement.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.config import Config, ConfigError
from pipeline.supervisor.procs import Child

# what a multi-node learner's command says for the parts its launcher fills in at each start (RayGang)
NODE_RANK, MASTER_ADDR, MASTER_PORT = "$NODE_RANK", "$MASTER_ADDR", "$MASTER_PORT"


def torchrun_command(args: list[str], per_node: int, nodes: int = 1) -> list[str]:
    """The learner's ranks under torchrun: `per_node` on this machine (`--standalone`), or on each of `nodes` nodes
    with a static rendezvous at the node of rank 0 (NODE_RANK, MASTER_ADDR and MASTER_PORT filled in per node)."""
    where = ["--standalone"] if nodes == 1 else [f"--nnodes={nodes}", f"--node-rank={NODE_RANK}",
                                                 f"--master-addr={MASTER_ADDR}", f"--master-port={MASTER_PORT}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={per_node}", "-m",
            "pipeline.consumer.main", *args]


class Launcher:
    """The local launcher: every process a child of the supervisor, on this machine."""

    name = "local"

    def child(self, name: str, role: str, cmd: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Child:
        return Child(name, role, cmd, log_dir, env)

    def gang(self, name: str, role: str, cmd: list[str], log_dir: Path, nodes: int) -> Child:
        """One process per node on `nodes` nodes, watched as one (the learner's torchrun on each of its nodes):
        only a launcher that places processes on nodes has it."""
        raise ConfigError(f"learner.num_nodes = {nodes} needs run.launcher = \"ray\" (this launcher runs everything "
                          "on this machine); or start the learner's ranks by hand (README, Across machines)")

    def buffer_host(self, cfg: Config, buffer: Child) -> str:
        """The host clients give to reach the buffer (`buffer` is planned, not started)."""
        return cfg.endpoints.host

    def placement(self, children: list[Child]) -> dict[str, dict]:
        """Where each child runs now: {name: {"node": ..., "pid": ...}}."""
        return {c.name: {"node": "local", "pid": c.pid} for c in children}

    def close(self) -> None:
        """Release what the launcher holds (after every child is stopped)."""


def make_launcher(cfg: Config) -> Launcher:
    """The launcher `run.launcher` names (Ray is imported only here, and only when chosen)."""
    if cfg.run.launcher == "ray":
        from pipeline.supervisor.ray_launcher import RayLauncher

        return RayLauncher(cfg)
    return Launcher()


def write_placement(path: Path, launcher: Launcher, children: list[Child]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"launcher": launcher.name, "children": launcher.placement(children)}, indent=1))
    tmp.replace(path)
