"""The L3 tier, scheduler side: backups, prefetches, settlement, and their accounting.

Backup (L2 -> L3) is chained after each write-through ack: the node's host pages are pinned
and a :class:`BackupOperation` goes to the backup thread; the pin is released when the agreed
number of backup acks is consumed. Prefetch (L3 -> L2) starts when a request enters the waiting
queue (span = the page-aligned tokens after the tree's match), goes through the query thread's
hit vote, gets host pages only once the agreed hit is known (allocation success is voted too),
and is settled at admission on *consensus* progress: the fetched prefix is hung below its anchor
as host-only nodes and later loaded back like any L2 hit.

Accounting closes on every exit path (revoke, settle, abort, IO end): ``occupied`` is SGLang's
``prefetch_tokens_occupied``; host pages of an op are freed only after its IO thread has
finished with them (the ``abort-frees-in-flight`` legacy switch frees them at abort instead).

The tier sees the layers below it through :class:`L2Side`, handed over at construction (the
host pool, the radix tree, the host-page pins and an allocator); it never calls back into the
cache that owns it.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hicache_runtime.config import PrefetchPolicy, StorageConfig
from hicache_runtime.contracts.errors import InvariantViolation
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.contracts.profiles import (
    DEFAULT_PROFILE,
    PROFILES,
    TimeoutBudget,
    TimeoutClock,
)
from hicache_runtime.dist.protocols import DrainCounts
from hicache_runtime.kv.pools import ALL_PAGES
from hicache_runtime.l3.keys import extend_chain
from hicache_runtime.l3.ops import BackupOperation, PrefetchAck, PrefetchOperation

if TYPE_CHECKING:
    from hicache_runtime.dist.protocols import RankSync
    from hicache_runtime.kv.host_pins import HostPins
    from hicache_runtime.kv.pools import HostKVPool
    from hicache_runtime.kv.radix_tree import RadixTree, TreeNode
    from hicache_runtime.kv.request import Req
    from hicache_runtime.l3.workers import StorageWorkers
    from hicache_runtime.telemetry.tracer import Tracer


log = logging.getLogger(__name__)

#: How often a blocked drain checks that the worker it waits for is still alive.
_TAKE_POLL_S = 0.5


class HostAllocator(Protocol):
    """Host pages for a prefetch, with L2 eviction behind them (the cache's host space)."""

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        """Rank-local: slots, evicting L2 once if needed; None if L2 is full."""

    def take(self, num_tokens: int, site: str, *, rank_local: bool = False
             ) -> torch.Tensor | None:
        """Slots as the run allocates host pages: agreed over every rank (None on every rank
        unless all got them; a vote named ``site``) or this rank's own; ``rank_local`` forces
        the latter."""

    def take_prefix(self, num_tokens: int, page_size: int, at_least: int
                    ) -> tuple[torch.Tensor, int] | None:
        """After a failed full allocation: the page-aligned part that fits (at least
        ``at_least`` tokens), as releases allocate; None under an agreed allocation."""


@dataclass(frozen=True)
class L2Side:
    """What the L3 tier uses of the tiers below it.

    ``host``: the pool prefetched pages are read into and freed back to; ``tree``: where
    settled prefetches hang as host-only nodes and where backups take their page hashes;
    ``pins``: held on pages an L3 operation reads or hangs below; ``allocator``: prefetch
    pages, allocated as the cache allocates its own."""

    host: HostKVPool
    tree: RadixTree
    pins: HostPins
    allocator: HostAllocator


class L3Tier:
    """Scheduler-thread half of L3 for one rank (the threads live in ``StorageWorkers``)."""

    def __init__(self, cfg: StorageConfig, workers: StorageWorkers, l2: L2Side,
                 sync: RankSync, tracer: Tracer, legacy: frozenset[LegacySwitch]) -> None:
        self.cfg = cfg
        self.workers = workers
        self.host = l2.host
        self.tree = l2.tree
        self.pins = l2.pins
        self.allocator = l2.allocator
        self.sync = sync
        self.tracer = tracer
        self.legacy = legacy
        self.ps = l2.tree.page_size
        self.capacity = int(l2.host.capacity_tokens * cfg.prefetch_capacity_fraction)
        self.threshold = max(cfg.prefetch_threshold, self.ps)
        self.occupied = 0
        self.ongoing_prefetch: dict[str, PrefetchOperation] = {}
        self.ongoing_backup: dict[int, BackupOperation] = {}
        self.held_for: dict[str, torch.Tensor] = {}
        """Host pages a settled prefetch hung into the tree, pinned until its request is
        admitted: otherwise L2 pressure can evict them while the request still waits."""
        self._backup_ids = 0
        self.stats = {"prefetch_issued": 0, "prefetch_revoked": 0, "prefetch_rate_limited": 0,
                      "prefetched_tokens": 0, "backup_pages": 0, "backup_failed_pages": 0,
                      "query_errors": 0, "io_errors": 0, "backup_errors": 0,
                      "query_shed": 0, "backup_shed_pages": 0,
                      "late_writes_posted": 0, "late_writes_read": 0}
        """Scheduler-side counters; the last seven mirror the threads' (see ``drain``)."""

    # --- backup -------------------------------------------------------------------------------

    def backup(self, node: TreeNode) -> None:
        """Queue ``node``'s host pages for L3 (called once its L2 copy is complete)."""
        if node.host_value is None:
            return
        self._backup_ids += 1
        op = BackupOperation(self._backup_ids, node.id, node.host_value, self.hashes_of(node))
        self.pins.pin(op.host_slots)
        self.ongoing_backup[op.id] = op
        self.workers.backup_queue.put(op)
        self.tracer.emit(Ev.BACKUP_SUBMIT, node=node.id, pages=len(op.hashes))

    def hashes_of(self, node: TreeNode) -> list[str]:
        """The node's L3 page hashes, chained from its parent's (computed once, then kept)."""
        if node.hash_value is None:
            parent = node.parent
            prior = None if parent is None or parent is self.tree.root \
                else self.hashes_of(parent)[-1]
            node.hash_value = extend_chain(prior, node.key, self.ps)
        return node.hash_value

    # --- prefetch: submission -----------------------------------------------------------------

    def prefetch(self, req: Req) -> None:
        """Start an L3 prefetch for the part of ``req``'s prompt the tree does not hold."""
        max_prefix = self.tree.align(req.seq_len - 1)
        m = self.tree.match(req.fill_ids[:max_prefix])
        anchor = m.last_host_node
        if anchor is not self.tree.root and anchor.host_value is None:
            return  # the deepest hit has no host copy: nothing to chain L3 pages onto
        start = int(m.device_indices.numel()) + m.host_hit_length
        span = req.fill_ids[start:max_prefix]
        if len(span) < self.threshold:
            return
        if self.occupied >= self.capacity:  # upstream: limited once the reservations reach it
            self.stats["prefetch_rate_limited"] += 1
            self.tracer.emit(Ev.PREFETCH_REVOKE, rid=req.rid, reason="rate_limited",
                             occupied=self.occupied, capacity=self.capacity,
                             in_flight=len(self.ongoing_prefetch))
            return
        last_hash = None if anchor is self.tree.root else self.hashes_of(anchor)[-1]
        anchor_slots = None if anchor is self.tree.root else anchor.host_value
        self.pins.pin(anchor_slots)
        op = PrefetchOperation(req.rid, span, last_hash, anchor, anchor_slots, len(span),
                               self.tracer.step)
        self.ongoing_prefetch[req.rid] = op
        self.occupied += len(span)
        self.stats["prefetch_issued"] += 1
        self.workers.prefetch_queue.put(op)
        self.tracer.emit(Ev.PREFETCH_SUBMIT, rid=req.rid, start=start, tokens=len(span))

    # --- draining agreed counts -----------------------------------------------------------------

    def local_counts(self) -> dict[str, int]:
        w = self.workers
        return {"prefetch_hits": w.prefetch_hit_queue.qsize(),
                "prefetch_acks": w.ack_prefetch_queue.qsize(),
                "backup_acks": w.ack_backup_queue.qsize()}

    def drain(self, agreed: DrainCounts) -> None:
        """Consume exactly the agreed number of items of each queue, waiting for this rank's
        own threads when they are behind (a blocking ``get``, as upstream)."""
        w = self.workers
        w.check_alive()
        self.stats.update({f"{k}_errors": n for k, n in w.errors.items()},
                          query_shed=w.shed["query_ops"], backup_shed_pages=w.shed["backup_pages"],
                          **{f"late_writes_{k}": n for k, n in w.late_writes.items()})
        for op in _take(w.prefetch_hit_queue, agreed.prefetch_hits, w):
            self._on_hit(op)
        for ack in _take(w.ack_prefetch_queue, agreed.prefetch_acks, w):
            self._on_ack(ack)
        for bop in _take(w.ack_backup_queue, agreed.backup_acks, w):
            self._on_backup_ack(bop)

    def _on_hit(self, op: PrefetchOperation) -> None:
        tokens = op.hit_pages * self.ps
        if op.finished:
            return  # settled with nothing before its hit was known (best_effort)
        if op.is_terminated() or tokens < self.threshold:
            self._revoke(op, "terminated" if op.is_terminated() else "below_threshold")
            return
        slots = self.allocator.take(
            tokens, "prefetch_alloc",
            rank_local=LegacySwitch.LOCAL_PREFETCH_PROGRESS in self.legacy)
        if slots is None:  # a release falls back to the prefix that fits; proposed revokes
            # (with sidecar pools the trimmed op's pool pages are not modelled: revoked whole)
            part = None if op.pool_hit_pages else self.allocator.take_prefix(
                tokens, self.ps, self.threshold)
            if part is None:
                self._revoke(op, "host_full")
                return
            slots, tokens = part
            self.tracer.emit(Ev.PREFETCH_PARTIAL, rid=op.rid, hit_pages=op.hit_pages,
                             pages=tokens // self.ps)
            op.hit_pages = tokens // self.ps  # the IO thread reads only these pages
        op.host_slots = slots
        self.occupied -= op.reserved - tokens
        op.reserved = tokens
        self.workers.prefetch_buffer.put(op)

    def _on_ack(self, ack: PrefetchAck) -> None:
        op = self.ongoing_prefetch[ack.rid]
        op.acks += 1
        if ack.completed_req:
            op.io_finished = True
            if op.settled:
                self._finish(op)
        else:
            op.completed = ack.completed_tokens
            op.pool_pages = dict(zip(self.workers.sidecars, ack.pool_pages))
        self.tracer.emit(Ev.PREFETCH_ACK, rid=ack.rid, batch=ack.batch,
                         completed=ack.completed_tokens, done=ack.completed_req)

    def _on_backup_ack(self, op: BackupOperation) -> None:
        self.ongoing_backup.pop(op.id)
        self.pins.unpin(op.host_slots)
        self.stats["backup_pages"] += op.completed_pages
        if not op.skipped:
            self.stats["backup_failed_pages"] += len(op.hashes) - op.completed_pages

    # --- settlement at admission ----------------------------------------------------------------

    def check_progress(self, req: Req) -> bool:
        """False keeps ``req`` waiting for its prefetch; True settles (or it has none)."""
        op = self.ongoing_prefetch.get(req.rid)
        if op is None or op.settled:
            return True
        local = self._can_terminate(op)
        if LegacySwitch.LOCAL_PREFETCH_PROGRESS in self.legacy:
            # pre-#27010 (can_terminate_prefetch): a TP vote of this stage only; terminate
            # when every TP rank can, or when any already terminated
            can, live = self.sync.legacy_tp_min_many(
                [int(local), int(not op.is_terminated())], "prefetch_terminate")
            decided = bool(can) or not live
        else:
            decided = self.sync.agree_any(local, "prefetch_terminate")
        if not decided:
            return False
        op.mark_terminate()
        self._settle(op, req)
        return True

    def _can_terminate(self, op: PrefetchOperation) -> bool:
        policy = self.cfg.prefetch_policy
        if policy is PrefetchPolicy.BEST_EFFORT or op.revoked:
            return True
        done = op.io_finished or op.completed >= op.hit_pages * self.ps > 0
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return done
        if not self.sync.rank.is_first_stage and \
                LegacySwitch.LOCAL_PREFETCH_PROGRESS not in self.legacy:
            return False  # PP0 evaluates the wall-clock deadline; the vote carries it down
        if done:  # landed: a deadline would salvage nothing (0.5.23 L2273-2276)
            return True
        return self._deadline_passed(op)

    def _deadline_passed(self, op: PrefetchOperation) -> bool:
        """The ``timeout`` policy's deadline, as the profile's release has it
        (``contracts/profiles.py``: ``TimeoutClock``, ``TimeoutBudget``)."""
        policies = PROFILES[DEFAULT_PROFILE].policies  # a tier built without a run config
        budget_by = self.cfg.prefetch_timeout_budget or policies.timeout_budget
        tokens = (len(op.tokens) // self.ps * self.ps
                  if budget_by is TimeoutBudget.REQUESTED_TOKENS else op.hit_pages * self.ps)
        budget = self.cfg.prefetch_timeout_base_s + \
            tokens / 1024 * self.cfg.prefetch_timeout_per_ki_token_s
        now = time.monotonic()
        if (self.cfg.prefetch_timeout_clock or policies.timeout_clock) \
                is TimeoutClock.FIRST_BLOCKED_POLL:
            if op.wait_start is None:
                op.wait_start = now  # this poll is the first to find it unfinished
            return now - op.wait_start > budget
        return now - op.start_time > budget

    def _settle(self, op: PrefetchOperation, req: Req) -> None:
        if LegacySwitch.LOCAL_PREFETCH_PROGRESS in self.legacy:
            self._stage_progress_vote(op)
        completed = op.completed
        completed = min(completed, op.hit_pages * self.ps) if op.host_slots is not None else 0
        completed = self._usable_with_sidecars(op, completed)
        inserted = 0
        if completed and not op.pages_freed:
            assert op.host_slots is not None
            added = self._hang_host_pages(
                op.anchor, op.tokens[:completed], op.host_slots[:completed],
                op.hashes[: completed // self.ps])
            inserted = int(added.numel())
            if inserted:  # keep L2 from evicting them before the request is admitted
                self.pins.pin(added)
                self.held_for[req.rid] = added
        op.settled, op.settled_tokens = True, completed
        self.pins.unpin(op.anchor_slots)
        req.storage_pending = inserted
        self.stats["prefetched_tokens"] += inserted
        pools = {}
        if self.workers.sidecars:  # hybrid models: what each pool found and what counted
            pools = {"pools_ok": {n: list(op.pool_pages_ok.get(n, ()))
                                  for n in self.workers.sidecars},
                     "pools_counted": {n: op.pool_pages.get(n, 0) for n in self.workers.sidecars}}
        self.tracer.emit(Ev.PREFETCH_SETTLE, rid=op.rid, completed=completed,
                         local=op.local_completed, consensus=op.completed,
                         hit_pages=op.hit_pages, inserted=inserted, **pools)
        if op.io_finished or op.host_slots is None:
            self._finish(op)

    def _hang_host_pages(self, anchor: TreeNode, tokens: list[int], host_slots: torch.Tensor,
                         hashes: list[str]) -> torch.Tensor:
        """Hang fetched L3 pages below ``anchor`` as host-only nodes; returns the host slots
        added to the tree. Pages the tree already holds, or that cannot hang contiguously,
        are freed."""
        present, added = self.tree.insert_host(anchor, tokens, host_slots, hashes)
        if present:
            self.host.free(host_slots[:present])
        if present + added < len(tokens):
            self.host.free(host_slots[present + added :])
        return host_slots[present : present + added]

    def _stage_progress_vote(self, op: PrefetchOperation) -> None:
        """Pre-#27010 (``check_prefetch_progress``): the scheduler MIN-reduces what each rank
        of *this stage* loaded (its ``completed_tokens``, and each sidecar pool's pages) over
        the stage's TP group, after the op was terminated. Stages never compare: each settles
        on its own stage's value, which is what diverges under PP."""
        names = list(self.workers.sidecars)
        voted = self.sync.legacy_tp_min_many(
            [op.local_completed, *(op.local_pool_pages.get(n, 0) for n in names)],
            "prefetch_completed")
        op.completed, op.pool_pages = voted[0], dict(zip(names, voted[1:]))

    def _usable_with_sidecars(self, op: PrefetchOperation, completed: int) -> int:
        """Hybrid models (#31443): a KV-derived ``all_pages`` pool clamps the usable prefix to
        the pages it has too; a ``trailing_pages`` pool's state cannot be cut page by page, so
        anything short of the whole hit discards the prefetch."""
        pages = op.pool_pages
        for name in self.workers.sidecars:
            have = pages.get(name, 0) * self.ps
            if name == ALL_PAGES:
                completed = min(completed, have)
            elif completed and (completed < op.hit_pages * self.ps or have < completed):
                log.info("HiCache hybrid prefetch discarded req=%s reason=%s short "
                         "(%d of %d tokens)", op.rid, name, min(have, completed),
                         op.hit_pages * self.ps)
                self.tracer.emit(Ev.PREFETCH_DISCARD, rid=op.rid, pool=name, have=have,
                                 completed=completed, hit_pages=op.hit_pages)
                completed = 0
        return completed

    def release_hold(self, rid: str) -> None:
        """``rid`` was admitted (or is gone): its fetched pages may age out of L2 again."""
        held = self.held_for.pop(rid, None)
        if held is not None:
            self.pins.unpin(held)

    def release_aborted(self, req: Req) -> None:
        """The waiting ``req`` was aborted: stop its prefetch and release what it holds."""
        self.release_hold(req.rid)
        op = self.ongoing_prefetch.get(req.rid)
        if op is None:
            return
        op.mark_terminate()
        op.aborted = True
        if LegacySwitch.ABORT_FREES_IN_FLIGHT in self.legacy and op.host_slots is not None \
                and not op.settled and not op.pages_freed:
            # pre-#31296: the pages go back to the pool while the IO thread may still fill them
            # (a settled op's pages already belong to the tree or were freed at settlement)
            self.host.free(op.host_slots)
            op.pages_freed = True
        if not op.settled:
            op.settled = True
            self.pins.unpin(op.anchor_slots)
        if op.io_finished:
            self._finish(op)

    # --- closing an op --------------------------------------------------------------------------

    def _revoke(self, op: PrefetchOperation, reason: str) -> None:
        """No IO will run for ``op``: release everything now (the request, if still waiting,
        then finds no prefetch and proceeds)."""
        op.revoked = True
        op.io_finished = True
        self.stats["prefetch_revoked"] += 1
        self.tracer.emit(Ev.PREFETCH_REVOKE, rid=op.rid, reason=reason, hit_pages=op.hit_pages)
        if not op.settled:
            op.settled = True
            self.pins.unpin(op.anchor_slots)
        self._finish(op)

    def _finish(self, op: PrefetchOperation) -> None:
        """IO done and settled: free the pages not handed to the tree, close the reservation."""
        if op.finished:
            return
        op.finished = True
        if op.host_slots is not None and not op.pages_freed:  # the abort may have freed them
            tail = op.host_slots[op.settled_tokens :]
            if tail.numel():
                self.host.free(tail)
            op.pages_freed = True
        self.ongoing_prefetch.pop(op.rid, None)
        self.occupied -= op.reserved

    # --- state ------------------------------------------------------------------------------------

    def held_tokens(self) -> int:
        """Host tokens allocated to prefetches and not (yet) in the tree."""
        return sum(int(op.host_slots.numel()) - op.settled_tokens
                   for op in self.ongoing_prefetch.values()
                   if op.host_slots is not None and not op.pages_freed)

    def pin_holders(self) -> list[torch.Tensor | None]:
        """Host slots this tier holds pins on: backups in flight, unsettled prefetch anchors."""
        return [*(op.host_slots for op in self.ongoing_backup.values()),
                *(op.anchor_slots for op in self.ongoing_prefetch.values() if not op.settled),
                *self.held_for.values()]

    def check_accounting(self) -> None:
        """Reservations add up: ``prefetch_tokens_occupied`` is exactly what open ops hold."""
        held = sum(op.reserved for op in self.ongoing_prefetch.values())
        if held != self.occupied:
            raise InvariantViolation(
                f"prefetch_tokens_occupied is {self.occupied} but open prefetches hold {held}: "
                "a reservation leaked")

    def idle(self) -> bool:
        w = self.workers
        return not (self.ongoing_prefetch or self.ongoing_backup or w.prefetch_queue.qsize()
                    or w.ack_prefetch_queue.qsize() or w.ack_backup_queue.qsize())

    def open_ops(self) -> int:
        """L3 operations still open: prefetches not yet closed and backups not yet acked."""
        return len(self.ongoing_prefetch) + len(self.ongoing_backup)

    def shutdown(self) -> None:
        """Stop the L3 threads, then close the backend they used."""
        self.workers.stop()
        self.workers.backend.close()

    def snapshot(self) -> dict[str, Any]:
        return {
            "prefetch_tokens_occupied": self.occupied, "capacity": self.capacity,
            "ongoing_prefetch": {rid: {"hit_pages": op.hit_pages, "completed": op.completed,
                                       "local_completed": op.local_completed,
                                       "acks": op.acks, "settled": op.settled,
                                       "io_finished": op.io_finished,
                                       "terminated": op.is_terminated()}
                                 for rid, op in self.ongoing_prefetch.items()},
            "ongoing_backup": sorted(self.ongoing_backup),
            "queues": dict(self.local_counts()),
            "stats": dict(self.stats), "backend": self.workers.backend.stats().as_dict(),
        }


def _take(q: queue.Queue, n: int, workers: StorageWorkers) -> list:
    """``n`` items, blocking while this rank's own thread is behind (as upstream); a worker
    that died while we wait is reported instead of waited for forever."""
    out: list[Any] = []
    while len(out) < n:
        try:
            out.append(q.get(timeout=_TAKE_POLL_S))
        except queue.Empty:
            workers.check_alive()
    return out
