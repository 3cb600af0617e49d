"""KV pools: the device pool (L1) and the host pool (L2).

Both hold K and V for this rank's layers (its PP stage) and heads (its TP shard), and hand out
page-aligned slots through a :class:`PageAllocator`. The device pool keeps them as ``[layers,
slots, heads, head_dim]`` (what attention reads); the host pool in its memory layout
(``layer_first``, ``page_first`` or ``page_first_direct``, see :mod:`.layouts`).

Index ranges of one request's KV, by tier::

    token positions   0 ............ prefix_len ............ kv_len
    device slots      [ tree-owned (locked) ][ request-owned     ]
    host slots        [ tree host copies    ]  (none: not in the tree yet)

The device pool serves attention: ``get_kv`` waits on the layer-done counter of the batch being
run, so a load-back overlaps with compute (SGLang's per-layer load barrier).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache_runtime.kv.allocator import PageAllocator
from hicache_runtime.kv.copy_engine import LayerDoneCounter
from hicache_runtime.kv.late_writes import LateWrites
from hicache_runtime.kv.layouts import LAYER_FIRST, buffer_shape, check_layout, page_view

_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True)
class KVShape:
    """Per-rank KV geometry: this stage's layers and this TP rank's heads, plus the sidecar
    pools a hybrid model keeps next to K and V (per slot, same page layout):

    * ``all_pages``: a KV-derived per-token value (a DSA-indexer-like key, one per head);
      every page of a prefix needs its own.
    * ``trailing_pages``: a per-page recurrent state (Mamba/SWA-like, one vector per head),
      stored at the slot of the page's last token; continuing a prefix needs the state of
      its last page.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    sidecars: tuple[str, ...] = ()

    def aux_dims(self, name: str) -> tuple[int, ...]:
        """Per-slot shape of sidecar pool ``name``."""
        return (self.num_heads,) if name == ALL_PAGES else (self.num_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K, V and sidecar bytes one token occupies on this rank (differs per PP stage)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.num_heads * self.head_dim + sum(
            math.prod(self.aux_dims(n)) for n in self.sidecars)
        return self.num_layers * per_layer * elem


ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"


class KVPool:
    """K/V buffers plus a page allocator. Subclasses fix where the memory lives.

    ``k``, ``v`` and ``aux[name]`` are the buffers as laid out in memory (``layout``); the
    ``read_*``/``write_*`` methods and :meth:`page_view` give the same values in a fixed order
    whatever the layout."""

    def __init__(self, shape: KVShape, capacity_tokens: int, page_size: int, name: str,
                 device: torch.device, pin: bool = False, layout: str = LAYER_FIRST) -> None:
        check_layout(layout)
        self.shape = shape
        self.page_size = page_size
        self.name = name
        self.device = device
        self.layout = layout

        def buffer(slot: tuple[int, ...]) -> torch.Tensor:
            dims = buffer_shape(layout, shape.num_layers, capacity_tokens, page_size, slot)
            return torch.zeros(dims, dtype=shape.dtype, device=device, pin_memory=pin)

        self.k = buffer((shape.num_heads, shape.head_dim))
        self.v = buffer((shape.num_heads, shape.head_dim))
        self.aux: dict[str, torch.Tensor] = {
            name: buffer(shape.aux_dims(name)) for name in shape.sidecars}
        self.allocator = PageAllocator(capacity_tokens // page_size, page_size, name)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity_tokens

    @property
    def available_tokens(self) -> int:
        return self.allocator.available_tokens

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        return self.allocator.alloc(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def page_view(self, buf: torch.Tensor) -> torch.Tensor:
        """One of this pool's buffers as ``[layers, pages, page_size, *slot]`` (no copy)."""
        return page_view(buf, self.layout, self.page_size)

    def read_pages(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V for ``slots`` across all layers: ``[layers, n, heads, dim]`` copies."""
        return self._gather(self.k, slots), self._gather(self.v, slots)

    def write_pages(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._scatter(self.k, slots, k)
        self._scatter(self.v, slots, v)

    def read_aux(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Sidecar ``name`` for ``slots`` across all layers (a copy)."""
        return self._gather(self.aux[name], slots)

    def write_aux(self, name: str, slots: torch.Tensor, data: torch.Tensor) -> None:
        self._scatter(self.aux[name], slots, data)

    def _gather(self, buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        idx = slots.to(self.device)
        if self.layout == LAYER_FIRST:
            return buf.index_select(1, idx)
        return self.page_view(buf)[:, idx // self.page_size, idx % self.page_size]

    def _scatter(self, buf: torch.Tensor, slots: torch.Tensor, data: torch.Tensor) -> None:
        idx = slots.to(self.device)
        if self.layout == LAYER_FIRST:
            buf.index_copy_(1, idx, data.to(self.device))
        else:
            view = self.page_view(buf)
            view[:, idx // self.page_size, idx % self.page_size] = data.to(self.device)


class DeviceKVPool(KVPool):
    """L1: the pool attention reads. ``consumer`` is the layer-counter slot of the running batch."""

    def __init__(self, shape: KVShape, capacity_tokens: int, page_size: int,
                 device: torch.device) -> None:
        super().__init__(shape, capacity_tokens, page_size, "device", device)
        self.layer_counter = LayerDoneCounter(shape.num_layers)
        self.consumer: int | None = None
        self.on_layer_wait: Callable[[int, int, int], None] | None = None
        """Called with (layer, start ns, end ns) for every layer read of a batch whose
        load-back was pending when it was formed: how long attention waited for that layer
        (0 when it had landed)."""
        """Called with (layer, wait start ns, wait end ns) when attention had to wait."""

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write freshly computed K/V of one layer into ``slots`` (an indexed assignment, as
        SGLang's ``set_kv_buffer``: a batch that disagrees with ``slots`` fails with torch's
        "shape mismatch: value tensor of shape ... cannot be broadcast" error)."""
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def set_aux(self, name: str, layer: int, slots: torch.Tensor, data: torch.Tensor) -> None:
        self.aux[name][layer][slots] = data

    def get_aux(self, name: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Sidecar values of one layer (call after ``get_kv``: same load-back barrier)."""
        return self.aux[name][layer].index_select(0, slots)

    def get_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of one layer for ``slots``; first waits until a pending load-back has landed."""
        if self.consumer is not None:
            if self.layer_counter.is_done(self.consumer, layer):
                self.layer_counter.wait_until(self.consumer, layer)  # GPU: stream wait
                if self.on_layer_wait is not None:  # read while the batch's load-back ran:
                    now = time.monotonic_ns()  # a wait of 0, still an overlap to show
                    self.on_layer_wait(layer, now, now)
            else:
                t0 = time.monotonic_ns()
                self.layer_counter.wait_until(self.consumer, layer)
                if self.on_layer_wait is not None:
                    self.on_layer_wait(layer, t0, time.monotonic_ns())
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)


class HostKVPool(KVPool):
    """L2: pinned host memory when a GPU is present, in the memory layout asked for
    (``cache.mem_layout``). Allocation may be failed by a fault."""

    def __init__(self, shape: KVShape, capacity_tokens: int, page_size: int, pin: bool,
                 alloc_fault: Callable[[int], bool] | None = None,
                 layout: str = LAYER_FIRST) -> None:
        super().__init__(shape, capacity_tokens, page_size, "host", torch.device("cpu"), pin,
                         layout)
        self._alloc_fault = alloc_fault
        self.late_writes = LateWrites()
        """Pages a late writer still holds after they were freed (``kv/late_writes.py``)."""

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        if self._alloc_fault is not None and self._alloc_fault(num_tokens):
            return None
        return self.allocator.alloc(num_tokens)
