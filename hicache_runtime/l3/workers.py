"""The L3 background threads of one rank and the queues between them and the scheduler.

==================  ===============================  ==========================================
thread              consumes                         produces
==================  ===============================  ==========================================
prefetch-query      ``prefetch_queue``               ``prefetch_hit_queue`` (agreed hit length)
prefetch-io         ``prefetch_buffer``              ``prefetch_sync_queue`` (raw acks)
prefetch-sync       ``prefetch_sync_queue``          ``ack_prefetch_queue`` (MIN-voted acks)
backup              ``backup_queue``                 ``ack_backup_queue``
==================  ===============================  ==========================================

Every thread owns its input queue and polls it with a timeout so the shared stop event ends it;
``stop`` joins them with a timeout and reports the ones that did not stop (a hung worker is a
finding, not something to hide). The voting threads use their own communicators (``sync``):
the query thread votes each op's hit, the sync thread each progress ack, the backup thread
each finished backup. Only the scheduler thread frees host pages; threads only read or fill
pages they were given.

A storage call that raises is caught where it runs (as SGLang does), traced, counted in
``errors`` and treated as a miss or a failed write: the thread goes on voting and acking, so
no peer waits for a vote that never comes. An exception outside those calls still ends the
thread, and the scheduler reports it (``check_alive``). A slow backend is bounded by the IO
budget (see ``l3_ops``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from faults.kinds import KINDS
from faults.points import FaultPoint
from hicache_runtime.contracts.errors import WorkerDied
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.l3.backend import StorageCallInfo
from hicache_runtime.l3.keys import extend_chain, sidecar_hash
from hicache_runtime.l3.ops import (
    BackupOperation,
    PrefetchAck,
    PrefetchOperation,
    past_budget,
    storage_drain_is_stage_local,
)

if TYPE_CHECKING:
    from faults.injector import FaultInjector
    from faults.rendezvous import PrefetchIORendezvous
    from hicache_runtime.config import StorageConfig
    from hicache_runtime.contracts.topology import RankInfo
    from hicache_runtime.dist.protocols import RankSync
    from hicache_runtime.kv.pools import HostKVPool
    from hicache_runtime.l3.backend import StorageBackend
    from hicache_runtime.l3.pages import PageCodec, SidecarCodec
    from hicache_runtime.telemetry.tracer import Tracer

log = logging.getLogger(__name__)
_POLL_S = 0.2
_ABORT_WAIT_S = 5.0
_WARN_FIRST, _WARN_EVERY = 5, 100

AbortRequester = Callable[[str], threading.Event]
"""Asks the scheduler to abort a request; the event is set once the abort has been applied."""


class StorageWorkers:
    """Owns the L3 threads and queues of one rank."""

    def __init__(self, cfg: StorageConfig, backend: StorageBackend, codec: PageCodec,
                 host: HostKVPool, sync: RankSync, tracer: Tracer, rank: RankInfo,
                 legacy: frozenset[LegacySwitch], faults: FaultInjector | None = None,
                 request_abort: AbortRequester | None = None,
                 sidecars: dict[str, SidecarCodec] | None = None,
                 io_budget_s: float | None = None,
                 rendezvous: PrefetchIORendezvous | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.codec = codec
        self.sidecars = dict(sidecars or {})
        """Hybrid sidecar pools, in config order, with their codecs."""
        self.host = host
        self.sync = sync
        self.tracer = tracer
        self.rank = rank
        self.legacy = legacy
        # A mid-prefetch abort is a client abort: it reaches the job through rank 0, which
        # passes it on to every rank with the next requests.
        self.faults = faults if faults and faults.armed(FaultPoint.PREFETCH_BATCH) \
            and rank.rank == 0 else None
        self.request_abort = request_abort
        self.rendezvous = rendezvous
        """Armed with a mid-prefetch-abort: times rank 0's abort after the peers' IO."""
        self.io_budget_s = io_budget_s
        """Wall time one query or backup may take from when it was queued (None: unbounded)."""
        self.vote_backups = not storage_drain_is_stage_local(legacy)
        self.errors = {"query": 0, "io": 0, "backup": 0}
        """Storage calls that raised, per thread (each key is written by one thread only)."""
        self.shed = {"query_ops": 0, "backup_pages": 0}
        """Work given up when the IO budget ran out."""
        self.late_writes = {"posted": 0, "read": 0}
        """``abort-frees-in-flight``: late writes posted, and landed as a load-back read them."""
        self.page_size = codec.layout.page_size
        self.prefetch_queue: queue.Queue[PrefetchOperation] = queue.Queue()
        self.prefetch_hit_queue: queue.Queue[PrefetchOperation] = queue.Queue()
        self.prefetch_buffer: queue.Queue[PrefetchOperation] = queue.Queue()
        self.prefetch_sync_queue: queue.Queue[PrefetchAck] = queue.Queue()
        self.ack_prefetch_queue: queue.Queue[PrefetchAck] = queue.Queue()
        self.backup_queue: queue.Queue[BackupOperation] = queue.Queue()
        self.ack_backup_queue: queue.Queue[BackupOperation] = queue.Queue()
        self.stop_event = threading.Event()
        self.failure: tuple[str, BaseException] | None = None
        self._warnings = 0
        self.writer = not cfg.single_writer or rank.tp_rank == 0
        self._threads = [
            threading.Thread(target=self._loop, args=(self.prefetch_queue, self._query),
                             name="hicache-prefetch-query", daemon=True),
            threading.Thread(target=self._loop, args=(self.prefetch_buffer, self._transfer),
                             name="hicache-prefetch-io", daemon=True),
            threading.Thread(target=self._loop, args=(self.prefetch_sync_queue, self._reduce),
                             name="hicache-prefetch-sync", daemon=True),
            threading.Thread(target=self._loop, args=(self.backup_queue, self._backup),
                             name="hicache-backup", daemon=True),
        ]

    def start(self) -> StorageWorkers:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> list[str]:
        """Stop and join every thread; returns the names of threads that did not stop."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            log.error("Failed to stop HiCache storage threads cleanly: %s", ", ".join(stuck))
        return stuck

    def _warn(self, msg: str, *args: object) -> None:
        """Upstream's warnings, rate-limited: during an outage every batch fails, and one
        line per batch would bury the log (the counters keep the exact numbers)."""
        self._warnings += 1
        n = self._warnings
        if n <= _WARN_FIRST or n % _WARN_EVERY == 0:
            suffix = "" if n <= _WARN_FIRST else f" ({n} storage warnings so far)"
            log.warning(msg + suffix, *args)

    def check_alive(self) -> None:
        """Raise on the scheduler thread if a worker died, chaining its exception: a dead
        worker would otherwise leave the scheduler waiting for acks forever."""
        if self.failure is not None:
            name, exc = self.failure
            raise WorkerDied(f"{name} died: {type(exc).__name__}: {exc}") from exc

    def _caught(self, where: str, rid: str | None, exc: Exception) -> None:
        """A storage call raised: log it with its traceback, trace it and count it; the
        caller carries on as if the call had failed soft."""
        self.errors[where] += 1
        log.warning("HiCache storage %s failed%s: %s: %s", where,
                    f" for request {rid}" if rid else "", type(exc).__name__, exc,
                    exc_info=self.errors[where] <= _WARN_FIRST)
        self.tracer.emit(Ev.STORAGE, op="raised", ok=False, thread=where, rid=rid,
                         error=f"{type(exc).__name__}: {exc}"[:300])

    def _loop(self, q: queue.Queue, handle: Callable[[object], None]) -> None:
        while not self.stop_event.is_set():
            try:
                item = q.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            try:
                handle(item)
            except Exception as exc:  # surfaced to the scheduler by check_alive()
                name = threading.current_thread().name
                log.exception("%s died", name)
                self.tracer.emit(Ev.WORKER_DIED, thread=name,
                                 error=f"{type(exc).__name__}: {exc}")
                self.failure = (name, exc)
                return

    # --- prefetch: existence query and hit vote -----------------------------------------------

    def _query(self, op: PrefetchOperation) -> None:
        op.hashes = extend_chain(op.last_hash, op.tokens, self.page_size)
        for name in self.sidecars:
            op.pool_hashes[name] = [sidecar_hash(h, name) for h in op.hashes]
        hit, pool_hits = 0, [0] * len(self.sidecars)
        if past_budget(op.start_time, self.io_budget_s):
            self.shed["query_ops"] += 1  # queued too long behind a slow backend: a miss
        else:
            try:
                hit = self._leading_hits(op, op.hashes, "kv")
                for i, name in enumerate(self.sidecars):
                    pool_hits[i] = self._leading_hits(op, op.pool_hashes[name][:hit], name)
            except Exception as exc:  # upstream: logged, the op votes 0 hits
                self._caught("query", op.rid, exc)
                hit, pool_hits = 0, [0] * len(self.sidecars)
        op.local_hit_pages = hit
        # Terminated ops still vote (0 is harmless under MIN): the k-th vote pairs the k-th op.
        local = [0 if op.is_terminated() else n for n in (hit, *pool_hits)]
        # pre-#27010 the hit was MIN-reduced over this stage's TP ranks only
        agreed = self.sync.legacy_hit_vote(local) \
            if LegacySwitch.LOCAL_PREFETCH_PROGRESS in self.legacy else self.sync.hit_vote(local)
        op.hit_pages = agreed[0]
        op.pool_hit_pages = dict(zip(self.sidecars, agreed[1:]))
        self.tracer.emit(Ev.PREFETCH_HIT, rid=op.rid, local=hit, agreed=op.hit_pages,
                         span=len(op.tokens), pools=op.pool_hit_pages)
        self.prefetch_hit_queue.put(op)

    def _leading_hits(self, op: PrefetchOperation, hashes: list[str], pool: str) -> int:
        """Leading pages of ``hashes`` present in L3, batch by batch; stops at the first
        short batch, or once the op's IO budget is spent (what was found so far is still a
        valid leading hit)."""
        info = StorageCallInfo(rid=op.rid, step=self.tracer.step, pool=pool)
        hit, batch = 0, self.cfg.io_batch_pages
        for start in range(0, len(hashes), batch):
            if start and past_budget(op.start_time, self.io_budget_s):
                break
            keys = hashes[start : start + batch]
            n = self.backend.batch_exists(keys, info)
            hit += n
            if n < len(keys):
                break
        return hit

    # --- prefetch: page reads ------------------------------------------------------------------

    def _transfer(self, op: PrefetchOperation) -> None:
        hashes = op.hashes[: op.hit_pages]
        batch = self.cfg.io_batch_pages
        info = StorageCallInfo(rid=op.rid, step=self.tracer.step)
        failed = False
        early_exit = LegacySwitch.ABORT_EARLY_EXIT in self.legacy
        late_writes = LegacySwitch.ABORT_FREES_IN_FLIGHT in self.legacy
        stopped = False
        armed: list[int] = []
        try:
            for index, start in enumerate(range(0, len(hashes), batch)):
                armed = self._maybe_abort(op, index, start, min(start + batch, len(hashes)))
                if op.is_terminated():
                    if early_exit:
                        self.tracer.emit_durable(Ev.PREFETCH_ACK, rid=op.rid, batch=index,
                                                 stopped=True)
                        stopped = True
                        return  # upstream, pre-#27010: no further acks for this op
                    if late_writes and not failed and op.pages_freed:
                        try:
                            self._late_write(op, hashes[start : start + batch], start, info)
                        except Exception as exc:  # as a read failure would be
                            self._caught("io", op.rid, exc)
                    failed = True
                if armed:  # posted, or no late write comes (the abort freed nothing)
                    self.host.late_writes.disarm(armed)
                    armed = []
                if not failed:
                    try:
                        failed = not self._read_batch(op, hashes[start : start + batch],
                                                      start, info)
                        for name in self.sidecars:
                            if not failed:
                                failed = not self._read_sidecar(op, name, start, batch)
                    except Exception as exc:  # upstream: logged, the batch counts 0 pages
                        self._caught("io", op.rid, exc)
                        failed = True
                # one ack per batch on every rank, whatever happened to this batch (#27010)
                self.prefetch_sync_queue.put(PrefetchAck(op.rid, op.local_completed, index,
                                                         pool_pages=self._pool_pages(op)))
        finally:
            if armed:
                self.host.late_writes.disarm(armed)
            if not stopped:  # the completion ack, also if something above raised
                self.prefetch_sync_queue.put(PrefetchAck(op.rid, op.local_completed, -1, True,
                                                         self._pool_pages(op)))
            if self.rendezvous is not None and self.faults is None:  # a peer: rank 0 waits
                self.rendezvous.finished(op.rid)

    def _late_write(self, op: PrefetchOperation, keys: list[str], first_page: int,
                    info: StorageCallInfo) -> None:
        """``abort-frees-in-flight`` (pre-#31296): the batch that was being read when the
        abort came is not re-checked: its bytes reach the op's pages although the abort
        already gave them back to the pool. In production the read was slow (that is why the
        request was aborted) and could complete after the scheduler had handed the pages to
        another owner. Here it is posted (``kv/late_writes.py``) and lands when a load-back
        is about to read one of the pages, on that new owner's complete copy: a
        use-after-free that shows as wrong KV in the request that loads it, not as a
        bookkeeping error. A batch nobody loads back never lands."""
        assert op.host_slots is not None
        ps = self.page_size
        slots = op.host_slots[first_page * ps : (first_page + len(keys)) * ps]
        pages = (slots[::ps] // ps).tolist()
        payloads = self.backend.batch_get(keys, info)
        good = next((i for i, p in enumerate(payloads) if p is None or not self.codec.fits(p)),
                    len(payloads))
        if not good:  # nothing to write late (the caller disarms the pages)
            return

        def land() -> None:  # in the reading load-back's thread, before it reads
            self.codec.write_pages(self.host, slots[: good * ps],
                                   payloads[:good])  # type: ignore[arg-type]
            reused = [p for p in pages[:good] if self.host.allocator.is_used(p)]
            self.late_writes["read"] += 1
            self.tracer.emit_durable(Ev.PREFETCH_LATE_WRITE, rid=op.rid, pages=pages[:good],
                                     reused=reused)

        self.host.late_writes.post(pages[:good], land)  # the caller disarms the rest
        self.late_writes["posted"] += 1

    def _pool_pages(self, op: PrefetchOperation) -> tuple[int, ...]:
        return tuple(op.local_pool_pages.get(name, 0) for name in self.sidecars)

    def _read_sidecar(self, op: PrefetchOperation, name: str, start: int, batch: int) -> bool:
        """Read one batch of a sidecar pool into the op's host pages. Counts the leading run
        of arrived pages (#31443); ``sum-hit-pages`` restores counting every arrived page,
        which treats a hole as coverage. True when the usable run goes on."""
        keys = op.pool_hashes[name][start : min(start + batch, op.hit_pages)]
        codec = self.sidecars[name]
        info = StorageCallInfo(rid=op.rid, step=self.tracer.step, pool=name)
        payloads = [p if p is not None and codec.fits(p) else None
                    for p in self.backend.batch_get(keys, info)]
        arrived = [i for i, p in enumerate(payloads) if p is not None]
        op.pool_pages_ok.setdefault(name, []).extend(p is not None for p in payloads)
        leading = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
        counted = len(arrived) if LegacySwitch.SUM_HIT_PAGES in self.legacy else leading
        ps = self.page_size
        assert op.host_slots is not None
        for i in (arrived if LegacySwitch.SUM_HIT_PAGES in self.legacy else range(leading)):
            page = start + i
            codec.write_pages(self.host, op.host_slots[page * ps : (page + 1) * ps],
                              [payloads[i]])  # type: ignore[list-item]
        op.local_pool_pages[name] = op.local_pool_pages.get(name, 0) + counted
        return LegacySwitch.SUM_HIT_PAGES in self.legacy or leading == len(keys)

    def _read_batch(self, op: PrefetchOperation, keys: list[str], first_page: int,
                    info: StorageCallInfo) -> bool:
        """Read one batch into the op's host pages; True when every page arrived."""
        payloads = self.backend.batch_get(keys, info)
        good = 0
        for p in payloads:
            if p is None or not self.codec.fits(p):
                break
            good += 1
        assert op.host_slots is not None
        if good:
            ps = self.page_size
            slots = op.host_slots[first_page * ps : (first_page + good) * ps]
            self.codec.write_pages(self.host, slots, payloads[:good])  # type: ignore[arg-type]
            op.local_completed += good * ps
        if good < len(keys):
            self._warn("Prefetch operation %s failed to retrieve page %s", op.rid, keys[good])
            return False
        return True

    def _maybe_abort(self, op: PrefetchOperation, index: int, first_page: int,
                     end_page: int) -> list[int]:
        """Ask for the abort a fault fires before batch ``index`` (pages ``first_page`` to
        ``end_page`` of the op). Returns the host pages armed for a late write
        (``abort-frees-in-flight``; the caller disarms them), else []."""
        if self.faults is None or self.request_abort is None:
            return []
        # a spec for another batch is neither fired nor counted at this one: it stays armed
        # for the op that reaches its batch (an op of fewer batches never does)
        fired = self.faults.fire(FaultPoint.PREFETCH_BATCH, step=self.tracer.step, rid=op.rid,
                                 only=lambda s: KINDS[s.kind].aborts(s, batch=index))
        if not fired:
            return []
        if self.rendezvous is not None:  # the peers are past this op (faults.rendezvous)
            self.rendezvous.wait_for_peers(op.rid)
        armed: list[int] = []
        if LegacySwitch.ABORT_FREES_IN_FLIGHT in self.legacy and op.host_slots is not None:
            # armed before the abort can free them: no owner's copy lands unreported
            ps = self.page_size
            armed = (op.host_slots[first_page * ps : end_page * ps : ps] // ps).tolist()
            self.host.late_writes.arm(armed)
        # The abort must land while this op is in flight: wait until it was applied.
        self.request_abort(op.rid).wait(_ABORT_WAIT_S)
        return armed

    # --- prefetch: per-batch MIN vote ---------------------------------------------------------

    def _reduce(self, ack: PrefetchAck) -> None:
        if LegacySwitch.LOCAL_PREFETCH_PROGRESS not in self.legacy:
            agreed = self.sync.progress_vote([ack.completed_tokens, *ack.pool_pages])
            ack = PrefetchAck(ack.rid, agreed[0], ack.batch, ack.completed_req,
                              tuple(agreed[1:]))
        self.ack_prefetch_queue.put(ack)

    # --- backup --------------------------------------------------------------------------------

    def _backup(self, op: BackupOperation) -> None:
        if not self.writer:
            op.skipped = True  # MLA-style single writer: others skip the write, but still ack
        else:
            try:
                self._write_backup(op)
            except Exception as exc:  # upstream ``_page_backup_or_log``: logged, still acked
                self._caught("backup", None, exc)
                op.failed = True
        agreed = self.sync.backup_vote(op.completed_pages) if self.vote_backups else None
        self.tracer.emit(Ev.BACKUP_ACK, node=op.node_id, pages=op.completed_pages,
                         of=len(op.hashes), skipped=op.skipped, shed=op.shed_pages,
                         agreed=agreed)
        self.ack_backup_queue.put(op)

    def _write_backup(self, op: BackupOperation) -> None:
        """Write the op's pages batch by batch; stop at the first failed batch, or when the
        IO budget is spent (the pages written so far are a valid leading run)."""
        ps, batch = self.page_size, self.cfg.io_batch_pages
        info = StorageCallInfo(step=self.tracer.step)
        for start in range(0, len(op.hashes), batch):
            if past_budget(op.queued_at, self.io_budget_s):
                op.shed_pages = len(op.hashes) - start
                self.shed["backup_pages"] += op.shed_pages
                return
            keys = op.hashes[start : start + batch]
            slots = op.host_slots[start * ps : (start + len(keys)) * ps]
            ok = self.backend.batch_set(keys, self.codec.read_pages(self.host, slots), info)
            for name, codec in self.sidecars.items():
                if all(ok):
                    ok = self.backend.batch_set(
                        [sidecar_hash(h, name) for h in keys],
                        codec.read_pages(self.host, slots),
                        StorageCallInfo(step=self.tracer.step, pool=name))
            if not all(ok):
                self._warn("Write page to storage: %d pages failed.", ok.count(False))
                return
            op.completed_pages += len(keys)
