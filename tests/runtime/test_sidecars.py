"""Hybrid sidecar pools (SGLang #31443): an ``all_pages`` KV-derived pool clamps a prefetch to
the pages it has, a ``trailing_pages`` state pool is all or nothing, and hit pages count as the
leading run. ``sum-hit-pages`` restores counting arrived pages, and a hole becomes silent
wrong output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faults.spec import parse_fault
from hicache_runtime.config import RuntimeConfig
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.launch.run import run_single
from tests.helpers import small_config
from tests.runtime.test_l3 import l3_config

HOLES = parse_fault("storage-shortfall:mode=holes,pool=sidecar,pages=1,at=1")


@pytest.mark.parametrize("pools", [("all_pages",), ("trailing_pages",),
                                   ("all_pages", "trailing_pages")])
def test_sidecars_follow_kv_through_l1_and_l2(pools: tuple[str, ...], bundle_root: Path) -> None:
    cfg = small_config(**{"model.sidecars": pools, "workload.requests": 32,
                          "cache.device_tokens": 192, "cache.host_tokens": 1024,
                          "observability.check_integrity_every": 1})
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    assert s.cached_tokens.host > 0


def _warm(path: Path, pools: tuple[str, ...], **extra: object) -> RuntimeConfig:
    cfg = l3_config(path, **{"model.sidecars": pools, **extra})
    warm = run_single(cfg.with_overrides(faults=()), compare=False)
    assert warm.outcome is RunOutcome.HEALTHY, warm.error
    return cfg


@pytest.mark.parametrize("pools", [("all_pages",), ("trailing_pages",)])
def test_holes_in_a_sidecar_pool_never_change_outputs(pools: tuple[str, ...], tmp_path: Path,
                                                      bundle_root: Path) -> None:
    cfg = _warm(tmp_path / "l3", pools, faults=(HOLES,))
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    assert s.faults_fired > 0


def test_trailing_pool_discards_a_partial_prefetch(tmp_path: Path, bundle_root: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    cfg = _warm(tmp_path / "l3", ("trailing_pages",), faults=(HOLES,),
                **{"observability.trace_path": trace})
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    kinds = [json.loads(line)["kind"] for line in trace.read_text().splitlines()]
    assert "l3.prefetch.discard" in kinds, "a short trailing state discards the whole prefix"


def test_sum_hit_pages_commits_a_page_that_never_loaded(tmp_path: Path,
                                                         bundle_root: Path) -> None:
    cfg = _warm(tmp_path / "l3", ("all_pages",), faults=(HOLES,),
                legacy=frozenset({LegacySwitch.SUM_HIT_PAGES}))
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.WRONG_OUTPUT, s.error
    assert s.mismatches
    assert s.cached_tokens.storage > 0
    assert s.bundle is not None



def test_single_writer_needs_replicated_kv_under_tp() -> None:
    from hicache_runtime.config import load_config
    from hicache_runtime.contracts.errors import ConfigError

    with pytest.raises(ConfigError, match=r"storage\.single_writer"):
        load_config({"topology.tp": 2, "storage.single_writer": True})
