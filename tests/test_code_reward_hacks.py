"""Known reward hacks against the code reward (`pipeline.rewards.code`): each must score 0.0, and honest solutions
must still score 1.0. Each hacking program is written so that it would pass if its attack worked (it defines a
correct function only then, or forges the verdict), so a 0.0 shows the attack failed, not that the program was
wrong for another reason. Attacks on the machine (files, network, processes) need the bwrap tier and are skipped,
with the reason, where this machine has only a weaker one; attacks on the verdict fail in every tier."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from pipeline.rewards import sandbox
from pipeline.rewards.code import run_program, unit_tests

LIMIT_S = 5.0
ISO = sandbox.isolation()
boxed = pytest.mark.skipif(ISO.kind != sandbox.BWRAP, reason=f"needs bubblewrap (isolation here: {ISO.kind}); "
                           f"{sandbox.INSTALL_HINT}")
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
CORRECT = "def add(a, b):\n    return a + b\n"


def score(program: str, tests: str = TESTS, iso: sandbox.Isolation | None = None) -> float:
    return float(run_program(program, tests, LIMIT_S, iso))


def processes_with(marker: str) -> list[int]:
    """Pids whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def gone(marker: str, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not processes_with(marker)


# ---- honest solutions ----


HONEST = [
    (CORRECT, TESTS),
    ("import math\ndef area(r):\n    return math.pi * r * r\n",
     "assert math.isclose(area(1.0), 3.14159, rel_tol=1e-4)\n"),  # the tests use the program's `import math`
    ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
     "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
     "    def __len__(self):\n        return len(self.items)\n",
     "s = Stack()\ns.push(1)\ns.push((2, 'b'))\nassert len(s) == 2 and s.pop() == (2, 'b') and s.items == [1]\n"),
    ("def squares(n):\n    for i in range(n):\n        yield i * i\n",
     "assert list(squares(4)) == [0, 1, 4, 9]\ng = squares(2)\nassert next(g) == 0\n"),
    ("def inv(x):\n    if x == 0:\n        raise ValueError('zero')\n    return 1 / x\n",
     "try:\n    inv(0)\nexcept ValueError:\n    pass\nelse:\n    assert False\nassert inv(4) == 0.25\n"),
    ("def stats(xs):\n    print('computing', xs)\n    return {'min': min(xs), 'set': set(xs), 'big': 2 ** 200, "
     "'b': bytes(xs), 'c': complex(1, 2), 'nan': float('nan')}\n",
     "r = stats([3, 1, 3])\nassert r['min'] == 1 and r['set'] == {1, 3} and r['big'] == 2 ** 200\n"
     "assert r['b'] == b'\\x03\\x01\\x03' and r['c'] == 1 + 2j and r['nan'] != r['nan']\n"),
    ("def has_close_elements(numbers, threshold):\n    return any(abs(a - b) < threshold for i, a in "
     "enumerate(numbers) for b in numbers[i + 1:])\n",
     "def check(candidate):\n    assert candidate([1.0, 2.0, 3.9], 0.3) is False\n"
     "    assert candidate([1.0, 2.8, 3.0], 0.3) is True\n\ncheck(has_close_elements)\n"),  # HumanEval's shape
    ("import threading\ndef work(path):\n    open(path, 'w').write('ok')\n"
     "    t = threading.Thread(target=lambda: None)\n    t.start()\n    t.join()\n    return open(path).read()\n",
     "assert work('scratch.txt') == 'ok'\n"),
]


@pytest.mark.parametrize(("program", "tests"), HONEST)
def test_honest_solutions_score_one(program, tests):
    assert score(program, tests) == 1.0
    assert score(program, tests + "assert False\n") == 0.0  # and a failing test still fails


def test_input_sees_an_end_of_file_not_the_channel():
    start = time.monotonic()
    program = "try:\n    input()\nexcept EOFError:\n    pass\nimport sys\nassert sys.stdin.read() == ''\n" + CORRECT
    assert score(program) == 1.0
    assert time.monotonic() - start < LIMIT_S


def test_unit_tests_end_to_end_and_timing():
    start = time.monotonic()
    for _ in range(3):
        assert unit_tests(f"```python\n{CORRECT}```", "", tests=TESTS.splitlines()) == 1.0
    per_sample_s = (time.monotonic() - start) / 3
    assert per_sample_s < 2.0, f"{per_sample_s:.2f} s per sample"


# ---- attacks on the verdict (every tier) ----


VERDICT_HACKS = {
    "exit before the tests": "import sys\nsys.exit(0)\n" + CORRECT.replace("a + b", "0"),
    "os._exit before the tests": "import os\nos._exit(0)\n",
    "exit inside the tested function": "def add(a, b):\n    raise SystemExit(0)\n",
    "os._exit inside the tested function": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "frame inspection (the issue's attack)": (
        "import os, sys\ndef add(a, b):\n    l = sys._getframe(1).f_locals\n"
        "    os.write(l.get('result', 1), str(l.get('token', 'pass')).encode() + b'\\n')\n    raise SystemExit(0)\n"),
    "every frame and object searched for the verdict channel": (
        "import gc, os, sys\ndef add(a, b):\n    f = sys._getframe()\n    while f:\n"
        "        for v in list(f.f_locals.values()) + list(f.f_globals.values()):\n"
        "            if hasattr(v, 'write'):\n                try:\n"
        "                    v.write(b'pass\\n'); v.flush()\n"
        "                except Exception:\n                    pass\n        f = f.f_back\n"
        "    for fd in range(256):\n        try:\n            os.write(fd, b'pass\\n')\n        except OSError:\n"
        "            pass\n    os._exit(0)\n"),
    "write the result file and descriptors": (
        "import os\nfor name in ('result', '/tmp/result', '../result', 'verdict'):\n    try:\n"
        "        open(name, 'w').write('pass\\n')\n    except OSError:\n        pass\n"
        "for fd in range(3, 256):\n    try:\n        os.write(fd, b'pass\\n')\n    except OSError:\n        pass\n"
        "os._exit(0)\n"),
    "patch builtins and AssertionError": (
        "import builtins\nclass Never(BaseException):\n    pass\nbuiltins.AssertionError = Never\n"
        "builtins.len = lambda x: 3\nbuiltins.abs = lambda x: 0\n"
        "def add(a, b):\n    return 0\n"),
    "a global that shadows a builtin": "def len(x):\n    return 3\ndef add(a, b):\n    return []\n",
    "an object equal to everything": (
        "class Eq:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
        "def add(a, b):\n    return Eq()\n"),
    "an int subclass equal to everything": (
        "class I(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return I(7)\n"),
    "a list subclass equal to everything": (
        "class L(list):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return L()\n"),
}
BUILTIN_TESTS = "assert add(1, 2) == 3\nassert len(add(1, 2)) == 3 if False else True\nassert abs(add(1, 2) - 3) == 0\n"


@pytest.mark.parametrize("name", VERDICT_HACKS)
def test_verdict_hacks_score_zero(name):
    assert score(VERDICT_HACKS[name], TESTS + BUILTIN_TESTS) == 0.0


def test_shadowed_builtins_are_the_tests_own():
    program = "def len(x):\n    return 3\ndef items():\n    return []\n"
    assert score(program, "assert len(items()) == 3\n") == 0.0
    assert score(program, "assert len(items()) == 0\n") == 1.0


def test_the_tests_expected_values_never_reach_the_program():
    """The program looks everywhere it can for the expected value (a fresh secret) and returns what it finds."""
    expected = f"SECRET{secrets.token_hex(16)}"
    program = (
        "import gc, glob, os, re, sys\npat = re.compile(rb'SECRET[0-9a-f]{32}')\n"
        "def answer():\n    blobs = []\n    f = sys._getframe()\n    while f:\n"
        "        blobs.append(repr(f.f_locals).encode())\n        f = f.f_back\n"
        "    blobs += [repr(o).encode()[:10000] for o in gc.get_objects()[:20000]]\n"
        "    for path in glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ') + glob.glob('/tmp/*') "
        "+ glob.glob('/proc/*/fd/*') + ['tests.py', '../tests.py']:\n        try:\n"
        "            with open(path, 'rb') as fh:\n                blobs.append(fh.read(1 << 20))\n"
        "        except Exception:\n            pass\n"
        "    for b in blobs:\n        m = pat.search(b)\n        if m:\n            return m.group().decode()\n"
        "    return ''\n")
    assert score(program, f"assert answer() == {expected!r}\n") == 0.0


# ---- attacks on the machine (bwrap) ----


@boxed
def test_no_secret_of_the_run_directory_can_be_read(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    token = secrets.token_hex(16)
    (run_dir / "learner.token").write_text(token)
    (run_dir / "learner.token").chmod(0o600)
    (run_dir / "learner.key_secret").write_text("secret-key = \"x\"\n")
    program = (f"import os\ndef add(a, b):\n    try:\n        t = open({str(run_dir / 'learner.token')!r}).read()\n"
               f"        os.listdir({str(run_dir)!r})\n    except OSError:\n        return None\n"
               f"    return a + b if t == {token!r} else None\n")
    assert score(program) == 0.0
    # nor the virtualenv, this repository, or a file in the trainer's home
    home_file = Path.home() / f".reward-hack-{secrets.token_hex(4)}"
    home_file.write_text("private")
    try:
        for path in (Path(sys.prefix) / "pyvenv.cfg", Path(__file__), home_file):
            assert score(f"open({str(path)!r}).read()\n" + CORRECT) == 0.0, path
            if path != home_file:  # the box's home holds only the folders of the bound interpreter
                assert score(f"import os\nos.listdir({str(path.parent)!r})\n" + CORRECT) == 0.0, path.parent
    finally:
        home_file.unlink()


@boxed
def test_a_pth_drop_into_the_virtualenv_fails():
    target = Path(sysconfig.get_paths()["purelib"]) / f"zz_reward_hack_{secrets.token_hex(4)}.pth"
    program = (f"def add(a, b):\n    try:\n        open({str(target)!r}, 'w').write('/nonexistent-reward-hack\\n')\n"
               f"    except OSError:\n        return None\n    return a + b\n")
    try:
        assert score(program) == 0.0
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


@boxed
def test_no_writable_file_outside_the_box(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o666)
    program = (f"def add(a, b):\n    try:\n        open({str(victim)!r}, 'w').write('owned')\n"
               f"    except OSError:\n        return None\n    return a + b\n")
    assert score(program) == 0.0
    assert victim.read_text() == "precious"


@boxed
def test_no_network_even_to_loopback():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    program = (f"import socket\ndef add(a, b):\n    try:\n        s = socket.create_connection(('127.0.0.1', {port}), "
               f"timeout=1)\n        s.sendall(b'hello')\n    except OSError:\n        return None\n    return a + b\n")
    try:
        assert score(program) == 0.0
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


@boxed
def test_killing_the_parent_or_everyone_reaches_no_process_outside(procs):
    bystander = subprocess.Popen(["sleep", "30"])
    procs.append(bystander)
    program = (f"import os, signal\nfor pid in ({os.getpid()}, {bystander.pid}, os.getppid(), -1):\n    try:\n"
               f"        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n" + CORRECT)
    score(program)  # whatever it scores, nothing outside the box died
    assert bystander.poll() is None


@boxed
def test_a_fork_bomb_is_bounded_and_dies_with_the_call():
    marker = f"{900 + secrets.randbelow(99)}.{secrets.randbelow(10**6)}"
    program = (
        "import os\nforked = 0\nfor _ in range(1000):\n    try:\n        pid = os.fork()\n    except OSError:\n"
        f"        break\n    if pid == 0:\n        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    forked += 1\n"
        "def add(a, b):\n    return a + b if forked >= 500 else None\n")
    start = time.monotonic()
    assert score(program) == 0.0
    assert time.monotonic() - start < LIMIT_S + 2
    assert gone(marker), "a forked process outlived its reward call"


@boxed
def test_a_setsid_escape_dies_with_the_call():
    marker = f"{800 + secrets.randbelow(99)}.{secrets.randbelow(10**6)}"
    program = (f"import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\n" + CORRECT)
    assert score(program) == 1.0  # a correct program: the escape gains nothing, and nothing survives
    assert gone(marker), "a setsid child outlived its reward call"


@boxed
def test_limits_hold_inside_the_box():
    for program in ("x = bytearray(4 << 30)\n", "open('big', 'wb').write(b'x' * (8 << 20))\n",
                    "import resource\nresource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6))\n",
                    "import os\nos.setuid(0)\n"):
        assert score(program + CORRECT) == 0.0, program


# ---- the weaker tiers still decide the verdict outside the program ----


@pytest.mark.parametrize("kind", [sandbox.UNSHARE, sandbox.NONE])
def test_weaker_tiers_keep_the_verdict_out_of_reach(kind, tmp_path, monkeypatch):
    iso = next((c for c in sandbox._candidates() if c.kind == kind), None)
    if iso is None or sandbox._works(iso):
        pytest.skip(f"isolation {kind!r} does not work here")
    monkeypatch.chdir(tmp_path)  # the caller's working directory: the boxes work in fresh directories of their own
    assert score(CORRECT, iso=iso) == 1.0
    for name in ("frame inspection (the issue's attack)", "write the result file and descriptors",
                 "an object equal to everything", "exit before the tests"):
        assert score(VERDICT_HACKS[name], iso=iso) == 0.0, name
    assert score("open('scratch.txt', 'w').write('x')\n" + CORRECT, iso=iso) == 1.0  # a program's own files
    assert list(tmp_path.iterdir()) == [], "a box wrote into the caller's working directory"


def test_a_forced_tier_that_is_missing_is_an_error_naming_the_fix(monkeypatch):
    monkeypatch.setenv(sandbox.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=r"REINFORCE_ADA_CODE_ISOLATION='bogus': use one of auto, bwrap"):
        sandbox.isolation.__wrapped__()
    monkeypatch.setenv(sandbox.ENV_VAR, "bwrap")
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"not available here \(not installed\); install bubblewrap"):
        sandbox.isolation.__wrapped__()


def test_the_box_ends_with_its_time_limit():
    start = time.monotonic()
    assert run_program("while True:\n    pass\n", "pass", 1.0) is False
    assert run_program("import time\ndef add(a, b):\n    time.sleep(60)\n", TESTS, 1.0) is False
    assert time.monotonic() - start < 4.0
    assert signal.SIGKILL  # (the boxes were killed by process group; see sandbox.kill_box)
