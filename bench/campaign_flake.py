"""False crashes of the built-in campaign: its healthy cells, over and over, with a second
campaign running beside them.

A healthy cell (a fixed protocol under its fault) must end healthy with outputs identical to
its cache-disabled reference, every time; any crash or hang it reports is a false alarm of the
runtime itself (teardown, rendezvous, timeouts under load), not of the protocol under test.
The second campaign (the whole default campaign, restarted whenever it ends) loads the
machine and races for ports and temporary directories the way other jobs do.

Goal: 0 false crashes in 200 cell-runs.

Usage: python bench/campaign_flake.py [--runs N] [--only GLOB] [--no-beside]
                                       [--bundle-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from faults.campaign.cells import CellResult, run_cell, select
from faults.campaign.plan import HEALTHY, load_campaign

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUNS = 200


class Beside:
    """The default campaign in a loop, in a process group of its own, until stopped."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.campaigns = 0
        self.unexpected = 0
        self._stop = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._thread = threading.Thread(target=self._loop, name="beside", daemon=True)

    def start(self) -> Beside:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its ranks and cleans up
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        tmp = self.work / "beside-tmp"  # whatever a stopped campaign leaves goes with us
        tmp.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "TMPDIR": str(tmp)}
        while not self._stop.is_set():
            self._proc = subprocess.Popen(
                [sys.executable, str(ROOT / "cli.py"), "campaign", "--json", "--bundle-dir",
                 str(self.work / "beside-bundles")],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, start_new_session=True)
            out, _ = self._proc.communicate()
            if self._stop.is_set():
                return
            try:
                cells = json.loads(out)["cells"]
            except (ValueError, KeyError, TypeError):
                continue
            self.campaigns += 1
            self.unexpected += sum(1 for c in cells if not c["passed"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                    help=f"healthy cell-runs in all (default {DEFAULT_RUNS})")
    ap.add_argument("--only", default=None, help="glob over the healthy cells' ids")
    ap.add_argument("--no-beside", action="store_true", help="no second campaign")
    ap.add_argument("--bundle-dir", type=Path, default=None,
                    help="keep the bundles of false crashes here (default: a temporary dir)")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    spec = load_campaign(None)
    cells = [c for c in select(spec, args.only) if c.expect == HEALTHY]
    if not cells:
        ap.error("no healthy cell selected")
    with tempfile.TemporaryDirectory(prefix="campaign-flake-") as tmp:
        work = Path(tmp)
        bundle_root = args.bundle_dir or work / "bundles"
        bundle_root.mkdir(parents=True, exist_ok=True)
        beside = None if args.no_beside else Beside(work).start()
        t0 = time.monotonic()
        results: list[CellResult] = []
        try:
            for i in range(args.runs):
                cell = cells[i % len(cells)]
                cell_work = work / f"cell{i}"  # a fresh L3 store, as in a campaign of its own
                r = run_cell(spec, cell, cell_work, bundle_root)
                shutil.rmtree(cell_work, ignore_errors=True)
                results.append(r)
                mark = "ok  " if r.passed else "FAIL"
                print(f"{mark} {i + 1:4d}/{args.runs}  {r.wall_s:6.1f} s  {cell.id}  "
                      f"{r.outcome}" + (f"  {r.error}" if not r.passed else "")
                      + (f"  bundle {r.bundle}" if not r.passed and r.bundle else ""),
                      flush=True)
        finally:
            if beside is not None:
                beside.stop()
        wall = time.monotonic() - t0
    outcomes = Counter(r.outcome for r in results)
    false_crashes = outcomes["crash"] + outcomes["hang"]
    per_cell = Counter(r.id for r in results if not r.passed)
    print(f"{len(results)} healthy cell-runs ({len(cells)} cells) in {wall:.0f} s: "
          f"{false_crashes} false crashes, {outcomes['wrong-output']} wrong outputs, "
          f"{outcomes['error']} cells that could not run"
          + (f"; beside: {beside.campaigns} whole campaigns, {beside.unexpected} cells not "
             "as expected" if beside is not None else ""))
    for cell_id, n in per_cell.most_common():
        print(f"  {n}x  {cell_id}")
    print(json.dumps({
        "bench": "campaign_flake", "cell_runs": len(results), "false_crashes": false_crashes,
        "wrong_output": outcomes["wrong-output"], "errors": outcomes["error"],
        "passed": sum(r.passed for r in results), "healthy_cells": len(cells),
        "beside_campaigns": beside.campaigns if beside is not None else None,
        "beside_unexpected": beside.unexpected if beside is not None else None,
        "wall_s": round(wall, 1),
    }))


if __name__ == "__main__":
    main()
