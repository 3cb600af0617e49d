"""A campaign's results log (``--resume``): header, appends, a resumed run taking what is
there, refusals of another run's log, a torn last line; and a real run interrupted by SIGINT
and resumed, with no cell run twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults.campaign.cells import CellResult
from faults.campaign.resume import ResumeLog
from hicache_runtime.contracts.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SEL = ["tp1/fixed/a", "tp1/fixed/b", "tp1/fixed/c"]


def _cell(cid: str) -> CellResult:
    return CellResult(id=cid, expect="healthy", observed="healthy", passed=True,
                      outcome="healthy", wall_s=1.0)


def test_a_log_resumes_with_what_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = ResumeLog(path, "c", SEL)
    assert log.done == {}
    log.append(_cell(SEL[0]))
    log.close()
    again = ResumeLog(path, "c", SEL)
    assert list(again.done) == [SEL[0]]
    again.append(_cell(SEL[1]))
    again.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["selection"] == SEL
    assert [json.loads(x)["id"] for x in lines[1:]] == SEL[:2]


def test_a_torn_last_line_is_dropped_and_the_cell_runs_again(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = ResumeLog(path, "c", SEL)
    log.append(_cell(SEL[0]))
    log.close()
    with path.open("a") as f:
        f.write(_cell(SEL[1]).model_dump_json()[:40])  # killed mid-write
    again = ResumeLog(path, "c", SEL)
    assert list(again.done) == [SEL[0]]
    again.append(_cell(SEL[1]))
    again.close()
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()[1:]] == SEL[:2]


def test_another_runs_log_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    ResumeLog(path, "c", SEL).close()
    with pytest.raises(ConfigError, match="another run"):
        ResumeLog(path, "c", SEL[:2])
    with pytest.raises(ConfigError, match="another run"):
        ResumeLog(path, "other", SEL)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(ConfigError, match="not a campaign results log"):
        ResumeLog(bad, "c", SEL)
    foreign = tmp_path / "foreign.jsonl"
    ResumeLog(foreign, "c", SEL).close()
    with foreign.open("a") as f:
        f.write(_cell("tp1/fixed/zzz").model_dump_json() + "\n")
    with pytest.raises(ConfigError, match="not in this run"):
        ResumeLog(foreign, "c", SEL)


#: The second cell sleeps 250 ms a step (about 7 s in all): the interrupt, sent once the first
#: cell's result is logged, lands in it even when this machine's load keeps the test's own
#: process off a core for seconds (with four cells of about a second each, a loaded run once
#: finished them all before the signal came).
SPEC = {
    "name": "resumable",
    "defaults": {"workload.requests": 6, "cache.device_tokens": 256, "cache.host_tokens": 512},
    "cells": [{"tp": 1, "faults": [fault], "expect": "healthy"}
              for fault in ("dma-lag:ms=5", "stage-lag:ms=250", "dma-lag:ms=7", "dma-lag:ms=8")],
}


def _sigint_ignored() -> bool:
    """Whether this process ignores SIGINT (what a child would inherit), from the kernel."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


@pytest.mark.slow
def test_a_run_stopped_by_sigint_resumes_and_runs_no_cell_twice(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    log = tmp_path / "results.jsonl"
    cmd = [sys.executable, str(ROOT / "cli.py"), "campaign", str(spec), "--resume", str(log),
           "--json", "--bundle-dir", str(tmp_path / "bundles")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # started as from a terminal: an ignored SIGINT is inherited across exec (a handler is
    # not), and a loaded full run once ran this test in a worker whose SIGINT was ignored (the
    # campaign ran all four cells through the interrupt and exited 0); a handler for the
    # moment of the fork gives the child the default disposition whatever this worker's
    ignored = _sigint_ignored()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # stop it once a cell has its result, not before
        if log.exists() and len(log.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=120)
    assert first.returncode != 0, (f"SIGINT ignored in this worker: {ignored}", err[-2000:])
    done_first = [json.loads(x)["id"] for x in log.read_text().splitlines()[1:]]
    assert 1 <= len(done_first) < 4
    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert second.returncode == 0, second.stderr[-2000:]
    result = json.loads(second.stdout)
    ids = [c["id"] for c in result["cells"]]
    assert len(ids) == 4
    assert all(c["passed"] for c in result["cells"])
    logged = [json.loads(x)["id"] for x in log.read_text().splitlines()[1:]]
    assert sorted(logged) == sorted(ids), "every cell logged exactly once"
    assert logged[:len(done_first)] == done_first
