"""The README documents every configuration key and opens with the two setup commands."""

from pathlib import Path

import msgspec

from pipeline.config import Config

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


def test_readme_opens_with_the_two_commands():
    head = README[:1500]
    assert "make run" in head and "make test" in head
