"""Copy engine: asynchronous L1<->L2 page copies with completion events.

SGLang copies between the device pool and the pinned host pool on dedicated CUDA streams and
tracks completion with CUDA events; attention waits per layer on a ``LayerDoneCounter`` so a
load-back overlaps with compute. This module offers the same contract on both kinds of machine:

* :class:`CudaCopyEngine` (a GPU is present): a D2H and an H2D stream, ``torch.cuda.Event``.
  Both copy streams first wait for the work already queued on the compute stream, so a write
  reads finished KV and a load never lands under a kernel still using its pages.
* :class:`CpuCopyEngine` (no GPU): one worker thread per direction; :class:`CopyEvent` gives the
  same ``query()`` / ``synchronize()`` semantics as a CUDA event.

Jobs in one direction complete in submission order (a stream is FIFO), which is what the ack
queues rely on: the ready count is the length of the leading run of completed acks.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from hicache_runtime.contracts.errors import InvariantViolation
from hicache_runtime.contracts.events import Ev

if TYPE_CHECKING:
    from hicache_runtime.telemetry.tracer import Tracer

#: Layer-done producer slots; SGLang keeps three so overlap scheduling can run ahead.
LAYER_COUNTER_SLOTS = 3


class Event(Protocol):
    """What acks hold: a CUDA event or a :class:`CopyEvent`."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class CopyEvent:
    """Completion of one CPU copy job. ``query`` never blocks; ``synchronize`` does."""

    __slots__ = ("_done", "error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise InvariantViolation(f"copy job failed: {self.error!r}") from self.error

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


class LayerDoneCounter:
    """Per-layer progress of load-backs, which attention waits on before reading a layer.

    A producer (a load job) takes a slot with :meth:`start_producer` and reports each layer,
    either when the CPU worker finished it (:meth:`layer_done`) or, on a GPU, by handing over the
    CUDA event recorded after that layer (:meth:`set_layer_event`). The batch that consumes the
    slot calls :meth:`wait_until` before attention reads a layer: on the CPU it blocks until the
    layer is there; on a GPU it makes the compute stream wait on the event without blocking the
    host. Layers are stage-local (0 = this stage's first layer).
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._done = [num_layers] * LAYER_COUNTER_SLOTS
        self._events: list[list[torch.cuda.Event | None]] = [
            [None] * num_layers for _ in range(LAYER_COUNTER_SLOTS)
        ]
        self._next = 0
        self._cond = threading.Condition()

    def start_producer(self) -> int:
        """Take the next slot. If its previous load is still copying (loads started with no
        batch consuming them can run ahead), wait for it rather than reuse a live slot."""
        with self._cond:
            slot = self._next
            while self._done[slot] != self.num_layers:
                self._cond.wait()
            self._done[slot] = 0
            self._events[slot] = [None] * self.num_layers
            self._next = (slot + 1) % LAYER_COUNTER_SLOTS
            return slot

    def layer_done(self, slot: int, layer: int) -> None:
        with self._cond:
            self._done[slot] = max(self._done[slot], layer + 1)
            self._cond.notify_all()

    def set_layer_event(self, slot: int, layer: int, event: torch.cuda.Event) -> None:
        with self._cond:
            self._events[slot][layer] = event
            self._done[slot] = max(self._done[slot], layer + 1)
            self._cond.notify_all()

    def finish(self, slot: int) -> None:
        self.layer_done(slot, self.num_layers - 1)

    def wait_until(self, slot: int, layer: int) -> None:
        with self._cond:
            while self._done[slot] <= layer:
                self._cond.wait()
            event = self._events[slot][layer]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def is_done(self, slot: int, layer: int) -> bool:
        return self._done[slot] > layer


class KVBuffers(Protocol):
    """What the copy engine reads and writes: K and V shaped [layers, slots, heads, dim], and
    sidecar tensors shaped [layers, slots, ...] moved with the same slots."""

    k: torch.Tensor
    v: torch.Tensor
    aux: dict[str, torch.Tensor]


@dataclass
class CopyJob:
    """One merged transfer. ``layer_slot`` is set for loads that report per-layer progress."""

    src: KVBuffers
    dst: KVBuffers
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    event: CopyEvent
    counter: LayerDoneCounter | None = None
    layer_slot: int | None = None
    label: str = ""


LagFn = Callable[[], float]
"""Returns seconds to delay a job's completion (the dma-lag fault); 0 when not armed."""


class CopyEngine(ABC):
    """Submit L1<->L2 copies; each returns an event. Jobs per direction finish in order."""

    page_size: int

    @abstractmethod
    def write(self, device: KVBuffers, host: KVBuffers, device_slots: torch.Tensor,
              host_slots: torch.Tensor) -> Event:
        """Copy every layer of ``device_slots`` to ``host_slots`` (L1 -> L2)."""

    @abstractmethod
    def load(self, host: KVBuffers, device: KVBuffers, host_slots: torch.Tensor,
             device_slots: torch.Tensor, counter: LayerDoneCounter) -> tuple[Event, int]:
        """Copy L2 -> L1 layer by layer; returns the event and the layer-counter slot."""

    @abstractmethod
    def shutdown(self) -> None:
        """Finish queued jobs and stop workers."""


class CpuCopyEngine(CopyEngine):
    """Worker threads standing in for the D2H and H2D streams."""

    def __init__(self, page_size: int, tracer: Tracer | None = None,
                 lag: LagFn | None = None) -> None:
        self.page_size = page_size
        self._tracer = tracer
        self._lag = lag
        self._queues: dict[str, queue.Queue[CopyJob | None]] = {}
        self._threads: list[threading.Thread] = []
        for direction in ("d2h", "h2d"):
            q: queue.Queue[CopyJob | None] = queue.Queue()
            t = threading.Thread(target=self._worker, args=(q,), name=f"hicache-copy-{direction}",
                                 daemon=True)
            self._queues[direction] = q
            self._threads.append(t)
            t.start()

    def write(self, device: KVBuffers, host: KVBuffers, device_slots: torch.Tensor,
              host_slots: torch.Tensor) -> CopyEvent:
        job = CopyJob(device, host, device_slots, host_slots, CopyEvent(), label="d2h")
        self._queues["d2h"].put(job)
        return job.event

    def load(self, host: KVBuffers, device: KVBuffers, host_slots: torch.Tensor,
             device_slots: torch.Tensor, counter: LayerDoneCounter) -> tuple[CopyEvent, int]:
        slot = counter.start_producer()
        job = CopyJob(host, device, host_slots, device_slots, CopyEvent(), counter, slot, "h2d")
        self._queues["h2d"].put(job)
        return job.event, slot

    def shutdown(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=5.0)

    def _worker(self, q: queue.Queue[CopyJob | None]) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            t0 = time.monotonic_ns()
            try:
                self._run(job)
            except BaseException as exc:  # surfaced to the waiter by synchronize()
                if job.counter is not None and job.layer_slot is not None:
                    job.counter.finish(job.layer_slot)
                job.event.set(exc)
                continue
            if self._tracer is not None:
                self._tracer.emit(Ev.COPY, dir=job.label, tokens=int(job.src_slots.numel()),
                                  layer_slot=job.layer_slot, t0_ns=t0,
                                  dur_ns=time.monotonic_ns() - t0)
            job.event.set()

    def _run(self, job: CopyJob) -> None:
        lag = self._lag() if self._lag is not None else 0.0
        layers = job.src.k.shape[0]
        runs = page_runs(job.src_slots, job.dst_slots, self.page_size)
        for layer in range(layers):
            copy_layer(job.src, job.dst, layer, job.src_slots, job.dst_slots, runs,
                       self.page_size)
            if job.counter is not None and job.layer_slot is not None:
                if lag:
                    time.sleep(lag / layers)
                job.counter.layer_done(job.layer_slot, layer)
        if job.layer_slot is None and lag:
            time.sleep(lag)


class CudaCopyEngine(CopyEngine):
    """CUDA streams and events; used when the pools live on a GPU."""

    def __init__(self, page_size: int, device: torch.device, tracer: Tracer | None = None,
                 lag: LagFn | None = None) -> None:
        self.page_size = page_size
        self._device = device
        self._tracer = tracer
        self._lag = lag
        self._d2h = torch.cuda.Stream(device=device)
        self._h2d = torch.cuda.Stream(device=device)

    def write(self, device: KVBuffers, host: KVBuffers, device_slots: torch.Tensor,
              host_slots: torch.Tensor) -> torch.cuda.Event:
        runs = page_runs(device_slots, host_slots, self.page_size)
        self._d2h.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._d2h):
            for layer in range(device.k.shape[0]):
                copy_layer(device, host, layer, device_slots, host_slots, runs, self.page_size)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        self._maybe_lag()
        return ev

    def load(self, host: KVBuffers, device: KVBuffers, host_slots: torch.Tensor,
             device_slots: torch.Tensor, counter: LayerDoneCounter) -> tuple[torch.cuda.Event, int]:
        slot = counter.start_producer()
        runs = page_runs(host_slots, device_slots, self.page_size)
        # The copy overwrites device pages that kernels already queued on the compute stream
        # may still read or write (pages freed by eviction and handed straight to this load, a
        # forward still running ahead under overlap). As SGLang's cache controller does in
        # ``start_loading`` (a start event recorded on the compute stream, waited on by the
        # H2D stream), the copy starts only after everything queued there so far.
        start = torch.cuda.Event()
        start.record(torch.cuda.current_stream(self._device))
        self._h2d.wait_event(start)
        with torch.cuda.stream(self._h2d):
            for layer in range(host.k.shape[0]):
                copy_layer(host, device, layer, host_slots, device_slots, runs, self.page_size)
                done = torch.cuda.Event()
                done.record(self._h2d)
                counter.set_layer_event(slot, layer, done)
            ev = torch.cuda.Event()
            ev.record(self._h2d)
        self._maybe_lag()
        return ev, slot

    def shutdown(self) -> None:
        torch.cuda.synchronize(self._device)

    def _maybe_lag(self) -> None:
        if self._lag is not None:
            lag = self._lag()
            if lag:
                self._h2d.synchronize()
                time.sleep(lag)


# --- copying pages --------------------------------------------------------------------------


def page_runs(src: torch.Tensor, dst: torch.Tensor, page_size: int) -> list[tuple[int, int, int]]:
    """Split a page-aligned slot mapping into runs contiguous on both sides.

    Returns ``(src_start, dst_start, length)`` in slots. Allocators hand out consecutive pages
    most of the time, so a transfer is usually a handful of slice copies.
    """
    if src.numel() != dst.numel():
        raise InvariantViolation(f"copy of {src.numel()} slots into {dst.numel()}")
    if src.numel() == 0:
        return []
    sp = src[::page_size].tolist()
    dp = dst[::page_size].tolist()
    runs: list[tuple[int, int, int]] = []
    start_s, start_d, n = sp[0], dp[0], page_size
    for s, d in zip(sp[1:], dp[1:]):
        if s == start_s + n and d == start_d + n:
            n += page_size
        else:
            runs.append((start_s, start_d, n))
            start_s, start_d, n = s, d, page_size
    runs.append((start_s, start_d, n))
    return runs


#: Above this many runs a gather/scatter beats one slice copy per run.
_MAX_SLICE_RUNS = 32


def copy_layer(src: KVBuffers, dst: KVBuffers, layer: int, src_slots: torch.Tensor,
               dst_slots: torch.Tensor, runs: list[tuple[int, int, int]],
               page_size: int) -> None:
    """Copy one layer's K and V for the given slots.

    Few runs: one slice copy per run (a single pass over the bytes). Many runs (a fragmented
    pool): gather whole pages, then scatter them, indexing pages rather than tokens and moving
    them as 8-byte words (index kernels are much faster on int64 than on half floats)."""
    non_blocking = dst.k.device != src.k.device
    pairs = [(src.k[layer], dst.k[layer]), (src.v[layer], dst.v[layer])]
    pairs += [(src.aux[name][layer], dst.aux[name][layer]) for name in src.aux]
    if len(runs) <= _MAX_SLICE_RUNS:
        for s, d, n in runs:
            for s_buf, d_buf in pairs:
                d_buf[d : d + n].copy_(s_buf[s : s + n], non_blocking=non_blocking)
        return
    src_pages = (src_slots[::page_size] // page_size).to(src.k.device)
    dst_pages = (dst_slots[::page_size] // page_size).to(dst.k.device)
    for s_buf, d_buf in pairs:
        s_view, d_view = _page_rows(s_buf, page_size), _page_rows(d_buf, page_size)
        d_view.index_copy_(0, dst_pages, s_view.index_select(0, src_pages).to(d_buf.device))


def _page_rows(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """``buf`` ([slots, ...], contiguous) as one row per page, in int64 words if the page's
    bytes allow it."""
    rows = buf.view(buf.shape[0] // page_size, -1)
    if (rows.shape[1] * rows.element_size()) % 8 == 0:
        return rows.view(torch.int64)
    return rows
