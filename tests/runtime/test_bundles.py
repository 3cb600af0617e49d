"""Crash bundles: an injected crash, a stalled scheduler and a wrong output each leave a bundle
whose files validate against the exported JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

import hicache_runtime.kv.copy_engine as copy_engine
from faults.spec import parse_fault
from hicache_runtime.contracts.bundle import RunOutcome, bundle_json_schema, load_manifest
from hicache_runtime.launch.run import run_single
from tests.helpers import small_config


def _validate(bundle: Path) -> dict:
    schema = bundle_json_schema()
    manifest = json.loads((bundle / "manifest.json").read_text())
    jsonschema.validate(manifest, schema["manifest.json"])
    load_manifest(bundle)  # and the pydantic model reads it back
    for rank in manifest["ranks"]:
        files = rank["files"]
        state = json.loads((bundle / files["state"]).read_text())
        jsonschema.validate(state, schema["state.json"])
        for line in (bundle / files["events"]).read_text().splitlines()[:200]:
            jsonschema.validate(json.loads(line), schema["events.jsonl"])
        fr = json.loads((bundle / files["flight_recorder"]).read_text())
        jsonschema.validate(fr, schema["flight_recorder.json"])
        assert (bundle / files["stacks"]).read_text().strip()
    return manifest


def test_injected_crash_leaves_a_valid_bundle(bundle_root: Path) -> None:
    cfg = small_config(faults=(parse_fault("crash:point=model.forward,step=6"),))
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.CRASH
    assert s.error is not None
    assert s.error.startswith("InjectedFault")
    assert s.bundle is not None
    manifest = _validate(Path(s.bundle))
    assert manifest["outcome"] == "crash"
    assert manifest["faults_fired"][0]["kind"] == "crash"
    tb = (Path(s.bundle) / manifest["ranks"][0]["files"]["traceback"]).read_text()
    assert "InjectedFault: injected crash at model.forward" in tb
    assert "_fault_point" in tb


def test_stalled_scheduler_is_a_hang_with_stacks(bundle_root: Path) -> None:
    cfg = small_config(**{"faults": (parse_fault("hang:point=cache.events,step=5"),),
                          "observability.watchdog_timeout_s": 1.0})
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HANG
    assert s.bundle is not None
    manifest = _validate(Path(s.bundle))
    assert manifest["outcome"] == "hang"
    stacks = (Path(s.bundle) / manifest["ranks"][0]["files"]["stacks"]).read_text()
    assert "_fault_point" in stacks, "the stacks show where the scheduler is stuck"
    assert "hicache-watchdog" in json.dumps(manifest) or "watchdog" in stacks


def test_wrong_output_is_detected_and_bundled(bundle_root: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    original = copy_engine.copy_layer

    def stale_load(src, dst, layer, src_slots, dst_slots, runs, page):  # type: ignore[no-untyped-def]
        original(src, dst, layer, src_slots, dst_slots, runs, page)
        if dst.k.shape[1] < src.k.shape[1]:  # host -> device: garble the first loaded page
            dst.k[layer, dst_slots[:4]] = 0.0

    monkeypatch.setattr(copy_engine, "copy_layer", stale_load)
    cfg = small_config(**{"workload.kind": "multi_turn", "workload.requests": 24,
                          "cache.device_tokens": 160, "cache.host_tokens": 2048})
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.cached_tokens.host > 0
    assert s.outcome is RunOutcome.WRONG_OUTPUT
    assert s.output_match is False
    manifest = _validate(Path(s.bundle or ""))
    assert manifest["mismatches"], "the manifest names the requests that differ"
