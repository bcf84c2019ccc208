"""Each test module's time in a serial `make test` run, so that `-n 2` starts the longest modules first.

`make test` runs the suite on two pytest-xdist workers, a module per worker at a time (`--dist loadfile`: a
module's fixtures, such as an engine or a Ray cluster, are built once). Modules are handed out in the order
conftest.py sorts them: longest first by the seconds in durations.json, so the short ones fill the gaps at the
end instead of one long module running alone while the other worker idles. A module missing from the file
counts as short; a stale file only costs balance, never a test.

Regenerate after a serial run that wrote a JUnit report:
    .venv/bin/python -m pytest -p no:xdist --junitxml=/tmp/junit.xml
    .venv/bin/python -m tests.support.durations /tmp/junit.xml
"""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")


def load() -> dict[str, float]:
    """Seconds by module path (tests/test_x.py); empty when the file is missing or unreadable."""
    try:
        return {str(k): float(v) for k, v in json.loads(FILE.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def from_junit(path: str | Path) -> dict[str, float]:
    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is tests.test_x (a function) or tests.test_x.TestClass (a method)
        if len(module) >= 2:
            seconds[f"{module[0]}/{module[1]}.py"] += float(case.get("time") or 0)
    return {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m tests.support.durations JUNIT_XML (writes {FILE})", file=sys.stderr)
        return 2
    FILE.write_text(json.dumps(from_junit(argv[0]), indent=1) + "\n")
    print(f"wrote {FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
