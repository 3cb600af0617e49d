"""Throughput of the runtime with the always-on event ring vs tracing off, in one run.

Runs the same single-rank workload alternately with ``observability.tracing`` on and off
(several rounds, interleaved so machine noise hits both alike) and compares the best
throughput of each. Goal: ratio >= 0.97.

Usage: python bench/tracing_overhead.py [--requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import time

from hicache_runtime.config import load_config
from hicache_runtime.engine.loop import Engine
from hicache_runtime.engine.rank import build_rank
from hicache_runtime.engine.workload import Workload


def one_run(tracing: bool, requests: int) -> tuple[float, int, int]:
    cfg = load_config({"workload.requests": requests, "cache.device_tokens": 1024,
                       "observability.tracing": tracing, "workload.max_new_tokens": 16})
    rt = build_rank(cfg)
    try:
        t0 = time.perf_counter()
        result = Engine(rt, Workload(cfg.workload, cfg.model.vocab_size, cfg.seed)).run()
        wall = time.perf_counter() - t0
        tokens = sum(len(r.output_ids) + len(r.input_ids) for r in result.reqs.values())
        return wall, tokens, rt.tracer.total
    finally:
        rt.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    one_run(True, 8)  # warm up torch and the allocator
    best = {True: float("inf"), False: float("inf")}
    tokens = events = 0
    for r in range(args.rounds):
        for tracing in (r % 2 == 0, r % 2 == 1):
            wall, tokens, n_events = one_run(tracing, args.requests)
            best[tracing] = min(best[tracing], wall)
            if tracing:
                events = n_events
            print(f"round {r} tracing={'on ' if tracing else 'off'} {wall:.3f}s "
                  f"{tokens / wall:,.0f} tok/s")
    on, off = tokens / best[True], tokens / best[False]
    ratio = on / off
    print(f"best: tracing on {on:,.0f} tok/s ({events} events/run), off {off:,.0f} tok/s, "
          f"ratio {ratio:.3f} (goal >= 0.97)")
    print(json.dumps({"bench": "tracing_overhead", "ratio": round(ratio, 4),
                      "tok_per_s_on": round(on), "tok_per_s_off": round(off),
                      "events_per_run": events}))


if __name__ == "__main__":
    main()
