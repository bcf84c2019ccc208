"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY_MODEL_DIR = Path(__file__).resolve().parents[1] / ".cache" / "tiny-model"


def pytest_collection_modifyitems(config, items):
    """Slow tests first, in file order, then the rest: with `make test`'s two workers (`-n 2 --dist worksteal`)
    the long multi-process tests start at once and the many short ones fill the gaps at the end, instead of one
    long test running alone while the other worker idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny arithmetic model (seed 0), built once per checkout (~1-2 min on 2 cores) and then reused."""
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
    checkout (~2 min on one core) into .cache/realistic-model; see pipeline/testing/realistic_model.py."""
    from pipeline.testing.realistic_model import ensure_realistic_model

    return ensure_realistic_model()
