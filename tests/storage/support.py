"""Helpers shared by the storage tests (keys, payloads, a small host pool)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache_runtime.kv.pools import HostKVPool, KVShape
from hicache_runtime.l3.backend import StorageBackend
from hicache_runtime.l3.keys import KeyScheme, chain_hashes

SCHEME = KeyScheme("_tiny-test_0_1")

MakeBackend = Callable[..., StorageBackend]
"""A factory of one backend's instances on one medium (``new_backend(scheme=SCHEME)``)."""


def hashes(n: int, seed: int = 0, page_size: int = 4) -> list[str]:
    """``n`` chained page hashes of a seeded token run."""
    tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(n * page_size)]
    return chain_hashes(tokens, page_size)


def payload_for(key: str, size: int = 256) -> bytes:
    """A payload that is a function of its key, so any mix-up is visible."""
    block = bytes.fromhex(key)
    return (block * (size // len(block) + 1))[:size]


def small_pool(dtype: torch.dtype = torch.float32, pages: int = 16, page_size: int = 4,
               seed: int = 0) -> HostKVPool:
    pool = HostKVPool(KVShape(2, 2, 4, dtype), pages * page_size, page_size, pin=False)
    gen = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen, dtype=torch.float64).to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen, dtype=torch.float64).to(dtype))
    return pool
