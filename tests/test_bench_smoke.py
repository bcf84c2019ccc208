"""Every bench runs in the suite, small (issue #25): each module of bench/ is named here with the test that runs its
real code path on tiny inputs, so an API change breaks `make test`, not `make bench`. And a bench that fails, fails
fast and leaves nothing behind: killed mid-run, no process of it is left (bench/guard.py).

A new bench module needs a line in SMOKE naming its smoke test (test_every_bench_module_has_a_smoke_test fails
otherwise). Benches that start vLLM engines run them on tiny models, marked slow; so are the multi-process ones.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from bench import guard

ROOT = Path(__file__).resolve().parents[1]
HERE = "tests/test_bench_smoke.py"
TABLE2 = "tests/test_bench_table2.py::test_cli_writes_json_and_markdown_rendered_from_it"
SAMPLING = "tests/test_bench_sampling.py::test_cli_writes_table_and_plot"
ALLOCATION = "tests/test_bench_sampling.py::test_allocation_bench_drives_every_policy_and_reports_the_goals"
E2E = f"{HERE}::test_e2e_bench_trains_and_evaluates_a_tiny_sweep"
THROUGHPUT = f"{HERE}::test_throughput_smoke_runs_every_component"
PIPELINE = f"{HERE}::test_pipeline_bench_smoke"

# bench module (dotted, under bench/) -> the test that runs it (parts of a study: the test of the study that uses them;
# a study package's __main__: its study's test)
SMOKE = {
    "allocation.__main__": ALLOCATION,
    "allocation.report": ALLOCATION,
    "allocation.study": ALLOCATION,
    "cost_per_gain": "tests/test_readme.py::test_result_tables_are_generated_from_bench_results",
    "e2e.__main__": E2E,
    "e2e.data": E2E,
    "e2e.evaluate": E2E,
    "e2e.report": E2E,
    "e2e.runs": E2E,
    "e2e.stats": E2E,
    "e2e.strategies": E2E,
    "e2e.study": E2E,
    "eval_noise": f"{HERE}::test_eval_noise_bench_smoke",
    "flood": "tests/test_adversarial_wire.py::test_memory_stays_flat_under_a_flood_of_new_identities",
    "guard": f"{HERE}::test_a_bench_killed_mid_run_leaves_no_process",
    "output": TABLE2,
    "peer_trl": f"{HERE}::test_peer_trl_bench_smoke",
    "pipeline.__main__": PIPELINE,
    "pipeline.reference_buffer": PIPELINE,
    "pipeline.study": PIPELINE,
    "pipeline.timeline": PIPELINE,
    "readme_results": "tests/test_readme.py::test_result_tables_are_generated_from_bench_results",
    "run_all": f"{HERE}::test_run_all_goes_on_after_failures_and_reports_them_all",
    "sampling": SAMPLING,
    "sim.costmodel": TABLE2,
    "sim.engine": TABLE2,
    "sim.population": SAMPLING,
    "sim.run": SAMPLING,
    "sim.trace": TABLE2,
    "soak": "tests/test_soak.py::test_soak_memory_flat_and_nothing_lost",
    "table2.__main__": TABLE2,
    "table2.report": TABLE2,
    "table2.study": TABLE2,
    "throughput.__main__": THROUGHPUT,
    "throughput.buffer_ingest": THROUGHPUT,
    "throughput.learner": f"{HERE}::test_learner_bench_publish_baseline_and_spread",
    "throughput.producer": THROUGHPUT,
    "throughput.study": THROUGHPUT,
    "train_throughput": f"{HERE}::test_train_throughput_smoke",
    "weights": f"{HERE}::test_weights_bench_smoke",
}
NOT_YET: set[str] = set()


def _bench(*args: str, timeout_s: float = 600) -> guard.Outcome:
    out = guard.run([sys.executable, "-m", *args], timeout_s, echo=False, tail_lines=40)
    assert out.code == 0, f"python -m {' '.join(args)}: exit {out.code}\n{out.tail}"
    assert out.leftovers == 0, f"python -m {' '.join(args)} left {out.leftovers} process(es) running"
    return out


# ---------------------------------------------------------------- the rule itself


def _bench_modules() -> dict[str, Path]:
    """Every module under bench/, by its dotted name below `bench` (`e2e.study`), package __init__ files left out."""
    return {".".join(p.relative_to(ROOT / "bench").with_suffix("").parts): p
            for p in (ROOT / "bench").rglob("*.py") if p.name != "__init__.py"}


def test_every_bench_module_has_a_smoke_test():
    modules = set(_bench_modules()) - NOT_YET
    missing = sorted(modules - set(SMOKE))
    assert not missing, (f"bench modules without a smoke test: {missing}; add a test that runs each on tiny inputs "
                         f"and name it in SMOKE in {HERE}")
    assert not set(SMOKE) - modules, f"SMOKE names modules that are gone: {sorted(set(SMOKE) - modules)}"
    for module, node in SMOKE.items():
        path, name = node.split("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, f"SMOKE[{module!r}] names {node}, which does not exist"


def test_every_bench_entry_point_is_guarded():
    """A bench run as a script stops everything it started however it ends (bench.guard.main)."""
    for module, path in _bench_modules().items():
        text = path.read_text()
        if module in NOT_YET or 'if __name__ == "__main__":' not in text:
            continue
        entry = text.split('if __name__ == "__main__":')[-1]
        assert "guard.main(main)" in entry, f"bench.{module}: end it with `guard.main(main)` (see bench/guard.py)"


def test_every_study_package_has_one_entry_point():
    """A study package runs as `python -m bench.NAME` (its __main__.py); bench/sim/ is a library, not a study."""
    for package in (p.parent for p in (ROOT / "bench").glob("*/__init__.py")):
        if package.name == "sim":
            assert not (package / "__main__.py").exists(), "bench/sim/ is shared by studies and runs nothing itself"
            continue
        assert (package / "__main__.py").is_file(), f"bench/{package.name}/: add a __main__.py (python -m bench.NAME)"
        assert (package / "study.py").is_file(), f"bench/{package.name}/: the study's code goes in study.py"


# ---------------------------------------------------------------- fails fast, leaves nothing


def _alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def test_a_failing_bench_exits_at_once_and_stops_its_children(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys
        from bench import guard

        def main():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            print(child.pid, flush=True)
            raise RuntimeError("boom")

        guard.main(main)
    """))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr
    assert time.monotonic() - t0 < 30
    assert _alive([int(proc.stdout.split()[0])]) == []


def test_run_stops_a_bench_that_ignores_sigterm_and_whose_child_holds_its_pipe():
    """The hang of issue #25: past the limit, the bench and an orphan that holds its output pipe are killed."""
    code = textwrap.dedent("""
        import signal, subprocess, sys, time
        ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
        print(subprocess.Popen([sys.executable, "-c", ignore]).pid, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
    """)
    t0 = time.monotonic()
    out = guard.run([sys.executable, "-c", code], 3, echo=False, grace_s=1)
    assert out.code == "timeout" and time.monotonic() - t0 < 30
    assert _alive([int(out.tail.split()[0])]) == []


def test_a_bench_whose_runner_is_killed_stops_with_its_processes(tmp_path):
    """SIGKILL the process that ran a bench through guard.run (a test run or `make bench` killed): the bench notices
    that its runner is gone and stops itself and its children instead of running on unowned."""
    bench = tmp_path / "bench_sleeps.py"
    bench.write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        from bench import guard

        def main():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            print("PIDS", os.getpid(), child.pid, flush=True)
            time.sleep(120)

        guard.main(main)
    """))
    runner = subprocess.Popen(
        [sys.executable, "-c", f"from bench import guard; guard.run([{sys.executable!r}, {str(bench)!r}], 120)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = runner.stdout.readline()
            assert line, "the runner ended before the bench started"
        pids = [int(x) for x in line.split()[1:]]
        runner.kill()
        runner.wait()
        end = time.monotonic() + 30
        while _alive(pids) and time.monotonic() < end:
            time.sleep(0.2)
        assert _alive(pids) == [], "the bench outlived the process that ran it"
    finally:
        runner.kill()
        runner.wait()
        runner.stdout.close()


@pytest.mark.slow
def test_a_bench_killed_mid_run_leaves_no_process(tmp_path, tiny_model_dir):
    """bench.pipeline (a buffer, scripted producers and the learner as processes), SIGTERMed once they run: it
    exits non-zero within seconds and none of its processes is left."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.pipeline", "--steps", "200", "--out", str(tmp_path / "p.md")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        end = time.monotonic() + 120
        seen: dict[int, psutil.Process] = {}
        while time.monotonic() < end and len(seen) < 3:  # the buffer and both producers
            seen.update((p.pid, p) for p in guard.descendants(proc.pid))
            time.sleep(0.2)
        assert len(seen) >= 3, "bench.pipeline never started its processes"
        time.sleep(2)
        seen.update((p.pid, p) for p in guard.descendants(proc.pid))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        assert code != 0 and time.monotonic() - t0 < 20
        time.sleep(0.5)
        assert _alive(list(seen)) == [], "processes of the killed bench still run"
        assert guard.group_members(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_run_all_goes_on_after_failures_and_reports_them_all(capsys):
    from bench import run_all

    py = ["-c"]
    benches = [("fails", [*py, "raise SystemExit(3)"], 30), ("hangs", [*py, "import time; time.sleep(120)"], 2),
               ("works", [*py, "print('fine')"], 30)]
    t0 = time.monotonic()
    assert run_all.main([], benches=benches) == 1
    assert time.monotonic() - t0 < 30
    out = capsys.readouterr().out
    assert "=== works: exit 0" in out and "2 of 3 benchmarks failed" in out
    assert "--- fails (exit 3)" in out and "--- hangs (timed out after" in out
    for name, args, _ in run_all.BENCHES:  # the real list names modules that exist, each with a main
        package = (ROOT / Path(*args[1].split("."))).is_dir()  # a study package: `-m` runs its __main__.py
        entry = f"{args[1]}.__main__" if package else args[1]
        assert args[0] == "-m" and callable(__import__(entry, fromlist=["main"]).main), name


# ---------------------------------------------------------------- each bench, small


def test_learner_bench_publish_baseline_and_spread(tmp_path):
    """bench.throughput.learner in-process: the publish rows' baseline is memcpy into preallocated memory, with its
    spread."""
    from bench.throughput import learner

    out = tmp_path / "learner.md"
    assert learner.main(["--reps", "1", "--hidden", "64", "--layers", "1", "--vocab", "256", "--groups", "2",
                         "--big-mib", "32", "--publish-reps", "2", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    for p in data["publish"].values():
        s = p["ratio_to_memcpy_spread"]
        assert 0 < s["min"] <= s["median"] <= s["max"] and p["memcpy_mbs"] > 0
    assert "memcpy (preallocated)" in out.read_text()


@pytest.mark.slow
def test_throughput_smoke_runs_every_component(tmp_path):
    """bench.throughput --smoke: its parts as subprocesses, bench.throughput.buffer_ingest (a buffer process),
    bench.throughput.producer (real vLLM engines on a random tiny Llama) and bench.throughput.learner, and the table
    with each ratio's spread, its numbers also in throughput.json (the README's table)."""
    out = tmp_path / "throughput.md"
    _bench("bench.throughput", "--smoke", "--results", str(tmp_path), "--out", str(out), timeout_s=900)
    text = out.read_text()
    for row in ("buffer ingest", "producer generation", "learner step", "weight publish",
                "producer in-place weight load"):
        assert row in text, f"no {row!r} row:\n{text}"
    assert "failed" not in text and "copy into new memory" not in text
    for name in ("buffer_ingest", "producer", "learner"):
        assert (tmp_path / f"{name}.json").is_file()
    data = json.loads(out.with_suffix(".json").read_text())  # what the README's table is rendered from
    assert not data["failures"] and len(data["loadavg"]["samples_1min"]) == 2 * 3
    for row in data["rows"]:
        assert row["ours"] > 0 and row["baseline"] > 0 and row["ratio"] > 0, row
        assert row["ratio_spread"]["min"] <= row["ratio_spread"]["max"], row
    assert {r["component"].split(" (")[0] for r in data["rows"]} >= {"buffer ingest", "producer generation",
                                                                    "weight publish, bf16"}


@pytest.mark.slow
def test_pipeline_bench_smoke(tmp_path, tiny_model_dir):
    """bench.pipeline on the scripted engine: the round-synchronous reference arm (bench.pipeline.reference_buffer's
    barrier buffer) and max_staleness 0, 1, 2, with the timeline's table and picture."""
    out = tmp_path / "pipeline.md"
    _bench("bench.pipeline", "--engines", "scripted", "--steps", "4", "--repeats", "1", "--batch", "2", "--out",
           str(out))
    text = out.read_text()
    for arm in ("reference (round-synchronous)", "max_staleness 0", "max_staleness 1", "max_staleness 2"):
        assert f"| {arm} |" in text, f"no {arm!r} row:\n{text}"
    data = json.loads(out.with_suffix(".json").read_text())["engines"]["scripted"]["arms"]
    assert data["reference"]["x_reference"]["median"] == 1.0 and data["reference"]["staleness_seen"] == 0
    assert all(data[str(k)]["timeline"] for k in ("reference", 0, 1, 2))
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_pipeline_bench_vllm_smoke(tmp_path, tiny_model_dir):
    """bench.pipeline's vLLM path, small: a real `reinforce-ada producer` engine with --timeline (one, eager: two
    engine starts in all, one per arm; the second producer of the full bench runs the same code), the reference and
    on-policy arms, their timeline (weight loads included) and CPU share, and the vLLM picture."""
    out = tmp_path / "pipeline.md"
    _bench("bench.pipeline", "--engines", "vllm", "--vllm-steps", "4", "--vllm-repeats", "1", "--batch", "2",
           "--arms", "reference,0", "--producers", "1", "--eager", "--out", str(out), timeout_s=900)
    data = json.loads(out.with_suffix(".json").read_text())["engines"]["vllm"]["arms"]
    assert set(data) == {"reference", "0"} and data["0"]["staleness_seen"] == 0
    timeline = data["0"]["timeline"][0]
    assert timeline["weight_load_s_median"] is not None and 0 < timeline["cpu_share"] <= 1.05
    # a vLLM producer's assignments overlap: busy is the union of their spans, a share of the window (<= 1 only
    # with the union; the sum of overlapping spans goes past 1), and the one producer generated every measured
    # step's batch, so it was busy inside the window
    busy = timeline["producer_busy_share"]
    assert len(busy) == 1 and 0 < max(busy.values()) <= 1, busy
    assert {"learner", "producer"} <= {k.split("/")[0] for k in timeline["cpu_share_by_role"]}
    assert "--arms reference,0" in out.read_text() and out.with_name("pipeline_vllm.png").stat().st_size > 0


@pytest.mark.slow
def test_peer_trl_bench_smoke(tmp_path, tiny_model_dir):
    """bench.peer_trl for real, small: TRL's GRPOTrainer (transformers generation, the fallback: the vLLM one is
    the full bench's) and this project's GRPO, two steps each on the tiny model, evaluated by one vLLM engine
    (--smoke: eager engines), reported with its table and plot."""
    _bench("bench.peer_trl", "--smoke", "--seeds", "0", "--arms", "trl-grpo", "grpo", "--trl-engine", "transformers",
           "--out", str(tmp_path), "--work", str(tmp_path / "work"), "--model.path", "tiny",
           "--producers.engine.max_model_len", "64",
           "--sampling.max_new_tokens", "8", timeout_s=1200)
    data = json.loads((tmp_path / "peer_trl.json").read_text())
    runs = data["runs"]["0"]
    assert runs["trl-grpo"]["steps"] == 2 and runs["grpo"]["steps"] == 2
    for arm in ("trl-grpo", "grpo"):
        assert [c["version"] for c in runs[arm]["curve"]] == [0, 1, 2]
    assert runs["trl-grpo"]["curve"][-1]["samples"] == 2 * 4 * data["batch_prompts"]  # n per prompt, B per step
    assert runs["grpo"]["curve"][-1]["samples"] >= 2 * 4 * data["batch_prompts"]  # streaming: more in flight
    assert (tmp_path / "peer_trl.md").is_file() and (tmp_path / "peer_trl.png").is_file()
    assert runs["grpo"]["run_start_s"] > runs["grpo"]["learner_start_s"] > 0  # engines and buffer before the learner
    # an interrupted sweep goes on with --reuse: every arm and evaluation that finished is taken, nothing reruns
    again = tmp_path / "again"
    _bench("bench.peer_trl", "--smoke", "--seeds", "0", "--arms", "trl-grpo", "grpo", "--reuse", "--out", str(again),
           "--work", str(tmp_path / "work"), "--model.path", "tiny", "--producers.engine.max_model_len", "64",
           "--sampling.max_new_tokens", "8", timeout_s=120)
    reused = json.loads((again / "peer_trl.json").read_text())["runs"]["0"]
    for arm in ("trl-grpo", "grpo"):
        assert reused[arm]["curve"] == runs[arm]["curve"]
    assert reused["grpo"]["reused"].endswith("grpo-s0")


@pytest.mark.slow
def test_weights_bench_smoke(tmp_path, tiny_model_dir):
    _bench("bench.weights", "--reps", "1", "--members", "1", "--big-mib", "16", "--out", str(tmp_path))
    data = json.loads((tmp_path / "weights.json").read_text())
    assert {r["set"] for r in data["results"]} == {"tiny model", "16 MiB set"}
    assert all("ratio_spread" in r for r in data["results"])


@pytest.mark.slow
def test_e2e_bench_trains_and_evaluates_a_tiny_sweep(tmp_path, tiny_model_dir):
    """bench.e2e for real: one GRPO run of 2 steps (`reinforce-ada train`: buffer, a vLLM producer, the learner;
    --smoke: one producer, eager engines), then bench.e2e.evaluate on 20 held-out problems, the statistics, the
    markdown and the plot."""
    _bench("bench.e2e", "--smoke", "--seeds", "1", "--settings", "normal", "--steps", "2", "--eval-every", "2",
           "--strategies", "grpo", "--eval-problems", "20", "--k", "1", "--out", str(tmp_path), "--name", "smoke",
           timeout_s=900)
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert [r["code"] for r in data["runs"]] == [0]
    assert (tmp_path / "smoke.md").is_file() and (tmp_path / "smoke.png").is_file()


@pytest.mark.slow
def test_eval_noise_bench_smoke(tmp_path, tiny_model_dir):
    """bench.eval_noise on the tiny model: 2 draws of 6 problems along both paths (vLLM's LLM, then the producer's
    engine fed evaluation rounds; eager engines, as both paths build theirs from producers.engine), and a report
    that compares them."""
    _bench("bench.eval_noise", "--config", "configs/tiny.toml", "--draws", "2", "--problems", "6", "--k", "2",
           "--out", str(tmp_path), "--producers.engine.enforce_eager", "true", timeout_s=600)
    data = json.loads((tmp_path / "eval_noise.json").read_text())
    for path in ("offline", "engine"):
        assert [d["seed"] for d in data["draws"][path]] == [0, 1]
        assert all(0.0 <= d["accuracy"] <= 1.0 for d in data["draws"][path])
        assert data["summary"][path]["min"] <= data["summary"][path]["mean"] <= data["summary"][path]["max"]
    assert "| engine | 2 |" in (tmp_path / "eval_noise.md").read_text()


@pytest.mark.slow
def test_train_throughput_smoke(tmp_path):
    """bench.train_throughput --smoke: one offline vLLM engine and one `reinforce-ada train` run on the realistic
    model's shape (random weights, no trained model needed), each pinned to its cores as the full bench's pinned
    pair is (learner.cpu_cores, producers.engine.cpu_cores)."""
    out = tmp_path / "tt"
    _bench("bench.train_throughput", "--smoke", "--prompts", "8", "--steps", "2", "--max-new-tokens", "8",
           "--out", str(out), timeout_s=900)
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["offline"][0]["tokens"] > 0 and data["train"][0]["steps"] == 2
    assert data["offline"][0]["cores"] and data["train"][0]["pinned"] and 0 <= data["train"][0]["learner_busy"] <= 1
    assert "/ offline on the same cores" in out.with_suffix(".md").read_text()
