"""Cached runs produce exactly the tokens of the cache-disabled run of the same config and seed,
with pools small enough that L1 evicts and L2 loads back."""

from __future__ import annotations

import pytest

from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.launch.run import run_single
from tests.helpers import small_config


@pytest.mark.parametrize("workload", ["multi_turn", "shared_prefix", "long_context", "mixed"])
def test_outputs_identical_under_eviction_and_load_back(workload: str, bundle_root) -> None:
    cfg = small_config(**{"workload.kind": workload, "workload.requests": 24,
                          "cache.device_tokens": 192, "cache.host_tokens": 1024,
                          "observability.check_integrity_every": 1})
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    assert s.cached_tokens.device > 0
    assert s.cache_stats.total.evicted_device > 0, "the pool must be small enough to evict"


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_every_write_policy_serves_host_hits(policy: str, bundle_root) -> None:
    cfg = small_config(**{"cache.write_policy": policy, "workload.requests": 40,
                          "workload.kind": "multi_turn", "cache.device_tokens": 160,
                          "cache.host_tokens": 2048, "cache.write_through_threshold": 1,
                          "observability.check_integrity_every": 1})
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    assert s.cached_tokens.host > 0, "L2 must serve load-backs"
    assert s.cache_stats.total.load_tokens > 0


def test_chunked_prefill_and_retraction_keep_outputs(bundle_root) -> None:
    cfg = small_config(**{"workload.kind": "long_context", "workload.requests": 12,
                          "workload.long_context_tokens": 160, "workload.max_new_tokens": 12,
                          "scheduler.chunked_prefill_size": 32, "cache.device_tokens": 256,
                          "scheduler.decode_reserve_ratio": 0.0,
                          "observability.check_integrity_every": 1})
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True


def test_l1_only_cache_and_aborts(bundle_root) -> None:
    cfg = small_config(**{"cache.enable_hicache": False, "workload.abort_fraction": 0.3,
                          "workload.requests": 24, "observability.check_integrity_every": 1})
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    assert s.aborted > 0
