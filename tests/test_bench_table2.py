"""Invariants of the Table-2 cost model (bench.table2) at small sizes: the model's own laws, no timed assertions."""

import json
from dataclasses import replace

import numpy as np
import pytest

from bench.sim.costmodel import SENSITIVITY, Constants, batch_decode_s, response_lengths
from bench.sim.engine import Engine, Seq
from bench.sim.population import REWARD_CURVES, curve_at, pass_rates
from bench.sim.run import SimConfig, Strategy, simulate
from bench.sim.trace import Trace
from bench.table2.study import (
    RULES,
    Table2Config,
    joint_band,
    main,
    out_of_sample,
    ratios,
    replay_seconds,
    run_reference,
)

SMALL = Table2Config(batch_size=32, phases=(50, 450), steps_per_phase=2, gpus=4, reference_slots=1024,
                     stream_warmup=1, stream_steps=1)


@pytest.fixture(scope="module")
def reference():
    return run_reference(SMALL, Constants())


def test_grpo_generates_n_per_prompt_and_ada_at_most_m_times_n(reference):
    ref, _ = reference
    B = SMALL.batch_size
    assert ref["fixed"]["samples_per_step"] == 4 * B  # one round of n = 4, nothing else
    assert ref["fixed"]["max_rounds_per_prompt"] == 1
    for rule in ("pos", "balance"):
        assert 8 * B <= ref[rule]["samples_per_step"] <= 32 * B  # M = 8 in round 1, at most N = 4 rounds
        assert ref[rule]["max_rounds_per_prompt"] <= 4  # reference: no staleness, no round beyond N
        assert ref[rule]["time_per_step"] > ref["fixed"]["time_per_step"]
    assert ref["balance"]["samples_per_step"] >= ref["pos"]["samples_per_step"]  # same prompts, stricter exit


def test_replay_reproduces_the_simulated_step_times(reference):
    ref, traces = reference
    replayed = replay_seconds(traces, SMALL, Constants())
    for rule in RULES:
        assert replayed[rule] == pytest.approx(ref[rule]["time_per_step"], rel=1e-4)


def test_step_time_grows_with_every_time_and_length_constant(reference):
    _, traces = reference
    c = Constants()
    base = replay_seconds(traces, SMALL, c)
    for name in SENSITIVITY:
        if name == "len_sigma":  # a wider spread is not monotone in the mean of the capped lengths
            continue
        more = replay_seconds(traces, SMALL, replace(c, **{name: getattr(c, name) * 1.5}))
        for rule in RULES:
            if name == "learner_mfu":  # a faster learner: less time
                assert more[rule] < base[rule], (name, rule)
            else:
                assert more[rule] >= base[rule], (name, rule)


def test_the_joint_band_holds_the_base_ratios_and_can_miss_the_paper(reference):
    """With no room for the constants (spread 1) the band is the model's own ratios, and the paper's ratio is inside
    it only if the model hits it exactly: the band check can fail. With room, the band widens around them."""
    _, traces = reference
    base = ratios(replay_seconds(traces, SMALL, Constants()))
    tight = joint_band(traces, SMALL, Constants(), draws=3, spread=1.0)
    for rule in ("pos", "balance"):
        assert tight[rule]["p5"] == pytest.approx(base[rule]) == pytest.approx(tight[rule]["p95"])
        assert tight[rule]["paper_inside"] == (tight[rule]["p5"] <= tight[rule]["paper"] <= tight[rule]["p95"])
    wide = joint_band(traces, SMALL, Constants(), draws=30, spread=2.0)
    for rule in ("pos", "balance"):
        assert wide[rule]["p5"] < base[rule] < wide[rule]["p95"] and 0.0 <= wide[rule]["within_20pct_share"] <= 1.0


def test_out_of_sample_fits_one_ratio_exactly_and_predicts_the_other(reference):
    _, traces = reference
    for row in out_of_sample(traces, SMALL, Constants()):
        if row["scale"] is None:  # no learner speed in range reaches the paper's ratio at this size
            continue
        assert row["fitted"] == pytest.approx(ratios({"fixed": 102.0, "pos": 228.0, "balance": 290.0})[row["fit"]],
                                              rel=1e-3)
        assert row["error"] == pytest.approx(row["predicted"] / row["paper"] - 1)


def test_same_seed_same_numbers():
    p = pass_rates(150, "ada", 200, np.random.default_rng(0))
    cfg = SimConfig(batch_size=16, num_steps=2, warmup_steps=1, num_engines=2, slots=64, learner_gpus=2)
    assert simulate(Strategy("b", "balance", True), p, cfg) == simulate(Strategy("b", "balance", True), p, cfg)
    sync = SimConfig(batch_size=16, num_steps=2, num_engines=2, slots=1024, learner_gpus=2)
    assert simulate(Strategy("p", "pos", False), p, sync) == simulate(Strategy("p", "pos", False), p, sync)


def test_streaming_invariants():
    p = pass_rates(250, "ada", 2000, np.random.default_rng(1))
    cfg = SimConfig(batch_size=32, num_steps=2, warmup_steps=1, num_engines=2, slots=64, learner_gpus=2)
    drop = simulate(Strategy("d", "balance", True, unresolved="drop"), p, cfg)
    keep = simulate(Strategy("k", "balance", True, unresolved="keep"), p, cfg)
    assert drop["zero_adv_share"] == 0.0 and drop["useful_per_step"] == 32  # drop trains only groups with signal
    assert keep["useful_per_step"] <= 32
    for r in (drop, keep):
        assert 0 < r["utilisation"] <= 1 + 1e-9 and 0 < r["learner_busy"] <= 1 + 1e-9
        assert r["time_per_step"] > 0 and r["samples_per_useful_group"] >= 4


def test_engine_equals_the_closed_form_when_everything_starts_at_once():
    c = Constants()
    lengths = np.random.default_rng(0).integers(1, 2049, 300)
    eng = Engine(512, c)
    eng.add_round([Seq(int(n), None) for n in lengths], 0.0)
    t = 0.0
    while not eng.idle:
        t = eng.next_event()
        eng.pop_finished(t)
    prefill = c.prompt_tokens * c.prefill_s_per_token
    assert t == pytest.approx(batch_decode_s(lengths, c) + prefill, rel=1e-3)
    assert eng.tokens == lengths.sum()


def test_engine_queues_beyond_its_slots_and_frees_them_on_cancel():
    c = Constants()
    eng = Engine(2, c)
    seqs = [Seq(100, i) for i in range(4)]
    eng.add_round(seqs, 0.0)
    assert eng.running == 2 and eng.queued == 2 and eng.load == 4
    t = eng.next_event()
    wasted = eng.cancel(seqs[0], t / 2)
    assert 0 < wasted < 100 and eng.running == 2 and eng.queued == 1  # the freed slot went to a queued one
    eng.cancel(seqs[3], t / 2)
    assert eng.load == 2
    done = []
    while not eng.idle:
        done.append(eng.pop_finished(eng.next_event()).payload)
    assert sorted(done) == [1, 2]


def test_lengths_depend_on_correctness_and_difficulty():
    c = Constants()
    n = 20000
    rng = np.random.default_rng(0)
    z, u = rng.standard_normal(n), rng.random(n)
    right = response_lengths(np.full(n, 0.5), np.ones(n, bool), z, u, c)
    wrong = response_lengths(np.full(n, 0.5), np.zeros(n, bool), z, u, c)
    hard_wrong = response_lengths(np.full(n, 0.05), np.zeros(n, bool), z, u, c)
    assert right.mean() < wrong.mean() < hard_wrong.mean()
    assert right.max() <= c.max_new_tokens and right.min() >= 1
    assert (hard_wrong == c.max_new_tokens).mean() > (wrong == c.max_new_tokens).mean() > 0


def test_population_follows_the_reward_curve():
    for curve in REWARD_CURVES:
        p = pass_rates(300, curve, 40000, np.random.default_rng(2))
        assert p.mean() == pytest.approx(curve_at(REWARD_CURVES[curve], 300), abs=0.01)
        assert ((p > 0) & (p < 1)).all()
    with pytest.raises(ValueError, match="reward curve"):
        pass_rates(300, "nope", 10, np.random.default_rng(0))


def test_bad_constants_are_a_clear_error():
    with pytest.raises(ValueError, match="t0"):
        Constants(t0=-1.0)
    with pytest.raises(ValueError, match="trunc_wrong"):
        Constants(trunc_wrong=2.0)
    with pytest.raises(ValueError, match="streaming"):
        simulate(Strategy("s", "pos", True), np.full(10, 0.5), SimConfig(batch_size=2), trace=Trace())


def test_cli_writes_json_and_markdown_rendered_from_it(tmp_path, capsys):
    data = main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "table2.json").read_text())
    assert saved["ratios"] == data["ratios"] and set(saved["ratios"]) == {"pos", "balance"}
    md = (tmp_path / "table2.md").read_text()
    assert "Table 2, reproduced" in md and "Sensitivity" in md and "6+2" in md
    rows = saved["streaming"]
    assert len(rows) == 2 * 3 * 2  # two splits x GRPO, pos, balance x keep, drop
    for split in ("4+4", "6+2"):
        grpo = [r for r in rows if r["split"] == split and r["rule"] == "fixed" and r["unresolved"] == "keep"]
        assert grpo[0]["vs_streaming_grpo"] == 1.0
    assert len(saved["sensitivity"]) == len(SENSITIVITY)
    assert "Ada-balance" in capsys.readouterr().out
