"""The L3 tier end to end: backups chained after L2 writes, prefetches settled on consensus,
hits served from L3 when L2 is too small, and faults that must never change outputs."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from faults.spec import parse_fault
from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.launch.run import RunSummary, run_single


def l3_config(path: Path, **overrides: object) -> RuntimeConfig:
    """Default model, small pools: L2 cannot hold the working set, so L3 must serve hits."""
    base: dict[str, object] = {
        "storage.backend": "file", "storage.path": path, "workload.requests": 64,
        "cache.device_tokens": 512, "cache.host_tokens": 768, "storage.io_batch_pages": 4,
        "observability.check_integrity_every": 1, "observability.watchdog_timeout_s": 30.0,
    }
    base.update(overrides)
    return load_config(base)


def healthy(s: RunSummary) -> None:
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is not False, s.mismatches[:2]


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_small_l2_serves_hits_from_l3(policy: str, tmp_path: Path, bundle_root: Path) -> None:
    cfg = l3_config(tmp_path / "l3", **{"storage.prefetch_policy": policy,
                                         # wall-clock deadline: generous on a loaded machine
                                         "storage.prefetch_timeout_base_s": 20.0})
    healthy(run_single(cfg, compare=False, bundle_root=bundle_root))  # fills L3
    # Same prompts again, L1 and L2 empty: what L2 cannot hold must come back from L3.
    s = run_single(cfg, bundle_root=bundle_root)
    healthy(s)
    assert s.cached_tokens.storage > 0
    l3 = s.cache_stats.total.l3
    assert l3 is not None
    assert l3.backup_pages > 0
    assert l3.prefetched_tokens > 0


@pytest.mark.parametrize("fault", [
    "storage-corrupt:p=0.3",
    "storage-shortfall:mode=holes,pages=1,at=1",
    "storage-shortfall:mode=short,pages=2",
    "storage-latency:ms=2",
    "storage-error:p=0.5",
])
def test_storage_faults_never_change_outputs(fault: str, tmp_path: Path,
                                             bundle_root: Path) -> None:
    s = run_single(l3_config(tmp_path / "l3", faults=(parse_fault(fault),)),
                   bundle_root=bundle_root)
    healthy(s)
    assert s.faults_fired > 0


def test_corrupted_and_truncated_files_are_misses(tmp_path: Path, bundle_root: Path) -> None:
    store = tmp_path / "l3"
    healthy(run_single(l3_config(store), bundle_root=bundle_root))  # warms L3
    files = sorted(p for p in store.rglob("*.bin"))
    assert files
    rng = random.Random(7)
    for f in rng.sample(files, len(files) // 2):
        data = bytearray(f.read_bytes())
        if rng.random() < 0.5:
            data[len(data) // 2] ^= 0xFF  # flip a byte
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) // 3]))  # truncate
    s = run_single(l3_config(store), bundle_root=bundle_root)
    healthy(s)
    assert s.cache_stats.total.l3 is not None
    backend = s.cache_stats.total.l3.backend
    assert backend.corrupt > 0, "corrupt pages are detected and counted"
    assert backend.discarded > 0, "and dropped, so a later backup rewrites them"


def test_aborts_during_prefetch_leak_nothing(tmp_path: Path, bundle_root: Path) -> None:
    # check_integrity runs every step and after the final drain: it fails on a leaked host
    # page, a leaked pin or a prefetch reservation that was not returned.
    cfg = l3_config(tmp_path / "l3", **{"storage.io_batch_pages": 1,
                                         "faults": (parse_fault("mid-prefetch-abort:batch=1"),),
                                         "workload.abort_fraction": 0.2})
    s = run_single(cfg, bundle_root=bundle_root)
    healthy(s)
    assert s.faults_fired > 0
    assert s.aborted > 0


def test_legacy_abort_frees_in_flight_never_trips_the_pool_bookkeeping(
        tmp_path: Path, bundle_root: Path) -> None:
    """The pre-#31296 abort is a use-after-free (late writes into pages handed out again,
    wrong KV where they are loaded), not a double free: the run ends with its outputs, right
    or wrong (``tests/runtime/test_legacy_abort.py`` and the campaign cell show the rest)."""
    cfg = l3_config(tmp_path / "l3", **{
        "storage.io_batch_pages": 1, "legacy": frozenset({LegacySwitch.ABORT_FREES_IN_FLIGHT}),
        "faults": (parse_fault("mid-prefetch-abort:batch=1"),)})
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome in (RunOutcome.HEALTHY, RunOutcome.WRONG_OUTPUT), s.error


def test_page_files_corrupted_while_the_workload_runs(tmp_path: Path, bundle_root: Path) -> None:
    """Pages go bad under a live run (a disk, a neighbour process): reads that find them bad
    are misses, the prefix is recomputed, outputs never change."""
    store = tmp_path / "l3"
    cfg = l3_config(store)
    run_single(cfg, compare=False, bundle_root=bundle_root)  # L3 holds pages to go bad
    rng = random.Random(11)
    hit: list[int] = []

    def corrupt(step: int, finished: int, total: int) -> None:
        if step % 10 or step > 200:
            return
        # The backend's own threads remove pages they found bad while this runs, so a listed
        # page (or a whole directory, which os.walk skips) may be gone by the time it is read:
        # that is the workload going on, not a failure of the corruption.
        files = sorted(Path(d, n) for d, _, names in os.walk(store)
                       for n in names if n.endswith(".bin"))
        for f in rng.sample(files, min(len(files), max(1, len(files) // 10))):
            try:
                with open(f, "r+b") as fh:  # r+: never re-creates a page removed meanwhile
                    data = bytearray(fh.read())
                    if len(data) > 64:
                        at = rng.randrange(32, len(data))
                        fh.seek(at)
                        fh.write(bytes([data[at] ^ 0x5A]))
            except FileNotFoundError:
                continue
        hit.append(step)

    s = run_single(cfg, progress=corrupt, bundle_root=bundle_root)
    healthy(s)
    assert hit, "the corruption ran during the workload"
    assert s.cache_stats.total.l3 is not None
    assert s.cache_stats.total.l3.backend.corrupt > 0
