"""`reinforce-ada slurm`: a run over the nodes of one Slurm allocation, as an sbatch script.

The script holds the same processes as `train` (plan.py), each started with `srun` on its node: the buffer and the
learner (under `torchrun` for several ranks) on the allocation's first node, the producers round-robin over the other
nodes (all on the first node when the allocation has one), each producer on the GPU of its index on its node.
Every process runs under a small restart loop with the supervisor's limits (restarts.POLICIES; the buffer and the
learner come back with --resume, a producer fresh), and the job ends when the learner exits 0 and the buffer has
run its final evaluation. The buffer binds every interface, so the run uses CurveZMQ keys: the config's
endpoints.keys_dir, else keys made in RUN_DIR/keys. The run directory (config.toml, logs/, the script) is written
now and must be on a filesystem every node sees, as must the checkout and its Python environment.

    reinforce-ada slurm --config configs/qwen2.5-math-1.5b.toml --nodes 3 --gpus-per-node 8 \\
        --producers.count 16 --learner.num_ranks 8 [--partition P] [--time 1-00:00:00] [--submit]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from pipeline.config import Config, ConfigError, dumps_toml, load_config
from pipeline.models import resolve_model_path
from pipeline.supervisor.plan import KEYS, ROUTER_PORT, check_data_files, prepare_run_dir, producer_ids
from pipeline.supervisor.restarts import POLICIES

SCRIPT = "run.sbatch"

HEADER = """#!/usr/bin/env bash
# Written by `reinforce-ada slurm` for the run in {run_dir}: submit with `sbatch {script}`.
#SBATCH --job-name={job}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --output={logs}/slurm-%j.out
{extra}
set -uo pipefail
cd {cwd}
PY={py}
LOGS={logs}
COMMON=({common})
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${{NODES[0]}}
# the address the other nodes reach the head by (this script runs on the allocation's first node)
HEAD_ADDR=${{RA_HEAD_ADDR:-$(hostname -I 2>/dev/null | awk '{{print $1}}')}}
HEAD_ADDR=${{HEAD_ADDR:-127.0.0.1}}
CONNECT="$HEAD_ADDR:{port}"
if [ "${{#NODES[@]}}" -gt 1 ]; then PRODUCER_NODES=("${{NODES[@]:1}}"); else PRODUCER_NODES=("$HEAD"); fi
echo "$(date +%T) run {name}: buffer and learner on $HEAD ($CONNECT), producers on ${{PRODUCER_NODES[*]}}"

# NAME NODE MAX_RESTARTS RESUME_FLAG ENV -- COMMAND...: run COMMAND on NODE, restarting it until it exits 0 (a clean
# end) or dies MAX_RESTARTS + 1 times; a restart adds RESUME_FLAG (the buffer and the learner continue from their
# snapshot and checkpoint). pipeline.supervisor.procs runs it as `reinforce-ada train` runs a child: its log is
# $LOGS/NAME.log, and the process group dies with its leader (a killed producer leaves no engine behind).
supervise() {{
  local name=$1 node=$2 max=$3 resume=$4 env=$5; shift 6
  local tries=0 code extra=()
  while true; do
    srun --nodes=1 --ntasks=1 --overlap -w "$node" --kill-on-bad-exit=0 \\
      env $env $PY -m pipeline.supervisor.procs "$name" "$LOGS" -- "$@" "${{extra[@]}}"
    code=$?
    if [ "$code" -eq 0 ]; then return 0; fi
    tries=$((tries + 1))
    if [ "$tries" -gt "$max" ]; then
      echo "$(date +%T) $name exited with code $code $tries times: the run stops (see $LOGS/$name.log)"; return "$code"
    fi
    echo "$(date +%T) $name exited with code $code; restarting it ($tries)"
    if [ -n "$resume" ]; then extra=("$resume"); fi
    sleep 2
  done
}}

# the end of the job stops every step; SIGTERM first, so producers finish their rounds and the buffer snapshots
cleanup() {{ for p in $(jobs -p); do pkill -TERM -P "$p" 2>/dev/null; kill "$p" 2>/dev/null; done; wait; }}
trap cleanup EXIT
trap 'exit 130' INT TERM

supervise buffer "$HEAD" {buffer_max} --resume "" -- $PY -m pipeline.cli buffer "${{COMMON[@]}}" {again} &
BUFFER=$!
until (exec 3<>"/dev/tcp/$HEAD_ADDR/{port}") 2>/dev/null; do
  sleep 1; kill -0 $BUFFER 2>/dev/null || {{ echo "the buffer did not start: see $LOGS/buffer.log"; exit 1; }}
done
for ((i = 0; i < {producers}; i++)); do
  node=${{PRODUCER_NODES[$((i % ${{#PRODUCER_NODES[@]}}))]}}
  gpu=$((i / ${{#PRODUCER_NODES[@]}}))
  env="{gpu_env}"
  supervise "producer-$i" "$node" {producer_max} "" "$env" -- $PY -m pipeline.cli producer --connect "$CONNECT" \\
    --id "producer-$i" "${{COMMON[@]}}" &
done
supervise learner "$HEAD" {learner_max} --resume "" -- {learner} --connect "$CONNECT" "${{COMMON[@]}}" {again}
CODE=$?
# after the last step the buffer runs the final evaluation, then exits on the learner's request
for ((t = 0; t < {final_s}; t++)); do kill -0 $BUFFER 2>/dev/null || break; sleep 1; done
echo "$(date +%T) run {name}: the learner exited with code $CODE"
exit $CODE
"""


def render(cfg: Config, cfg_path: Path, model_dir: str, keys_dir: str, nodes: int, gpus_per_node: int,
           partition: str = "", time_limit: str = "", resume: bool = False) -> str:
    """The sbatch script of a run whose resolved config is `cfg_path`."""
    port = cfg.endpoints.router_port or 5555
    common = ["--config", str(cfg_path.resolve()), "--model", model_dir, f"--{ROUTER_PORT}", str(port),
              "--endpoints.host", "0.0.0.0", "--endpoints.keys_dir", keys_dir]
    extra = [f"#SBATCH --gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    extra += [f"#SBATCH --partition={partition}"] if partition else []
    extra += [f"#SBATCH --time={time_limit}"] if time_limit else []
    if cfg.learner.num_ranks > 1:
        learner = (f"$PY -m torch.distributed.run --standalone --nproc-per-node={cfg.learner.num_ranks} "
                   "-m pipeline.consumer.main")
    else:
        learner = "$PY -m pipeline.cli learner"
    logs = (cfg.run_dir / "logs").resolve()
    return HEADER.format(
        run_dir=cfg.run_dir.resolve(), script=cfg.run_dir.resolve() / SCRIPT, job=f"reinforce-ada-{cfg.run.name}",
        nodes=nodes, logs=logs, extra="\n".join(extra), cwd=shlex.quote(os.getcwd()), py=shlex.quote(sys.executable),
        common=shlex.join(common), port=port, name=cfg.run.name, again="--resume" if resume else "",
        buffer_max=POLICIES["buffer"].max_restarts, producer_max=POLICIES["producer"].max_restarts,
        learner_max=POLICIES["learner"].max_restarts, producers=cfg.producers.count, learner=learner,
        gpu_env="CUDA_VISIBLE_DEVICES=$gpu" if gpus_per_node else "",
        final_s=int(cfg.buffer.lease_s + 30))


def write_run(cfg: Config, nodes: int, gpus_per_node: int, partition: str, time_limit: str) -> Path:
    """Prepare the run directory (config.toml, logs/, keys when the config has none) and write its script."""
    from pipeline.auth import make_keys  # pyzmq: only here

    prepare_run_dir(cfg)
    run_dir = cfg.run_dir
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    keys_dir = cfg.endpoints.keys_dir or str(make_keys(run_dir / KEYS, producer_ids(cfg)).resolve())
    model_dir = str(Path(resolve_model_path(cfg)).resolve())
    cfg_path = run_dir / "config.toml"
    cfg_path.write_text(dumps_toml(cfg))
    script = run_dir / SCRIPT
    script.write_text(render(cfg, cfg_path, model_dir, keys_dir, nodes, gpus_per_node, partition, time_limit))
    script.chmod(0o755)
    return script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada slurm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML config (default: configs/tiny.toml's settings)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the allocation (first: buffer and learner)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: a CPU run)")
    parser.add_argument("--partition", default="", help="the Slurm partition")
    parser.add_argument("--time", default="", dest="time_limit", help="the job's time limit (Slurm's format)")
    parser.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    args, overrides = parser.parse_known_args(argv)
    from pipeline.supervisor.main import DEFAULT_CONFIG

    try:
        if args.nodes < 1 or args.gpus_per_node < 0:
            raise ConfigError(f"--nodes {args.nodes} --gpus-per-node {args.gpus_per_node}: need 1 or more nodes and "
                              "0 or more GPUs per node")
        cfg = load_config(args.config or str(DEFAULT_CONFIG), overrides)
        check_data_files(cfg)
        script = write_run(cfg, args.nodes, args.gpus_per_node, args.partition, args.time_limit)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {script}; submit it with `sbatch {script}` (logs in {script.parent / 'logs'})", flush=True)
    if args.submit:
        return subprocess.run(["sbatch", str(script)]).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
