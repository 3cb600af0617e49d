"""L2 -> L3 backups reach the store whatever path put the pages in L2: a write-through whose
node was split while it was in flight, and write-back's copies at eviction."""

from __future__ import annotations

from pathlib import Path

from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.l3.keys import extend_chain
from hicache_runtime.launch.run import run_single
from tests.helpers import CacheRig
from tests.runtime.test_l3 import healthy, l3_config


def test_a_split_during_the_write_backs_up_every_fragment(tmp_path: Path) -> None:
    rig = CacheRig.make(**{"storage.backend": "file", "storage.path": tmp_path / "l3",
                           "storage.io_batch_pages": 2})
    try:
        cache = rig.cache
        assert cache.controller is not None
        assert cache.l3 is not None
        tokens = [(5 * i) % 97 + 1 for i in range(16)]  # four pages of four tokens
        req = rig.admit("a", tokens)
        assert req is not None
        rig.finish(req)  # insert: one node of 16 tokens, its L2 write queued
        cache.controller.start_writing()  # the copy is in flight, its ack not consumed
        cache.tree.match(tokens[:8])  # a request sharing two pages splits the node
        node = cache.tree.match(tokens).last_device_node
        assert node.parent is not None
        assert (len(node.parent.key), len(node.key)) == (8, 8), "the node was split"
        rig.drain()  # the write ack, the L3 backups it chains, their acks
        backend = cache.l3.workers.backend
        chain = extend_chain(None, tokens, cache.page_size)
        assert backend.batch_exists(chain) == 4, "a chained lookup from the root finds them"
        assert cache.l3.stats["backup_pages"] == 4
    finally:
        rig.close()


def test_write_back_backs_up_to_l3_and_a_cold_host_finds_the_pages(tmp_path: Path,
                                                                  bundle_root: Path) -> None:
    cfg = l3_config(tmp_path / "l3", **{"cache.write_policy": "write_back"})
    first = run_single(cfg, compare=False, bundle_root=bundle_root)
    assert first.outcome is RunOutcome.HEALTHY, first.error
    l3 = first.cache_stats.total.l3
    assert l3 is not None
    assert first.cache_stats.total.backup_tokens > 0, "evictions copied pages to L2"
    assert l3.backend.set_calls > 0
    assert l3.backup_pages > 0
    # Same prompts again with L1 and L2 empty: what write-back put in L3 comes back from it.
    second = run_single(cfg, bundle_root=bundle_root)
    healthy(second)
    assert second.output_match is True
    assert second.cached_tokens.storage > 0
