"""bench.e2e without training: the statistics (mean, std, the paired t-interval, equal-budget differences), the
markdown and plot rendered from a small synthetic JSON, the strategy table, the run summary and the held-out check."""

import datetime
import json
import math

import pytest

from bench.e2e.data import held_out_check, held_out_file, training_problems
from bench.e2e.report import plot, render, verdict
from bench.e2e.runs import attach_evals, eval_versions, summarise_run
from bench.e2e.stats import interp, mean, pair_difference, paired_interval, paired_se, std, summarise, t_quantile
from bench.e2e.strategies import BASELINE, CONFIG, STRATEGIES, STRATEGY_ROWS, parse_strategy, pick_strategies
from bench.e2e.study import expected_seconds, main, parse_args
from pipeline.config import load_config


@pytest.mark.parametrize("df, expected", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)])
def test_t_quantile_matches_the_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=2e-4)


def test_t_quantile_rejects_a_lower_tail():
    with pytest.raises(ValueError, match="0.5 < p < 1"):
        t_quantile(0.3, 3)


def test_mean_and_sample_std():
    assert mean([1.0, 2.0, 3.0]) == 2.0
    assert std([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert std([5.0]) is None and mean([]) is None


def test_paired_interval_is_the_t_interval_of_the_differences():
    d = paired_interval([0.01, 0.03, 0.02])
    half = 4.302653 * 0.01 / math.sqrt(3)
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.02) and d["std"] == pytest.approx(0.01)
    assert d["lo"] == pytest.approx(0.02 - half, abs=1e-6) and d["hi"] == pytest.approx(0.02 + half, abs=1e-6)
    assert verdict(d) == "not distinguishable"  # [-0.005, 0.045] holds 0
    assert verdict(paired_interval([0.05, 0.06, 0.055])) == "better"
    assert verdict(paired_interval([-0.05, -0.06, -0.055])) == "worse"


def test_one_pair_gives_no_interval():
    d = paired_interval([0.04])
    assert d["lo"] is None and d["hi"] is None and d["std"] is None
    assert verdict(d) == "untested"


def test_paired_se_is_the_standard_error_of_the_per_problem_differences():
    a, b = [1.0, 0.5, 0.75, 0.25], [0.75, 0.5, 0.5, 0.25]  # differences 0.25, 0, 0.25, 0
    assert paired_se(a, b) == pytest.approx(std([0.25, 0, 0.25, 0]) / 2)
    assert paired_se(a, a) == 0.0


def test_interp_never_extrapolates():
    assert interp(5, [0, 10], [0.2, 0.4]) == pytest.approx(0.3)
    assert interp(10, [0, 10], [0.2, 0.4]) == pytest.approx(0.4)
    assert interp(11, [0, 10], [0.2, 0.4]) is None and interp(-1, [0, 10], [0.2, 0.4]) is None


def curve(accs, samples_per_step, s_per_step, every=3):
    return [{"version": v, "accuracy": a, "se": 0.01, "samples": v * samples_per_step, "seconds": v * s_per_step}
            for v, a in zip(range(0, every * len(accs), every), accs)]


def test_equal_budget_differences_compare_at_the_smaller_total():
    grpo = curve([0.30, 0.34, 0.36], samples_per_step=100, s_per_step=1.0)  # 600 samples, 6 s
    ada = curve([0.30, 0.40, 0.44], samples_per_step=300, s_per_step=2.0)  # 1800 samples, 12 s
    assert pair_difference(grpo, ada, "final") == pytest.approx(0.08)
    # at 600 samples Ada is at version 2: 0.30 + (0.40 - 0.30) * 600 / 900
    assert pair_difference(grpo, ada, "equal_samples") == pytest.approx(0.30 + 0.1 * 600 / 900 - 0.36)
    assert pair_difference(grpo, ada, "equal_seconds") == pytest.approx(0.30 + 0.1 * 6 / 6 - 0.36)
    assert pair_difference(grpo, ada[:2], "final") is None  # not the same last step


def run(setting, strategy, seed, accs, sps, spstep, code=0):
    c = curve(accs, sps, spstep)
    return {"final_diff_eval_se": None if strategy == "grpo" else 0.012 + 0.001 * seed,
            "key": f"{setting}/{strategy}/{seed}", "setting": setting, "strategy": strategy, "seed": seed,
            "code": code, "curve": c if code == 0 else [], "final_accuracy": accs[-1], "gain": accs[-1] - accs[0],
            "samples_per_step": sps, "samples_per_group": sps / 32, "zero_adv": 0.4 if strategy == "grpo" else 0.0,
            "mixed": 0.6 if strategy == "grpo" else 1.0, "dropped": 0, "wall_s": 6 * spstep, "s_per_step": spstep,
            "tail": "boom" if code else ""}


def synthetic() -> dict:
    runs = []
    for seed, (g, a, b) in enumerate([(0.36, 0.42, 0.37), (0.35, 0.43, 0.33), (0.37, 0.44, 0.39)]):
        runs += [run("normal", "grpo", seed, [0.3, 0.33, g], 128, 0.7),
                 run("normal", "ada-pos", seed, [0.3, 0.38, a], 380, 1.4),
                 run("normal", "ada-balance", seed, [0.3, 0.34, b], 500, 1.5)]
    runs.append(run("hard", "grpo", 0, [0.3, 0.31, 0.32], 128, 0.7))
    runs.append(run("hard", "ada-pos", 0, [0.3, 0.33, 0.35], 400, 1.6))
    runs.append(run("hard", "ada-balance", 0, [0.3], 0, 0, code=1))
    held = {"drawn": 1000, "overlap_removed": 0, "problems": 1000, "train_problems": 4000}
    data = {"command": "python -m bench.e2e --seeds 3", "config": CONFIG, "date": "2025-01-01 00:00",
            "machine": {"cpus": 2, "load_start": 1.5, "load_end": 2.0}, "baseline": BASELINE, "minutes": 60.0,
            "expected_s": 3600.0, "plot": "e2e.png",
            "args": {"seeds": 3, "steps": 6, "eval_every": 3, "eval_problems": 1000, "eval_seed": 0, "k": 4},
            "held_out": {"file": ".cache/e2e/held-out-x.jsonl", "problems": 1000, "seed": 9_000_011,
                         "excluded_training_problems": 11_000},
            "strategies": [{"name": s.name, "label": s.label, "overrides": list(s.overrides), "semantics": s.semantics}
                           for s in STRATEGY_ROWS[:3]],
            "settings": {"normal": {"description": "normal prompts", "overrides": [], "held_out": {"0": held}},
                         "hard": {"description": "hard prompts", "overrides": [], "held_out": {"0": held},
                                  "selection": {"kept": 1996, "problems": 4000, "samples_per_problem": 16,
                                                "spec": {"min_correct": 1, "max_correct": 5}, "seconds": 89.0,
                                                "command": "python -m pipeline.cli select-prompts ...",
                                                "file": ".cache/e2e-hard/hard-x.jsonl"}}},
            "runs": runs}
    data["summary"] = json.loads(json.dumps(summarise(runs, BASELINE)))  # as the JSON file holds it
    return data


def test_summary_pairs_by_seed_and_leaves_failed_runs_out():
    s = synthetic()["summary"]
    normal = s["normal"]
    assert normal["strategies"]["grpo"]["final_accuracy"]["mean"] == pytest.approx(0.36)
    assert normal["strategies"]["grpo"]["final_accuracy"]["std"] == pytest.approx(0.01)
    pos = normal["differences"]["ada-pos"]["final"]
    assert pos["n"] == 3 and [x for _, x in pos["per_seed"]] == pytest.approx([0.06, 0.08, 0.07])
    assert pos["lo"] > 0  # Ada-pos better at the same step in every seed
    assert pos["eval_se"] == pytest.approx(0.013)  # the mean of the seeds' measurement noise
    bal = normal["differences"]["ada-balance"]["final"]
    assert bal["lo"] < 0 < bal["hi"]
    assert s["hard"]["differences"]["ada-balance"]["final"]["n"] == 0  # its only run failed
    assert s["hard"]["differences"]["ada-pos"]["final"]["n"] == 1
    curve0 = normal["strategies"]["ada-pos"]["curve"]
    assert [p["version"] for p in curve0] == [0, 3, 6] and curve0[-1]["samples"] == 6 * 380


def test_markdown_states_intervals_verdicts_and_limits():
    text = render(synthetic())
    assert "## Setting: normal" in text and "## Setting: hard" in text
    assert "0.360 ± 0.010" in text  # GRPO's final accuracy, mean ± std over 3 seeds
    assert "+0.060 ± 0.010" in text  # its gain: the std carries no sign
    assert "- Ada-pos (3.0x GRPO's samples per step): at the same step +0.070 [+0.045, +0.095] (3 seeds): " \
           "better" in text
    assert "Ada-balance (3.9x GRPO's samples per step): at the same step +0.003 [-0.048, +0.055] (3 seeds): " \
           "not distinguishable" in text
    assert "Distinguishable from zero at 95%: Ada-pos at the same step better than GRPO; Ada-balance at equal " \
           "samples worse than GRPO. No other difference is." in text
    assert "at the same step +0.030 (1 seed, no interval)" in text  # the hard setting has one seed of Ada-pos
    assert "No interval: fewer than 2 seeds" in text
    assert "1,000 two-digit problems (`.cache/e2e/held-out-x.jsonl`" in text
    assert "seed 0: 1000 of 1000 used, 0 removed as training problems" in text
    assert "1,996 of 4,000" in text
    assert "What this data cannot show" in text
    assert "in one seed's difference at the last step, measured on the same problems with the same sampling seeds, " \
           "about 0.013" in text
    assert "`hard/ada-balance/0` failed (1)" in text and "boom" in text


def test_plot_writes_a_png(tmp_path):
    plot(synthetic(), tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_strategy_table():
    assert len(STRATEGIES) == len(STRATEGY_ROWS)
    grpo = STRATEGIES[BASELINE]
    assert grpo.overrides == ("--sampling.exit_rule", "fixed", "--buffer.unresolved", "keep")
    for s in STRATEGY_ROWS:  # every row is a valid config
        cfg = load_config(CONFIG, list(s.overrides))
        assert cfg.sampling.exit_rule in s.semantics
    assert [s.name for s in pick_strategies(["ada-pos"], [])] == ["grpo", "ada-pos"]  # baseline always first
    with pytest.raises(ValueError, match="unknown strategy"):
        pick_strategies(["nope"], [])


def test_a_strategy_from_the_command_line_is_one_more_row():
    s = parse_strategy("ada-x=--sampling.exit_rule balance --buffer.unresolved keep")
    assert s.overrides == ("--sampling.exit_rule", "balance", "--buffer.unresolved", "keep")
    assert [r.name for r in pick_strategies(["grpo"], [s])] == ["grpo", "ada-x"]
    for bad in ("ada-x", "=--a b", "grpo=--sampling.exit_rule pos", "x="):
        with pytest.raises(ValueError):
            parse_strategy(bad)


def test_eval_versions_include_the_last_step():
    assert eval_versions(6, 3) == [3, 6] and eval_versions(20, 6) == [6, 12, 18, 20]


def test_run_summary_clock_starts_with_the_learner(tmp_path):
    rows = [{"step": v, "time": 100.0 + 2 * v, "wait_seconds": 1.5 if v == 1 else 0.1, "step_seconds": 0.5,
             "buffer/samples_received": 130.0 * v, "buffer/samples_per_released_group": 4.0, "mixed_frac": 0.5,
             "zero_adv_frac": 0.5, "reward_mean": 0.3, "buffer/dropped_unresolved": 0.0,
             "buffer/dropped_zero_variance": 0.0, "buffer/released": 32.0 * v} for v in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarise_run(tmp_path)
    assert s["steps"] == 3 and s["samples_per_step"] == pytest.approx(130.0)
    assert s["at"]["0"] == [0.0, 0.0] and s["at"]["1"] == [130.0, pytest.approx(2.0)]  # 102 - (102 - 1.5 - 0.5)
    assert s["wall_s"] == pytest.approx(6.0)
    attach_evals(s, [{"version": 0, "accuracy": 0.3, "se": 0.01}, {"version": 3, "accuracy": 0.35, "se": 0.01}])
    assert s["curve"][1]["samples"] == 390.0 and s["gain"] == pytest.approx(0.05)
    # with the learner's log, second 0 is the learner process's start (its loading time counts)
    (tmp_path / "logs").mkdir()
    mark = datetime.datetime.fromtimestamp(95.0).strftime("%H:%M:%S")
    (tmp_path / "logs" / "learner.log").write_text(f"\n==== {mark} start: python -m pipeline.cli learner\nstep 1\n"
                                                   "\n==== 23:59:59 start: python -m pipeline.cli learner --resume\n")
    s = summarise_run(tmp_path)
    assert s["at"]["1"][1] == pytest.approx(7.0) and s["wall_s"] == pytest.approx(11.0)
    assert s["learner_start_s"] == pytest.approx(5.0) and s["s_per_step"] == pytest.approx(2.0)


def test_held_out_set_holds_no_training_problem_and_is_checked_for_size():
    h = held_out_check(["--run.seed", "1", "--data.num_arithmetic_eval", "2000", "--eval.num_problems", "1000"])
    assert h["problems"] == 1000 and h["drawn"] == 2000 and 200 < h["overlap_removed"] < 600
    with pytest.raises(ValueError, match=r"1000 problems drawn, \d+ of them are training problems"):
        held_out_check(["--data.num_arithmetic_eval", "1000", "--eval.num_problems", "1000"])


def test_one_held_out_file_serves_every_seed_without_a_training_problem(tmp_path):
    runs = [["--run.seed", str(seed)] for seed in (0, 1)]
    path, record = held_out_file(300, runs, cache=tmp_path)
    assert path.parent == tmp_path and record["problems"] == 300 and record["excluded_training_problems"] > 4000
    assert held_out_file(300, runs, cache=tmp_path)[0] == path  # named by its content: the same draw, the same file
    train = training_problems(runs[0]) | training_problems(runs[1])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 300 and not {r["problem"] for r in rows} & train
    for o in runs:
        c = held_out_check([*o, "--data.eval_files", json.dumps([str(path)]), "--eval.num_problems", "300"])
        assert c == {"drawn": 300, "overlap_removed": 0, "problems": 300, "train_problems": 4000}


def test_quick_plan_is_one_seed_of_the_normal_setting():
    args = parse_args(["--quick"])
    assert (args.seeds, args.steps, args.settings, args.name) == (1, 20, ["normal"], "e2e_quick")
    full = parse_args(["--seeds", "3"])
    assert full.settings == ["normal", "hard"] and full.eval_problems >= 1000
    assert expected_seconds(args, True) < expected_seconds(full, True)


def test_render_redoes_markdown_and_plot_from_the_json(tmp_path):
    data = synthetic()
    del data["summary"]  # recomputed from the runs
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(data))
    assert main(["--render", str(path)]) == 0
    assert "## Setting: hard" in (tmp_path / "e2e.md").read_text()
    assert (tmp_path / "e2e.png").is_file() and "summary" in json.loads(path.read_text())
