"""Shared pytest fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One torch (OpenMP) thread per process, inherited by every process a test starts: `make test` runs four workers on
# two cores, each with engines, learners and builds of its own, and the spare threads only spin waiting for a core
# (the suite: 806 -> 763 s on 2 cores, 1540 -> 1380 CPU-seconds). A value set outside the suite stays.
os.environ.setdefault("OMP_NUM_THREADS", "1")
TINY_MODEL_DIR = ROOT / ".cache" / "tiny-model"


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: only the tests that will run count
def pytest_collection_modifyitems(config, items):
    """Slow tests first, in file order, then the rest: with `make test`'s workers (`-n 4 --dist loadgroup
    --no-loadscope-reorder`: a worker takes the next test or group when it runs low) the long multi-process tests
    start at once and the many short ones fill the gaps at the end, instead of one long test running alone while the
    other workers idle. The tests that share a module-scoped fixture (a vLLM engine, a Ray cluster: tens of seconds
    of CPU to start) form one group, so one worker starts it once; split between workers, both started it."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        fixtures = item._fixtureinfo.name2fixturedefs.values()
        if any(d.scope == "module" for defs in fixtures for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    _start_model_builds(config, items)


def _model_builds() -> dict[str, tuple[bool, str]]:
    """{fixture: (its model is built and current, Python code that builds it)} for the test models."""
    from pipeline import tiny_model
    from pipeline.testing import realistic_model

    return {
        "tiny_model_dir": (tiny_model.is_current(TINY_MODEL_DIR, 0), "from pipeline.tiny_model import "
                           f"ensure_tiny_model; ensure_tiny_model({str(TINY_MODEL_DIR)!r})"),
        "realistic_model_dir": (realistic_model.is_current(realistic_model.DEFAULT_DIR, 0), "from "
                                "pipeline.testing.realistic_model import ensure_realistic_model; "
                                "ensure_realistic_model()"),
    }


def _start_model_builds(config, items) -> None:
    """Build the test models the selected tests need in background processes, one per model, from the start.

    Each build runs on one core for one to two minutes. Built inside the first fixture that needs it, a build held its
    worker, and the other worker soon blocked on the build's lock too: a core idled for minutes at the start of every
    clean run. Started here, the builds run side by side while the workers take tests; a fixture that needs a model
    still calls its `ensure_*`, which waits on the build's lock (or builds the model itself if this build failed)."""
    workers = getattr(config, "workerinput", {"workerid": "gw0", "workercount": 1})  # no xdist: one "worker"
    index, count = int(workers["workerid"].removeprefix("gw")), int(workers["workercount"])
    wanted = [(name, code) for name, (built, code) in _model_builds().items()
              if not built and any(name in item.fixturenames for item in items)]
    for i, (name, code) in enumerate(wanted):
        if i % count == index:  # each model is started by one worker
            (ROOT / ".cache").mkdir(exist_ok=True)
            with open(ROOT / ".cache" / f"{name.removesuffix('_dir')}-build.log", "a") as log:
                subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny arithmetic model (seed 0), copied once per checkout from the shipped build and then reused."""
    from pipeline.tiny_model import ensure_tiny_model

    return ensure_tiny_model(TINY_MODEL_DIR, seed=0)


@pytest.fixture
def procs():
    """Processes a test started; killed (by pid) and reaped at the end whatever happened."""
    started: list = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture(scope="session")
def realistic_model_dir() -> Path:
    """A model of realistic shape (BPE 8k vocabulary, chat template, tied embeddings, GQA), built once per
    checkout (about 95 s of one core) into .cache/realistic-model; see pipeline/testing/realistic_model.py."""
    from pipeline.testing.realistic_model import ensure_realistic_model

    return ensure_realistic_model()
