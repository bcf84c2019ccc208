"""Where every bench's results go, and how they are written: one place for the folder, the JSON and the markdown.

A study writes its numbers as JSON and its page as markdown rendered from them, side by side under RESULTS
(`NAME.json` beside `NAME.md`); bench/readme_results.py renders the README's tables from those JSON files, and
tests/test_readme.py fails when the two drift, so a file's name and its JSON's shape are part of the interface.
Every file written here ends with a newline; the JSON is written first, so a page that fails to render still
leaves the numbers it would have shown.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
RESULTS = ROOT / "bench" / "results"


def write_text(path: Path | str, text: str) -> Path:
    """`text` at `path`, its folder made if missing, with one final newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


def write_json(path: Path | str, data, *, indent: int = 1) -> Path:
    """`data` as indented JSON at `path` (its folder made if missing)."""
    return write_text(path, json.dumps(data, indent=indent))


def write(md_path: Path | str, markdown: str, data=None, *, indent: int = 1) -> Path:
    """A study's page at `md_path` and, given `data`, its numbers beside it (same name, .json), the JSON first."""
    md_path = Path(md_path)
    if data is not None:
        write_json(md_path.with_suffix(".json"), data, indent=indent)
    return write_text(md_path, markdown)
