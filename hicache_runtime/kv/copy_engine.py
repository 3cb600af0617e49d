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

The host pool may be in any memory layout (:mod:`.layouts`); the device pool is layer-first.
Both are indexed through their page views (``[layers, pages, page_size, ...]``), and a job's page
mapping is worked out once (:class:`PagePlan`): pages contiguous on both sides are coalesced
into runs copied with one slice copy each; otherwise one vectorised index copy per run of one
side; only a mapping scattered on both sides in small pages goes through a cache-sized staging
buffer (a gather, then a scatter). A load lands layer by layer, except that from a page-major
host pool it lands its first layer alone and the others together (:func:`landing_groups`).
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import torch

from hicache_runtime.contracts.errors import InvariantViolation
from hicache_runtime.contracts.events import Ev
from hicache_runtime.kv.layouts import LAYER_FIRST, PAGE_FIRST, page_view

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
    """What the copy engine reads and writes: K, V and sidecar buffers (``aux``, moved with the
    same slots) laid out as ``layout`` says (see :mod:`.layouts`)."""

    k: torch.Tensor
    v: torch.Tensor
    aux: dict[str, torch.Tensor]
    layout: str


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

HoldFn = Callable[[], int]
"""Returns scheduler steps before this rank's scheduler may see a job finished (the dma-lag
fault's ``hold``); 0 when none fires. Unlike a lag in time, a hold in steps is the same however
slow the machine runs, so what it reorders does not depend on load."""


class CopyEngine(ABC):
    """Submit L1<->L2 copies; each returns an event. Jobs per direction finish in order."""

    page_size: int
    hold: HoldFn | None = None
    """Scheduler steps this rank's scheduler is kept from seeing a job finished, asked once per
    job at submission (the dma-lag fault's ``hold``); None when no such fault is armed."""

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
        layers = job.src.k.shape[_layer_dim(job.src.layout)]
        plan = PagePlan(job.src_slots, job.dst_slots, self.page_size)
        if job.counter is None or job.layer_slot is None:  # a write
            for group in write_groups(job.dst.layout, layers):
                copy_layers(job.src, job.dst, group, plan, self.page_size)
            if lag:
                time.sleep(lag)
            return
        for group in landing_groups(job.src.layout, layers):
            if len(group) == 1:
                copy_layer(job.src, job.dst, group.start, job.src_slots, job.dst_slots, plan,
                           self.page_size)
            else:
                copy_layers(job.src, job.dst, group, plan, self.page_size)
            if lag:
                time.sleep(lag * len(group) / layers)
            job.counter.layer_done(job.layer_slot, group.stop - 1)


class CudaCopyEngine(CopyEngine):
    """CUDA streams and events; used when the pools live on a GPU.

    Every transfer between host and device memory is a block contiguous on both sides (an
    asynchronous DMA from or to pinned memory); pages are gathered and scattered on the GPU,
    where indexing is cheap, around DMAs of host runs (host pages consecutive in the job). A
    ``page_first``/``page_first_direct`` host page is one block holding every layer, so a load
    moves each host run in one DMA, then lands layer by layer with one scatter kernel per layer
    (an event each). A ``layer_first`` host pool moves layer by layer. When the host pages lie
    in many runs they go through pinned staging instead of one small DMA per run: gathered on
    the CPU for a load; scattered there, once the DMA has landed, for a ``layer_first`` write.
    """

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
        plan = PagePlan(host_slots, device_slots, self.page_size)  # src side: the host
        self._d2h.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._d2h):
            dev_pages = plan.dst.to(self._device)
            for dev_buf, host_buf in _buffer_pairs(device, host):
                dev = page_view(dev_buf, device.layout, self.page_size)
                self._write_buffer(dev.index_select(1, dev_pages), host_buf, host.layout, plan)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        self._maybe_lag()
        return ev

    def load(self, host: KVBuffers, device: KVBuffers, host_slots: torch.Tensor,
             device_slots: torch.Tensor, counter: LayerDoneCounter) -> tuple[torch.cuda.Event, int]:
        slot = counter.start_producer()
        plan = PagePlan(host_slots, device_slots, self.page_size)
        # The copy overwrites device pages that kernels already queued on the compute stream
        # may still read or write (pages freed by eviction and handed straight to this load, a
        # forward still running ahead under overlap). As SGLang's cache controller does in
        # ``start_loading`` (a start event recorded on the compute stream, waited on by the
        # H2D stream), the copy starts only after everything queued there so far.
        start = torch.cuda.Event()
        start.record(torch.cuda.current_stream(self._device))
        self._h2d.wait_event(start)
        with torch.cuda.stream(self._h2d):
            dev_pages = plan.dst.to(self._device)
            pairs = [(h, page_view(d, device.layout, self.page_size))
                     for d, h in _buffer_pairs(device, host)]
            if host.layout == LAYER_FIRST:
                pinned = [self._pin_scattered(h, host.layout, plan) for h, _ in pairs]
                for layer in range(device.k.shape[0]):
                    for (h, dev), staged in zip(pairs, pinned):
                        self._load_layer(h, dev, layer, plan, dev_pages, staged)
                    counter.set_layer_event(slot, layer, self._record())
            else:
                fetched = [self._fetch(h, host.layout, plan) for h, _ in pairs]
                for layer in range(device.k.shape[0]):
                    for (_, dev), pages in zip(pairs, fetched):
                        dev[layer].index_copy_(0, dev_pages, pages[layer])
                    counter.set_layer_event(slot, layer, self._record())
            ev = self._record()
        self._maybe_lag()
        return ev, slot

    def shutdown(self) -> None:
        torch.cuda.synchronize(self._device)

    def _write_buffer(self, gathered: torch.Tensor, host_buf: torch.Tensor, layout: str,
                      plan: PagePlan) -> None:
        """Move ``gathered`` (the job's device pages, ``[L, n, ps, ...]`` in job order) into the
        plan's host pages of ``host_buf``."""
        runs = plan.src_job_runs
        if layout == LAYER_FIRST:
            host = page_view(host_buf, layout, self.page_size)
            if len(runs) > _MAX_DMA_RUNS:
                # One DMA into pinned staging, then a scatter on the CPU once it has landed.
                staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                staging.copy_(gathered, non_blocking=True)
                self._d2h.synchronize()
                copy_pages(staging, host, PagePlan.of_pages(torch.arange(plan.pages), plan.src))
                return
            for h0, off, n in runs:
                for layer in range(gathered.shape[0]):
                    host[layer, h0 : h0 + n].copy_(gathered[layer, off : off + n],
                                                   non_blocking=True)
            return
        # Page-major host: lay the pages out as host blocks on the GPU, one DMA per host run.
        blocks = _blocks_like(host_buf, layout, plan.pages, self.page_size, self._device)
        page_view(blocks, layout, self.page_size).copy_(gathered)
        for h0, off, n in runs:
            _run_block(host_buf, layout, h0, n, self.page_size).copy_(
                _run_block(blocks, layout, off, n, self.page_size), non_blocking=True)

    def _pin_scattered(self, host_buf: torch.Tensor, layout: str,
                       plan: PagePlan) -> torch.Tensor | None:
        """The plan's host pages gathered on the CPU into pinned staging (every layer, as
        ``[L, n, ps, ...]`` in job order) when they lie in too many runs to DMA one by one;
        else None."""
        if len(plan.src_job_runs) <= _MAX_DMA_RUNS:
            return None
        host = page_view(host_buf, layout, self.page_size)
        staging = torch.empty((host.shape[0], plan.pages, *host.shape[2:]), dtype=host.dtype,
                              pin_memory=True)
        copy_pages(host, staging, PagePlan.of_pages(plan.src, torch.arange(plan.pages)))
        return staging

    def _load_layer(self, host_buf: torch.Tensor, dev: torch.Tensor, layer: int,
                    plan: PagePlan, dev_pages: torch.Tensor,
                    staged: torch.Tensor | None) -> None:
        """One layer of a ``layer_first`` host pool into the device pool."""
        host = page_view(host_buf, LAYER_FIRST, self.page_size)
        if staged is not None:
            landed = staged[layer].to(self._device, non_blocking=True)
        elif len(plan.runs) <= _MAX_DMA_RUNS:
            for h0, d0, n in plan.runs:  # contiguous on both sides: straight into place
                dev[layer, d0 : d0 + n].copy_(host[layer, h0 : h0 + n], non_blocking=True)
            return
        else:
            landed = torch.empty((plan.pages, *host.shape[2:]), dtype=host.dtype,
                                 device=self._device)
            for h0, off, n in plan.src_job_runs:
                landed[off : off + n].copy_(host[layer, h0 : h0 + n], non_blocking=True)
        dev[layer].index_copy_(0, dev_pages, landed)

    def _fetch(self, host_buf: torch.Tensor, layout: str, plan: PagePlan) -> torch.Tensor:
        """Every layer of the plan's pages of a page-major host buffer on the device, as
        ``[L, n, ps, ...]`` in job order: one DMA per host run, or one DMA from pinned staging
        when the runs are many."""
        blocks = _blocks_like(host_buf, layout, plan.pages, self.page_size, self._device)
        if len(plan.src_job_runs) <= _MAX_DMA_RUNS:
            for h0, off, n in plan.src_job_runs:
                _run_block(blocks, layout, off, n, self.page_size).copy_(
                    _run_block(host_buf, layout, h0, n, self.page_size), non_blocking=True)
        else:
            pinned = _blocks_like(host_buf, layout, plan.pages, self.page_size,
                                  torch.device("cpu"), pin=True)
            copy_pages(page_view(host_buf, layout, self.page_size),
                       page_view(pinned, layout, self.page_size),
                       PagePlan.of_pages(plan.src, torch.arange(plan.pages)))
            blocks.copy_(pinned, non_blocking=True)
        return page_view(blocks, layout, self.page_size)

    def _record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self._h2d)
        return ev

    def _maybe_lag(self) -> None:
        if self._lag is not None:
            lag = self._lag()
            if lag:
                self._h2d.synchronize()
                time.sleep(lag)


#: Above this many host runs a CUDA transfer goes through pinned staging (one DMA, plus a CPU
#: gather or scatter) rather than one DMA per run.
_MAX_DMA_RUNS = 64


def _blocks_like(host_buf: torch.Tensor, layout: str, pages: int, page_size: int,
                 device: torch.device, pin: bool = False) -> torch.Tensor:
    """An empty page-major buffer of ``pages`` pages shaped like ``host_buf``."""
    if layout == PAGE_FIRST:
        shape = (pages * page_size, *host_buf.shape[1:])
    else:  # page_first_direct
        shape = (pages, *host_buf.shape[1:])
    return torch.empty(shape, dtype=host_buf.dtype, device=device, pin_memory=pin)


def _run_block(buf: torch.Tensor, layout: str, page: int, pages: int,
               page_size: int) -> torch.Tensor:
    """Pages ``[page, page + pages)`` of a page-major buffer: one contiguous block."""
    if layout == PAGE_FIRST:
        return buf[page * page_size : (page + pages) * page_size]
    return buf[page : page + pages]


# --- planning a job -------------------------------------------------------------------------


def page_runs(src: torch.Tensor, dst: torch.Tensor, page_size: int) -> list[tuple[int, int, int]]:
    """Split a page-aligned slot mapping into runs contiguous on both sides.

    Returns ``(src_start, dst_start, length)`` in slots. Allocators hand out consecutive pages
    most of the time, so a transfer is usually a handful of slice copies.
    """
    plan = PagePlan(src, dst, page_size)
    return [(s * page_size, d * page_size, n * page_size) for s, d, n in plan.runs]


def _run_starts(*sides: torch.Tensor) -> list[int]:
    """Positions where a run starts: some side does not continue the previous page by one."""
    n = sides[0].numel()
    brk = torch.zeros(n, dtype=torch.bool)
    brk[0] = True
    for side in sides:
        brk[1:] |= (side[1:] - side[:-1]) != 1
    return brk.nonzero().flatten().tolist()


def _runs(starts: list[int], n: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each run."""
    ends = [*starts[1:], n]
    return [(a, b - a) for a, b in zip(starts, ends)]


class PagePlan:
    """Where one job's pages go, worked out once and used for every buffer and layer.

    ``src``/``dst``: the page of each pair on either side (int64, CPU), in job order.
    ``runs``: ``(src page, dst page, pages)`` contiguous on both sides, in job order. The other
    groupings are computed when first asked for.
    """

    def __init__(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, page_size: int) -> None:
        if src_slots.numel() != dst_slots.numel():
            raise InvariantViolation(f"copy of {src_slots.numel()} slots into "
                                     f"{dst_slots.numel()}")
        self._set(src_slots[::page_size] // page_size, dst_slots[::page_size] // page_size)

    @classmethod
    def of_pages(cls, src: torch.Tensor, dst: torch.Tensor) -> PagePlan:
        plan = cls.__new__(cls)
        plan._set(src, dst)
        return plan

    def _set(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.src = src.to("cpu", torch.int64)
        self.dst = dst.to("cpu", torch.int64)
        self.pages = int(self.src.numel())
        self.runs: list[tuple[int, int, int]] = []
        if self.pages:
            s, d = self.src.tolist(), self.dst.tolist()
            self.runs = [(s[i], d[i], n)
                         for i, n in _runs(_run_starts(self.src, self.dst), self.pages)]

    @cached_property
    def src_job_runs(self) -> list[tuple[int, int, int]]:
        """``(src page, offset, pages)``: stretches of the job whose src pages are consecutive
        (whatever the dst side does), in job order."""
        if not self.pages:
            return []
        s = self.src.tolist()
        return [(s[i], i, n) for i, n in _runs(_run_starts(self.src), self.pages)]

    @cached_property
    def dst_runs(self) -> tuple[list[tuple[int, int, int]], torch.Tensor, torch.Tensor]:
        """Pairs sorted by dst page: ``(dst page, pages, offset)`` of each dst-contiguous run,
        the src pages in that order, and the dst pages in that order."""
        return _side_runs(self.dst, self.src)

    @cached_property
    def src_runs(self) -> tuple[list[tuple[int, int, int]], torch.Tensor, torch.Tensor]:
        """Pairs sorted by src page: ``(src page, pages, offset)`` of each src-contiguous run,
        the dst pages in that order, and the src pages in that order."""
        return _side_runs(self.src, self.dst)


def _side_runs(key: torch.Tensor, other: torch.Tensor
               ) -> tuple[list[tuple[int, int, int]], torch.Tensor, torch.Tensor]:
    order = torch.argsort(key, stable=True)
    key_sorted, other_sorted = key[order], other[order]
    keys = key_sorted.tolist()
    runs = [(keys[i], n, i) for i, n in _runs(_run_starts(key_sorted), len(keys))]
    return runs, other_sorted, key_sorted


def landing_groups(host_layout: str, num_layers: int) -> list[range]:
    """The layer groups a CPU load lands in, in order (each group's layers are reported done
    together once it is copied).

    One layer at a time from a ``layer_first`` pool, where one layer of a run of pages is one
    block. In a page-major pool one layer of a page is a piece of the page's block (one token
    at a time in ``page_first``, one block per page in ``page_first_direct``), and a CPU reads
    pieces spread over every page at a fraction of the bandwidth it reads whole blocks at; so
    the first layer lands alone (attention starts on it) and the rest together."""
    if host_layout != LAYER_FIRST and num_layers > 2:
        return [range(0, 1), range(1, num_layers)]
    return [range(layer, layer + 1) for layer in range(num_layers)]


def write_groups(host_layout: str, num_layers: int) -> list[range]:
    """The layer groups a CPU write copies one after the other: every layer at once into a
    page-major host pool (a host page is one block), one at a time into a ``layer_first`` one
    (each layer of a page is its own block there, far from the others)."""
    if host_layout == LAYER_FIRST:
        return [range(layer, layer + 1) for layer in range(num_layers)]
    return [range(num_layers)]


def _layer_dim(layout: str) -> int:
    """The dimension of a buffer in ``layout`` that counts layers."""
    return 0 if layout == LAYER_FIRST else 1


def _buffer_pairs(src: KVBuffers, dst: KVBuffers) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pairs = [(src.k, dst.k), (src.v, dst.v)]
    pairs += [(src.aux[name], dst.aux[name]) for name in src.aux]
    return pairs


# --- copying pages (CPU) --------------------------------------------------------------------


def copy_layer(src: KVBuffers, dst: KVBuffers, layer: int, src_slots: torch.Tensor,
               dst_slots: torch.Tensor, plan: PagePlan, page_size: int) -> None:
    """Copy one layer's K, V and sidecars for the plan's pages (``src_slots`` -> ``dst_slots``,
    the slots the plan was made from)."""
    copy_layers(src, dst, range(layer, layer + 1), plan, page_size)


def copy_layers(src: KVBuffers, dst: KVBuffers, layers: range, plan: PagePlan,
                page_size: int) -> None:
    """Copy ``layers`` of K, V and sidecars for the plan's pages, whatever the two layouts."""
    part = slice(layers.start, layers.stop)
    for s_buf, d_buf in _buffer_pairs(src, dst):
        copy_pages(page_view(s_buf, src.layout, page_size)[part],
                   page_view(d_buf, dst.layout, page_size)[part], plan)


#: Up to this many runs, one op per run whatever their size.
_MAX_SLICE_RUNS = 32
#: A run at least this large amortises the fixed cost of one copy op (a few microseconds of
#: Python and kernel setup); many smaller runs are batched through staging instead.
_MIN_RUN_BYTES = 64 << 10
#: Transposition block and staging chunk: a few pages that stay in a core's caches.
_BLOCK_BYTES = 2 << 20
#: Pieces at least this large (a memory page) copy at full speed in any order.
_MIN_PIECE_BYTES = 4 << 10

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_scratch = threading.local()


def copy_pages(src: torch.Tensor, dst: torch.Tensor, plan: PagePlan) -> None:
    """Copy the plan's pages between two page views (``[layers, pages, page_size, ...]``, any
    strides, same shape but for the page count), each byte read and written once:

    * few runs contiguous on both sides (what allocators hand out): a slice copy per run,
      a cache-sized block of pages at a time when the two sides order a page differently;
    * the destination in runs: one ``index_select`` into each destination run;
    * the source in runs, the destination scattered: one indexed assignment of whole pages per
      source run; when the sides order a page differently, a transposing copy per run if the
      runs are large enough to amortise an op each, else through a staging buffer that stays
      in cache (the transposition happens there, the pages leave it as whole blocks);
    * scattered on both sides: staging too, a chunk of pages at a time (gathered into the
      buffer, scattered from it), unless the pages are large enough to copy one run each.
    """
    if plan.pages == 0:
        return
    page_bytes = src[:, 0].numel() * src.element_size()
    if len(plan.runs) <= _MAX_SLICE_RUNS:
        _copy_runs(src, dst, plan.runs, page_bytes)
        return
    total = plan.pages * page_bytes

    def few(runs: int) -> bool:
        return runs <= _MAX_SLICE_RUNS or total >= runs * _MIN_RUN_BYTES

    dst_runs, src_by_dst, _ = plan.dst_runs
    src_runs, dst_by_src, _ = plan.src_runs
    if len(dst_runs) <= len(src_runs) and few(len(dst_runs)):
        _gather_runs(src, dst, dst_runs, src_by_dst)
    elif few(len(src_runs)) and not _transposing(src, dst):
        _scatter_runs(src, dst, src_runs, dst_by_src)
    elif _transposing(src, dst) and few(len(plan.runs)):
        # Pages large enough to amortise an op each (a page-major host page is one block of
        # every layer): transposed straight into place, run by run. Staging would cost a
        # second pass (0.56 -> 0.8 of a plain copy for a write into a scattered page_first
        # pool, 128 KiB pages).
        _copy_runs(src, dst, plan.runs, page_bytes)
    elif few(len(src_runs)) or not few(len(dst_runs)):
        _copy_staged(src, dst, plan, page_bytes)
    else:
        _gather_runs(src, dst, dst_runs, src_by_dst)


def _copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]],
               page_bytes: int) -> None:
    # When the two sides order a page's bytes differently (a page_first host pool against the
    # layer-first device pool) the copy is a transposition; done a cache-sized block of pages
    # at a time it keeps streaming reads and writes (about 0.5 -> 0.8 of memcpy on a CPU).
    if not _transposing(src, dst):
        for s0, d0, n in runs:
            dst[:, d0 : d0 + n].copy_(src[:, s0 : s0 + n])
        return
    # Pages first and the rest in the destination's memory order: the copy writes each block
    # sequentially and gathers its pieces (about 0.72 -> 0.8 of memcpy for 128 KiB pages).
    src_pm, dst_pm = _page_major(src, dst)
    block = max(1, _BLOCK_BYTES // page_bytes)
    for s0, d0, n in runs:
        if n == 1:  # most runs of a scattered pool: an index is cheaper than a slice
            dst_pm[d0].copy_(src_pm[s0])
            continue
        for off in range(0, n, block):
            b = min(block, n - off)
            dst_pm[d0 + off : d0 + off + b].copy_(src_pm[s0 + off : s0 + off + b])


def _gather_runs(src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]],
                 src_pages: torch.Tensor) -> None:
    """One ``index_select`` per destination run, straight into the destination. Indexed on a
    leading page dimension: torch's CPU kernel is many times slower indexing an inner one of a
    strided tensor."""
    src_pm, dst_pm = src.transpose(0, 1), dst.transpose(0, 1)
    for d0, n, off in runs:
        if n == 1:
            dst_pm[d0].copy_(src_pm[int(src_pages[off])])
        else:
            torch.index_select(src_pm, 0, src_pages[off : off + n], out=dst_pm[d0 : d0 + n])


def _scatter_runs(src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]],
                  dst_pages: torch.Tensor) -> None:
    """One indexed assignment per source run, straight from the source. numpy's: torch's
    ``index_copy_`` moves one element per index lookup on a CPU, numpy's a whole row."""
    src_pm, dst_pm = _page_major(src, dst)
    s_words, d_words = _as_words(src_pm, dst_pm)
    d_np = d_words.numpy()
    idx = dst_pages.numpy()
    for s0, n, off in runs:
        if n == 1:
            dst_pm[int(dst_pages[off])].copy_(src_pm[s0])
        else:
            d_np[idx[off : off + n]] = s_words[s0 : s0 + n].numpy()


def _copy_staged(src: torch.Tensor, dst: torch.Tensor, plan: PagePlan, page_bytes: int) -> None:
    """Pages scattered on both sides: gather a chunk into a staging buffer that stays in cache,
    scatter it, next chunk (two passes, but the second reads the cache, not memory)."""
    src_pm, dst_pm = _page_major(src, dst)
    chunk = max(1, _BLOCK_BYTES // page_bytes)
    scratch = _scratch_bytes(chunk * page_bytes).view(src.dtype)
    per_page = page_bytes // src.element_size()
    idx = plan.dst.numpy()
    src_pages = plan.src.tolist()
    for i in range(0, plan.pages, chunk):
        m = min(chunk, plan.pages - i)
        stage = scratch[: m * per_page].view(m, *src_pm.shape[1:])
        first = src_pages[i]
        if src_pages[i : i + m] == list(range(first, first + m)):  # one slice copy
            stage.copy_(src_pm[first : first + m])
        else:
            torch.index_select(src_pm, 0, plan.src[i : i + m], out=stage)
        s_words, d_words = _as_words(stage, dst_pm)
        d_words.numpy()[idx[i : i + m]] = s_words.numpy()


def _page_major(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both page views with the page dimension first and the others in ``dst``'s memory order
    (the order an indexed assignment into ``dst`` should walk)."""
    rest = sorted((d for d in range(dst.dim()) if d != 1), key=lambda d: -dst.stride()[d])
    return src.permute(1, *rest), dst.permute(1, *rest)


def _as_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two page-major tensors of one page shape (any page counts), with the dimensions after
    the page merged wherever both are contiguous across them, and their bytes viewed as the
    widest integers that fit: numpy copies an indexed page one innermost row at a time, so the
    fewer and longer the rows the faster."""
    shape, a_st, b_st = list(a.shape), list(a.stride()), list(b.stride())
    i = len(shape) - 1
    while i > 1:
        if a_st[i - 1] == a_st[i] * shape[i] and b_st[i - 1] == b_st[i] * shape[i]:
            shape[i - 1] *= shape[i]
            a_st[i - 1], b_st[i - 1] = a_st[i], b_st[i]
            del shape[i], a_st[i], b_st[i]
        i -= 1
    a2 = a.as_strided([a.shape[0], *shape[1:]], a_st)
    b2 = b.as_strided([b.shape[0], *shape[1:]], b_st)
    for size in (8, 4, 2):
        if size <= a.element_size():
            break
        try:
            return a2.view(_INT_OF_SIZE[size]), b2.view(_INT_OF_SIZE[size])
        except RuntimeError:  # rows not a multiple of the size, or not aligned to it
            continue
    itype = _INT_OF_SIZE[a.element_size()]
    return a2.view(itype), b2.view(itype)


def _transposing(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether the two page views order a page's dimensions differently in memory (as a
    ``page_first`` pool and the device pool do) and the pieces contiguous on both sides at once
    are smaller than ``_MIN_PIECE_BYTES``: a CPU copies such pieces at a fraction of its
    bandwidth unless the copy stays within its caches."""
    def order(t: torch.Tensor) -> list[int]:
        return sorted((d for d in range(t.dim()) if t.shape[d] > 1 and d != 1),
                      key=lambda d: -t.stride()[d])

    dims = order(dst)
    if order(src) == dims:
        return False
    piece, want = dst.element_size(), 1
    for d in reversed(dims):
        if src.stride(d) != want or dst.stride(d) != want:
            break
        piece *= dst.shape[d]
        want *= dst.shape[d]
    return piece < _MIN_PIECE_BYTES


def _scratch_bytes(nbytes: int) -> torch.Tensor:
    """This thread's staging buffer, at least ``nbytes`` long (each copy worker has its own)."""
    buf: torch.Tensor | None = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        _scratch.buf = buf
    return buf[:nbytes]
