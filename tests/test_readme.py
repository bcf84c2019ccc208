"""The README documents every configuration key, exactly as the schema renders it, and opens with the two setup
commands."""

from pathlib import Path

import msgspec

from pipeline.config import Config
from pipeline.config.reference import REGENERATE, readme_section, reference_markdown

README = (Path(__file__).parents[1] / "README.md").read_text()


def _keys(cls, prefix=""):
    for f in msgspec.structs.fields(cls):
        value = getattr(cls(), f.name)
        if isinstance(value, msgspec.Struct):
            yield from _keys(type(value), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_every_config_key_is_documented():
    missing = [k for k in _keys(Config) if f"`{k}`" not in README]
    assert not missing, f"README's configuration reference lacks {missing}"


def test_configuration_reference_is_generated_from_the_schema():
    assert readme_section(README) == reference_markdown(), (
        f"README.md's configuration reference differs from the config schema; regenerate it with `{REGENERATE}`")


def test_readme_opens_with_the_two_commands():
    head = README[:1500]
    assert "make run" in head and "make test" in head


def test_result_tables_are_generated_from_bench_results():
    from bench.readme_results import drift

    stale = drift(README, Path(__file__).parents[1] / "bench" / "results")
    assert not stale, (f"README.md's result tables {stale} differ from bench/results/*.json; regenerate them with "
                       "`python -m bench.readme_results --write`")


def test_cost_and_throughput_tables_are_among_the_generated_ones():
    from bench.readme_results import TABLES

    assert {"cost-per-gain", "throughput"} <= set(TABLES)
    for name in ("cost-per-gain", "throughput"):
        assert f"<!-- results:{name} -->" in README and f"<!-- /results:{name} -->" in README


def _arm(label, gain, lo, hi, grpo=False, samples=1000.0, seconds=100.0):
    from bench.cost_per_gain import _arm

    return _arm("g", label, grpo, 3, gain, lo, hi, samples, seconds)


def test_a_cost_carries_the_gains_interval_and_an_unestablished_gain_has_no_upper_bound():
    from bench.cost_per_gain import cost

    assert cost(1000.0, _arm("a", 0.05, 0.04, 0.10)) == "200 (100-250)"  # 1,000 samples over 5, 10, 4 units
    assert cost(1000.0, _arm("a", 0.02, -0.01, 0.05)) == "gain not established (>= 200)"
    assert cost(1000.0, _arm("a", -0.01, -0.03, 0.01)) == "no gain measured (>= 1,000)"
    assert cost(1000.0, _arm("a", -0.02, -0.03, -0.01)) == "no gain"


def test_grpo_at_its_best_is_the_cheapest_established_grpo_and_others_are_set_against_it():
    from bench.cost_per_gain import against, best_grpo

    keep = _arm("keep", 0.05, 0.04, 0.06, grpo=True, samples=1000.0)  # 200 (167-250) per +0.01
    drop = _arm("drop", 0.05, 0.01, 0.09, grpo=True, samples=600.0)  # cheaper, established
    lucky = _arm("lucky", 0.09, -0.01, 0.19, grpo=True, samples=100.0)  # cheapest, but not established
    ada = _arm("ada", 0.08, 0.07, 0.09, samples=4000.0, seconds=10.0)  # 500 (444-571) per +0.01
    assert best_grpo([keep, drop, lucky, ada]) is drop and best_grpo([lucky, ada]) is None
    assert against(ada, keep, "samples") == "dearer" and against(ada, keep, "seconds") == "cheaper"
    assert against(ada, drop, "samples") == "not separated" and against(keep, keep, "samples") == ""
