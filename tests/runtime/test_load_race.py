"""A load-back started for a request that was not admitted is still copying when another
request reads the same pages: that batch must wait for the copy (it once did not, and read
stale KV; a rare, timing-dependent wrong output)."""

from __future__ import annotations

import torch

from faults.spec import parse_fault
from hicache_runtime.kv.request import Req
from tests.helpers import CacheRig, fingerprint


def test_batch_waits_for_a_load_started_without_it() -> None:
    rig = CacheRig.make(**{"faults": (parse_fault("dma-lag:ms=300"),),
                           "cache.load_back_threshold": 0})
    try:
        cache, pool = rig.cache, rig.rt.device_pool
        tokens = [(7 * i) % 50 + 1 for i in range(32)]
        req = rig.admit("a", tokens)
        assert req is not None
        rig.finish(req)
        rig.drain()
        cache.evict(1 << 20)  # now only L2 holds the prefix
        first = Req(rid="b", input_ids=[*tokens, 3], max_new_tokens=1)
        plan = cache.prepare_prefix(first, mem_quota=1 << 30)
        assert plan.host_hit == 32, "the prefix is loaded back from L2"
        slot = cache.start_loading()  # the copy starts; say "b" is then not admitted
        assert slot is not None
        second = Req(rid="c", input_ids=[*tokens, 4], max_new_tokens=1)
        plan2 = cache.prepare_prefix(second, mem_quota=1 << 30)
        assert plan2.device_hit == 32, "the pages count as device-resident already"
        consumer = cache.start_loading()
        assert consumer == slot, "the next batch must wait for the copy still in flight"
        pool.consumer = consumer
        try:
            k, _ = pool.get_kv(0, plan2.indices)
        finally:
            pool.consumer = None
        want = torch.tensor([fingerprint(tokens, p) for p in range(32)], dtype=k.dtype)
        assert torch.equal(k[:, 0, 0], want), "the batch read the loaded KV, not stale slots"
        rig.drain()
    finally:
        rig.close()
