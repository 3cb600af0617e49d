"""The records that flow between the scheduler and the L3 threads.

Prefetch ack protocol (SGLang #27010, per op, on every rank):

1. the query thread votes the leading hit length (MIN over all ranks) and hands the op back;
2. the IO thread emits exactly one :class:`PrefetchAck` per batch of ``io_batch_pages`` pages
   of the agreed hit, carrying its cumulative ``completed_tokens`` — also after a read failure,
   a termination or an abort (it stops reading, never stops acking);
3. then exactly one ack with ``completed_req=True``.

Because the hit length is agreed, every rank emits the same number of acks per op, and the
sync thread can pair the k-th ack of each rank in a MIN vote. The ``abort-early-exit`` legacy
switch breaks rule 2.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hicache_runtime.radix_tree import TreeNode


@dataclass(eq=False)
class PrefetchOperation:
    """One request's L3 -> L2 prefetch.

    Written by: the scheduler (everything except the fields marked otherwise), the query
    thread (``hashes``, ``local_hit_pages``, ``hit_pages``), the IO thread
    (``local_completed``). The terminate flag is shared and guarded by a lock."""

    rid: str
    tokens: list[int]
    """The span to fetch: page-aligned tokens right after the tree's match."""
    last_hash: str | None
    anchor: TreeNode
    anchor_slots: torch.Tensor | None
    reserved: int
    """Tokens this op holds in ``prefetch_tokens_occupied``."""
    step: int
    start_time: float = field(default_factory=time.monotonic)
    hashes: list[str] = field(default_factory=list)
    local_hit_pages: int = 0
    hit_pages: int = 0
    host_slots: torch.Tensor | None = None
    pool_hashes: dict[str, list[str]] = field(default_factory=dict)
    """Sidecar pools: each pool's object hashes for the span (query thread)."""
    pool_hit_pages: dict[str, int] = field(default_factory=dict)
    """Sidecar pools: agreed leading hit pages per pool."""
    local_pool_pages: dict[str, int] = field(default_factory=dict)
    """Sidecar pools: pages this rank's IO thread counted as loaded, per pool."""
    pool_pages: dict[str, int] = field(default_factory=dict)
    """Sidecar pools: consensus loaded pages per pool (MIN over ranks)."""
    local_completed: int = 0
    completed: int = 0
    """Consensus progress in tokens (MIN over ranks), applied by the scheduler."""
    io_finished: bool = False
    settled: bool = False
    settled_tokens: int = 0
    aborted: bool = False
    pages_freed: bool = False
    revoked: bool = False
    finished: bool = False
    """Closed: reservation returned and no longer in ``ongoing_prefetch``."""
    acks: int = 0
    _terminated: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def mark_terminate(self) -> None:
        with self._lock:
            self._terminated = True

    def is_terminated(self) -> bool:
        with self._lock:
            return self._terminated


@dataclass(frozen=True)
class PrefetchAck:
    """One progress report of the IO thread (raw) or its reduction (after the MIN vote)."""

    rid: str
    completed_tokens: int
    batch: int
    completed_req: bool = False
    pool_pages: tuple[int, ...] = ()
    """Sidecar pools, in config order: cumulative pages counted as loaded."""


@dataclass(eq=False)
class BackupOperation:
    """One node's L2 -> L3 backup; its host pages stay pinned until the ack is consumed."""

    id: int
    node_id: int
    host_slots: torch.Tensor
    hashes: list[str]
    completed_pages: int = 0
    skipped: bool = False
