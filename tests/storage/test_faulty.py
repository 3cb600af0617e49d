"""The fault-injection wrapper at the storage fault points."""

from __future__ import annotations

import time

import pytest

from faults.injector import FaultInjector
from faults.spec import parse_faults
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.l3.backend import StorageCallInfo
from hicache_runtime.l3.backends.file import FileBackend
from hicache_runtime.l3.faulty import FaultyBackend, wrap_faults
from tests.storage.support import hashes, payload_for


def injector(*specs: str, rank: RankInfo | None = None, seed: int = 0) -> FaultInjector:
    return FaultInjector(parse_faults(list(specs)), seed, rank or RankInfo())


def filled(backend: FileBackend, n: int = 8) -> tuple[list[str], list[bytes]]:
    keys = hashes(n)
    payloads = [payload_for(k) for k in keys]
    assert all(backend.batch_set(keys, payloads))
    return keys, payloads


def test_no_armed_storage_fault_means_no_wrapper(file_backend: FileBackend) -> None:
    assert wrap_faults(file_backend, None) is file_backend
    assert wrap_faults(file_backend, injector("stage-lag:ms=5")) is file_backend
    # Armed, but for another rank.
    assert wrap_faults(file_backend, injector("storage-error:rank=1")) is file_backend
    assert isinstance(wrap_faults(file_backend, injector("storage-error")), FaultyBackend)


def test_shortfall_short_cuts_the_existence_answer(file_backend: FileBackend) -> None:
    keys, _ = filled(file_backend)
    b = wrap_faults(file_backend, injector("storage-shortfall:mode=short,pages=3"))
    assert b.batch_exists(keys) == 5
    assert b.batch_exists(keys[:2]) == 0  # never below zero
    assert b.stats().injected == 2


def test_shortfall_holes_blank_pages_while_later_pages_load(file_backend: FileBackend) -> None:
    keys, payloads = filled(file_backend)
    b = wrap_faults(file_backend, injector("storage-shortfall:mode=holes,pages=2,at=1"))
    assert b.batch_exists(keys) == 8  # holes act on reads only
    got = b.batch_get(keys)
    assert got == [payloads[0], None, None, *payloads[3:]]
    s = b.stats()
    assert (s.gets, s.hits, s.misses, s.injected) == (8, 6, 2, 1)


def test_latency_sleeps_on_every_call(file_backend: FileBackend) -> None:
    keys, _ = filled(file_backend, 2)
    b = wrap_faults(file_backend, injector("storage-latency:ms=40"))
    for call in (lambda: b.batch_exists(keys), lambda: b.batch_get(keys),
                 lambda: b.batch_set(keys, [b"x", b"y"])):
        t0 = time.perf_counter()
        call()
        assert time.perf_counter() - t0 >= 0.035


def test_error_fails_reads_and_writes_without_touching_the_medium(
        file_backend: FileBackend) -> None:
    keys, _ = filled(file_backend, 2)
    b = wrap_faults(file_backend, injector("storage-error"))
    fresh = hashes(2, seed=5)
    assert b.batch_get(keys) == [None, None]
    assert b.batch_set(fresh, [b"a", b"b"]) == [False, False]
    assert file_backend.batch_exists(fresh) == 0  # nothing written underneath
    s = b.stats()
    assert s.set_failures == 2
    assert s.misses == 2
    assert s.injected == 2


def test_corrupt_is_caught_by_the_checksum_and_keeps_the_stored_page(
        file_backend: FileBackend) -> None:
    keys, payloads = filled(file_backend)
    b = wrap_faults(file_backend, injector("storage-corrupt:count=1", seed=3))
    got = b.batch_get(keys)
    bad = [i for i, p in enumerate(got) if p is None]
    assert len(bad) == 1  # exactly one page flipped, and it was not served
    assert all(got[i] == payloads[i] for i in range(len(keys)) if i not in bad)
    s = b.stats()
    assert s.corrupt == 1
    assert s.discarded == 0
    assert s.injected == 1
    assert b.batch_get(keys) == payloads  # count=1 spent; the stored page was fine


def test_corrupt_hits_the_same_page_reads_however_they_are_batched(
        file_backend: FileBackend) -> None:
    """storage-corrupt decides per page read, by the page and how often it was read: one
    batch of eight and eight calls of one hit the same pages (a prefetch thread batches by
    timing, so a per-call decision made the number of hits a matter of load)."""
    keys, payloads = filled(file_backend, 32)

    def missed(batches: list[list[str]]) -> list[str]:
        b = wrap_faults(file_backend, injector("storage-corrupt:p=0.4", seed=5))
        got = [p for batch in batches for p in b.batch_get(batch)]
        assert b.stats().discarded == 0  # only the copies read were bad
        return [k for k, p in zip(keys, got, strict=True) if p is None]

    whole = missed([keys])
    assert 0 < len(whole) < len(keys)
    assert missed([[k] for k in keys]) == whole
    assert missed([keys[:5], keys[5:20], keys[20:]]) == whole
    # A second read of a page is a visit of its own: another draw, the same for any batching.
    b = wrap_faults(file_backend, injector("storage-corrupt:p=0.4", seed=5))
    b.batch_get(keys)
    again = [k for k, p in zip(keys, b.batch_get(keys), strict=True) if p is None]
    assert again != whole
    assert file_backend.batch_get(keys) == payloads  # the stored pages were never touched


def test_faults_are_deterministic_per_seed(tmp_path: object, file_backend: FileBackend) -> None:
    keys, _ = filled(file_backend)

    def pattern(seed: int) -> list[bool]:
        b = wrap_faults(file_backend, injector("storage-error:p=0.5", seed=seed))
        return [b.batch_get(keys[:1])[0] is None for _ in range(24)]

    assert pattern(7) == pattern(7)
    assert pattern(7) != pattern(8) or pattern(7) != pattern(9)


def test_request_and_step_selectors_apply(file_backend: FileBackend) -> None:
    keys, payloads = filled(file_backend, 2)
    step = {"now": 0}
    b = wrap_faults(file_backend, injector("storage-error:rid=req-1*,steps=5-9"),
                    step=lambda: step["now"])
    assert b.batch_get(keys, StorageCallInfo(rid="req-10")) == payloads  # step 0
    step["now"] = 6
    assert b.batch_get(keys, StorageCallInfo(rid="req-2")) == payloads
    assert b.batch_get(keys, StorageCallInfo(rid="req-10")) == [None, None]
    assert b.batch_get(keys, StorageCallInfo(rid="req-10", step=12)) == payloads


@pytest.mark.parametrize("spec", ["storage-error", "storage-shortfall:mode=short"])
def test_wrapper_passes_through_the_rest_of_the_interface(file_backend: FileBackend,
                                                          spec: str) -> None:
    b = wrap_faults(file_backend, injector(spec))
    b.clear()
    assert b.healthy
    assert b.name == "file"
    assert "injected" in b.describe()
    b.close()
    assert not file_backend.healthy
