"""The release policies a profile runs (``contracts/profiles.py``: ``Policies``), held to the
readings of SGLang's wheels that the enums cite.

* ``write_through_selective`` hit counting: 0.5.23 counts, on every insert, the nodes that end
  past what the request itself inserted before (``unified_tree_core.py``
  ``_finish_insert_walk_node`` L1368-1375, ``cache_inserted_len``); 0.5.5 to 0.5.20 count
  nothing on a chunk's insert and every walked node on the final insert (``_inc_hit_count``,
  ``chunked`` skips it).
* the ``timeout`` prefetch policy: 0.5.23 starts the clock at the first admission poll that
  finds the prefetch unfinished and sizes the budget by the requested span in whole pages;
  0.5.5 to 0.5.20 start it at creation and size it by the hit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache_runtime.config import load_config
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.profiles import (
    PROFILES,
    EvictionPolicy,
    HitCounting,
    Policies,
    TimeoutBudget,
    TimeoutClock,
)
from hicache_runtime.kv.radix_tree import TreeNode
from hicache_runtime.l3 import tier as tier_module
from hicache_runtime.l3.ops import PrefetchOperation
from tests.helpers import CacheRig, fingerprint

PS = 4


def _node(rig: CacheRig, tokens: list[int]) -> TreeNode:
    m = rig.cache.tree.match(tokens)
    assert m.last_device_node is not None
    return m.last_device_node


def _chunked_prefill(rig: CacheRig, rid: str, tokens: list[int], chunk: int) -> None:
    """A prefill of ``tokens`` in chunks of ``chunk``: an insert after each but the last
    (``cache_unfinished_req``), then the request's final insert."""
    req = rig.admit(rid, tokens[:chunk])
    assert req is not None
    req.input_ids = list(tokens)
    for end in range(2 * chunk, len(tokens) + 1, chunk):
        rig.cache.cache_unfinished_req(req)
        need = end - req.kv_slots.numel()
        slots = rig.cache.alloc_device(need)
        assert slots is not None
        req.kv_slots = torch.cat([req.kv_slots[:req.kv_len], slots])
        for pos in range(req.kv_len, end):  # the chunk's forward writes its KV
            rig.write(int(req.kv_slots[pos]), fingerprint(tokens, pos))
        req.kv_len = end
    rig.finish(req)


@pytest.mark.parametrize(("counting", "first_chunk_hits"), [
    (HitCounting.PAST_OWN_INSERTS, 1),  # its own re-inserts never count again
    (HitCounting.SKIP_CHUNKED, 1),  # counted once, at the final insert
])
def test_a_chunked_prefill_counts_its_own_pages_once(counting: HitCounting,
                                                     first_chunk_hits: int) -> None:
    rig = CacheRig.make(**{"cache.write_policy": "write_through_selective",
                           "cache.hit_counting": counting.value, "cache.page_size": PS})
    try:
        tokens = list(range(1, 25))  # three chunks of 8
        _chunked_prefill(rig, "a", tokens, 8)
        assert _node(rig, tokens[:8]).hit_count == first_chunk_hits
        # a second request over the same prefix is the next hit
        req = rig.admit("b", tokens[:16])
        assert req is not None
        rig.finish(req)
        assert _node(rig, tokens[:8]).hit_count == first_chunk_hits + 1
    finally:
        rig.close()


def test_chunk_inserts_count_nothing_before_0_5_23() -> None:
    rig = CacheRig.make(**{"cache.write_policy": "write_through_selective",
                           "cache.hit_counting": "skip-chunked", "cache.page_size": PS})
    try:
        tokens = list(range(1, 17))
        req = rig.admit("a", tokens[:8])
        assert req is not None
        req.input_ids = list(tokens)
        rig.cache.cache_unfinished_req(req)  # a chunk's insert: the new node counts nothing
        assert _node(rig, tokens[:8]).hit_count == 0
    finally:
        rig.close()


_0505 = frozenset(EvictionPolicy(e) for e in ("lru", "lfu", "fifo", "mru", "filo"))
_0513 = _0505 | {EvictionPolicy.PRIORITY, EvictionPolicy.SLRU}


def test_every_profile_names_its_policies() -> None:
    old = (TimeoutClock.SUBMISSION, TimeoutBudget.HIT_TOKENS, HitCounting.SKIP_CHUNKED)
    assert PROFILES["sglang-0.5.5"].policies == Policies(*old, _0505)
    for name in ("sglang-0.5.13", "sglang-0.5.16", "sglang-0.5.20"):
        assert PROFILES[name].policies == Policies(*old, _0513), name
    new = Policies(TimeoutClock.FIRST_BLOCKED_POLL, TimeoutBudget.REQUESTED_TOKENS,
                   HitCounting.PAST_OWN_INSERTS, frozenset(EvictionPolicy))
    assert PROFILES["sglang-0.5.23"].policies == new
    assert PROFILES["proposed"].policies == new  # 0.5.23 plus the stronger protocols
    cfg = load_config({"profile": "sglang-0.5.16",
                       "storage.prefetch_timeout_clock": "first-blocked-poll"})
    assert cfg.policies == Policies(TimeoutClock.FIRST_BLOCKED_POLL, TimeoutBudget.HIT_TOKENS,
                                    HitCounting.SKIP_CHUNKED, _0513)  # a field set wins


@pytest.mark.parametrize(("profile", "policy"), [("sglang-0.5.5", "slru"),
                                                 ("sglang-0.5.5", "priority"),
                                                 ("sglang-0.5.20", "tlru")])
def test_a_profile_refuses_an_eviction_policy_its_release_did_not_offer(profile: str,
                                                                        policy: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"profile": profile, "cache.eviction_policy": policy})
    assert err.value.field == "cache.eviction_policy"
    assert f"{policy} is not in profile {profile}" in str(err.value)
    load_config({"profile": "sglang-0.5.23", "cache.eviction_policy": policy})


def test_eviction_settings_are_the_policy_s_own() -> None:
    cfg = load_config({"cache.eviction_policy": "slru",
                       "cache.eviction_policy_config": {"protected_threshold": 3}})
    assert cfg.cache.eviction_policy_config == {"protected_threshold": 3}
    with pytest.raises(ConfigError, match="'threshold' is no setting of slru"):
        load_config({"cache.eviction_policy": "slru",
                     "cache.eviction_policy_config": {"threshold": 3}})
    with pytest.raises(ConfigError, match=r"no setting of lru \(its settings: none\)"):
        load_config({"cache.eviction_policy_config": {"threshold": 3}})


def test_write_back_counts_no_hits() -> None:
    """No release counts hits under write_back, so lfu and slru order by recency there."""
    rig = CacheRig.make(**{"cache.write_policy": "write_back", "cache.page_size": PS,
                           "cache.eviction_policy": "lfu"})
    try:
        tokens = list(range(1, 9))
        for rid in ("a", "b"):
            req = rig.admit(rid, tokens)
            assert req is not None
            rig.finish(req)
        assert _node(rig, tokens).hit_count == 0
    finally:
        rig.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize("profile", ["sglang-0.5.23", "sglang-0.5.20"])
def test_the_timeout_deadline_follows_the_release(profile: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    policies = PROFILES[profile].policies
    rig = CacheRig.make(**{
        "storage.backend": "file", "storage.path": tmp_path / "l3", "cache.page_size": PS,
        "storage.prefetch_policy": "timeout", "storage.prefetch_timeout_base_s": 1.0,
        "storage.prefetch_timeout_per_ki_token_s": 1.0,
        "storage.prefetch_timeout_clock": policies.timeout_clock.value,
        "storage.prefetch_timeout_budget": policies.timeout_budget.value})
    try:
        l3 = rig.cache.l3
        assert l3 is not None
        clock = _Clock()
        monkeypatch.setattr(tier_module, "time", clock)
        # created at t=100, asking for 1026 tokens (256 whole pages = 1024); L3 holds 128 pages
        op = PrefetchOperation("r", list(range(1026)), None, rig.cache.tree.root, None, 0, 0,
                               start_time=clock.now, hit_pages=128)
        clock.now = 101.4  # the request waited in the queue; its first admission poll
        if policies.timeout_clock is TimeoutClock.FIRST_BLOCKED_POLL:
            # budget 1 + 1024/1024 = 2 s from this poll
            assert not l3._deadline_passed(op)
            assert op.wait_start == 101.4
            clock.now = 103.3
            assert not l3._deadline_passed(op)
            clock.now = 103.5
            assert l3._deadline_passed(op)
        else:
            # budget 1 + 512/1024 = 1.5 s from creation: nearly spent while it queued
            assert not l3._deadline_passed(op)
            clock.now = 101.6
            assert l3._deadline_passed(op)
            assert op.wait_start is None
    finally:
        rig.close()
