"""The StorageBackend contract, checked on every backend the registry knows (``conftest.py``:
file, Redis and Mooncake on real throwaway servers, and the test backends of
``extra_backends/``)."""

from __future__ import annotations

import threading

import torch

from hicache_runtime.l3.backend import StorageBackend
from hicache_runtime.l3.keys import KeyScheme
from hicache_runtime.l3.pages import PageCodec
from tests.storage.support import MakeBackend, hashes, payload_for, small_pool


def test_exists_counts_the_leading_contiguous_run(backend: StorageBackend) -> None:
    keys = hashes(8)
    assert backend.batch_exists(keys) == 0
    present = [0, 1, 2, 4, 5]  # a hole at 3
    assert backend.batch_set([keys[i] for i in present],
                             [payload_for(keys[i]) for i in present]) == [True] * 5
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[4:]) == 2
    assert backend.batch_exists([]) == 0
    assert backend.exists(keys[4])
    assert not backend.exists(keys[3])
    s = backend.stats()
    assert s.exists_hits == 3 + 2 + 1
    assert s.stored == 5


def test_get_returns_payloads_and_holes_in_order(backend: StorageBackend) -> None:
    keys = hashes(6)
    backend.batch_set([keys[0], keys[2], keys[5]],
                      [payload_for(keys[0]), payload_for(keys[2]), payload_for(keys[5])])
    got = backend.batch_get(keys)
    assert got == [payload_for(keys[0]), None, payload_for(keys[2]), None, None,
                   payload_for(keys[5])]
    s = backend.stats()
    assert (s.gets, s.hits, s.misses, s.corrupt) == (6, 3, 3, 0)
    assert s.bytes_read == 3 * 256


def test_set_skips_existing_objects(backend: StorageBackend) -> None:
    keys = hashes(3)
    assert backend.batch_set(keys[:2], [b"first", b"first"]) == [True, True]
    assert backend.batch_set(keys, [b"second"] * 3) == [True] * 3
    assert backend.batch_get(keys) == [b"first", b"first", b"second"]
    assert backend.stats().set_skipped == 2


def test_clear_removes_only_this_ranks_objects(backend: StorageBackend,
                                               new_backend: MakeBackend) -> None:
    keys = hashes(4)
    backend.batch_set(keys, [payload_for(k) for k in keys])
    # Another rank (a PP stage) writing into the same medium, with a longer suffix.
    other = new_backend(KeyScheme(backend.scheme.suffix + "_2_1"))
    other.batch_set(keys, [b"other"] * 4)
    backend.clear()
    assert backend.batch_exists(keys) == 0
    assert other.batch_exists(keys) == 4
    other.close()


def test_host_pages_round_trip_through_the_backend(backend: StorageBackend) -> None:
    src, dst = small_pool(torch.bfloat16, seed=5), small_pool(torch.bfloat16, seed=6)
    codec = PageCodec.for_pool(src)
    slots = src.alloc(16)
    target = dst.alloc(16)
    assert slots is not None
    assert target is not None
    keys = hashes(4, seed=9)
    assert all(backend.batch_set(keys, codec.read_pages(src, slots)))
    payloads = backend.batch_get(keys)
    assert all(p is not None for p in payloads)
    codec.write_pages(dst, target, [p for p in payloads if p is not None])
    assert torch.equal(dst.k[:, target], src.k[:, slots])
    assert torch.equal(dst.v[:, target], src.v[:, slots])


def test_concurrent_backup_prefetch_and_query_threads(backend: StorageBackend) -> None:
    """Three roles at once on overlapping keys: every served payload is the right one."""
    keys = hashes(64, seed=3)
    errors: list[str] = []
    stop = threading.Event()

    def backup(offset: int) -> None:
        for start in range(offset, len(keys), 8):
            batch = keys[start : start + 8]
            if not all(backend.batch_set(batch, [payload_for(k, 4096) for k in batch])):
                errors.append("set failed")

    def prefetch() -> None:
        while not stop.is_set():
            for start in range(0, len(keys), 8):
                batch = keys[start : start + 8]
                for k, p in zip(batch, backend.batch_get(batch)):
                    if p is not None and p != payload_for(k, 4096):
                        errors.append(f"wrong payload for {k[:8]}")

    def query() -> None:
        while not stop.is_set():
            n = backend.batch_exists(keys)
            if not 0 <= n <= len(keys):
                errors.append(f"bad count {n}")

    readers = [threading.Thread(target=prefetch), threading.Thread(target=query)]
    writers = [threading.Thread(target=backup, args=(o,)) for o in (0, 4, 0)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join(timeout=60)
    stop.set()
    for t in readers:
        t.join(timeout=60)
    assert not errors
    assert backend.batch_exists(keys) == len(keys)
    assert backend.batch_get(keys) == [payload_for(k, 4096) for k in keys]
    s = backend.stats()
    assert s.corrupt == 0
    assert s.errors == 0
    assert s.gets == s.hits + s.misses


def test_closed_backend_fails_soft(backend: StorageBackend) -> None:
    keys = hashes(2)
    backend.batch_set(keys, [b"a", b"b"])
    backend.close()
    backend.close()  # idempotent
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get(keys) == [None, None]
    assert backend.batch_set(keys, [b"a", b"b"]) == [False, False]
    assert not backend.healthy
