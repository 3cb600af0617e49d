"""Domain helpers shared by tests: small configs, KV fingerprints, a one-rank cache rig."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache_runtime.cache.hicache import HiCache
from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.engine.rank import RankRuntime, build_rank
from hicache_runtime.kv.request import Req


def small_config(**overrides: object) -> RuntimeConfig:
    """A config small enough for unit tests: 2 layers, tiny pools, short prompts."""
    base: dict[str, object] = {
        "model.num_layers": 2, "model.hidden_size": 32, "model.num_heads": 2,
        "model.head_dim": 8, "model.ffn_size": 64, "model.vocab_size": 128,
        "cache.page_size": 4, "cache.device_tokens": 256, "cache.host_tokens": 512,
        "workload.requests": 16, "workload.system_prompt_tokens": 32,
        "workload.turn_tokens": 12, "workload.long_context_tokens": 96,
        "workload.max_new_tokens": 4, "scheduler.chunked_prefill_size": 64,
        "scheduler.max_prefill_tokens": 256, "observability.watchdog_timeout_s": 20.0,
    }
    base.update(overrides)
    return load_config(base)


def fingerprint(tokens: list[int], pos: int) -> float:
    """The value a test writes as the KV of ``tokens[pos]`` given its whole prefix."""
    return float(hash(tuple(tokens[: pos + 1])) % 1_000_003)


@dataclass
class CacheRig:
    """A real one-rank HiCache with fingerprint KV, driven the way the scheduler drives it."""

    rt: RankRuntime

    @classmethod
    def make(cls, **overrides: object) -> CacheRig:
        return cls(build_rank(small_config(**overrides)))

    @property
    def cache(self) -> HiCache:
        cache = self.rt.cache
        assert isinstance(cache, HiCache)
        return cache

    def admit(self, rid: str, tokens: list[int]) -> Req | None:
        """Match, load back, lock, allocate and write fingerprints: a request that ran its
        prefill. Returns None (nothing held) if L1 cannot hold it."""
        cache, ps = self.cache, self.cache.page_size
        req = Req(rid=rid, input_ids=list(tokens), max_new_tokens=1)
        plan = cache.prepare_prefix(req, mem_quota=1 << 30)
        cache.lock(plan.last_node)
        self.wait_loads()
        self.check_prefix(tokens, plan.indices)
        need = -(-(len(tokens) - len(plan.indices)) // ps) * ps
        slots = cache.alloc_device(need)
        if slots is None:
            cache.unlock(plan.last_node)
            return None
        req.kv_slots = torch.cat([plan.indices, slots])
        req.prefix_len = len(plan.indices)
        req.last_node = plan.last_node
        req.kv_len = len(tokens)
        for pos in range(req.prefix_len, len(tokens)):
            self.write(int(req.kv_slots[pos]), fingerprint(tokens, pos))
        return req

    def finish(self, req: Req) -> None:
        self.cache.cache_finished_req(req)

    def wait_loads(self) -> None:
        slot = self.cache.start_loading()
        if slot is not None:
            ctl = self.cache.controller
            assert ctl is not None
            ctl.ack_load_queue[-1].event.synchronize()

    def write(self, slot: int, value: float) -> None:
        pool = self.rt.device_pool
        pool.k[:, slot] = value
        pool.v[:, slot] = -value

    def check_prefix(self, tokens: list[int], indices: torch.Tensor) -> None:
        """Every matched slot holds the fingerprint of its token prefix."""
        if indices.numel() == 0:
            return
        pool = self.rt.device_pool
        got = pool.k[0, indices, 0, 0].tolist()
        want = [fingerprint(tokens, p) for p in range(indices.numel())]
        assert got == want, f"KV mismatch: first bad position {_first_diff(got, want)}"
        assert (pool.v[0, indices, 0, 0] == -pool.k[0, indices, 0, 0]).all()

    def drain(self) -> None:
        self.cache.drain()

    def close(self) -> None:
        self.rt.close()


def _first_diff(a: list[float], b: list[float]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)


#: A campaign of two single-rank cells, small: the sum-hit-pages reproduction (a warm L3,
#: sidecar holes, 24 requests) and its fixed twin.
SUM_HIT_PAGES_CAMPAIGN = """
name: tp1
defaults: {workload.requests: 24, cache.device_tokens: 512, cache.host_tokens: 768,
           storage.backend: file, model.sidecars: [all_pages]}
matrix:
  - legacy: [[], [sum-hit-pages]]
    faults: [["storage-shortfall:mode=holes,pool=sidecar,pages=1,at=1"]]
    warm: true
    expect: {fixed: healthy, sum-hit-pages: prefetch-gap-overcount}
"""
