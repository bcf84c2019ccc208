"""Loading a config: a TOML file, then dotted command-line overrides, then one validation.

Invariant: `load_config` returns a fully checked Config or raises ConfigError whose message starts with the
field's `section.key` (derived from the schema, never typed here) and says what to change; an unknown key gets
a did-you-mean.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from pipeline.config.base import (
    ConfigError,
    bound_problem,
    field_error,
    fields,
    is_section,
    literal_choices,
    not_allowed,
    toml_value,
    unwrap,
)
from pipeline.config.schema import Config

# keys that existed once: what to do instead
RETIRED = {"endpoints.control_port": "it is always endpoints.router_port + 1 now: delete the key"}


def _check_keys(data: dict, cls: type, where: str) -> None:
    """Unknown keys are errors with a did-you-mean (msgspec alone names the key but suggests nothing)."""
    known = fields(cls)
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if path in RETIRED:
            raise ConfigError(f"{path}: no longer a setting; {RETIRED[path]}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean `{(where + '.') if where else ''}{close[0]}`?)" if close else ""
            raise ConfigError(f"{path}: unknown key{hint}; known keys here: {', '.join(sorted(known))}")
        if is_section(known[key].type):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: must be a table ([{path}] section), got {type(value).__name__}")
            _check_keys(value, unwrap(known[key].type)[0], path)


def _parse_value(text: str) -> Any:
    """A command-line value as TOML (numbers, booleans, lists, quoted strings), else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `--a.b value` / `--a.b=value` pairs to the nested dict `data` (in place) and return it."""
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"override {arg!r}: expected --section.key VALUE (e.g. --sampling.round_size 8)")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(overrides):
                raise ConfigError(f"override {arg}: missing value (e.g. {arg} 8)")
            key, text = arg[2:], overrides[i + 1]
            i += 2
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key}: {part} is not a section")
        node[parts[-1]] = _parse_value(text)
    return data


def _explain(exc: msgspec.ValidationError, data: dict) -> ConfigError:
    """msgspec's 'Expected `int` >= 1 - at `$.sampling.round_size`' as a ConfigError about that field."""
    body, sep, where = str(exc).rpartition(" - at `$.")
    if not sep:
        return ConfigError(str(exc))
    steps = re.findall(r"[^.\[\]`]+|\[\d+\]", where.rstrip("`"))
    names = [s for s in steps if not s.startswith("[")]
    cls: Any = Config
    value: Any = data
    for i, name in enumerate(names):  # walk the schema and the input together down to the failing field
        if not is_section(cls) or name not in cls.__struct_fields__:
            return ConfigError(f"{'.'.join(names)}: {body}")
        value = value.get(name) if isinstance(value, dict) else None
        if i + 1 < len(names):
            cls = unwrap(fields(cls)[name].type)[0]
    key = names[-1]
    if is_section(fields(cls)[key].type):  # e.g. a section given as a number
        return ConfigError(f"{'.'.join(names)}: {body}")
    ftype = fields(cls)[key].type
    problem = bound_problem(unwrap(ftype)[1], value)
    if problem:
        return field_error(cls, key, f"{problem}, got {_show(value)}")
    if body.startswith("Invalid enum value"):  # also a list's item: `data.arithmetic_levels[0]`
        choices = literal_choices(ftype) or literal_choices(_item_type(ftype))
        bad = body.removeprefix("Invalid enum value").strip()
        return field_error(cls, key, not_allowed(bad, bad.strip("'"), choices))
    wrong_type = re.match(r"Expected `([^`]+)`, got `[^`]+`$", body)
    if wrong_type:
        return field_error(cls, key, f"expected {wrong_type.group(1)}, got {_show(value)}")
    return field_error(cls, key, f"{body[0].lower()}{body[1:]}, got {_show(value)}")


def _item_type(tp: Any) -> Any:
    args = getattr(unwrap(tp)[0], "__args__", ())
    return args[0] if args else None


def _show(value: Any) -> str:
    try:
        return toml_value(value)
    except TypeError:
        return repr(value)


def from_dict(data: dict) -> Config:
    """Validate a nested dict into a Config, or raise ConfigError naming the field and the fix."""
    _check_keys(data, Config, "")
    try:
        return msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ConfigError):  # a section's check(): its message already names the field
            raise ConfigError(str(cause)) from None
        raise _explain(exc, data) from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML file (None = all defaults) and apply dotted overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (shipped configs live in configs/)")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    apply_overrides(data, list(overrides or []))
    return from_dict(data)
