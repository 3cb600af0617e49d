"""Per-layer load-back overlaps with compute: attention on layer 0 proceeds while later layers
are still being copied from L2 (SGLang's LayerDoneCounter)."""

from __future__ import annotations

from pathlib import Path

from faults.spec import parse_fault
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.jsonl import read_jsonl
from hicache_runtime.launch.run import run_single
from tests.helpers import small_config


def test_layer_zero_computes_before_the_load_finishes(tmp_path: Path, bundle_root) -> None:
    trace = tmp_path / "trace.jsonl"
    cfg = small_config(**{
        "model.num_layers": 4, "workload.kind": "multi_turn", "workload.requests": 16,
        "cache.device_tokens": 160, "cache.host_tokens": 2048,
        "observability.trace_path": trace,
        # Each load job takes >= 150 ms, released layer by layer: layer 0 lands well before
        # the job ends even when the machine is loaded and the scheduler waits for a core.
        "faults": (parse_fault("dma-lag:ms=150"),),
    })
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    events = list(read_jsonl(trace))
    loads = [e["attrs"] for e in events if e["kind"] == Ev.COPY and e["attrs"]["dir"] == "h2d"]
    waits = [e["attrs"] for e in events if e["kind"] == Ev.LAYER_WAIT]
    assert loads, "the workload must load back from L2"
    overlapped = 0
    for job in loads:
        end = job["t0_ns"] + job["dur_ns"]
        first = [w for w in waits if w["layer"] == 0 and job["t0_ns"] <= w["t0_ns"] <= end]
        # layer 0 was released >= 15 ms before the whole copy finished
        overlapped += any(w["t0_ns"] + w["dur_ns"] < end - 15_000_000 for w in first)
    assert overlapped >= 1, "attention must start on layer 0 while later layers still copy"
    later = [w for w in waits if w["layer"] > 0 and w["dur_ns"] > 0]  # 0: it had landed
    assert later, "later layers waited for their copies"
