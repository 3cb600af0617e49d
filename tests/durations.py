"""How long each test takes, for the order in which the suite starts them.

``tests/durations.json`` maps a test's node id to the seconds it took (setup, call and teardown
together) in one full run under ``pytest -n 2`` on two shared cores; only tests of at least
``MIN_S`` are kept. ``tests/conftest.py`` starts the longest first (pytest-xdist then hands the
short ones out last, so no worker is left alone with a long test at the end). Only the order
depends on these figures: a test missing from the file counts ``SLOW_S`` when marked ``slow``,
else ``FAST_S``, and a stale entry does nothing.

Refresh it from a full run's report::

    python -m pytest -n 2 --durations=0 > run.log
    python tests/durations.py run.log
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")
MIN_S = 2.0
SLOW_S = 20.0
FAST_S = 1.0
#: One line of pytest's ``--durations`` report: ``12.34s call     tests/x.py::test_y[a]``.
_LINE = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*?)\s*$")


def parse(report: str) -> dict[str, float]:
    """Seconds per node id in a ``--durations`` report (its phases added up), rounded to
    tenths; tests under ``MIN_S`` left out."""
    total: defaultdict[str, float] = defaultdict(float)
    for line in report.splitlines():
        m = _LINE.match(line)
        if m:
            total[m.group(3)] += float(m.group(1))
    return {node: round(s, 1) for node, s in sorted(total.items()) if s >= MIN_S}


def load(path: Path = FILE) -> dict[str, float]:
    """The recorded seconds per node id; empty when the file is missing or unreadable (the
    order then falls back to the ``slow`` marks)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items()
            if isinstance(k, str) and isinstance(v, (int, float))}


def expected_s(nodeid: str, slow: bool, recorded: dict[str, float]) -> float:
    """How long ``nodeid`` is expected to take."""
    return recorded.get(nodeid, SLOW_S if slow else FAST_S)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python tests/durations.py PYTEST_REPORT\n")
        return 2
    found = parse(Path(argv[0]).read_text(encoding="utf-8", errors="replace"))
    if not found:
        sys.stderr.write(f"no --durations lines in {argv[0]}\n")
        return 1
    FILE.write_text(json.dumps(found, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    sys.stderr.write(f"{len(found)} tests of at least {MIN_S:g} s, "
                     f"{sum(found.values()):.0f} s in all, written to {FILE}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
