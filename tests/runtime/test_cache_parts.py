"""HiCache is built from its parts at construction: the L3 tier comes with the cache (no tier
attached afterwards), sees L2 only through what it was handed, and accounting reads the parts
the cache names."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_runtime.cache.accounting import drain_account
from hicache_runtime.cache.hicache import HiCache
from hicache_runtime.cache.interface import NoPrefixCache
from hicache_runtime.kv.radix_tree import RadixTree
from tests.helpers import CacheRig


def test_the_l3_tier_is_built_with_the_cache_on_its_parts(tmp_path: Path) -> None:
    rig = CacheRig.make(**{"storage.backend": "file", "storage.path": tmp_path / "l3"})
    try:
        cache = rig.cache
        tier = cache.l3
        assert tier is not None
        assert (tier.host, tier.tree, tier.pins) == (cache.host, cache.tree, cache.pins)
        assert tier.allocator is cache.space, "prefetch pages come from the cache's L2 space"
        assert not hasattr(tier, "cache"), "the tier holds no pointer back to the cache"
        parts = cache.parts()
        assert (parts.device, parts.tree, parts.host, parts.pins, parts.l3) == \
            (cache.device, cache.tree, cache.host, cache.pins, tier)
    finally:
        rig.close()


def test_an_l1_only_cache_has_no_l2_parts() -> None:
    rig = CacheRig.make(**{"cache.enable_hicache": False})
    try:
        cache = rig.cache
        assert (cache.controller, cache.space, cache.backups, cache.loads, cache.l3) == \
            (None, None, None, None, None)
        assert cache.evict_host(64) == 0
        account = drain_account(cache)
        assert (account.host_capacity, account.device_capacity) == \
            (0, cache.device.capacity_tokens // cache.page_size)
    finally:
        rig.close()


def test_a_host_pool_comes_with_a_copy_engine() -> None:
    rig = CacheRig.make()
    try:
        rt = rig.rt
        with pytest.raises(ValueError, match="copy engine"):
            HiCache(rt.cfg.cache, rt.device_pool, rt.host_pool, None, rt.sync, rt.tracer,
                    RadixTree(rt.cfg.cache.page_size))
    finally:
        rig.close()


def test_the_cache_disabled_reference_is_measured_by_its_device_pool_alone() -> None:
    rig = CacheRig.make()
    try:
        pool = rig.rt.device_pool
        account = drain_account(NoPrefixCache(pool))
        assert account.device_capacity == pool.allocator.num_pages
        assert (account.device_tree, account.host_capacity, account.l3_open) == (0, 0, 0)
    finally:
        rig.close()
