"""TP, PP and TP x PP runs as real processes: identical outputs to the cache-disabled run of
the same topology, with L1, L2 and L3 hits all exercised, and every decision checked for
cross-rank consensus."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.launch.run import run
from tests.multirank.conftest import mr_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


# tp2 x pp2 on a file store is the README's line, run in tests/multirank/test_readme_runs.py.
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_outputs_match_with_every_tier(tp: int, pp: int, tmp_path: Path,
                                       bundle_root: Path) -> None:
    cfg = mr_config(**{
        "topology.tp": tp, "topology.pp": pp, "workload.requests": 48,
        "cache.host_tokens": 768, "storage.backend": "file", "storage.path": tmp_path / "l3",
        "observability.consensus_check": True})
    warm = run(cfg, compare=False, bundle_root=bundle_root)  # what L2 cannot hold goes to L3
    assert warm.outcome is RunOutcome.HEALTHY, warm.error
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True, s.mismatches[:2]
    assert s.cached_tokens.device > 0
    assert s.cached_tokens.host > 0
    assert s.cached_tokens.storage > 0
    assert not list(bundle_root.iterdir()), "a healthy run leaves no bundle"


def test_mla_style_single_writer_shares_l3_pages(tmp_path: Path, bundle_root: Path) -> None:
    """KV replicated over TP (MLA-style): TP rank 0 alone writes L3 and every TP rank reads
    the shared objects; non-writers skip the write but still ack."""
    cfg = mr_config(**{"topology.tp": 2, "workload.requests": 48, "cache.host_tokens": 768,
                       "model.kv_replicated": True, "storage.single_writer": True,
                       "storage.backend": "file", "storage.path": tmp_path / "l3"})
    assert run(cfg, compare=False, bundle_root=bundle_root).outcome is RunOutcome.HEALTHY
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    backends = {r: x.l3.backend for r, x in s.cache_stats.ranks.items() if x.l3 is not None}
    assert backends[1].stored == 0, "the non-writer never writes"
    assert backends[1].hits > 0, "but reads what the writer stored"
    assert not any("_0_2" in p.name or "_1_2" in p.name for p in (tmp_path / "l3").rglob("*"))
