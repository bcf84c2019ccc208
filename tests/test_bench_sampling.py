"""Smoke test of bench/sampling and bench/allocation: the simulation at a tiny scale drives the real Scheduler
and gives sane costs."""

import json
import math

import numpy as np
import pytest

from bench.sampling import STRATEGIES, SimConfig, main, run_regime, simulate, table
from bench.sim.population import _beta_moment, draw_pass_rates, early_population, late_population

TINY = SimConfig(batch_size=32, num_steps=3, warmup_steps=1, num_engines=2, slots=32)


@pytest.fixture(scope="module")
def early():
    return run_regime(early_population(), TINY)


def test_populations_match_the_paper_targets():
    w0, a, b = early_population()
    assert (1 - w0) * a / (a + b) == pytest.approx(0.265, abs=1e-6)  # pass@1
    assert (1 - w0) * (1 - _beta_moment(a, b, 0, 256)) == pytest.approx(0.81, abs=1e-6)  # pass@256
    assert 0.1 < w0 < 0.3  # about the paper's ~19% prompts never solved
    w0_late, a_late, b_late = late_population(w0)
    assert (1 - w0_late) * _beta_moment(a_late, b_late, 4, 0) == pytest.approx(0.35, abs=1e-6)
    p = draw_pass_rates((w0, a, b), 20000, np.random.default_rng(0))
    assert p.mean() == pytest.approx(0.265, abs=0.01)


def test_costs_are_sane(early):
    stats, results = early
    grpo = results["GRPO (n=4)"]
    assert grpo["samples_per_step"] == 4 * TINY.batch_size  # one round of n = 4 per prompt, nothing else
    assert grpo["max_rounds_per_prompt"] == 1 and grpo["samples_ratio"] == 1.0
    for rule in ("pos", "balance"):
        sync, stream = results[f"Ada-{rule} round-sync"], results[f"Ada-{rule} streaming"]
        assert sync["samples_per_step"] > 2 * grpo["samples_per_step"]  # >= one round of M = 8 per prompt
        assert sync["max_rounds_per_prompt"] <= 4  # N = 4 and no staleness at max_staleness = 0
        assert sync["time_per_step"] > grpo["time_per_step"]
        assert stream["utilisation"] >= sync["utilisation"]
        assert stream["zero_adv_share"] == 0.0  # unresolved="drop" never trains a zero-variance group
    assert results["Ada-balance round-sync"]["samples_per_step"] > results["Ada-pos round-sync"]["samples_per_step"]
    for r in results.values():
        assert 0 < r["utilisation"] <= 1 + 1e-9 and math.isfinite(r["time_per_step"])
    assert table(results).count("\n") == len(STRATEGIES) + 1


def test_same_seed_same_numbers():
    p = draw_pass_rates(early_population(), 2000, np.random.default_rng(0))
    cfg = SimConfig(batch_size=16, num_steps=2, warmup_steps=1, num_engines=2, slots=16)
    assert simulate(STRATEGIES[4], p, cfg) == simulate(STRATEGIES[4], p, cfg)


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="batch_size"):
        SimConfig(batch_size=0)


def test_cli_writes_table_and_plot(tmp_path, capsys):
    main(["--quick", "--steps", "1", "--out", str(tmp_path)])
    md = (tmp_path / "sampling.md").read_text()
    assert "## early training" in md and "## late training" in md and "Ada-balance streaming" in md
    assert (tmp_path / "sampling.png").stat().st_size > 1000
    assert "late training" in capsys.readouterr().out


# ---------------------------------------------------------------- bench.allocation (issue #15)


@pytest.fixture(scope="module")
def allocation(tmp_path_factory):
    from bench.allocation.study import main as allocation_main

    out = tmp_path_factory.mktemp("allocation")
    only = ["GRPO round-sync", "Ada-balance round-sync", "GRPO streaming", "Ada-balance fixed M=8",
            "Ada-balance min_cost", "Ada-balance min_cost floor=0", "Ada-balance fixed M=8 sample"]
    return allocation_main(["--quick", "--out", str(out), "--only", *only]), out


def test_allocation_bench_drives_every_policy_and_reports_the_goals(allocation):
    from pipeline.buffer.policy.allocation import MAX_DEFERRALS

    data, out = allocation
    for pop in data["populations"].values():
        rows = pop["rows"]
        assert abs(sum(pop["population_hist"]) - 1) < 1e-9 and pop["oracle"]["balance_vs_grpo"] > 1
        for name, r in rows.items():
            assert abs(sum(r["trained_hist"]) - 1) < 1e-9 and r["time_per_useful_group"] > 0
            assert r["max_deferral_streak"] <= MAX_DEFERRALS
            assert (r["deferred_share"] > 0) <= (name == "Ada-balance min_cost")  # only min_cost defers
        assert rows["GRPO round-sync"]["rounds_per_prompt"] == 1 and rows["GRPO streaming"]["unresolved_share"] == 0
        assert rows["Ada-balance fixed M=8"]["len_bias_neg"] > rows["Ada-balance fixed M=8 sample"]["len_bias_neg"]
    goals = data["goals"]["early"]["balance"]
    assert goals["vs_stream_grpo"] > 1 and goals["best_fixed_m"] == 8 and goals["vs_best_fixed"] > 0
    md = (out / "allocation.md").read_text()
    assert "## Goals (issue #15), measured" in md and "## late training" in md and "trade-off" in md
    assert json.loads((out / "allocation.json").read_text())["goals"] == data["goals"]
