"""What the fixed sync protocols cost, and what tracing costs, at tp2 x pp2.

Runs the same multi-rank workload (real rank processes on gloo) with
* the fixed protocols (default),
* every legacy switch on (the pre-fix protocols: fewer votes, no PP chain, no backpressure),
* the fixed protocols with the event ring off,
interleaved over several rounds, and compares engine time per step on rank 0 (process start-up
excluded). Goals: fixed vs legacy throughput ratio >= 0.95; tracing on vs off >= 0.97.

The legacy run has no faults, but its protocols can still break on their own (that is the
bug); a round in which it did not stay healthy is reported and left out.

Usage: python bench/sync_overhead.py [--tp 2] [--pp 2] [--requests 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.launch.launcher import launch


def config(args: argparse.Namespace, *, legacy: bool, tracing: bool) -> RuntimeConfig:
    return load_config({
        "topology.tp": args.tp, "topology.pp": args.pp, "workload.requests": args.requests,
        "cache.device_tokens": 512, "cache.host_tokens": 1024,
        "observability.tracing": tracing, "observability.pending_send_limit": 0,
        "observability.watchdog_timeout_s": 60.0,
        "legacy": frozenset(LegacySwitch) if legacy else frozenset(),
    })


def step_time(cfg: RuntimeConfig, bundles: Path) -> float | None:
    res = launch(cfg, bundle_root=bundles)
    try:
        r0 = res.results.get(0)
        if res.outcome is not RunOutcome.HEALTHY or r0 is None or not r0.steps:
            print(f"  (run not healthy: {res.outcome.value}: {res.error})")
            return None
        return float(r0.wall_s or 0.0) / r0.steps
    finally:
        res.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    variants = {"fixed": (False, True), "legacy": (True, True), "untraced": (False, False)}
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                legacy, tracing = variants[name]
                t = step_time(config(args, legacy=legacy, tracing=tracing), Path(tmp))
                print(f"round {r} {name:9s} " + (f"{t * 1000:.2f} ms/step" if t else "n/a"))
                if t is not None:
                    best[name] = min(best.get(name, float("inf")), t)
    fixed = best.get("fixed")
    sync_ratio = best["legacy"] / fixed if fixed and "legacy" in best else None
    trace_ratio = best["untraced"] / fixed if fixed and "untraced" in best else None
    print(f"tp{args.tp} x pp{args.pp}: fixed {fixed and fixed * 1000:.2f} ms/step, "
          f"legacy-all {best.get('legacy', 0) * 1000:.2f}, untraced "
          f"{best.get('untraced', 0) * 1000:.2f}")
    print(f"fixed vs legacy throughput ratio {sync_ratio} (goal >= 0.95); "
          f"tracing on vs off {trace_ratio} (goal >= 0.97)")
    print(json.dumps({"bench": "sync_overhead", "tp": args.tp, "pp": args.pp,
                      "sync_ratio": sync_ratio and round(sync_ratio, 3),
                      "tracing_ratio": trace_ratio and round(trace_ratio, 3),
                      "fixed_ms_per_step": fixed and round(fixed * 1000, 3)}))


if __name__ == "__main__":
    main()
