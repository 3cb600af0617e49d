"""Wall time of the built-in campaign: per cell, per signature reproduction, and in total.

Goals (SPEC §7, on a 2-core CPU machine): every known signature reproduced by its default
campaign cell in <= 20 s wall (the cell's whole wall time: warm-up run, rank start-up, the run,
rank dumps and the doctor's diagnosis); the whole default campaign in <= 5 minutes.

Usage: python bench/campaign.py [--only GLOB] [--spec FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from faults.campaign.cells import run_campaign
from faults.campaign.plan import HEALTHY, load_campaign


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None)
    ap.add_argument("--spec", type=Path, default=None)
    args = ap.parse_args()
    spec = load_campaign(args.spec)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_campaign(spec, bundle_root=Path(tmp), only=args.only)
    for c in result.cells:
        print(f"{'pass' if c.passed else 'FAIL'}  {c.wall_s:6.1f} s  {c.id}  -> {c.observed}")
    repro = [c for c in result.cells if c.expect != HEALTHY]
    slowest = max(repro, key=lambda c: c.wall_s, default=None)
    print(f"{result.passed}/{len(result.cells)} cells as expected in {result.wall_s:.1f} s; "
          f"slowest reproduction {slowest.wall_s if slowest else 0:.1f} s "
          f"({slowest.id if slowest else '-'})")
    print(json.dumps({
        "bench": "campaign", "cells": len(result.cells), "passed": result.passed,
        "total_s": result.wall_s,
        "max_reproduction_s": slowest.wall_s if slowest else None,
        "max_cell_s": max((c.wall_s for c in result.cells), default=None),
    }))


if __name__ == "__main__":
    main()
