"""Wall time of the built-in campaign: per cell, per signature reproduction, and in total.

Goals (SPEC §7, on a 2-core CPU machine): every known signature reproduced by its default
campaign cell in <= 20 s wall (the cell's whole wall time: warm-up run, rank start-up, the run,
rank dumps and the doctor's diagnosis); the whole default campaign in <= 5 minutes.

``--executor ray`` runs the cells as Ray tasks on a local cluster of two nodes started here (a
head that runs no task and a worker node with ``--worker-cpus``; ``faults/campaign/ray_local.py``)
and also times Ray's own cost per task (a task that does nothing, submitted and waited for),
the figures an estimate for a real cluster is made from.

Usage: python bench/campaign.py [--only GLOB] [--spec FILE] [--executor local|ray]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from faults.campaign.cells import RayOptions, run_campaign
from faults.campaign.plan import HEALTHY, load_campaign


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None)
    ap.add_argument("--spec", type=Path, default=None)
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    ap.add_argument("--worker-cpus", type=int, default=2)
    args = ap.parse_args()
    spec = load_campaign(args.spec)
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.executor == "ray":
            from faults.campaign.ray_local import LocalRayCluster

            with LocalRayCluster(Path(tmp) / "ray").start(worker_cpus=args.worker_cpus) as c:
                result = run_campaign(spec, bundle_root=Path(tmp), only=args.only,
                                      ray=RayOptions(c.address))
                extra["ray_task_overhead_ms"] = _task_overhead_ms()
                import ray

                ray.shutdown()
        else:
            result = run_campaign(spec, bundle_root=Path(tmp), only=args.only)
    for c in result.cells:
        print(f"{'pass' if c.passed else 'FAIL'}  {c.wall_s:6.1f} s  {c.id}  -> {c.observed}")
    repro = [c for c in result.cells if c.expect != HEALTHY]
    slowest = max(repro, key=lambda c: c.wall_s, default=None)
    print(f"{result.passed}/{len(result.cells)} cells as expected in {result.wall_s:.1f} s; "
          f"slowest reproduction {slowest.wall_s if slowest else 0:.1f} s "
          f"({slowest.id if slowest else '-'})")
    print(json.dumps({
        "bench": "campaign", "executor": args.executor, "cells": len(result.cells),
        "passed": result.passed, "total_s": result.wall_s,
        "mean_cell_s": round(statistics.mean(c.wall_s for c in result.cells), 2)
        if result.cells else None,
        "max_reproduction_s": slowest.wall_s if slowest else None,
        "max_cell_s": max((c.wall_s for c in result.cells), default=None), **extra,
    }))


def _task_overhead_ms(n: int = 200) -> float:
    """Ray's own cost per task on this cluster: the median round trip of a task that does
    nothing, one at a time."""
    import ray

    noop = ray.remote(num_cpus=1)(lambda: None)
    ray.get(noop.remote())  # a worker process up first
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(noop.remote())
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 2)


if __name__ == "__main__":
    main()
