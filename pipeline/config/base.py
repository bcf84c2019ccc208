"""What every config section shares: field limits read from the types, and errors that name `section.key`.

A field's type is its whole contract: `Annotated[int, Meta(ge=1, description="...")]` carries the type, the
limits and the one-line doc. msgspec checks the limits when a file is decoded; `Section.__post_init__` checks the
same limits for sections built in code, then runs the section's cross-field `check()`. An error's path is
derived from where the section class lives under the root config (registered once by `schema.py`), never typed
by hand; sibling keys named in `backticks` in a message are qualified the same way.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import re
from typing import Annotated, Any, Literal, get_args, get_origin

import msgspec


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and how to fix it."""


_ROOT: list[type] = []  # the root config class, registered by schema.py


def register_root(cls: type) -> None:
    """Declare the root config class that every section's path is derived from (called once, by schema.py)."""
    _ROOT[:] = [cls]
    section_paths.cache_clear()


def unwrap(tp: Any) -> tuple[Any, msgspec.Meta | None]:
    """`Annotated[T, Meta(...)]` -> (T, Meta); any other type -> (type, None)."""
    if get_origin(tp) is Annotated:
        base, *extras = get_args(tp)
        metas = [m for m in extras if isinstance(m, msgspec.Meta)]
        return base, metas[0] if metas else None
    return tp, None


def is_section(tp: Any) -> bool:
    tp = unwrap(tp)[0]
    return isinstance(tp, type) and issubclass(tp, Section)


def literal_choices(tp: Any) -> tuple:
    """The allowed values of a Literal type (also inside Annotated), else ()."""
    tp = unwrap(tp)[0]
    return get_args(tp) if get_origin(tp) is Literal else ()


def registry_choices(tp: Any) -> dict[str, str]:
    """{allowed value: what it does} of a field whose values come from a registry, else {}.

    Such a field is declared `Annotated[str, Meta(extra={"choices": "package.module:function"}, ...)]`; the
    function returns the dict. It is imported on first use, so the registry's package (e.g. the buffer's policy
    package) may import the config without a cycle, and adding a value there needs no edit of the schema."""
    meta = unwrap(tp)[1]
    target = (meta.extra or {}).get("choices") if meta is not None else None
    if not target:
        return {}
    module, _, name = target.partition(":")  # read each time: a registry may grow (a test's rule, a plugin)
    return dict(getattr(importlib.import_module(module), name)())


def allowed_values(tp: Any) -> tuple:
    """The allowed values of a field: its Literal's, or its registry's; () when any value of its type is."""
    return literal_choices(tp) or tuple(registry_choices(tp))


def describe(tp: Any) -> str:
    """A field's one-line doc: its Meta's description, then what each registry value does."""
    meta = unwrap(tp)[1]
    doc = meta.description if meta is not None and meta.description else ""
    values = registry_choices(tp)
    if values:
        doc += ": " + ", ".join(f"{toml_value(v)} ({what})" for v, what in values.items())
    return doc


def not_allowed(shown: str, value: Any, choices: tuple) -> str:
    """'\'bal\' is not allowed (did you mean "balance"?); choose one of ...' (`shown`: the value as quoted)."""
    by_text = {str(c): c for c in choices}
    close = difflib.get_close_matches(str(value), list(by_text), n=1)
    guess = f" (did you mean {toml_value(by_text[close[0]])}?)" if close else ""
    return f"{shown} is not allowed{guess}; choose one of {', '.join(toml_value(c) for c in choices)}"


def fields(cls: type) -> dict[str, msgspec.structs.FieldInfo]:
    return {f.name: f for f in msgspec.structs.fields(cls)}


@functools.cache
def section_paths() -> dict[type, str]:
    """Every section class -> its dotted path under the root ("" for the root itself)."""
    assert _ROOT, "schema.py registers the root config class"
    out: dict[type, str] = {}

    def walk(cls: type, path: str) -> None:
        assert cls not in out, f"{cls.__name__} is used twice in the config: paths would be ambiguous"
        out[cls] = path
        for f in msgspec.structs.fields(cls):
            if is_section(f.type):
                walk(unwrap(f.type)[0], f"{path}.{f.name}" if path else f.name)

    walk(_ROOT[0], "")
    return out


def key_path(cls: type, key: str) -> str:
    """`section.key` of field `key` of section class `cls` (e.g. `producers.engine.max_model_len`)."""
    assert key in cls.__struct_fields__, f"{cls.__name__} has no field {key!r}"
    prefix = section_paths()[cls]
    return f"{prefix}.{key}" if prefix else key


def limits_text(meta: msgspec.Meta | None) -> str:
    """The limits of a Meta in words: '>= 1', 'in (0, 1]', 'non-empty' ('' when there are none)."""
    if meta is None:
        return ""
    low = ("[", meta.ge) if meta.ge is not None else ("(", meta.gt) if meta.gt is not None else None
    high = (meta.le, "]") if meta.le is not None else (meta.lt, ")") if meta.lt is not None else None
    parts = []
    if low and high:
        parts.append(f"in {low[0]}{low[1]}, {high[0]}{high[1]}")
    elif low:
        parts.append(f"{'>=' if low[0] == '[' else '>'} {low[1]}")
    elif high:
        parts.append(f"{'<=' if high[1] == ']' else '<'} {high[0]}")
    if meta.min_length == 1:
        parts.append("non-empty")
    elif meta.min_length is not None:
        parts.append(f"at least {meta.min_length} long")
    return ", ".join(parts)


def bound_problem(meta: msgspec.Meta | None, value: Any) -> str:
    """'must be >= 1' when `value` breaks the limits of `meta`, else ''."""
    if meta is None:
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        broken = ((meta.ge is not None and not value >= meta.ge) or (meta.gt is not None and not value > meta.gt)
                  or (meta.le is not None and not value <= meta.le) or (meta.lt is not None and not value < meta.lt))
        if broken:
            return f"must be {limits_text(msgspec.Meta(ge=meta.ge, gt=meta.gt, le=meta.le, lt=meta.lt))}"
    if isinstance(value, (list, str, dict)) and meta.min_length is not None and len(value) < meta.min_length:
        return "must not be empty" if meta.min_length == 1 else f"must hold at least {meta.min_length} items"
    return ""


def field_hint(cls: type, key: str) -> str:
    """' (what the field is; default X)': appended to every error about the field."""
    info = fields(cls)[key]
    doc = describe(info.type)
    default = info.default_factory() if info.default is msgspec.NODEFAULT else info.default
    if is_section(type(default)):
        return f" ({doc})" if doc else ""
    return f" ({doc + '; ' if doc else ''}default {toml_value(default)})"


def qualify(cls: type, message: str) -> str:
    """Rewrite `sibling` (a field of `cls` in backticks) as `section.sibling`."""
    return re.sub(r"`(\w+)`", lambda m: f"`{key_path(cls, m.group(1))}`" if m.group(1) in cls.__struct_fields__
                  else m.group(0), message)


def field_error(cls: type, key: str, problem: str) -> ConfigError:
    return ConfigError(f"{key_path(cls, key)}: {qualify(cls, problem)}{field_hint(cls, key)}")


def toml_value(v: Any) -> str:
    """A value as TOML text (the config's own writer: the format needed here is small)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A `[section]` of the config. Subclasses declare Annotated fields and may override `check()`."""

    def __post_init__(self) -> None:
        for name, info in fields(type(self)).items():
            value = getattr(self, name)
            problem = bound_problem(unwrap(info.type)[1], value)
            if problem:  # sections built in code; a decoded file was already checked by msgspec
                raise field_error(type(self), name, f"{problem}, got {toml_value(value)}")
            choices = registry_choices(info.type)  # msgspec knows only the type (str): decoded files too
            if choices and value not in choices:
                raise field_error(type(self), name, not_allowed(repr(value), value, tuple(choices)))
        self.check()

    def check(self) -> None:
        """Cross-field checks: call `self.require(condition, key, problem)` for each."""

    def require(self, condition: bool, key: str, problem: str) -> None:
        """Raise a ConfigError naming this section's `key` (and qualifying `siblings` in `problem`)."""
        if not condition:
            raise field_error(type(self), key, problem)
