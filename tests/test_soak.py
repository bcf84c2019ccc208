"""Soak: a real buffer with 8 scripted producers at full rate and a scripted learner (bench/soak.py; run
`python -m bench.soak --seconds 60` for the long version). Memory must stay flat and no message be lost."""

import pytest

from bench.soak import run_soak

pytestmark = pytest.mark.slow


def test_soak_memory_flat_and_nothing_lost(tmp_path):
    r = run_soak(seconds=20, num_producers=8, batch=32, warmup_s=5, run_dir=tmp_path, log=print)
    assert r["rss_end_mb"] < r["rss_warm_mb"] + 50, r  # flat after warm-up
    assert r["results_sent"] > 1000 and r["learner_steps"] > 10, r
    assert r["results_received"] == r["results_sent"], r  # every result accepted, ignored or rejected: none lost
    assert r["samples_received"] <= r["samples_sent"], r
    assert r["groups_consumed"] == r["groups_trained"] + r["late_groups"], r  # every group handed out arrived
    assert r["late_groups"] == 0 and r["repeated_prompt_ids"] == 0, r
    assert r["prompts_accounted"], r  # admitted == released - reopened + dropped + active
    assert r["malformed"] == 0 and r["unroutable"] == 0, r
    assert r["snapshots"] >= r["learner_steps"], r  # one after every version
