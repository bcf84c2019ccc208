"""Stage 1 of `reinforce-ada train`: plan the run. Nothing is started here.

The plan is the run directory (config.toml, logs/, commands.sh, learner.token) and one Child per process with
its exact command: the buffer, `producers.count` producers and the learner (under torchrun for several ranks).
Every child reads the same resolved config.toml and is told only the router port; the control channel is the next
port.

Without CurveZMQ keys, each run gets a fresh learner token (run_dir/learner.token, mode 0600, see pipeline/auth.py):
the buffer and the learner find it through the run directory, so it is never on a command line, and only the
learner can take batches, announce weights or stop the buffer. Restarted children read the same file.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.auth import create_token, learner_token_path
from pipeline.config import Config, ConfigError, dumps_toml, key_path
from pipeline.config.schema import DataConfig, EndpointsConfig
from pipeline.models import resolve_model_path
from pipeline.supervisor.procs import Child, write_commands
from pipeline.transport import free_port_pair

ROUTER_PORT = key_path(EndpointsConfig, "router_port")


@dataclass
class RunPlan:
    cfg: Config
    run_dir: Path
    children: list[Child]
    router_port: int

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def router_url(self) -> str:
        return f"tcp://{self.cfg.endpoints.host}:{self.router_port}"

    @property
    def control_url(self) -> str:
        return f"tcp://{self.cfg.endpoints.host}:{self.router_port + 1}"

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


def plan_children(cfg: Config, cfg_path: Path, model_dir: str, log_dir: Path, router_port: int) -> list[Child]:
    """The buffer, producers and learner of a run as Child objects (not started)."""
    connect = f"{cfg.endpoints.host}:{router_port}"
    common = ["--config", str(cfg_path), "--model", model_dir, f"--{ROUTER_PORT}", str(router_port)]
    children = [Child("buffer", "buffer", _python() + ["buffer"] + common, log_dir)]
    for i in range(cfg.producers.count):
        env = {"CUDA_VISIBLE_DEVICES": cfg.producers.devices[i]} if cfg.producers.devices else {}
        children.append(Child(f"producer-{i}", "producer",
                              _python() + ["producer", "--connect", connect, "--id", f"producer-{i}"] + common,
                              log_dir, env))
    learner_args = ["--connect", connect] + common
    if cfg.learner.num_ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={cfg.learner.num_ranks}", "-m", "pipeline.consumer.main"] + learner_args
    else:
        cmd = _python() + ["learner"] + learner_args
    children.append(Child("learner", "learner", cmd, log_dir))
    return children


def check_data_files(cfg: Config) -> None:
    """Every data file exists (checked before any process starts): a ConfigError naming the key otherwise."""
    for name in ("train_files", "eval_files"):
        for f in getattr(cfg.data, name):
            if f != "arithmetic" and not Path(f).is_file():
                raise ConfigError(f"{key_path(DataConfig, name)}: {f} does not exist (JSONL or Parquet files, or "
                                  "\"arithmetic\")")


def plan_run(cfg: Config) -> RunPlan:
    """Create the run directory, resolve the model (building the tiny one on first use), choose the ports, and
    record every child's command in commands.sh."""
    run_dir = cfg.run_dir
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if cfg.model.path == "tiny":
        print("preparing the tiny model (built once into .cache/tiny-model, about a minute)...", flush=True)
    model_dir = resolve_model_path(cfg)
    cfg_path = run_dir / "config.toml"
    cfg_path.write_text(dumps_toml(cfg))
    if not cfg.endpoints.keys_dir:  # with keys, the learner's key holds the role
        create_token(learner_token_path(run_dir))
    router_port = cfg.endpoints.router_port or free_port_pair()
    children = plan_children(cfg, cfg_path, model_dir, run_dir / "logs", router_port)
    write_commands(run_dir / "commands.sh", children, os.getcwd())
    return RunPlan(cfg, run_dir, children, router_port)
