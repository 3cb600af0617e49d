"""Dynamic chunking vs fixed chunks: long-context prefill at pp=2.

Runs the same long-context workload (real rank processes on gloo, prompts of
``--context`` tokens chunked many times) with fixed chunks and with ``--enable-dynamic-chunking``,
interleaved over ``--rounds`` rounds, and reads from each run's traces:

* the **pipeline bubble**: the time each stage spends blocked receiving from the stage before
  it (PP1 waiting for PP0's hidden states and step plan, PP0 waiting for the sampled tokens
  that come round the ring), as a share of the stages' engine time;
* **TTFT** of each request as rank 0's scheduler sees it: from its arrival to the first decode
  batch it is in (its first token applied);
* the chunks: how many prefill chunks were cut and their sizes, and the start-up profile.

The seed's claim is that equal-latency chunks shrink the bubble. The runtime forms a slot's next
batch only after its previous one has left the pipeline and runs one chunked prefill at a time,
so two chunks of one prompt are never in different stages at once: what this measures is the
cost of cutting more, smaller chunks (more steps, each paying the stages' fixed per-step cost)
against shorter stalls behind long chunks. Ends with one JSON line of figures.

Usage: python bench/dynamic_chunking.py [--requests 8] [--context 1536] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.events import Ev
from hicache_runtime.launch.launcher import launch

#: Receives of a stage from the stage before it: hidden states, the step's plan, tokens.
_PIPELINE_GROUPS = ("pp_act", "pp_sync", "pp_out")


def config(args: argparse.Namespace, trace: Path, *, dynamic: bool) -> RuntimeConfig:
    return load_config({
        "topology.pp": 2, "workload.kind": "long_context", "workload.requests": args.requests,
        "workload.long_context_tokens": args.context, "workload.max_new_tokens": 4,
        "cache.device_tokens": args.device_tokens, "cache.host_tokens": args.device_tokens,
        "scheduler.max_prefill_tokens": args.device_tokens,
        "scheduler.enable_dynamic_chunking": dynamic,
        "observability.trace_path": trace, "observability.watchdog_timeout_s": 120.0,
    })


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _blocked_s(events: list[dict[str, Any]]) -> float:
    """Seconds this rank spent inside receives on the pipeline groups."""
    entered: dict[tuple[str, int], int] = {}
    total = 0
    for e in events:
        a = e["attrs"]
        if e["kind"] not in (Ev.COLLECTIVE_ENTER, Ev.COLLECTIVE_EXIT) \
                or a.get("group") not in _PIPELINE_GROUPS or a.get("op") != "recv":
            continue
        key = (a["group"], a["seq"])
        if e["kind"] == Ev.COLLECTIVE_ENTER:
            entered[key] = e["t_ns"]
        elif key in entered:
            total += e["t_ns"] - entered.pop(key)
    return total / 1e9


def _engine_s(events: list[dict[str, Any]]) -> float:
    """From the first step to the last event of the run (start-up and profile excluded)."""
    stepped = [e["t_ns"] for e in events if e["step"] >= 1]
    return (stepped[-1] - stepped[0]) / 1e9 if stepped else 0.0


def _ttft_s(events: list[dict[str, Any]]) -> list[float]:
    arrived: dict[str, int] = {}
    first: dict[str, float] = {}
    for e in events:
        if e["kind"] == Ev.REQ_ARRIVE:
            arrived[e["attrs"]["rid"]] = e["t_ns"]
        elif e["kind"] == Ev.BATCH and e["attrs"].get("decode"):
            for rid in e["attrs"]["rids"]:
                if rid in arrived and rid not in first:
                    first[rid] = (e["t_ns"] - arrived[rid]) / 1e9
    return list(first.values())


def measure(cfg: RuntimeConfig, trace: Path, bundles: Path) -> dict[str, Any] | None:
    res = launch(cfg, bundle_root=bundles)
    try:
        if res.outcome is not RunOutcome.HEALTHY:
            print(f"  (run not healthy: {res.outcome.value}: {res.error})")
            return None
    finally:
        res.cleanup()
    ranks = {r: _events(trace.with_name(f"{trace.stem}.rank{r}{trace.suffix}")) for r in (0, 1)}
    blocked = sum(_blocked_s(ev) for ev in ranks.values())
    engine = sum(_engine_s(ev) for ev in ranks.values())
    r0 = ranks[0]
    chunks = [x for e in r0 if e["kind"] == Ev.BATCH and not e["attrs"]["decode"]
              for x in e["attrs"]["extend"]]
    profile = next((e["attrs"] for e in r0 if e["kind"] == Ev.CHUNK_PROFILE), None)
    ttft = _ttft_s(r0)
    return {"bubble": blocked / engine if engine else 0.0, "blocked_s": blocked,
            "engine_s": engine, "ttft_s": statistics.median(ttft) if ttft else None,
            "prefill_batches": len(chunks), "chunk_sizes": sorted(set(chunks), reverse=True),
            "fitted": profile is not None and "a" in profile,
            "profile_s": profile["profile_s"] if profile else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=1536, help="tokens of each long document")
    ap.add_argument("--device-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"fixed": [], "dynamic": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["fixed", "dynamic"] if r % 2 == 0 else ["dynamic", "fixed"]
            for name in order:
                trace = Path(tmp) / f"{name}{r}" / "run.jsonl"
                trace.parent.mkdir()
                m = measure(config(args, trace, dynamic=name == "dynamic"), trace, Path(tmp))
                if m is None:
                    continue
                runs[name].append(m)
                print(f"round {r} {name:8s} bubble {m['bubble']:.3f} ({m['blocked_s']:.2f} s "
                      f"of {m['engine_s']:.2f} s), TTFT median {m['ttft_s']:.3f} s, "
                      f"{m['prefill_batches']} prefill batches, sizes {m['chunk_sizes'][:6]}"
                      + (f", profile {m['profile_s']:.2f} s, fitted {m['fitted']}"
                         if name == "dynamic" else ""))

    def med(name: str, key: str) -> float | None:
        vals = [m[key] for m in runs[name] if m[key] is not None]
        return statistics.median(vals) if vals else None

    fig = {name: {k: med(name, k) for k in ("bubble", "ttft_s", "prefill_batches")}
           for name in runs}
    bubble_ratio = fig["dynamic"]["bubble"] / fig["fixed"]["bubble"] \
        if fig["dynamic"]["bubble"] and fig["fixed"]["bubble"] else None
    ttft_ratio = fig["dynamic"]["ttft_s"] / fig["fixed"]["ttft_s"] \
        if fig["dynamic"]["ttft_s"] and fig["fixed"]["ttft_s"] else None
    print(f"pp2, {args.context}-token documents: bubble dynamic/fixed {bubble_ratio}, "
          f"TTFT dynamic/fixed {ttft_ratio} (below 1: dynamic chunking helps)")
    print(json.dumps({
        "bench": "dynamic_chunking", "pp": 2, "context": args.context,
        "rounds": args.rounds,
        "bubble_fixed": fig["fixed"]["bubble"] and round(fig["fixed"]["bubble"], 3),
        "bubble_dynamic": fig["dynamic"]["bubble"] and round(fig["dynamic"]["bubble"], 3),
        "bubble_ratio": bubble_ratio and round(bubble_ratio, 3),
        "ttft_fixed_s": fig["fixed"]["ttft_s"] and round(fig["fixed"]["ttft_s"], 3),
        "ttft_dynamic_s": fig["dynamic"]["ttft_s"] and round(fig["dynamic"]["ttft_s"], 3),
        "ttft_ratio": ttft_ratio and round(ttft_ratio, 3),
        "prefill_batches_fixed": _whole(fig["fixed"]["prefill_batches"]),
        "prefill_batches_dynamic": _whole(fig["dynamic"]["prefill_batches"]),
        "fitted": all(m["fitted"] for m in runs["dynamic"]),
    }))


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


if __name__ == "__main__":
    main()
