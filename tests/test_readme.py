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
