"""The store-backed rendezvous a ``mid-prefetch-abort`` times itself with: rank 0 asks for the
abort only once every peer's prefetch IO has finished the op (on a real ``TCPStore``, as the
ranks of a run share)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from faults.rendezvous import PrefetchIORendezvous, needs_prefetch_rendezvous
from faults.spec import parse_fault
from hicache_runtime.contracts.topology import RankInfo


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _client(master: dist.TCPStore) -> dist.TCPStore:
    """Another process's connection to the same store (each rank has its own)."""
    return dist.TCPStore("127.0.0.1", master.port, is_master=False,
                         timeout=timedelta(seconds=10))


def test_rank_zero_waits_until_every_peer_finished_the_op() -> None:
    store = _store()
    ranks = [PrefetchIORendezvous(_client(store), RankInfo.of(r, 3, 1), timeout_s=10)
             for r in range(3)]
    done_at: dict[int, float] = {}

    def peer(r: int, delay: float) -> None:
        time.sleep(delay)
        done_at[r] = time.monotonic()
        ranks[r].finished("req-1")

    threads = [threading.Thread(target=peer, args=(r, 0.2 * r)) for r in (1, 2)]
    for t in threads:
        t.start()
    assert ranks[0].wait_for_peers("req-1")
    released = time.monotonic()
    for t in threads:
        t.join()
    assert released >= max(done_at.values())  # not before the slower peer was done


def test_a_peer_that_never_finishes_lets_the_fault_fire_after_the_timeout() -> None:
    store = _store()
    r0 = PrefetchIORendezvous(store, RankInfo.of(0, 2, 1), timeout_s=0.3)
    PrefetchIORendezvous(_client(store), RankInfo.of(1, 2, 1), timeout_s=0.3).finished("other")
    t0 = time.monotonic()
    assert not r0.wait_for_peers("req-1")
    assert 0.25 <= time.monotonic() - t0 < 5


def test_only_runs_of_several_ranks_with_the_fault_need_it() -> None:
    abort = [parse_fault("mid-prefetch-abort:batch=1")]
    assert needs_prefetch_rendezvous(abort, 2)
    assert not needs_prefetch_rendezvous(abort, 1)
    assert not needs_prefetch_rendezvous([parse_fault("dma-lag:ms=5")], 2)
