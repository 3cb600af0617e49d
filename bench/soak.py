"""Soak: a long fixed-protocol run at tp2 x pp2 with L3, under a rotating set of faults, whose
resources must stay flat.

Every rank samples itself every ``--every`` steps (``observability.sample_every``): pending
async sends (every process group), pending-send bytes, device and host pages in use, RSS, and
(rank 0) the objects in the L3 store, plus radix-tree nodes and the objects Python's garbage
collector tracks. After ``--warmup`` steps each series is fitted with a least-squares line;
``slope_<series>`` is the steepest rank's slope per 1,000 steps. The goal is flat: a protocol
that keeps something per step (a send, a page, a record) shows as a slope. What is expected:

* the warm-up covers the bounded rings filling (the event ring, 65,536 events, fills in a few
  thousand steps at tp2 x pp2; the flight recorder, 8,192 ops, sooner): memory and Python
  objects rise until then and flatten;
* every request's prompt and output are kept to judge the run against the cache-disabled one,
  a few KB per request: a small residual slope in ``rss_mb`` and ``py_objects``;
* every new prompt writes new pages and the file store never evicts, so ``slope_l3_keys``
  follows the unique content written.

The faults are the ones the fixed protocols must survive (no crash, hang or kill), each active
for ``--fault-window`` steps in turn; the run is on the ``proposed`` profile (``--profile``),
since a release's rank-local host allocation does not survive ``host-alloc-fail``. The
workload is sized so the last request arrives at or after step ``--steps``; with
``--compare`` (default) outputs are checked against the cache-disabled run of the same
topology.

Usage: python bench/soak.py [--steps 10000] [--tp 2] [--pp 2] [--every 500] [--warmup 1000]
                            [--fault-window 250] [--no-faults] [--no-compare]
                            [--profile proposed]
                            [--set observability.ring_size=4096 ...]

Prints a line per sample while it runs, then one JSON line: ``outcome``, ``steps``,
``slope_<series>`` for pending_sends, pending_bytes, device_pages, host_pages, rss_mb and
l3_keys, ``max_pending_sends`` (after warm-up) and ``wrong_outputs``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from faults.spec import FaultSpec, parse_fault
from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.rank_result import RankResult
from hicache_runtime.engine.samples import ResourceSample, read_samples
from hicache_runtime.engine.workload import Workload
from hicache_runtime.kv.request import Req, ReqStatus
from hicache_runtime.launch.launcher import LaunchResult, launch
from hicache_runtime.launch.run import compare_outputs

SERIES = ("pending_sends", "pending_bytes", "device_pages", "host_pages", "rss_mb", "l3_keys",
          "tree_nodes", "py_objects")

#: Faults the fixed protocols must survive with outputs unchanged, as templates for a topology
#: (``{last}``: the last stage; ``{peer}``: a rank other than 0). One is active per window.
ROTATION = (
    "stage-lag:pp={last},ms=5",
    "dma-lag:rank={peer},ms=20",
    "host-alloc-fail:rank={peer},p=0.3",
    "storage-shortfall:rank={peer},mode=short,pages=2",
    "storage-shortfall:rank={peer},mode=holes,pages=1,at=1",
    "storage-latency:rank={peer},ms=50",
    "storage-error:rank={peer},p=0.3",
    "storage-corrupt:rank={peer},p=0.2",
    "mid-prefetch-abort:batch=1,count=2",
)


def rotating_faults(steps: int, window: int, tp: int, pp: int) -> list[FaultSpec]:
    """One fault per ``window`` steps, cycling through :data:`ROTATION`, up to ``steps``."""
    if tp * pp < 2:
        raise SystemExit("soak: the rotating faults need at least two ranks")
    out = []
    for k, start in enumerate(range(1, steps + 1, window)):
        text = ROTATION[k % len(ROTATION)].format(last=pp - 1, peer=tp * pp - 1)
        if text.startswith("stage-lag") and pp < 2:
            continue
        out.append(parse_fault(f"{text},steps={start}-{min(steps, start + window - 1)}"))
    return out


def requests_for(steps: int, base: dict[str, Any]) -> int:
    """The fewest requests whose last planned arrival is at or after ``steps``: the run then
    lasts at least that long (follow-up turns arrive later still)."""

    def last_arrival(n: int) -> int:
        cfg = load_config({**base, "workload.requests": n})
        w = Workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
        return max((p.arrival or 0) for p in w.plans.values())

    lo, hi = 1, 8
    while last_arrival(hi) < steps:
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if last_arrival(mid) >= steps:
            hi = mid
        else:
            lo = mid + 1
    return hi


def config(args: argparse.Namespace, l3_dir: Path) -> RuntimeConfig:
    base: dict[str, Any] = {
        "topology.tp": args.tp, "topology.pp": args.pp, "seed": args.seed,
        "profile": args.profile, "workload.arrival_gap_steps": args.arrival_gap,
        "storage.backend": "file", "storage.path": l3_dir,
        "observability.sample_every": args.every,
        "observability.protocol_timeout_s": args.protocol_timeout,
        "observability.watchdog_timeout_s": args.protocol_timeout * 4,
    }
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            base[key] = json.loads(value)
        except ValueError:
            base[key] = value
    base["workload.requests"] = requests_for(args.steps, base)
    if not args.no_faults:
        base["faults"] = tuple(rotating_faults(args.steps, args.fault_window, args.tp, args.pp))
    return load_config(base)


# --- results ----------------------------------------------------------------------------------


def slope_per_k(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of (step, value) per 1,000 steps; None with fewer than 2 points."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        return None
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / var


def summarise(samples: dict[int, list[ResourceSample]], warmup: int) -> dict[str, Any]:
    """``slope_<series>``: the steepest rank's slope after warm-up (None if too few samples);
    ``max_pending_sends``: the most sends any rank held at a sample after warm-up."""
    out: dict[str, Any] = {}
    for name in SERIES:
        slopes = []
        for rank_samples in samples.values():
            pts = [(s.step, float(v)) for s in rank_samples
                   if s.step > warmup and (v := getattr(s, name)) is not None]
            if (k := slope_per_k(pts)) is not None:
                slopes.append(k)
        out[f"slope_{name}"] = round(max(slopes), 3) if slopes else None
    late = [s.pending_sends for ss in samples.values() for s in ss if s.step > warmup]
    out["max_pending_sends"] = max(late) if late else None
    return out


def _reqs(result: RankResult | None) -> dict[str, Req]:
    out = {}
    for rid, r in (result.requests if result is not None else {}).items():
        out[rid] = Req(rid=rid, input_ids=r.input_ids, max_new_tokens=len(r.output_ids),
                       output_ids=r.output_ids, status=ReqStatus(r.status),
                       abort_reason=r.abort_reason)
    return out


def wrong_outputs(cfg: RuntimeConfig, res: LaunchResult, bundles: Path) -> int:
    """Requests whose tokens differ from the cache-disabled run's (aborted ones on the tokens
    they have); -1 when the reference itself failed."""
    got = _reqs(res.results.get(0))
    caps = {rid: len(r.output_ids) for rid, r in got.items()
            if r.status is ReqStatus.ABORTED and r.abort_reason == "client abort"}
    ref = launch(cfg.reference(), bundle_root=bundles, caps=caps)
    try:
        if ref.outcome is not RunOutcome.HEALTHY:
            return -1
        return len(compare_outputs(got, _reqs(ref.results.get(0))))
    finally:
        ref.cleanup()


class LivePrinter:
    """Prints each rank's samples as they land (called from the launcher's progress poll)."""

    def __init__(self, world: int, out: Callable[[str], None]) -> None:
        self.world = world
        self.out = out
        self.run_dir: Path | None = None
        self.seen = dict.fromkeys(range(world), 0)

    def poll(self) -> None:
        if self.run_dir is None:
            return
        for rank in range(self.world):
            samples = read_samples(self.run_dir, rank)
            for s in samples[self.seen[rank]:]:
                self.out(f"step {s.step:6d} rank {rank}: pending {s.pending_sends:3d} "
                         f"({s.pending_bytes} B) device {s.device_pages:4d} host "
                         f"{s.host_pages:4d} pages, rss {s.rss_mb:7.1f} MB"
                         + (f", l3 {s.l3_keys} keys" if s.l3_keys is not None else ""))
            self.seen[rank] = len(samples)


def soak(args: argparse.Namespace, work: Path, out: Callable[[str], None]) -> dict[str, Any]:
    cfg = config(args, work / "l3")
    out(f"soak: tp{args.tp} x pp{args.pp}, {cfg.workload.requests} requests (last arrival at "
        f"or after step {args.steps}), {len(cfg.faults)} fault windows, file L3")
    printer = LivePrinter(cfg.topology.world_size, out)
    # The launcher makes its run directory with ``tempfile``: point that at a directory of our
    # own, so the run's directory (and its samples) can be found while it runs.
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    saved, tempfile.tempdir = tempfile.tempdir, str(runs)

    def progress(step: int, done: int, total: int) -> None:
        if printer.run_dir is None:
            printer.run_dir = next(runs.glob("hicache-run-*"), None)
        printer.poll()

    t0 = time.monotonic()
    try:
        res = launch(cfg, bundle_root=work / "bundles", progress=progress)
    finally:
        tempfile.tempdir = saved
    try:
        printer.run_dir = res.run_dir
        printer.poll()
        samples = {r: read_samples(res.run_dir, r) for r in range(cfg.topology.world_size)}
        summary: dict[str, Any] = {
            "bench": "soak", "outcome": res.outcome.value, "error": res.error,
            "steps": res.results[0].steps if 0 in res.results else 0,
            "requests": cfg.workload.requests, "tp": args.tp, "pp": args.pp,
            "faults": len(cfg.faults), "every": args.every, "warmup": args.warmup,
            "wall_s": round(res.wall_s, 1),
            "bundle": str(res.bundle) if res.bundle else None,
            **summarise(samples, args.warmup),
            "wrong_outputs": None,
        }
        if res.outcome is RunOutcome.HEALTHY and not args.no_compare:
            summary["wrong_outputs"] = wrong_outputs(cfg, res, work / "bundles")
            if summary["wrong_outputs"]:
                summary["outcome"] = RunOutcome.WRONG_OUTPUT.value
        summary["total_s"] = round(time.monotonic() - t0, 1)
        return summary
    finally:
        res.cleanup()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000, help="run at least this many steps")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--every", type=int, default=500, help="sample every N steps")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps left out of the slopes (default: a quarter, at least 2 samples)")
    ap.add_argument("--fault-window", type=int, default=250)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--no-compare", action="store_true",
                    help="skip the cache-disabled reference run (halves the time)")
    ap.add_argument("--arrival-gap", type=int, default=6,
                    help="steps between independent arrivals (keeps the pipeline below "
                         "saturation, so nothing queues up by design)")
    ap.add_argument("--protocol-timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="proposed",
                    help="release profile (hicache profiles list); a release's rank-local host "
                         "allocation fails under the rotation's host-alloc-fail")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. observability.ring_size=4096 (JSON values)")
    ap.add_argument("--work-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.warmup is None:
        args.warmup = max(args.steps // 4, 2 * args.every)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hicache-soak-") as tmp:
        work = args.work_dir or Path(tmp)
        summary = soak(args, work, lambda line: print(line, flush=True))
    print(json.dumps(summary), flush=True)
    return 0 if summary["outcome"] == RunOutcome.HEALTHY.value else 1


if __name__ == "__main__":
    sys.exit(main())
