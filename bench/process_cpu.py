"""CPU the runtime's processes spend on a slice of the default campaign: user, system, minor
page faults and wall time of the whole process tree (the ``hicache campaign`` command, its
zygote and every rank forked from it, each waited for by its parent, so the kernel's figures
for the child include them).

On a two-core machine most of the test suite's time is this CPU: the ranks, forked from one
zygote per launcher process, and what they copy of its memory when they write to it (minor
faults). Run it before and after a change to start-up, fork or teardown, in one session: the
figures move with the machine's load.

Usage: python bench/process_cpu.py [--only GLOB] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _one(only: str, cwd: Path) -> dict[str, float]:
    """One campaign run as a child process, with what the kernel counted for it: the
    children it waited for (its zygote, which waited for the ranks) included."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "cli.py"),
                           "campaign", "--only", only, "--json"], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cells = json.loads(proc.stdout)["cells"]
    bad = [c["id"] for c in cells if not c["passed"]]
    if proc.returncode != 0 or bad:
        raise SystemExit(f"the campaign did not behave (exit {proc.returncode}): {bad}")
    return {"cells": len(cells), "wall_s": wall, "user_s": after.ru_utime - before.ru_utime,
            "sys_s": after.ru_stime - before.ru_stime,
            "minflt": after.ru_minflt - before.ru_minflt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="pp2/*")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            one = _one(args.only, Path(tmp))
            runs.append(one)
            print(f"{one['cells']} cells: {one['wall_s']:.1f} s wall, {one['user_s']:.1f} s "
                  f"user, {one['sys_s']:.1f} s sys, {one['minflt']} minor faults")
    print(json.dumps({
        "bench": "process_cpu", "only": args.only, "repeat": args.repeat,
        "cells": runs[0]["cells"],
        "wall_s": round(statistics.median(r["wall_s"] for r in runs), 2),
        "cpu_s": round(statistics.median(r["user_s"] + r["sys_s"] for r in runs), 2),
        "sys_s": round(statistics.median(r["sys_s"] for r in runs), 2),
        "minor_faults": int(statistics.median(r["minflt"] for r in runs)),
    }))


if __name__ == "__main__":
    main()
