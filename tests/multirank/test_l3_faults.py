"""Fixed protocols with L3 across ranks: one rank's slow or raising storage slows the run or
costs it hits, and never stops it (outputs identical to the cache-disabled reference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.spec import parse_fault
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.launch.run import run
from tests.multirank.conftest import mr_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_a_slow_stage_storage_never_stalls_the_pipeline(bundle_root: Path,
                                                        tmp_path: Path) -> None:
    """PP1's every L3 call takes 1.5 s against a 4 s protocol timeout: the backup acks that
    PP0 counts are ones every rank has finished (the backup vote), and each query or backup
    is bounded by the IO budget, so no rank waits long for another's storage."""
    cfg = mr_config(**{"topology.pp": 2, "storage.backend": "file",
                       "storage.path": tmp_path / "l3",
                       "faults": (parse_fault("storage-latency:pp=1,ms=1500"),)})
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    assert s.faults_fired > 0


def test_a_storage_call_longer_than_the_protocol_timeout_is_no_hang(bundle_root: Path,
                                                                     tmp_path: Path) -> None:
    """Rank 1's first two L3 calls take 6 s, past the 4 s protocol timeout (a Mooncake put
    under CPU contention took 2 s per 8 pages; the IO budget bounds how many calls an op
    makes, not how long one takes). Its peer waits in the L3 votes for it: those groups wait
    the protocol timeout plus the watchdog's (``dist.groups.STORAGE_IO_GROUPS``), so the run
    stays healthy. With the protocol timeout there, rank 0's query thread timed out and the
    run was reported hung."""
    cfg = mr_config(**{"topology.tp": 2, "workload.requests": 24, "storage.backend": "file",
                       "storage.path": tmp_path / "l3",
                       "faults": (parse_fault("storage-latency:rank=1,ms=6000,count=2"),)})
    assert cfg.observability.protocol_timeout_s < 6 < cfg.observability.watchdog_timeout_s
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    assert s.faults_fired == 2


def test_a_backend_raising_on_one_rank_starves_no_peer(bundle_root: Path,
                                                       tmp_path: Path) -> None:
    """Rank 1's page reads and writes raise: its IO thread catches each, still acks every
    batch (its peers vote on those acks), and its backup thread still votes every backup."""
    store = tmp_path / "l3"
    base = {"topology.tp": 2, "storage.backend": "file", "storage.path": store,
            "storage.io_batch_pages": 2}
    warm = run(mr_config(**base), compare=False, bundle_root=bundle_root)
    assert warm.outcome is RunOutcome.HEALTHY, warm.error
    cfg = mr_config(**base, faults=(parse_fault("storage-error:rank=1,mode=raise"),))
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    rank1 = s.cache_stats.ranks[1].l3
    assert rank1 is not None
    assert rank1.io_errors > 0
    assert rank1.backup_errors > 0
    rank0 = s.cache_stats.ranks[0].l3
    assert rank0 is not None
    assert rank0.io_errors == rank0.backup_errors == 0
