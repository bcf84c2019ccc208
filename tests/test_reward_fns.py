"""Pluggable rewards: `reward.fn` loading and its errors, extras per sample, user functions that hang, raise or
kill their worker (0.0, counted, the pool lives on), the exact-match reward, and the code reward against hostile
programs."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.rewards import RewardPool, check_reward_config, load_reward_fn, sandbox, score_guarded, verify
from pipeline.rewards.code import last_python_block, run_program, unit_tests
from pipeline.rewards.match import exact_match, final_answer, normalize_text

HERE = "tests.test_reward_fns"

# ---- user reward functions (top level: spawned workers import them by name) ----


def contains(completion: str, answer: str, **extras) -> float:
    """1.0 if the answer occurs in the completion; extras["weight"] scales it (a continuous reward)."""
    return float(answer in completion) * extras.get("weight", 1.0)


def misbehave(completion: str, answer: str, **extras) -> float:
    """Does what the completion says: loop in Python, raise, return junk, or kill its own process."""
    if completion == "loop":
        while True:
            pass
    if completion == "raise":
        raise ValueError("bad sample")
    if completion == "nan":
        return math.nan
    if completion == "text":
        return "1.0"  # type: ignore[return-value]
    if completion == "exit":
        raise SystemExit(0)
    if completion == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def only_completion(completion: str) -> float:
    return 1.0


def with_tests(completion: str, answer: str, tests: list) -> float:
    return float(len(tests))


not_a_function = 3


# ---- loading reward.fn ----


def test_the_default_and_the_builtins_load():
    assert load_reward_fn("pipeline.rewards.math:verify") is verify
    assert check_reward_config(load_config(None, [])) is verify
    cfg = load_config(None, ["--reward.fn", "pipeline.rewards.code:unit_tests", "--data.extra_keys",
                             '["extra_info.tests"]'])
    assert check_reward_config(cfg) is unit_tests
    assert load_reward_fn("pipeline.rewards.match:exact_match", ["aliases"]) is exact_match


@pytest.mark.parametrize(
    ("spec", "names", "match"),
    [
        ("no_such_module_xyz:f", (),
         r"reward\.fn: cannot import 'no_such_module_xyz' \(ModuleNotFoundError.*PYTHONPATH"),
        (f"{HERE}:missing", (),
         r"reward\.fn: module 'tests\.test_reward_fns' has no 'missing'; its functions: .*contains"),
        (f"{HERE}:not_a_function", (), r"reward\.fn: tests\.test_reward_fns:not_a_function is a int, not a function"),
        (f"{HERE}:only_completion", (), r"reward\.fn: .*cannot be called as only_completion\(completion, answer\)"),
        (f"{HERE}:with_tests", (), r"cannot be called as with_tests\(completion, answer\): missing .*'tests'"),
        ("pipeline.rewards.math:verify", ("tests",),
         r"reward\.fn: .* cannot be called as verify\(completion, answer, tests=\.\.\.\).*data\.extra_keys"),
        ("verify", (), r"reward\.fn: 'verify' must be \"package\.module:function\""),
    ],
)
def test_a_bad_reward_fn_is_a_config_error_naming_the_key(spec, names, match):
    with pytest.raises(ConfigError, match=match):
        load_reward_fn(spec, names)
    with pytest.raises(ConfigError, match=match):  # the pool checks before any worker starts
        RewardPool(num_workers=0, fn=spec, extra_names=names)


def test_the_pool_of_a_config_checks_reward_fn_against_the_extras():
    cfg = load_config(None, ["--data.extra_keys", '["extra_info.tests"]', "--producers.reward_workers", "0"])
    with pytest.raises(ConfigError, match=r"reward\.fn: pipeline\.rewards\.math:verify cannot be called as "
                                          r"verify\(completion, answer, tests=\.\.\.\)"):
        RewardPool.from_config(cfg)
    cfg = load_config(None, ["--reward.fn", f"{HERE}:with_tests", "--data.extra_keys", '["extra_info.tests"]',
                             "--producers.reward_workers", "0"])
    with RewardPool.from_config(cfg) as pool:
        assert pool.score(["x", "y"], ["a", "a"], [{"tests": [1, 2]}, {"tests": []}]) == [2.0, 0.0]


# ---- user functions inline (main thread) ----


def test_inline_user_functions_are_limited_and_fenced():
    with RewardPool(num_workers=0, timeout_s=0.5, fn=f"{HERE}:misbehave") as pool:
        start = time.monotonic()
        scores = pool.score(["loop", "raise", "nan", "text", "exit", "fine"], ["1"] * 6)
        assert scores == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert time.monotonic() - start < 3.0
        assert pool.metrics() == {"reward_errors": 4, "reward_timeouts": 1, "reward_crashes": 0,
                                  "reward_workers_replaced": 0}
        assert pool.counts["ok"] == 1


def test_a_continuous_reward_with_extras_per_sample():
    with RewardPool(num_workers=0, fn=contains, extra_names=["weight"]) as pool:
        got = pool.score(["the answer is 7", "no", "7"], ["7", "7", "7"], [{"weight": 0.25}, {}, {"weight": 3}])
        assert got == [0.25, 0.0, 3.0]
    with pytest.raises(ValueError, match="one dict per completion"):
        RewardPool(num_workers=0, fn=contains).score(["a"], ["a"], [])


def test_score_guarded_from_the_main_thread():
    assert score_guarded(f"{HERE}:contains", "x 5", "5", 1.0, {"weight": 0.5}) == 0.5
    start = time.monotonic()
    assert score_guarded(misbehave, "loop", "1", 0.3) == 0.0
    assert time.monotonic() - start < 2.0


# ---- user functions in worker processes ----


@pytest.mark.slow
def test_workers_survive_hanging_raising_and_dying_user_functions():
    with RewardPool(num_workers=2, timeout_s=1.0, fn=f"{HERE}:misbehave") as pool:
        assert pool.wait_ready(60)
        pids = set(pool.worker_pids())
        start = time.monotonic()
        assert pool.score(["loop", "raise", "nan", "fine"], ["1"] * 4) == [0.0, 0.0, 0.0, 1.0]
        assert time.monotonic() - start < 5.0
        # a Python loop is interrupted in the worker: no worker was replaced
        assert set(pool.worker_pids()) == pids and pool.num_replaced == 0
        # a function that kills its own process: 0.0, the worker is replaced, and the pool goes on
        assert pool.score(["die", "fine"], ["1", "1"]) == [0.0, 1.0]
        assert pool.num_replaced == 1
        assert pool.metrics() == {"reward_errors": 2, "reward_timeouts": 1, "reward_crashes": 1,
                                  "reward_workers_replaced": 1}


@pytest.mark.slow
def test_extras_reach_the_workers_and_inline_pools_use_a_worker_from_threads():
    with RewardPool(num_workers=1, timeout_s=5.0, fn=f"{HERE}:contains", extra_names=["weight"]) as pool:
        assert pool.score(["a 7", "a 7"], ["7", "7"], [{"weight": 2.5}, {}]) == [2.5, 1.0]
    with RewardPool(num_workers=0, timeout_s=1.0, fn=f"{HERE}:misbehave") as pool:
        got: list[float] = []
        t = threading.Thread(target=lambda: got.extend(pool.score(["loop", "fine"], ["1", "1"])))
        t.start()
        t.join(90)
        assert got == [0.0, 1.0]
        assert pool.metrics()["reward_timeouts"] == 1


# ---- exact match ----


def test_exact_match_on_a_normalised_string():
    assert normalize_text("  The Eiffel-Tower! ") == "eiffel tower"
    assert exact_match("I think the answer is: the Eiffel Tower.", "Eiffel tower") == 1.0
    assert exact_match("Paris\n\nFinal answer: \\boxed{PARIS}", "paris") == 1.0
    assert exact_match("It is Lyon.\nParis", "Paris") == 1.0  # the last line
    assert exact_match("Answer: Paris, France", "Paris") == 0.0  # exact, not contained
    assert exact_match("Answer: Londres", "London", aliases=["Londres"]) == 1.0
    assert exact_match("", "x") == 0.0 and exact_match("the", "a") == 0.0  # nothing left to compare
    assert exact_match(None, "x") == 0.0  # type: ignore[arg-type]
    assert final_answer("the answered question\nAnswer is 42") == "42"
    start = time.monotonic()
    assert exact_match("answer: " * 200_000 + "x", "x") == 1.0  # only the tail is read
    assert time.monotonic() - start < 1.0


# ---- the code reward ----

GOOD = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def block(code: str) -> str:
    return f"Sure.\n```python\n{code}\n```\nDone."


def test_last_python_block():
    assert last_python_block("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert last_python_block("```python\na = 1\n```\n```python\nunclosed") == "a = 1\n"
    assert last_python_block("```\nplain\n```") is None
    assert last_python_block("no code") is None
    start = time.monotonic()  # linear on a flood of fences
    assert last_python_block("```" * 1_000_001) is None
    assert last_python_block("```python\n" * 100_001) == ""  # empty blocks, fenced by the next opening
    assert time.monotonic() - start < 1.0


def test_unit_tests_pass_and_fail():
    assert unit_tests(GOOD, "", tests=TESTS) == 1.0
    assert unit_tests(GOOD, "assert add(2, 2) == 4") == 1.0  # the answer as the tests
    assert unit_tests(GOOD.replace("a + b", "a - b"), "", tests=TESTS) == 0.0
    assert unit_tests("def add(a, b): return a + b", "", tests=TESTS) == 0.0  # no block
    assert unit_tests(block("def add(a, b) return"), "", tests=TESTS) == 0.0  # a syntax error
    with pytest.raises(ValueError, match="no tests to run"):
        unit_tests(GOOD, "", tests=[])


@pytest.mark.parametrize(
    "program",
    [
        "import sys\nsys.exit(0)",  # an early exit with status 0 is not a pass
        "import os\nos._exit(0)",
        "raise SystemExit",
        # Each attack below must succeed for the program to go on to define `add` (with the old in-process guard
        # these raised PermissionError; now the box has no view of tmp_path and no other process to signal).
        "import os\nassert os.system('touch {marker}') == 0",
        "import subprocess\nsubprocess.run(['touch', '{marker}'], check=True)",
        "import os\nos.kill({caller}, 9)",  # kill the caller
        "import shutil\nshutil.rmtree('{victim}')",
        "import os\nos.remove('{victim}/keep')",
        "x = bytearray(8 << 30)",  # more memory than allowed
        "open('big', 'wb').write(b'x' * (64 << 20))",  # a file over the size limit
    ],
)
def test_hostile_programs_score_zero_and_harm_nothing(tmp_path, program):
    if sandbox.isolation().kind != sandbox.BWRAP and "{" in program:
        pytest.skip(f"needs bubblewrap (isolation here: {sandbox.isolation().kind}); {sandbox.INSTALL_HINT}")
    marker, victim = tmp_path / "marker", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    code = program.format(marker=marker, victim=victim, caller=os.getpid()) + "\ndef add(a, b):\n    return a + b"
    assert unit_tests(block(code), "", tests=TESTS) == 0.0
    assert not marker.exists() and (victim / "keep").read_text() == "precious"


def test_a_flood_of_output_or_an_endless_loop_stops_at_the_limit():
    for program in ("while True:\n    print('x' * 100_000)", "while True:\n    pass", "import time\ntime.sleep(60)"):
        start = time.monotonic()
        assert unit_tests(block(program), "", tests=TESTS, time_limit_s=1.0) == 0.0
        assert time.monotonic() - start < 3.0, program


@pytest.mark.slow
def test_code_reward_in_the_pool_is_cut_by_the_worker_deadline():
    """The worker's own time limit (shorter than the code reward's) stops the program, and nothing it started
    survives (the program becomes a `sleep` with a unique argument, found by its command line)."""
    marker = f"{700 + os.getpid() % 99}.{time.monotonic_ns() % 10**6}"
    hang = block(f"import os\nos.execv('/bin/sleep', ['sleep', '{marker}'])")
    with RewardPool(num_workers=1, timeout_s=2.0, fn="pipeline.rewards.code:unit_tests",
                    extra_names=["tests"]) as pool:
        assert pool.wait_ready(60)
        start = time.monotonic()
        scores = pool.score([hang, GOOD, GOOD], ["", "", ""], [{"tests": TESTS}, {"tests": TESTS}, {"tests": ["1/0"]}])
        assert scores == [0.0, 1.0, 0.0]
        assert time.monotonic() - start < 8.0
        assert pool.metrics()["reward_timeouts"] == 1 and pool.num_replaced == 0

    def alive() -> bool:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if marker.encode() in cmdline.read_bytes():
                    return True
            except OSError:
                pass
        return False

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(), "the program outlived its reward call"


def test_run_program_needs_the_tests_to_finish():
    """run_program(program, tests): the tests run in a box of their own (it took one source with both before)."""
    assert run_program("x = 1", "assert x == 1") is True
    assert run_program("import sys; sys.stdout.close()", "pass") is True  # closing stdout does not hide the result
    assert run_program("assert False", "pass") is False
    assert run_program("x = 1", "assert x == 2") is False
