"""Cache controller: L1<->L2 transfer queues and their acks (SGLang's ``HiCacheController``).

The scheduler thread queues transfers (``write``/``load``); ``start_writing``/``start_loading``
merge what is queued into one copy job per direction and append one :class:`HiCacheAck` to the
matching ack queue. Acks complete in order. The *ready count* of an ack queue is the length of
its leading run of completed acks; how many acks to consume is never decided from it directly
but from the agreed count that :mod:`hicache_runtime.dist.protocols` returns (see ``HiCache``).

The controller is the copy engine's only user: the cache copies through it (``write_now`` is
write-back eviction's synchronous copy) and stops the engine through it (``shutdown``).

The ack queues are plain lists consumed with ``pop(0)``, as upstream does; consuming more acks
than a rank holds therefore fails exactly the way production did:
``IndexError: pop from empty list``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from hicache_runtime.contracts.events import Ev
from hicache_runtime.kv.copy_engine import CopyEngine, Event
from hicache_runtime.kv.late_writes import LATE_WRITE_WAIT_S
from hicache_runtime.kv.pools import DeviceKVPool, HostKVPool
from hicache_runtime.telemetry.tracer import Tracer

log = logging.getLogger(__name__)


@dataclass
class CacheOperation:
    """A queued transfer: slots on both sides and the tree nodes it serves."""

    host_slots: torch.Tensor
    device_slots: torch.Tensor
    node_ids: list[int] = field(default_factory=list)


@dataclass
class HiCacheAck:
    """Completion record of one merged transfer, consumed in order by the scheduler."""

    event: Event
    node_ids: list[int]
    tokens: int
    done_at: float | None = None
    """``time.monotonic()`` when this rank first saw its own copy finished: a rank-local
    moment (a lagging copy engine sees it later). Read only by the ``wallclock-lru`` switch."""
    seen_from_step: int = 0
    """The first scheduler step at which this rank may see the transfer finished (a dma-lag
    fault's ``hold``; 0: as soon as it is)."""


class CacheController:
    """Owns the transfer queues of one rank. Scheduler thread only."""

    def __init__(self, device: DeviceKVPool, host: HostKVPool, engine: CopyEngine,
                 tracer: Tracer) -> None:
        self.device = device
        self.host = host
        self._engine = engine
        self.tracer = tracer
        self.write_queue: list[CacheOperation] = []
        self.load_queue: list[CacheOperation] = []
        self.ack_write_queue: list[HiCacheAck] = []
        self.ack_load_queue: list[HiCacheAck] = []
        self._last_load: tuple[Event, int] | None = None

    # --- writes (L1 -> L2) -------------------------------------------------------------------

    def write(self, device_slots: torch.Tensor, host_slots: torch.Tensor, node_id: int) -> None:
        self.write_queue.append(CacheOperation(host_slots, device_slots, [node_id]))

    def start_writing(self) -> None:
        """Launch every queued write as one copy job."""
        if not self.write_queue:
            return
        op = _merge(self.write_queue)
        self.write_queue = []
        event = self._engine.write(self.device, self.host, op.device_slots, op.host_slots)
        self.ack_write_queue.append(HiCacheAck(event, op.node_ids, int(op.host_slots.numel()),
                                               seen_from_step=self._seen_from()))
        self.tracer.emit(Ev.WRITE_SUBMIT, nodes=op.node_ids, tokens=int(op.host_slots.numel()))

    def write_now(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy L1 -> L2 outside the queues and wait for it (write-back eviction: the victim's
        device pages are freed right after). No ack: nothing is left in flight."""
        self._engine.write(self.device, self.host, device_slots, host_slots).synchronize()

    # --- loads (L2 -> L1) --------------------------------------------------------------------

    def load(self, host_slots: torch.Tensor, node_id: int) -> torch.Tensor | None:
        """Reserve device slots for a load-back and queue it; ``None`` when L1 is full."""
        device_slots = self.device.alloc(int(host_slots.numel()))
        if device_slots is None:
            return None
        self.load_queue.append(CacheOperation(host_slots, device_slots, [node_id]))
        return device_slots

    def start_loading(self) -> int | None:
        """Launch queued loads as one job; returns the layer-counter slot the next batch must
        consume. With nothing new queued, that is the slot of a load still copying (started
        earlier, e.g. for a request that was not admitted): a batch may read those pages now
        that they are in the tree, so it must wait for them too (loads finish in order, so
        waiting for the latest covers every earlier one). ``None``: nothing in flight."""
        if not self.load_queue:
            if self._last_load is not None and not self._last_load[0].query():
                return self._last_load[1]
            return None
        op = _merge(self.load_queue)
        self.load_queue = []
        self._reading(op.host_slots)
        event, slot = self._engine.load(self.host, self.device, op.host_slots, op.device_slots,
                                       self.device.layer_counter)
        self.ack_load_queue.append(HiCacheAck(event, op.node_ids, int(op.host_slots.numel()),
                                              seen_from_step=self._seen_from()))
        self._last_load = (event, slot)
        self.tracer.emit(Ev.LOAD_SUBMIT, nodes=op.node_ids, tokens=int(op.host_slots.numel()),
                         counter_slot=slot)
        return slot

    def _reading(self, host_slots: torch.Tensor) -> None:
        """A late write pending on a page this load reads lands now, so that the load reads
        it (``kv/late_writes.py``; only the ``abort-frees-in-flight`` legacy switch arms
        any)."""
        late = self.host.late_writes
        if not late.armed:
            return
        ps = self.host.page_size
        pages = set((host_slots[::ps] // ps).tolist())
        if not late.reading(pages, LATE_WRITE_WAIT_S):
            log.warning("a late write armed on host pages %s was not posted within %g s; "
                        "the load-back reads them without it", sorted(pages), LATE_WRITE_WAIT_S)

    # --- acks -------------------------------------------------------------------------------

    def _seen_from(self) -> int:
        hold = self._engine.hold
        return self.tracer.step + hold() if hold is not None else 0

    def release_holds(self) -> None:
        """Let every held ack count as soon as its transfer has finished (the end-of-run drain,
        where no step comes to pass a hold)."""
        for ack in (*self.ack_write_queue, *self.ack_load_queue):
            ack.seen_from_step = 0

    def ready_count(self, acks: list[HiCacheAck]) -> int:
        """Leading acks whose transfer has completed (a rank-local, physically timed number;
        an ack held by a dma-lag fault counts from its ``seen_from_step`` on)."""
        n = 0
        for ack in acks:
            if self.tracer.step < ack.seen_from_step or not ack.event.query():
                break
            if ack.done_at is None:
                ack.done_at = time.monotonic()
            n += 1
        return n

    @staticmethod
    def pop_ack(acks: list[HiCacheAck]) -> HiCacheAck:
        """Consume the oldest ack, waiting for its transfer if this rank is behind."""
        ack = acks.pop(0)
        ack.event.synchronize()
        if ack.done_at is None:  # consumed before this rank's own query saw it finish
            ack.done_at = time.monotonic()
        return ack

    def shutdown(self) -> None:
        """Finish the copies in flight and stop the copy engine."""
        self._engine.shutdown()

    def in_flight(self) -> dict[str, int]:
        return {
            "write_queue": len(self.write_queue), "load_queue": len(self.load_queue),
            "ack_write_queue": len(self.ack_write_queue),
            "ack_load_queue": len(self.ack_load_queue),
        }


def _merge(ops: list[CacheOperation]) -> CacheOperation:
    if len(ops) == 1:
        return ops[0]
    return CacheOperation(
        torch.cat([o.host_slots for o in ops]),
        torch.cat([o.device_slots for o in ops]),
        [nid for o in ops for nid in o.node_ids],
    )
