"""Queue-length spread across DP groups under a bursty arrival: round robin vs shortest queue.

A run of the DP controller per policy, same seed and workload: a mixed stream (chats, shared
system prompts, long documents: requests of very different cost) whose sessions start in
bursts (``--burst`` sessions at once, a burst every ``--gap`` steps: ``workload.burst_sessions``
and ``arrival_gap_steps``), so later bursts land on groups still busy with earlier ones, and
whose follow-up turns and questions come as earlier ones finish. Real rank processes, ``--dp``
groups of one rank each by default.

The queue length of a group is what its entry rank last wrote to the load board: requests it
holds and has not finished. At every dispatch the controller records the board (``dp.route``,
attribute ``board``); the spread is ``max - min`` of it, the imbalance the arriving request
meets (the controller routes nothing before every group is ready, so the first burst meets
empty queues). Timing moves a run's figures (the groups share the machine's cores), so each
policy runs ``--rounds`` times, interleaved, and the medians are reported: mean and largest
spread, requests served per group (last round), and wall time (rank start-up included).

Usage: python bench/dp_routing.py [--dp 2] [--tp 1] [--requests 96] [--burst 8] [--gap 16]
                                 [--rounds 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.events import Ev
from hicache_runtime.launch.dp_controller import launch_dp

POLICIES = ("round-robin", "shortest-queue")


def config(args: argparse.Namespace, policy: str, trace: Path) -> RuntimeConfig:
    return load_config({
        "seed": args.seed, "topology.dp": args.dp, "topology.tp": args.tp,
        "topology.dp_policy": policy, "workload.kind": "mixed",
        "workload.requests": args.requests, "workload.burst_sessions": args.burst,
        "workload.arrival_gap_steps": args.gap,
        "cache.device_tokens": 1024, "cache.host_tokens": 2048,
        "observability.trace_path": trace, "observability.watchdog_timeout_s": 120.0,
    })


def one_run(args: argparse.Namespace, policy: str, tmp: Path) -> dict[str, Any]:
    trace = tmp / policy / "t.jsonl"
    res = launch_dp(config(args, policy, trace), bundle_root=tmp / "bundles")
    try:
        if res.outcome is not RunOutcome.HEALTHY:
            raise SystemExit(f"{policy}: run not healthy: {res.outcome.value}: {res.error}")
        wall = res.wall_s
    finally:
        res.cleanup()
    lines = trace.with_name("t.controller.jsonl").read_text(encoding="utf-8").splitlines()
    routes = [e["attrs"] for e in map(json.loads, lines) if e["kind"] == Ev.DP_ROUTE]
    spreads = [max(r["board"]) - min(r["board"]) for r in routes]
    served = Counter(r["group"] for r in routes)
    return {"spread_mean": statistics.fmean(spreads), "spread_max": max(spreads),
            "served": [served.get(g, 0) for g in range(args.dp)], "wall_s": wall,
            "dispatches": len(routes)}


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"spread_mean": round(statistics.median(r["spread_mean"] for r in runs), 3),
            "spread_max": statistics.median(r["spread_max"] for r in runs),
            "served": runs[-1]["served"],
            "wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
            "dispatches": runs[-1]["dispatches"], "rounds": len(runs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--gap", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for policy in POLICIES if r % 2 == 0 else reversed(POLICIES):
                f = one_run(args, policy, Path(tmp) / f"round{r}")
                runs[policy].append(f)
                print(f"round {r} {policy:15s} spread mean {f['spread_mean']:.2f}, max "
                      f"{f['spread_max']}; served per group {f['served']}; {f['wall_s']:.1f} s")
    rr, sq = medians(runs["round-robin"]), medians(runs["shortest-queue"])
    ratio = sq["spread_mean"] / rr["spread_mean"] if rr["spread_mean"] else None
    print(f"median mean queue-length spread: round robin {rr['spread_mean']}, shortest queue "
          f"{sq['spread_mean']} (ratio {ratio and round(ratio, 3)}); median largest: "
          f"{rr['spread_max']} vs {sq['spread_max']}")
    print(json.dumps({"bench": "dp_routing", "dp": args.dp, "tp": args.tp,
                      "requests": args.requests, "burst": args.burst, "gap": args.gap,
                      "seed": args.seed,
                      "round_robin": rr, "shortest_queue": sq,
                      "spread_ratio": ratio and round(ratio, 3)}))


if __name__ == "__main__":
    main()
