"""A config as text: the resolved TOML of a run, and the README's configuration reference rendered from the types.

Invariant: both are walks over the schema (sections are the fields whose type is a Section), so a field added to
`schema.py` appears in both without any edit here, and a field whose values come from a registry (the exit
rules, the allocation policies: `base.registry_choices`) lists the registry's values and what each does.
`README.md`'s "Configuration reference" section is exactly `reference_markdown()`; tests/test_readme.py fails
when they differ.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import msgspec

from pipeline.config.base import Section, allowed_values, describe, fields, is_section, limits_text, toml_value, unwrap
from pipeline.config.schema import Config

HEADING = "## Configuration reference"
REGENERATE = "reinforce-ada check-config --readme README.md"
INTRO = f"""\
TOML files with `[section]` tables; any key can be overridden on the command line as `--section.key VALUE`.
Unknown keys are errors with a did-you-mean; every value is checked at load, and an error names the key and
what to change. `reinforce-ada check-config FILE` prints a file's resolved config. This section is generated
from the field declarations in `pipeline/config/schema.py`; `{REGENERATE}` rewrites it."""


def to_toml_dict(cfg: Config) -> dict:
    """The resolved config as plain data (for printing and for the run directory)."""
    return msgspec.to_builtins(cfg)


def dumps_toml(cfg: Section) -> str:
    """The resolved config as TOML text: a table per section, scalars first."""
    lines: list[str] = []

    def emit(section: Section, prefix: str) -> None:
        if prefix:
            lines.append(f"\n[{prefix}]")
        subsections = []
        for name, info in fields(type(section)).items():
            if is_section(info.type):
                subsections.append(name)
            else:
                lines.append(f"{name} = {toml_value(msgspec.to_builtins(getattr(section, name)))}")
        for name in subsections:
            emit(getattr(section, name), f"{prefix}.{name}" if prefix else name)

    emit(cfg, "")
    return "\n".join(lines).lstrip() + "\n"


def _type_text(tp: Any) -> str:
    """A field's type and limits in words: 'int >= 1', 'one of "drop", "keep"', 'list of strings'."""
    base, meta = unwrap(tp)
    limits = limits_text(meta)
    choices = allowed_values(tp)  # a registry's are imported and listed on every call: once here
    if choices:
        text = "one of " + ", ".join(toml_value(c) for c in choices)
    elif get_origin(base) is list:
        item = get_args(base)[0]
        items = ("values in " + ", ".join(toml_value(c) for c in get_args(item)) if get_origin(item) is Literal
                 else {str: "strings", int: "integers", float: "numbers"}.get(item, str(item)))
        text = f"list of {items}"
    elif get_origin(base) is dict:
        text = "table"
    else:
        text = {str: "string", int: "int", float: "float", bool: "bool"}.get(base, str(base))
    return f"{text}, {limits}" if limits and text.startswith(("list", "table")) else f"{text} {limits}".strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _tables(cls: type, prefix: str) -> list[str]:
    out: list[str] = []
    rows = []
    nested = []
    defaults = cls()
    for name, info in fields(cls).items():
        if is_section(info.type):
            nested.append((unwrap(info.type)[0], f"{prefix}.{name}" if prefix else name))
            continue
        meta = unwrap(info.type)[1]
        assert meta is not None and meta.description, f"{prefix}.{name} needs Meta(description=...)"
        default = toml_value(msgspec.to_builtins(getattr(defaults, name)))
        rows.append(f"| `{prefix}.{name}` | `{_cell(default)}` | {_cell(_type_text(info.type))} | "
                    f"{_cell(describe(info.type))} |")
    if rows:
        doc = inspect.getdoc(cls) or ""
        out += [f"**[{prefix}]** {doc}".rstrip(), "", "| key | default | type | meaning |", "|---|---|---|---|",
                *rows, ""]
    for sub, path in nested:
        out += _tables(sub, path)
    return out


def reference_markdown() -> str:
    """The README's "Configuration reference" section (heading included), rendered from the schema."""
    return "\n".join([HEADING, "", INTRO, "", *_tables(Config, "")]) + "\n"


def readme_section(text: str) -> str:
    """The "Configuration reference" section of README text: from its heading up to the next `## ` heading."""
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start:end + 1] if end >= 0 else text[start:]


def update_readme(path: str | Path) -> bool:
    """Rewrite the README's configuration reference from the schema; True when it changed."""
    p = Path(path)
    text = p.read_text()
    old = readme_section(text)
    new = reference_markdown()
    if old == new:
        return False
    p.write_text(text.replace(old, new, 1))
    return True
