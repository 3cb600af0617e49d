"""gloo reports a timed-out op as a plain ``RuntimeError``: the classifier tells it from a peer
that went away by the op's flight record (how long it waited in which group), on real gloo."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

RANK = textwrap.dedent('''
    import json, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from hicache_runtime.contracts.outcome import CommTimeouts, classify
    from hicache_runtime.dist.flight_recorder import FlightRecorder, Group

    rank, store, timeout_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    pg = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s), backend="gloo")
    group = Group("pp_act", pg, [0, 1], rank, FlightRecorder())
    if rank == 1:
        time.sleep(3 * timeout_s)  # never sends
        sys.exit(0)
    out = {}
    timeouts = CommTimeouts(timeout_s)
    try:
        group.recv(torch.zeros(1), src=1)
    except RuntimeError as exc:
        out["recv"] = classify(exc, timeouts).value
    try:  # the pair is closed now: the next op fails at once
        group.all_reduce(torch.zeros(1))
    except RuntimeError as exc:
        out["after"] = classify(exc, timeouts).value
    print(json.dumps(out), flush=True)
''')


def test_a_gloo_timeout_is_a_hang_and_a_closed_pair_a_crash(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    root = str(Path(__file__).resolve().parents[2])
    args = [str(tmp_path / "store"), "1.5"]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), *args], cwd=root,
                              env={"PYTHONPATH": root, "OMP_NUM_THREADS": "1",
                                   "PATH": "/usr/bin:/bin"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    assert out.strip(), err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"recv": "hang", "after": "crash"}
