"""The suite's order under pytest-xdist's work stealing (tests/conftest.py): each worker's
first share opens with its part of the long tests, and no test is lost or run twice; and
``bench/suite_cpu.py``, which tells whose CPU the suite's time is, charges a test the CPU of
the processes it starts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import LONG_TESTS, _spread_long_first


@dataclass(frozen=True)
class _Item:
    nodeid: str


def test_each_worker_s_first_share_opens_with_its_long_tests() -> None:
    short = [_Item(f"tests/test_x.py::test_{n}") for n in range(40)]
    long_ = [_Item(LONG_TESTS[0] + "[0]"), _Item(LONG_TESTS[0] + "[1]"),
             _Item(LONG_TESTS[2]), _Item(LONG_TESTS[5] + "test_mypy_clean")]
    items = [*short[:10], long_[2], *short[10:30], *long_[:2], *short[30:], long_[3]]
    order = _spread_long_first(items, 2)  # type: ignore[arg-type]
    assert sorted(i.nodeid for i in order) == sorted(i.nodeid for i in items)
    # xdist's worksteal sends the first len//2 to one worker and the rest to the other
    half = len(order) // 2
    first, second = order[:half], order[half:]
    assert first[:2] == [long_[0], long_[2]]  # the longest known first, dealt round robin
    assert second[:2] == [long_[1], long_[3]]
    # the other tests keep their file order
    assert [i for i in order if i in short] == short


def test_a_collection_without_long_tests_keeps_its_order() -> None:
    items = [_Item(f"tests/test_x.py::test_{n}") for n in range(5)]
    assert _spread_long_first(items, 2) == items  # type: ignore[arg-type]


_TWO_TESTS = """\
import subprocess, sys, time

BUSY = "import time\\nend = time.process_time() + 1.5\\nwhile time.process_time() < end: pass"


def test_busy_child():
    subprocess.run([sys.executable, "-c", BUSY], check=True)


def test_sleeping():
    time.sleep(1.0)
"""


@pytest.mark.slow
def test_the_suite_cpu_bench_charges_a_test_its_child_processes(tmp_path: Path) -> None:
    """A real pytest run on two workers: the test whose child burns 1.5 CPU-s gets it, the
    one that sleeps gets next to none."""
    (tmp_path / "test_two.py").write_text(_TWO_TESTS, encoding="utf-8")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "bench" / "suite_cpu.py"), "-n", "2",
                           "--top", "10", "--", str(tmp_path / "test_two.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (figures["exit"], figures["tests"], figures["workers"]) == (0, 2, 2)
    rows = {line.split()[-1].rsplit("::", 1)[-1]: float(line.split()[0])
            for line in proc.stdout.splitlines()
            if "test_two.py::" in line and not line.startswith("{")}
    assert rows["test_busy_child"] >= 1.2, rows
    assert rows.get("test_sleeping", 0.0) < 0.5, rows
    assert figures["cpu_s"] >= figures["attributed_cpu_s"] - 0.5
