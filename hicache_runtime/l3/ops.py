"""The records that flow between the scheduler and the L3 threads.

Prefetch ack protocol (SGLang #27010, per op, on every rank):

1. the query thread votes the leading hit length (MIN over all ranks) and hands the op back;
2. the IO thread emits exactly one :class:`PrefetchAck` per batch of ``io_batch_pages`` pages
   of the agreed hit, carrying its cumulative ``completed_tokens`` — also after a read failure,
   a termination or an abort (it stops reading, never stops acking);
3. then exactly one ack with ``completed_req=True``.

Because the hit length is agreed, every rank emits the same number of acks per op, and the
sync thread can pair the k-th ack of each rank in a MIN vote. The ``abort-early-exit`` legacy
switch breaks rule 2. An exception in the IO thread is caught per batch and counted; the op
goes on acking with the pages it has (SGLang catches it the same way).

Backup (L2 -> L3): the backup thread writes an op's pages, then votes once per op over every
rank (:meth:`RankSync.backup_vote`) before acking it, so an ack exists
on a rank only once every rank has finished that op: the scheduler's agreed drain never waits
for a peer's storage.

IO budget: every rank spends at most ``io_budget_s`` of wall time on one query or one backup,
counted from when the op was queued; what is not done by then is given up (a shorter leading
hit, fewer pages backed up), each a valid, smaller answer that the votes then agree on. A
peer therefore waits in a vote for at most the budget plus one storage call, whatever the
backlog of a slow rank: a slow backend makes L3 less useful, it never stops the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hicache_runtime.contracts.legacy import LegacySwitch

if TYPE_CHECKING:
    from hicache_runtime.kv.radix_tree import TreeNode


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
    wait_start: float | None = None
    """When an admission poll first found it unfinished (the ``first-blocked-poll`` clock of
    the ``timeout`` policy); None before."""
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
    pool_pages_ok: dict[str, list[bool]] = field(default_factory=dict)
    """Sidecar pools: which pages this rank's IO thread found, in page order (IO thread;
    the settlement traces them, so a hole counted as coverage shows)."""
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
    queued_at: float = field(default_factory=time.monotonic)
    completed_pages: int = 0
    """Pages this rank wrote (its own outcome; the vote only says every rank is done)."""
    shed_pages: int = 0
    """Pages given up because the IO budget ran out (a slow backend)."""
    skipped: bool = False
    failed: bool = False
    """The write raised; counted and acked like a failed write."""


def past_budget(queued_at: float, budget_s: float | None) -> bool:
    """Whether an op queued at ``queued_at`` has used up its IO budget (None: unbounded)."""
    return budget_s is not None and time.monotonic() - queued_at > budget_s


def storage_drain_is_stage_local(legacy: frozenset[LegacySwitch]) -> bool:
    """Whether ``legacy`` restores a path where storage queues are drained stage-locally (the
    pre-#27010 form) and ranks may submit different backups: no per-op backup vote then (a
    vote would pair different ops and change how those paths fail)."""
    return bool(legacy & {LegacySwitch.LOCAL_ACK_DRAIN, LegacySwitch.SKIP_EMPTY_SYNC,
                          LegacySwitch.LOCAL_PREFETCH_PROGRESS})
