"""`reinforce-ada slurm`: the sbatch script it writes places the run's processes as documented, and trains the
tiny config end to end: through a real sbatch where a Slurm answers (`.ci/slurm-up` starts a single-node one), else
through stand-ins for srun and scontrol (tests/support/fake_slurm) that run every step on this machine. The buffer
killed mid-run is restarted by the script, from its snapshot."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.supervisor.slurm import render
from pipeline.transport import free_port_pair

REPO = Path(__file__).parents[1]
FAKE = REPO / "tests" / "support" / "fake_slurm"


def _slurm_answers() -> bool:
    return shutil.which("sbatch") is not None and subprocess.run(["sinfo"], capture_output=True).returncode == 0


def test_the_script_puts_buffer_and_learner_first_and_one_producer_per_gpu(tmp_path):
    cfg = load_config(None, ["--run.dir", str(tmp_path), "--learner.num_ranks", "8", "--producers.count", "16"])
    text = render(cfg, tmp_path / "config.toml", "/models/m", "/keys", nodes=3, gpus_per_node=8, partition="gpu",
                  time_limit="1-00:00:00")
    for line in ("#SBATCH --nodes=3", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --time=1-00:00:00", "--nproc-per-node=8 -m pipeline.consumer.main",
                 'PRODUCER_NODES=("${NODES[@]:1}")', "CUDA_VISIBLE_DEVICES=$gpu", "i < 16",
                 "--endpoints.host 0.0.0.0 --endpoints.keys_dir /keys"):
        assert line in text, line
    path = tmp_path / "run.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_bad_node_counts_are_config_errors(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "slurm", "--nodes", "0", "--run.dir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--nodes 0" in out.stderr, out.stderr


def _pid_of(marker: str, role: str) -> int | None:
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        wrapped = "srun" in cmd or "supervisor.procs" in cmd  # the step and its wrapper carry the command too
        if marker in cmd and role in cmd and "pipeline.cli" in cmd and not wrapped:
            return int(proc.name)
    return None


def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.slow
def test_the_script_trains_and_restarts_a_killed_buffer_from_its_snapshot(tmp_path, tiny_model_dir):
    port = free_port_pair()  # below the ephemeral range: producers reconnect to it while the buffer is down
    run = tmp_path / "slurm"
    subprocess.run([sys.executable, "-m", "pipeline.cli", "slurm", "--config", str(REPO / "configs" / "tiny.toml"),
                    "--run.dir", str(tmp_path), "--run.name", "slurm", "--nodes", "1", "--learner.num_steps", "8",
                    "--learner.eval_every", "0", "--endpoints.router_port", str(port),
                    # one producer, eager: each engine start costs about 30 s of CPU (vLLM's imports in three
                    # processes, and compilation unless eager); the buffer is the one killed: the script's restart
                    # loop is the same for every process, and the buffer's adds --resume
                    "--producers.count", "1", "--producers.engine.enforce_eager", "true"],
                   cwd=REPO, check=True, timeout=300)
    script = run / "run.sbatch"
    real = _slurm_answers()
    if real:
        proc = subprocess.Popen(["sbatch", "--wait", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    else:
        env = dict(os.environ, PATH=f"{FAKE}:{os.environ['PATH']}", SLURM_JOB_NODELIST="localhost",
                   RA_HEAD_ADDR="127.0.0.1")
        proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)
    try:
        end = time.monotonic() + 300
        while _steps(run) < 2:
            assert proc.poll() is None and time.monotonic() < end, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        os.kill(_pid_of(str(run / "config.toml"), " buffer "), signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None and real:
            subprocess.run(["scancel", "--name", "reinforce-ada-slurm"])
        elif proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    if real:
        out = "".join(p.read_text() for p in (run / "logs").glob("slurm-*.out"))
    assert proc.returncode == 0, out[-3000:]
    assert "buffer exited with code" in out and "restarting it (1)" in out, out[-3000:]
    restarted = (run / "logs" / "buffer.log").read_text(errors="replace").rsplit("\n==== ", 1)[-1]
    assert "resumed from" in restarted and "starting fresh" not in restarted, restarted[-3000:]  # its snapshot
    assert "the learner exited with code 0" in out, out[-3000:]
    assert _steps(run) >= 8
    assert (run / "checkpoints").is_dir()
