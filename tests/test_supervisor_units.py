"""Supervisor parts without models: process groups die whole, logs and commands are recorded, the plan's
commands, the live view, the plain progress lines and the plots render."""

import json
import os
import sys
import time

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.plots import plot_runs
from pipeline.supervisor import live
from pipeline.supervisor.live import Display, JsonlTail, RunState, progress_line, render, sparkline
from pipeline.supervisor.plan import check_data_files, plan_children
from pipeline.supervisor.procs import Child, stop_all, write_commands

# a child that starts a grandchild and ignores SIGTERM in the grandchild, like an engine process might
SPAWNER = """
import os, signal, subprocess, sys, time
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
gc = subprocess.Popen([sys.executable, "-c", code])
print("GC" + "PID", gc.pid, flush=True)
time.sleep(60)
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_child_stop_kills_the_whole_group_and_logs(tmp_path):
    child = Child("spawner", "producer", [sys.executable, "-c", SPAWNER], tmp_path)
    child.start()
    deadline = time.monotonic() + 20
    while "GCPID" not in child.tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    gpid = int(child.tail().split("GCPID")[1].split()[0])
    assert _alive(gpid) and child.poll() is None
    t0 = time.monotonic()
    stop_all([child], grace_s=1.0)
    assert time.monotonic() - t0 < 10
    assert child.poll() is not None
    gone = time.monotonic() + 2.0  # SIGKILL was sent; on a loaded machine the kernel may take a moment to reap
    while _alive(gpid) and time.monotonic() < gone:
        time.sleep(0.05)
    assert not _alive(gpid), "the grandchild (ignoring SIGTERM) must be SIGKILLed with the group"
    assert "start:" in child.log_path.read_text()


def test_exit_code_and_restart(tmp_path):
    child = Child("crasher", "producer", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], tmp_path)
    child.start()
    child.proc.wait(10)
    assert child.poll() == 3 and "boom" in child.tail()
    child.start()
    child.proc.wait(10)
    assert child.log_path.read_text().count("start:") == 2


def test_commands_are_recorded(tmp_path):
    a = Child("buffer", "buffer", ["python", "-m", "pipeline.cli", "buffer", "--config", "x y.toml"], tmp_path)
    b = Child("producer-0", "producer", ["python", "-m", "pipeline.cli", "producer"], tmp_path,
              {"CUDA_VISIBLE_DEVICES": "1"})
    write_commands(tmp_path / "commands.sh", [a, b], "/repo")
    text = (tmp_path / "commands.sh").read_text()
    assert "'x y.toml'" in text and "CUDA_VISIBLE_DEVICES=1 python -m pipeline.cli producer" in text
    assert os.access(tmp_path / "commands.sh", os.X_OK)


def test_sparkline_and_tail(tmp_path):
    assert sparkline([0, 0.5, 1], lo=0, hi=1) == "▁▅█"
    assert sparkline([]) == ""
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []
    path.write_text('{"step": 1}\n{"step": 2')
    assert tail.read() == [{"step": 1}]
    with open(path, "a") as f:
        f.write('}\n')
    assert tail.read() == [{"step": 2}]


def test_live_view_renders(tmp_path):
    from rich.console import Console

    state = RunState("tiny", 10)
    state.steps = [{"step": 1, "reward_mean": 0.3, "loss": 0.1, "step_seconds": 1.0}]
    state.evals = [{"version": 0, "accuracy": 0.25, "k": 4, "problems": 10}]
    state.buffer = {"active": 3, "released": 5, "samples_per_released_group": 9.5, "rounds_to_exit": {1: 2, 2: 3},
                    "producers": {"producer-0": {"tokens_per_s": 1200.0, "busy_fraction": 0.9, "version": 1}}}
    state.children = [("producer-0", "running", "0")]
    console = Console(record=True, width=120)
    console.print(render(state))
    text = console.export_text()
    assert "producer-0" in text and "1200" in text and "0.250" in text
    assert "step 1 | reward 0.300" in state.step_line(state.steps[0])


# what a slow run needs: is anything generated, does the reward fire, where do the prompts go (the buffer's keys)
SNAPSHOT = {"samples_received": 4321, "positive_rate": 0.0712, "active": 37, "released": 120, "released_partial": 9,
            "dropped_unresolved": 14, "dropped_zero_variance": 55, "groups_waiting": 6, "learner_version": 3,
            "producers": {"producer-0": {"tokens_per_s": 234.5, "samples_done": 2100.0, "version": 3},
                          "producer-1": {"tokens_per_s": 198.0, "samples_done": 2221.0, "version": 2}}}


def test_live_view_shows_why_a_run_is_slow():
    from rich.console import Console

    state = RunState("slow", 10)
    state.buffer = SNAPSHOT
    state.children = [("producer-0", "running", "0"), ("producer-1", "down", "2")]
    console = Console(record=True, width=160)
    console.print(render(state))
    text = console.export_text()
    for expected in ("samples received", "4321", "pass rate so far", "0.071", "active 37", "released 120",
                     "9 unresolved", "dropped 14 unresolved, 55 zero-variance", "groups waiting", "learner version",
                     "2100", "2221", "234", "198"):
        assert expected in text, expected
    line = progress_line(SNAPSHOT)
    assert line.startswith("progress | samples 4321 (pass rate 0.071) | prompts active 37")
    assert "groups waiting 6 | learner version 3" in line and "producer-1 2221 samples 198 tok/s" in line
    # before the buffer answers, or with a key another version does not send, the view shows "-"
    assert "samples - (pass rate -)" in progress_line({})
    console.print(render(RunState("empty", 1)))


def test_plain_output_without_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(live, "PROGRESS_EVERY_S", 0.0)
    display = Display(RunState("plain", 2), tty=False)
    display.start()
    display.step({"step": 1, "reward_mean": 0.5, "loss": 0.01, "step_seconds": 2.0})
    display.eval({"version": 1, "k": 4, "accuracy": 0.4, "problems": 40})
    display.event("producer-0 exited with code -9; restarting it (1)")
    display.refresh()  # no metrics yet: no progress line
    display.state.buffer = SNAPSHOT
    display.refresh()
    display.stop()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1 | reward 0.500") and out[1] == "eval | version 1 | Ave@4 0.400 over 40 problems"
    assert out[2] == "producer-0 exited with code -9; restarting it (1)"
    assert len(out) == 4 and out[3].startswith("progress | samples 4321")


def test_plan_children_commands(tmp_path):
    cfg = load_config(None, ["--producers.count", "2", "--producers.devices", '["0", "1"]'])
    children, _ = plan_children(cfg, tmp_path / "config.toml", "/m", tmp_path, 6000)
    assert [c.name for c in children] == ["buffer", "producer-0", "producer-1", "learner"]
    for child in children:
        assert child.cmd[child.cmd.index("--endpoints.router_port") + 1] == "6000"
        assert "--endpoints.control_port" not in child.cmd  # derived: router_port + 1
        assert child.cmd[child.cmd.index("--config") + 1] == str(tmp_path / "config.toml")
    assert children[2].env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert children[1].cmd[children[1].cmd.index("--connect") + 1] == "127.0.0.1:6000"
    cfg = load_config(None, ["--learner.num_ranks", "2"])
    learner = plan_children(cfg, tmp_path / "c.toml", "/m", tmp_path, 6000)[0][-1]
    assert "torch.distributed.run" in learner.cmd and "--nproc-per-node=2" in learner.cmd


def test_missing_data_files_name_the_key(tmp_path):
    check_data_files(load_config(None))  # the built-in task
    with pytest.raises(ConfigError, match="^data.eval_files: nope.jsonl does not exist"):
        check_data_files(load_config(None, ["--data.eval_files", '["nope.jsonl"]']))
    existing = tmp_path / "train.jsonl"
    existing.write_text("{}\n")
    check_data_files(load_config(None, ["--data.train_files", f'["{existing}"]', "--data.eval_files", "[]"]))


def test_plots_single_and_overlay(tmp_path):
    for name, acc in (("a", 0.2), ("b", 0.3)):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"step": i, "reward_mean": 0.1 * i, "staleness_mean": 0.5, "staleness_max": 1,
             "buffer/samples_per_released_group": 9.0, "producers/busy": 0.8, "learner_busy": 0.5,
             "ledger/generated_tokens": 100 * i, "ledger/trained_tokens": 40 * i, "ledger/exit_cut_tokens": 60 * i})
            for i in range(1, 5)) + "\n")
        (run / "eval.jsonl").write_text(json.dumps({"version": 0, "accuracy": acc}) + "\n")
    files = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert len(files) == 6 and all(f.stat().st_size > 5000 for f in files)
    assert files[-1].name == "ledger.png"  # the tokens by fate, stacked (the first run's)


def test_train_refuses_a_reward_it_cannot_load_before_starting_anything(tmp_path, capsys):
    from pipeline.supervisor.main import main

    assert main(["--reward.fn", "no_such_module:score", "--run.dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "reward.fn" in err and "no_such_module" in err
    assert not (tmp_path / "tiny" / "logs").exists()  # no process was started


def test_every_process_logs_at_run_log_level(tmp_path):
    from pipeline import logs

    cfg = load_config(None, ["--run.log_level", "WARNING"])
    logs.setup(cfg.run.log_level)
    import logging

    assert logging.getLogger().level == logging.WARNING
    logs.setup("INFO")
    assert logging.getLogger().level == logging.INFO
    with pytest.raises(ConfigError, match="run.log_level"):
        load_config(None, ["--run.log_level", "LOUD"])


def _eval_row(version, math, amc):
    return {"version": version, "accuracy": (100 * math + 40 * amc) / 140, "k": 4, "problems": 140,
            "benchmarks": {"math500": {"problems": 100, "ave_at_k": math, "pass_at_k": min(1.0, 2 * math)},
                           "amc23": {"problems": 40, "ave_at_k": amc, "pass_at_k": min(1.0, 2 * amc)}}}


def test_evaluations_show_one_curve_per_benchmark(tmp_path, capsys):
    from rich.console import Console

    from pipeline.plots import eval_curves
    from pipeline.supervisor.live import summarise

    rows = [_eval_row(0, 0.30, 0.10), _eval_row(10, 0.35, 0.125), _eval_row(20, 0.40, 0.15)]
    curves = {label: pts for label, pts, _ in eval_curves(rows)}
    assert curves[" math500 Ave@k"] == [(0, 0.30), (10, 0.35), (20, 0.40)]
    assert curves[" amc23 pass@k"] == [(0, 0.2), (10, 0.25), (20, 0.3)]
    assert " all (Ave@k)" in curves  # several benchmarks: the weighted curve too
    state = RunState("tiny", 20)
    state.evals = rows
    console = Console(record=True, width=120)
    console.print(render(state))
    text = console.export_text()
    assert "amc23 Ave / pass@k" in text and "0.150 / 0.300" in text
    Display(state, tty=False).eval(rows[-1])
    assert "math500 Ave 0.400 pass 0.800" in capsys.readouterr().out
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    state.evals = [rows[0], rows[2], rows[1]]  # read in another order: the summary quotes the latest version
    summarise(state, run, 60.0)
    out = capsys.readouterr().out
    assert "0.243 at version 0 -> 0.329 at version 20 | math500 Ave 0.400" in out
    assert (run / "plots" / "accuracy.png").is_file()


def test_free_ports_lie_below_the_ephemeral_range_and_skip_held_ones(tmp_path, monkeypatch):
    """The supervisor's ports come from below the kernel's ephemeral range (an outgoing connection cannot take
    them as its source port before the buffer binds) and a port held on any interface is never handed out."""
    import secrets
    import socket

    from pipeline import transport

    (tmp_path / "range").write_text("31000\t60999\n")
    monkeypatch.setattr(transport, "EPHEMERAL_RANGE", tmp_path / "range")
    for _ in range(50):
        port = transport.free_port_pair()
        assert transport.PORT_FLOOR <= port and port + 1 < 31000
    with socket.socket() as held:
        held.bind(("", transport.free_port()))
        taken = held.getsockname()[1]
        picks = iter([taken - transport.PORT_FLOOR - 1, taken - transport.PORT_FLOOR, 5])
        monkeypatch.setattr(secrets, "randbelow", lambda n: next(picks))
        assert transport.free_port_pair() == transport.PORT_FLOOR + 5  # taken - 1 .. taken, then taken: skipped
    (tmp_path / "range").write_text(f"{transport.PORT_FLOOR + 1} 60999\n")  # no room below it: the kernel picks
    assert transport.free_port() > 0
