"""Stage 1 of `reinforce-ada train`: plan the run. Nothing is started here.

The plan is the run directory (config.toml, logs/, commands.sh, learner.token) and one Child per process with
its exact command: the buffer, `producers.count` producers and the learner (under torchrun for several ranks),
made by the launcher `run.launcher` names (launchers.py: on this machine, or on a Ray cluster's nodes).
Every child reads the same resolved config.toml and is told only the router port; the control channel is the next
port.

The run directory belongs to one run: a fresh start needs it empty or absent (`--overwrite` deletes a previous run's
first), and `--resume` continues the run it holds, starting the buffer and the learner with --resume (the buffer
from its snapshot, the learner from its latest checkpoint) and producers fresh.

Without endpoints.keys_dir, each run gets CurveZMQ keys of its own in run_dir/keys (the buffer's pair, the learner's
and one per producer, secret halves 0600; see pipeline/auth.py), recorded as endpoints.keys_dir in its config.toml,
where every child reads it, so no secret is on a command line. On loopback too, the buffer then proves itself to
every client by its server key (a process that takes the buffer's ports while it restarts gets no client to talk
to it), the learner's role is its key (only it can take batches, announce weights or stop the buffer), each producer
is one client (its own key: fairness and the stop rule count per key), and a client without the run's keys gets
nothing. Restarted and resumed children read the same keys.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.auth import make_keys
from pipeline.config import Config, ConfigError, dumps_toml, key_path
from pipeline.config.schema import DataConfig, EndpointsConfig, LearnerConfig, RunConfig
from pipeline.hf import latest_checkpoint
from pipeline.models import TINY_DIR, resolve_model_path
from pipeline.pretrained import CACHE, SMOLLM2, is_gguf
from pipeline.supervisor.launchers import Launcher, make_launcher, torchrun_command
from pipeline.supervisor.procs import Child, write_commands
from pipeline.transport import free_port_pair

ROUTER_PORT = key_path(EndpointsConfig, "router_port")
KEYS = "keys"  # run_dir/KEYS: the run's own CurveZMQ keys when endpoints.keys_dir is not set
RUN_MARKERS = ("config.toml", "metrics.jsonl", "checkpoints", "logs")  # what only a run directory holds


@dataclass
class RunPlan:
    cfg: Config
    run_dir: Path
    children: list[Child]
    router_port: int
    launcher: Launcher
    host: str  # where clients reach the buffer (endpoints.host, or the buffer node's address: launchers.py)

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def router_url(self) -> str:
        return f"tcp://{self.host}:{self.router_port}"

    @property
    def control_url(self) -> str:
        return f"tcp://{self.host}:{self.router_port + 1}"

    def role(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

    @property
    def buffer(self) -> Child:
        return self.role("buffer")[0]

    @property
    def learner(self) -> Child:
        return self.role("learner")[0]

    @property
    def producers(self) -> list[Child]:
        return self.role("producer")


def _python() -> list[str]:
    return [sys.executable, "-m", "pipeline.cli"]


def producer_ids(cfg: Config) -> list[str]:
    """The --id of each producer the run starts (also the name of its own key, when the run makes its keys)."""
    return [f"producer-{i}" for i in range(cfg.producers.count)]


def plan_children(cfg: Config, cfg_path: Path, model_dir: str, log_dir: Path, router_port: int,
                  resume: bool = False, launcher: Launcher | None = None) -> tuple[list[Child], str]:
    """The buffer, producers and learner of a run as Child objects of `launcher` (not started), and the host the
    clients are told; with `resume`, the buffer and the learner continue from the run's snapshot and checkpoint."""
    launcher = launcher or Launcher()
    common = ["--config", str(cfg_path), "--model", model_dir, f"--{ROUTER_PORT}", str(router_port)]
    again = ["--resume"] if resume else []
    buffer = launcher.child("buffer", "buffer", _python() + ["buffer"] + common + again, log_dir)
    host = launcher.buffer_host(cfg, buffer)
    connect = f"{host}:{router_port}"
    children = [buffer]
    for i, name in enumerate(producer_ids(cfg)):
        env = {"CUDA_VISIBLE_DEVICES": cfg.producers.devices[i]} if cfg.producers.devices else {}
        children.append(launcher.child(name, "producer",
                                       _python() + ["producer", "--connect", connect, "--id", name] + common,
                                       log_dir, env))
    learner_args = ["--connect", connect] + common + again
    nodes, ranks = cfg.learner.num_nodes, cfg.learner.num_ranks
    if nodes > 1:  # torchrun on each node; rank 0, the one that talks to the buffer, on the first
        children.append(launcher.gang("learner", "learner", torchrun_command(learner_args, ranks // nodes, nodes),
                                      log_dir, nodes))
        return children, host
    cmd = torchrun_command(learner_args, ranks) if ranks > 1 else _python() + ["learner"] + learner_args
    children.append(launcher.child("learner", "learner", cmd, log_dir))
    return children, host


def check_data_files(cfg: Config) -> None:
    """Every data file exists (checked before any process starts): a ConfigError naming the key otherwise."""
    for name in ("train_files", "eval_files"):
        for f in getattr(cfg.data, name):
            if f != "arithmetic" and not Path(f).is_file():
                raise ConfigError(f"{key_path(DataConfig, name)}: {f} does not exist (JSONL or Parquet files, or "
                                  "\"arithmetic\")")


def checkpoint_version(run_dir: Path) -> int | None:
    """The version of the run's latest checkpoint, or None when it has none."""
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    return None if ckpt is None else int(json.loads((ckpt / "meta.json").read_text())["version"])


def prepare_run_dir(cfg: Config, resume: bool = False, overwrite: bool = False) -> None:
    """Check (and with `overwrite`, empty) the run directory before anything starts; a ConfigError says what to do.

    A fresh run needs an absent or empty directory: reusing one would append to its metrics.jsonl and overwrite
    its checkpoints. `resume` needs a run directory whose latest checkpoint is below learner.num_steps."""
    run_dir = cfg.run_dir
    name_key = key_path(RunConfig, "name")
    if resume:  # the config came from the run directory's config.toml (supervisor/main.py)
        version = checkpoint_version(run_dir)
        if version is not None and version >= cfg.learner.num_steps:
            raise ConfigError(f"{key_path(LearnerConfig, 'num_steps')}: the run already reached version {version} "
                              f"(learner.num_steps = {cfg.learner.num_steps}); raise it to train on, e.g. "
                              f"--learner.num_steps {version + cfg.learner.num_steps}")
        return
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"{name_key}: the run directory {run_dir} is not empty (a previous run): continue it with "
                          f"`reinforce-ada train --resume {run_dir}`, start it over with --overwrite (deletes it), or "
                          "choose another --run.name")
    if not any((run_dir / marker).exists() for marker in RUN_MARKERS):
        raise ConfigError(f"{name_key}: --overwrite refuses to delete {run_dir}: it holds no run (none of "
                          f"{', '.join(RUN_MARKERS)}); choose another --run.name or --run.dir")
    shutil.rmtree(run_dir)


LATEST = "latest"


def link_latest(run_dir: Path) -> None:
    """Point `<run.dir>/latest` at this run (a relative link, replaced atomically), so the newest run is easy to
    find (`eval --model runs/latest`, `--resume runs/latest`). A real file or folder named `latest` is left alone."""
    link = run_dir.parent / LATEST
    if run_dir.name == LATEST or (link.exists() and not link.is_symlink()):
        return
    tmp = run_dir.parent / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, link)


def plan_run(cfg: Config, resume: bool = False) -> RunPlan:
    """Create the run directory, resolve the model (building the tiny one on first use), choose the ports, and
    record every child's command in commands.sh (prepare_run_dir has checked the directory)."""
    run_dir = cfg.run_dir
    # private: it holds the learner token, checkpoints (weights), logs and samples; other users have no business in it
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    run_dir.chmod(0o700)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    link_latest(run_dir)
    # the "once" message only when it is that once (a .gguf file's folder is known only after hashing the file)
    built = {"tiny": TINY_DIR, SMOLLM2: CACHE / SMOLLM2}.get(cfg.model.path)
    if built is not None and (built / "config.json").is_file():
        pass
    elif cfg.model.path == "tiny":
        print("preparing the tiny model (built once into .cache/tiny-model, about a minute)...", flush=True)
    elif cfg.model.path == SMOLLM2 or is_gguf(cfg.model.path):
        print(f"preparing {cfg.model.path} (converted once into .cache/, about a minute)...", flush=True)
    model_dir = resolve_model_path(cfg)
    if not cfg.endpoints.keys_dir:  # this run's own keys: see the module's docstring
        cfg.endpoints.keys_dir = str(make_keys(run_dir / KEYS, producer_ids(cfg)).resolve())
    cfg_path = run_dir / "config.toml"
    cfg_path.write_text(dumps_toml(cfg))
    router_port = cfg.endpoints.router_port or free_port_pair()
    launcher = make_launcher(cfg)  # `ray`: connects to the cluster (a ConfigError when there is none)
    children, host = plan_children(cfg, cfg_path, model_dir, run_dir / "logs", router_port, resume, launcher)
    write_commands(run_dir / "commands.sh", children, os.getcwd())
    return RunPlan(cfg, run_dir, children, router_port, launcher, host)
