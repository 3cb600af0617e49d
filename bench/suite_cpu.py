"""Where the test suite's CPU goes: each test's CPU, the processes it started included.

A two-core CI machine runs the suite at about 187% busy with four test processes, so its wall
time is its CPU over two; this tells which tests that CPU belongs to. The suite runs as a
child (``python -m pytest -n N`` plus any pytest arguments given after ``--``) with a small
plug-in that records when each test ran on which test process; meanwhile this process reads
every process's CPU from ``/proc`` every ``--interval`` seconds and charges each increment to
the test running on the test process it descends from: the rank processes a zygote forked,
CLI commands a test ran, servers a fixture started. What no test process started is counted
apart: the pytest controller, a daemon that detached (Ray's), anything else on the machine.
A process's CPU after its last reading is lost (at most one interval per process); a test
process's own start-up and collection show as its time between tests.

Linux only. Usage: python bench/suite_cpu.py [-n 4] [--top 30] [-- PYTEST ARGS]
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PLUGIN = textwrap.dedent('''\
    import json, os, time
    import pytest

    _OUT = os.environ["SUITE_CPU_SPANS"]


    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start = time.monotonic()
        yield
        line = json.dumps({"id": item.nodeid, "pid": os.getpid(), "start": start,
                           "end": time.monotonic()})
        with open(_OUT, "a", encoding="utf-8") as fh:
            fh.write(line + "\\n")
    ''')


@dataclass(frozen=True)
class Span:
    """One test on one test process, in ``time.monotonic`` seconds."""

    test: str
    pid: int
    start: float
    end: float


@dataclass(frozen=True)
class Increment:
    """CPU one process used between two readings (``since``, ``at``), with its ancestors
    (nearest first)."""

    since: float
    at: float
    seconds: float
    lineage: tuple[int, ...]


def _read_proc() -> dict[tuple[int, int], tuple[int, float]]:
    """Every process now: (pid, start tick) -> (parent pid, CPU seconds so far)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                stat = fh.read()
        except OSError:  # gone since the listing
            continue
        # fields after the command name, which may itself hold spaces and parentheses
        rest = stat[stat.rfind(")") + 2:].split()
        try:
            ppid, cpu = int(rest[1]), (int(rest[11]) + int(rest[12])) / tick
            out[(int(name), int(rest[19]))] = (ppid, cpu)
        except (IndexError, ValueError):
            continue
    return out


class Sampler(threading.Thread):
    """Reads ``/proc`` every ``interval`` seconds until stopped; keeps the increments."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True, name="suite-cpu-sampler")
        self.interval = interval
        self.increments: list[Increment] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        last = _read_proc()  # what ran before the suite is not the suite's
        then = time.monotonic()
        while not self._stop_event.wait(self.interval):
            now, seen = time.monotonic(), _read_proc()
            parent = {pid: ppid for (pid, _), (ppid, _) in seen.items()}
            for key, (_, cpu) in seen.items():
                used = cpu - last[key][1] if key in last else cpu
                if used <= 0:
                    continue
                lineage: list[int] = []
                pid = key[0]
                while pid in parent and pid > 1 and len(lineage) < 32:
                    lineage.append(pid)
                    pid = parent[pid]
                self.increments.append(Increment(then, now, used, tuple(lineage)))
            last, then = seen, now

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def attribute(spans: list[Span], increments: list[Increment]) -> tuple[dict[str, float], float]:
    """CPU seconds per test (and per test process between tests), and what no test process
    started."""
    by_pid: dict[int, list[Span]] = {}
    for span in sorted(spans, key=lambda s: s.start):
        by_pid.setdefault(span.pid, []).append(span)
    starts = {pid: [s.start for s in runs] for pid, runs in by_pid.items()}
    per_test: defaultdict[str, float] = defaultdict(float)
    elsewhere = 0.0
    for inc in increments:
        worker = next((pid for pid in inc.lineage if pid in by_pid), None)
        if worker is None:
            elsewhere += inc.seconds
            continue
        i = bisect.bisect_right(starts[worker], inc.at) - 1
        # the last test to start before the reading, if it still ran after the one before
        if i >= 0 and by_pid[worker][i].end >= inc.since:
            per_test[by_pid[worker][i].test] += inc.seconds
        else:
            per_test[f"(test process {worker}, between tests)"] += inc.seconds
    return dict(per_test), elsewhere


def _largest(seconds: dict[str, float], n: int) -> list[tuple[str, float]]:
    return sorted(seconds.items(), key=lambda kv: -kv[1])[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=4, help="test processes (pytest-xdist)")
    ap.add_argument("--top", type=int, default=30, help="tests and files to list")
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between readings")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = ap.parse_args()
    if not Path("/proc/self/stat").exists():
        ap.error("needs Linux's /proc")
    with tempfile.TemporaryDirectory() as tmp:
        plugin_dir = Path(tmp)
        (plugin_dir / "suite_cpu_spans.py").write_text(_PLUGIN, encoding="utf-8")
        spans_path = plugin_dir / "spans.jsonl"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SUITE_CPU_SPANS": str(spans_path),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_dir),
                                                           os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "suite_cpu_spans", "-n", str(args.n), *args.pytest_args]
        sampler = Sampler(args.interval)
        sampler.start()
        t0 = time.monotonic()
        before = os.times()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, check=False)
        wall = time.monotonic() - t0
        after = os.times()
        sampler.stop()
        spans = [Span(d["id"], d["pid"], d["start"], d["end"])
                 for d in map(json.loads, spans_path.read_text(encoding="utf-8").splitlines())
                 ] if spans_path.exists() else []
    cpu = (after.children_user - before.children_user) + \
        (after.children_system - before.children_system)
    per_test, elsewhere = attribute(spans, sampler.increments)
    per_file: defaultdict[str, float] = defaultdict(float)
    for test, seconds in per_test.items():
        per_file[test.split("::")[0]] += seconds
    took = {s.test: s.end - s.start for s in spans}
    print(f"\n{'CPU s':>8} {'wall s':>8}  test (top {args.top})")
    for test, seconds in _largest(per_test, args.top):
        print(f"{seconds:8.1f} {took.get(test, 0.0):8.1f}  {test}")
    print(f"\n{'CPU s':>8}  file")
    for name, seconds in _largest(per_file, args.top):
        print(f"{seconds:8.1f}  {name}")
    print(json.dumps({
        "exit": proc.returncode, "workers": args.n, "tests": len(spans),
        "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
        "busy": round(cpu / wall, 2) if wall else None,
        "attributed_cpu_s": round(sum(per_test.values()), 1),
        "outside_tests_cpu_s": round(elsewhere, 1),
        "top": [[t, round(s, 1)] for t, s in _largest(per_test, 5)],
    }))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
