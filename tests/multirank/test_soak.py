"""A short ``bench/soak.py``: tp2 x pp2 with L3 under rotating faults, run as the bench runs
(its own process, its JSON line), and the bound on pending sends held at every sample."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[2]
PENDING_BOUND = 16
"""A PP0 rank holds at most three steps of activation sends (9) and two rounds of chain sends;
an unreaped channel passes this within a few dozen steps."""


def test_short_soak_keeps_pending_sends_bounded(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "bench/soak.py", "--steps", "400", "--every", "20", "--warmup", "100",
         "--fault-window", "40", "--protocol-timeout", "10", "--work-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-2000:]
    summary = json.loads(lines[-1])
    assert summary["outcome"] == "healthy", (summary, proc.stderr[-2000:])
    assert summary["wrong_outputs"] == 0
    assert summary["steps"] >= 400
    assert summary["faults"] >= 9  # every fault of the rotation had its window
    assert summary["max_pending_sends"] <= PENDING_BOUND, summary
    samples = [line for line in lines if line.startswith("step ")]
    assert len(samples) >= 4 * (400 // 20)  # every rank, every 20 steps, reported live
    assert all(int(line.split("pending")[1].split()[0]) <= PENDING_BOUND for line in samples)
    assert proc.returncode == 0
