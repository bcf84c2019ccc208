"""The supervisor's restart decisions: crash loops end the run with their cause, other deaths keep the restart
budgets. The decision is tested as a pure function of a child's history, then through the real watch loop with
real child processes (tiny Python commands, no models)."""

import sys

import pytest

from pipeline.config import Config
from pipeline.supervisor.launchers import Launcher
from pipeline.supervisor.lifecycle import RunFailed, Watch, wait_until
from pipeline.supervisor.live import Display, RunState
from pipeline.supervisor.plan import RunPlan
from pipeline.supervisor.procs import Child, stop_all
from pipeline.supervisor.restarts import POLICIES, Death, RestartPolicy, decide, last_error_line

ERROR = "RuntimeError: CPU Generator does not use offset"
TRACEBACK = """\
INFO 12:00:01 engine started
Traceback (most recent call last):
  File "/x/gpu_model_runner.py", line 10, in _bookkeeping_sync
    gen.set_offset(gen.get_offset() - 4)
    ^^^^^^^^^^^^^^
RuntimeError: CPU Generator does not use offset
INFO 12:00:02 shutting down
"""


def test_same_error_k_times_in_a_row_is_a_crash_loop():
    policy = RestartPolicy(max_restarts=5, same_error_limit=3)
    deaths = [Death(1, ERROR), Death(1, ERROR)]
    assert decide(deaths, policy) is None
    verdict = decide(deaths + [Death(1, ERROR)], policy)
    assert verdict is not None and verdict.crash_loop
    text = verdict.describe("producer-0", "runs/x/logs/producer-0.log", "tail")
    assert ERROR in text and "producer-0" in text and "runs/x/logs/producer-0.log" in text
    assert "3 times in a row with the same error" in text
    # only the last K deaths count: an older different error does not hide a loop
    assert decide([Death(1, "ValueError: x"), Death(1, ERROR), Death(1, ERROR), Death(1, ERROR)], policy).crash_loop


def test_different_errors_and_deaths_without_one_keep_the_budget():
    policy = POLICIES["producer"]
    mixed = [Death(1, "ValueError: a"), Death(1, "ValueError: b"), Death(1, "ValueError: a"),
             Death(1, "ValueError: b"), Death(1, "ValueError: a")]
    assert decide(mixed, policy) is None  # 5 deaths: the 5th restart is within the budget of 5
    verdict = decide(mixed + [Death(1, "ValueError: b")], policy)
    assert verdict is not None and not verdict.crash_loop
    assert "died 6 times (last exit code 1)" in verdict.describe("producer-0", "p.log", "last lines")
    # SIGKILLs leave no exception line: never a crash loop, and one breaks a loop in progress
    killed = [Death(-9)] * 3
    assert decide(killed, policy) is None
    assert decide([Death(1, ERROR), Death(1, ERROR), Death(-9)], policy) is None
    assert decide([Death(1, ERROR), Death(-9), Death(1, ERROR)], policy) is None
    # the learner and the buffer have 3 restarts
    assert decide([Death(-9)] * 3, POLICIES["learner"]) is None
    assert not decide([Death(-9)] * 4, POLICIES["buffer"]).crash_loop


def test_last_error_line():
    assert last_error_line(TRACEBACK) == ERROR
    chained = TRACEBACK + "\nThe above exception was the direct cause of the following exception:\n\n" + \
        "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n" + \
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    assert last_error_line(chained) == "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."
    # vLLM's engine process prefixes its lines with its pid, and messages may hold addresses: both are masked
    a = last_error_line("(EngineCore_DP0 pid=111) Traceback (most recent call last):\n(EngineCore_DP0 pid=111)   "
                        "File \"x\"\n(EngineCore_DP0 pid=111) KeyError: <obj at 0x7f00aa>\n")
    b = last_error_line("(EngineCore_DP0 pid=222) Traceback (most recent call last):\n(EngineCore_DP0 pid=222)   "
                        "File \"x\"\n(EngineCore_DP0 pid=222) KeyError: <obj at 0x7f11bb>\n")
    assert a == b == "KeyError: <obj at 0x?>"
    assert last_error_line("INFO ready\nERROR something\n") == ""
    assert last_error_line("") == ""
    assert last_error_line("INFO x\nValueError: bad row 3\nINFO exiting\n") == "ValueError: bad row 3"


def test_log_since_start_is_the_last_run_only(tmp_path):
    child = Child("p", "producer", [sys.executable, "-c", "raise ValueError('first')"], tmp_path)
    child.start()
    child.proc.wait(20)
    assert last_error_line(child.log_since_start()) == "ValueError: first"
    child.cmd = [sys.executable, "-c", "print('fine')"]
    child.start()
    child.proc.wait(20)
    assert "first" not in child.log_since_start() and "fine" in child.log_since_start()
    assert last_error_line(child.log_since_start()) == ""


def _plan(tmp_path, producer_code: str, learner_code: str = "import time; time.sleep(60)") -> RunPlan:
    py = sys.executable
    children = [Child("buffer", "buffer", [py, "-c", "import time; time.sleep(60)"], tmp_path),
                Child("producer-0", "producer", [py, "-c", producer_code], tmp_path),
                Child("learner", "learner", [py, "-c", learner_code], tmp_path)]
    return RunPlan(Config(), tmp_path, children, router_port=0, launcher=Launcher(), host="127.0.0.1")


def _watch(plan: RunPlan) -> tuple[Watch, list[str]]:
    display = Display(RunState("t", 1), tty=False)
    events: list[str] = []
    display.event = events.append
    return Watch(plan, display, metrics=lambda: None, stopping=lambda: ""), events


def test_a_crash_loop_stops_the_run_with_its_cause(tmp_path):
    plan = _plan(tmp_path, "raise RuntimeError('CPU Generator does not use offset')")
    watch, events = _watch(plan)
    try:
        for child in plan.children:
            child.start()
        with pytest.raises(RunFailed) as err:
            watch.run()
    finally:
        stop_all(plan.children, grace_s=1.0)
    text = str(err.value)
    assert "producer-0 died 3 times in a row with the same error" in text
    assert f"    {ERROR}\n" in text and str(tmp_path / "producer-0.log") in text
    producer = plan.producers[0]
    assert producer.log_path.read_text().count("start:") == 3  # started, restarted twice, then given up on
    assert [d.error for d in producer.deaths] == [ERROR] * 3
    assert events == ["producer-0 exited with code 1; restarting it (1)",
                      "producer-0 exited with code 1; restarting it (2)"]


def test_deaths_without_the_same_error_use_the_budget(tmp_path):
    plan = _plan(tmp_path, "import sys; sys.exit(3)")  # no exception line: restarted 5 times, then the run stops
    watch, events = _watch(plan)
    try:
        for child in plan.children:
            child.start()
        with pytest.raises(RunFailed, match=r"producer-0 died 6 times \(last exit code 3\)"):
            watch.run()
    finally:
        stop_all(plan.children, grace_s=1.0)
    assert len(events) == 5 and plan.producers[0].restarts == 5


def test_a_dead_learner_is_restarted_with_resume_and_its_exit_0_ends_the_watch(tmp_path):
    learner = "import sys; sys.exit(0 if '--resume' in sys.argv else 1)"
    plan = _plan(tmp_path, "import time; time.sleep(60)", learner)
    watch, events = _watch(plan)
    try:
        for child in plan.children:
            child.start()
        watch.run()  # returns: the learner finished after its restart
    finally:
        stop_all(plan.children, grace_s=1.0)
    assert events == ["learner exited with code 1; restarting it (1)"]
    assert plan.learner.cmd[-1] == "--resume" and plan.learner.poll() == 0 and plan.learner.restarts == 1


def test_a_child_that_dies_while_starting_ends_the_run_with_its_error(tmp_path):
    child = Child("buffer", "buffer", [sys.executable, "-c", "raise OSError('Address already in use')"], tmp_path)
    child.start()
    try:
        with pytest.raises(RunFailed) as err:
            wait_until(lambda: False, [child], 30, "the buffer", stopping=lambda: "")
    finally:
        stop_all([child], grace_s=1.0)
    assert "buffer exited with code 1 while starting" in str(err.value)
    assert "    OSError: Address already in use" in str(err.value)
    with pytest.raises(RunFailed, match="interrupted"):
        wait_until(lambda: False, [], 30, "the buffer", stopping=lambda: "interrupted (Ctrl-C)")


def test_a_child_that_stops_the_run_on_purpose_is_not_restarted(tmp_path):
    from pipeline.exits import EXIT_FATAL

    verdict = decide([Death(EXIT_FATAL)], POLICIES["buffer"])
    assert verdict is not None and verdict.fatal
    text = verdict.describe("buffer", "b.log", "INFO serving\nbuffer: stopping the run: the reward never fired\n\n")
    assert f"buffer stopped the run (exit code {EXIT_FATAL})" in text
    assert "the reward never fired" in text and "b.log" in text
    # through the real watch loop: the buffer exits EXIT_FATAL, the learner follows with 0 (it got the Shutdown)
    py = sys.executable
    say = "import sys; print('buffer: stopping the run: the reward never fired', file=sys.stderr); sys.exit(%d)"
    say %= EXIT_FATAL
    children = [Child("buffer", "buffer", [py, "-c", say], tmp_path),
                Child("learner", "learner", [py, "-c", "import time; time.sleep(1.0)"], tmp_path)]
    plan = RunPlan(Config(), tmp_path, children, router_port=0, launcher=Launcher(), host="127.0.0.1")
    try:
        for child in children:
            child.start()
        watch = Watch(plan, Display(RunState("t", 1), tty=False), lambda: None, lambda: "")
        with pytest.raises(RunFailed, match="buffer stopped the run .exit code 78.:\n    buffer: stopping the run"):
            watch.run()
        assert children[0].restarts == 0
    finally:
        stop_all(children)
    # the same words when it stops the run before the others are up (a producer still loading its engine)
    (tmp_path / "early").mkdir()
    early = Child("buffer", "buffer", [py, "-c", say], tmp_path / "early")
    early.start()
    try:
        with pytest.raises(RunFailed, match="buffer stopped the run .exit code 78.:\n    buffer: stopping the run"):
            wait_until(lambda: False, [early], 30, "the producers", stopping=lambda: "")
    finally:
        stop_all([early], grace_s=1.0)
