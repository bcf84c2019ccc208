"""`run.launcher = "ray"` on a real two-node Ray cluster on loopback (`ray start --head` and a second `ray start
--address`, each node with its own custom resource so that placement is visible): the tiny config trains with the
buffer on one node, the producers on the other and the learner's two ranks on both (a torchrun on each node,
`learner.num_nodes = 2`); the buffer's process killed mid-run, and a producer's actor killed (what losing its node
looks like to the supervisor), are both replaced, and the run finishes with its steps and its final evaluation."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipeline.transport import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).parents[1]
RAY = str(Path(sys.executable).parent / "ray")
NODE_ARGS = ["--node-ip-address", "127.0.0.1", "--num-cpus", "4", "--object-store-memory", str(80 << 20),
             "--disable-usage-stats"]


def _node_ids(address: str) -> dict[str, str]:
    """{custom resource: node id} of the cluster, asked by a short-lived driver."""
    code = (f"import json, ray; ray.init(address={address!r}, logging_level='ERROR'); "
            "print(json.dumps({r: n['NodeID'] for n in ray.nodes() if n['Alive'] for r in n['Resources'] "
            "if r.startswith('node_')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine; `ray stop` ends them (and any other Ray node of this machine's user), so a
    file lock keeps a second pytest-xdist worker from starting its own cluster until this one is stopped."""
    with open("/tmp/reinforce-ada-ray-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _cluster()


def _cluster():
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ra-", dir="/tmp")  # short: Ray's socket paths live under it
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    address = f"127.0.0.1:{port}"
    try:
        subprocess.run([RAY, "start", "--head", "--port", str(port), "--include-dashboard=false", "--temp-dir", temp,
                        "--resources", '{"node_a": 1}', *NODE_ARGS], env=env, check=True, capture_output=True,
                       timeout=180)
        subprocess.run([RAY, "start", "--address", address, "--resources", '{"node_b": 1}', *NODE_ARGS], env=env,
                       check=True, capture_output=True, timeout=180)
        yield address, _node_ids(address)
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def _placement(run: Path) -> dict:
    path = run / "logs" / "placement.json"
    return json.loads(path.read_text())["children"] if path.is_file() else {}


def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait(cond, proc, what: str, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"train exited while waiting for {what}:\n{proc.stdout.read()[-4000:]}"
        assert time.monotonic() < end, f"no {what} within {timeout_s} s"
        time.sleep(0.5)


def test_a_run_on_two_ray_nodes_places_by_resource_spreads_the_learner_and_survives_kills(cluster, tmp_path,
                                                                                        tiny_model_dir):
    address, nodes = cluster
    run = tmp_path / "ray"
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--config", str(REPO / "configs" / "tiny.toml"),
           "--run.dir", str(tmp_path), "--run.name", "ray", "--run.launcher", "ray", "--run.ray_address", address,
           "--run.ray_resources", "{buffer = {node_a = 0.1}, producer = {node_b = 0.1}}",
           "--learner.num_nodes", "2", "--learner.num_ranks", "2", "--learner.num_steps", "10",
           "--learner.checkpoint_every", "2", "--learner.eval_every", "10", "--eval.num_problems", "40",
           "--buffer.heartbeat_timeout_s", "5", "--endpoints.router_port", "0",
           # one producer, eager: each engine start costs about 30 s of CPU (vLLM's imports in three processes,
           # and compilation unless eager); the buffer's process is the one killed (a restart without an engine)
           "--producers.count", "1", "--producers.engine.enforce_eager", "true"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: _steps(run) >= 2 and "learner" in _placement(run), proc, "2 steps")
        placed = _placement(run)
        assert placed["buffer"]["node"] == nodes["node_a"], placed
        assert sorted(n["node"] for n in placed["learner"]["nodes"]) == sorted(nodes.values()), placed  # one a node
        assert all(n["pid"] for n in placed["learner"]["nodes"]), placed
        assert placed["producer-0"]["node"] == nodes["node_b"], placed
        os.kill(placed["buffer"]["pid"], signal.SIGKILL)  # the process dies; its actor reports the exit
        _wait(lambda: _placement(run)["buffer"]["restarts"] == 1, proc, "the buffer's restart")
        steps = _steps(run)
        _wait(lambda: _steps(run) > steps, proc, "a step after the process kill")
        steps, actor = _steps(run), _placement(run)["producer-0"]["actor_pid"]
        os.kill(actor, signal.SIGKILL)  # the actor dies, as with its node
        _wait(lambda: _placement(run)["producer-0"]["restarts"] == 1, proc, "producer-0's new actor")
        assert _placement(run)["producer-0"]["actor_pid"] != actor
        _wait(lambda: _steps(run) > steps, proc, "a step after both kills")
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
    assert proc.returncode == 0, out[-4000:]
    assert out.count("buffer exited with code -9; restarting it") == 1, out[-3000:]
    assert out.count("producer-0 exited with code -9; restarting it") == 1, out[-3000:]
    placed = _placement(run)
    assert sorted(n["node"] for n in placed["learner"]["nodes"]) == sorted(nodes.values()), placed
    assert placed["producer-0"]["node"] == nodes["node_b"] and placed["producer-0"]["restarts"] == 1, placed
    assert placed["buffer"]["node"] == nodes["node_a"] and placed["buffer"]["restarts"] == 1, placed
    assert _steps(run) >= 10
    final = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()][-1]
    assert final["version"] >= 10 and 0.0 <= final["accuracy"] <= 1.0, final


def test_no_cluster_is_a_config_error_that_says_how_to_start_one(tmp_path):
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--run.dir", str(tmp_path), "--run.launcher", "ray",
           "--run.ray_address", f"127.0.0.1:{free_port()}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "run.ray_address: no Ray cluster" in out.stderr and "ray start --head" in out.stderr, out.stderr


def test_a_role_no_node_can_take_fails_the_run_naming_the_resource(cluster, tmp_path):
    address, _ = cluster
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--run.dir", str(tmp_path), "--run.launcher", "ray",
           "--run.ray_address", address, "--run.ray_resources", "{buffer = {node_z = 1}}",
           "--endpoints.router_port", "0"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "buffer: no node of the Ray cluster has what it reserves" in out.stderr and "node_z" in out.stderr, \
        out.stderr
    assert "node_b" in out.stderr, out.stderr  # what the nodes have


def test_a_learner_on_more_nodes_than_the_cluster_has_fails_the_run_at_once(cluster, tmp_path):
    address, _ = cluster
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--run.dir", str(tmp_path), "--run.launcher", "ray",
           "--run.ray_address", address, "--learner.num_nodes", "3", "--learner.num_ranks", "3",
           "--endpoints.router_port", "0"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "learner: fewer than 3 nodes of the Ray cluster have what it reserves" in out.stderr, out.stderr
    assert not (tmp_path / "tiny" / "logs" / "buffer.log").exists()  # nothing was started
