"""Page payloads: one host page of K and V as bytes, and back into a host pool.

A payload is a 32-byte layout header followed by K then V of one page in the pool's dtype,
each C-contiguous in one of two orders: layer-major ``[layers, page_size, heads, head_dim]``
(what a ``layer_first`` or ``page_first_direct`` host pool holds per page) or token-major
``[page_size, layers, heads, head_dim]`` (a ``page_first`` pool's page block). The header records
the order and the layout (dtype, sizes and which layers/heads of the model this rank owns), and
:meth:`PageCodec.decode` rejects a payload whose layout differs from the reader's. That matters
because a key only says *which prefix*; the header says *which slice of the KV*: e.g. with
shared (MLA-style) keys and a head-sharded model, another TP rank's page has the same key but
different heads, and must not be served. The order is not part of the slice: a payload of
either order is accepted, so a store written by a run with another host layout still serves.

Pages move between a pool and payloads without repacking: a page-major pool's page is one
block per tensor, read into the payload and written back in one copy each; a ``layer_first``
pool's page is one block per layer, joined into the payload and split out of it likewise.

Integrity (checksums, truncation) is the envelope's job (``envelope.py``, applied by every
backend); this module only deals with layout. ``PageCodec`` is immutable and thread-safe; the
pool methods read or write the pool tensors named in their docstrings and nothing else.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hicache_runtime.contracts.errors import CorruptPage
from hicache_runtime.kv.layouts import LAYER_FIRST, page_block, token_major
from hicache_runtime.kv.pools import KVPool, KVShape

_MAGIC = b"HKVP"
_VERSION = 1
#: magic, version, dtype code, order (0 layer-major, 1 token-major), layers, heads, head_dim,
#: page_size, first layer, first head. Payloads from before the order byte have 0 there.
_HEADER = struct.Struct("<4sHBB6I")
HEADER_SIZE = _HEADER.size

#: Stable dtype codes for the header (never renumber).
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4,
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


@dataclass(frozen=True, slots=True)
class PageLayout:
    """What one page payload holds: this rank's slice of the model's KV for one page."""

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    layer_start: int = 0
    """First model layer this rank holds (its PP stage's offset)."""
    head_start: int = 0
    """First attention head this rank holds (its TP shard's offset)."""

    @classmethod
    def of(cls, shape: KVShape, page_size: int, *, layer_start: int = 0,
           head_start: int = 0) -> PageLayout:
        return cls(shape.num_layers, shape.num_heads, shape.head_dim, shape.dtype, page_size,
                   layer_start, head_start)

    @property
    def page_dims(self) -> tuple[int, int, int, int]:
        """Shape of K (and of V) in one page: ``[layers, page_size, heads, head_dim]``."""
        return (self.num_layers, self.page_size, self.num_heads, self.head_dim)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of K (or of V) in one page."""
        n = self.num_layers * self.page_size * self.num_heads * self.head_dim
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def payload_bytes(self) -> int:
        """Total payload size: header + K + V."""
        return HEADER_SIZE + 2 * self.tensor_bytes

    def header(self, token_major: bool = False) -> bytes:
        """The header of a payload of this layout in either order."""
        if self.dtype not in _DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} has no page payload code")
        return _HEADER.pack(_MAGIC, _VERSION, _DTYPE_CODES[self.dtype], int(token_major),
                            self.num_layers, self.num_heads, self.head_dim, self.page_size,
                            self.layer_start, self.head_start)


def describe_header(payload: bytes) -> str:
    """A readable account of a payload's header, for error messages."""
    if len(payload) < HEADER_SIZE:
        return f"{len(payload)} bytes (shorter than a header)"
    magic, version, code, order, layers, heads, dim, ps, l0, h0 = _HEADER.unpack_from(payload)
    if magic != _MAGIC:
        return f"bad magic {magic!r}"
    dtype = _CODE_DTYPES.get(code, f"code {code}")
    orders = {0: "", 1: " token-major"}
    return (f"v{version} {dtype} layers {l0}+{layers} heads {h0}+{heads} head_dim {dim} "
            f"page_size {ps}{orders.get(order, f' order {order}')}")


class PageCodec:
    """Encodes and decodes the pages of one layout. Immutable after construction.

    ``token_major`` is the order of the payloads it writes (:meth:`for_pool` picks the pool's
    own); it reads payloads of either order."""

    def __init__(self, layout: PageLayout, token_major: bool = False) -> None:
        self.layout = layout
        self.token_major = token_major
        self._header = layout.header(token_major)
        self._other_header = layout.header(not token_major)
        self._size = layout.payload_bytes

    @classmethod
    def for_pool(cls, pool: KVPool, *, layer_start: int = 0, head_start: int = 0) -> PageCodec:
        return cls(PageLayout.of(pool.shape, pool.page_size, layer_start=layer_start,
                                 head_start=head_start), token_major(pool.layout))

    @property
    def payload_bytes(self) -> int:
        """Size of every payload this codec encodes or accepts."""
        return self._size

    # --- one page ---------------------------------------------------------------------------

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> bytes:
        """Payload of one page; ``k``/``v`` are ``[layers, page_size, heads, head_dim]``."""
        dims = self.layout.page_dims
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != dims or t.dtype != self.layout.dtype:
                raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}, layout wants "
                                 f"{dims} {self.layout.dtype}")
        if self.token_major:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        return b"".join((self._header, _raw(k), _raw(v)))

    def decode(self, payload: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one page (fresh tensors, ``[layers, page_size, heads, head_dim]``).

        Raises :class:`CorruptPage` when the payload's layout is not this codec's, or its
        size is wrong; the caller treats that page as a miss.
        """
        self.check(payload)
        n = self.layout.tensor_bytes
        # bytearray: torch.frombuffer wants a writable buffer, and the copy detaches the
        # tensors from the payload object.
        raw = torch.frombuffer(bytearray(memoryview(payload)[HEADER_SIZE:]), dtype=torch.uint8)
        dims = self.layout.page_dims
        if payload[:HEADER_SIZE] == _token_major_header(self):
            stored = (dims[1], dims[0], *dims[2:])
            k = raw[:n].view(self.layout.dtype).reshape(stored).transpose(0, 1).contiguous()
            v = raw[n:].view(self.layout.dtype).reshape(stored).transpose(0, 1).contiguous()
            return k, v
        return (raw[:n].view(self.layout.dtype).reshape(dims),
                raw[n:].view(self.layout.dtype).reshape(dims))

    def check(self, payload: bytes) -> None:
        """Raise :class:`CorruptPage` unless ``payload`` fits this codec's layout."""
        if not self.fits(payload):
            raise CorruptPage(
                f"page layout mismatch: payload has {describe_header(payload)} "
                f"({len(payload)} bytes), reader wants {describe_header(self._header)} "
                f"({self._size} bytes)"
            )

    def fits(self, payload: bytes) -> bool:
        """Whether ``payload`` fits this codec's layout, in either order (no exception)."""
        if len(payload) != self._size:
            return False
        head = payload[:HEADER_SIZE]
        return head == self._header or head == self._other_header

    # --- pool pages -------------------------------------------------------------------------

    def read_pages(self, pool: KVPool, slots: torch.Tensor) -> list[bytes]:
        """Payloads of the pages whose slots are ``slots`` (a multiple of ``page_size`` long,
        page-aligned runs as the allocator hands out). Reads the pool; mutates nothing.

        Each payload is joined from the page's blocks in the pool (one copy of the bytes).
        The caller must keep the pages from being freed and reused while this runs (the
        backup path protects host pages until its ack).
        """
        pages = self._pages(slots)
        return [b"".join((self._header, *self._blocks(pool, pool.k, page),
                          *self._blocks(pool, pool.v, page))) for page in pages]

    def write_pages(self, pool: KVPool, slots: torch.Tensor, payloads: Sequence[bytes]) -> None:
        """Write one payload per page into ``slots`` of ``pool`` (its K and V tensors).

        Every payload is checked first; on a mismatch :class:`CorruptPage` is raised and the
        pool is left untouched. The caller owns ``slots`` (allocated, not visible to readers
        until it publishes them). Each tensor of a page is copied once, from the payload into
        its place (transposed on the way when the payload's order is not the pool's).
        """
        pages = self._pages(slots)
        if len(pages) != len(payloads):
            raise ValueError(f"{len(pages)} pages of slots but {len(payloads)} payloads")
        for p in payloads:
            self.check(p)
        n = self.layout.tensor_bytes
        tm_header = _token_major_header(self)
        for page, payload in zip(pages, payloads):
            payload_tm = payload[:HEADER_SIZE] == tm_header
            for i, buf in enumerate((pool.k, pool.v)):
                raw = np.frombuffer(payload, dtype=np.uint8, count=n,
                                    offset=HEADER_SIZE + i * n)
                np.copyto(_page_bytes(pool, buf, page), self._as_layer_major(raw, payload_tm))

    def _pages(self, slots: torch.Tensor) -> list[int]:
        n = int(slots.numel())
        ps = self.layout.page_size
        if n % ps:
            raise ValueError(f"{n} slots is not a whole number of {ps}-slot pages")
        return (slots[::ps] // ps).tolist()

    def _blocks(self, pool: KVPool, buf: torch.Tensor, page: int) -> list[memoryview]:
        """One tensor of one page in this codec's order, as contiguous byte blocks of the pool
        (copied into one block only when the pool keeps the page in the other order)."""
        ps = self.layout.page_size
        block = page_block(buf, pool.layout, page, ps)
        if block is not None and token_major(pool.layout) == self.token_major:
            return [_bytes_of(block)]
        if pool.layout == LAYER_FIRST and not self.token_major:
            view = pool.page_view(buf)
            return [_bytes_of(view[layer, page]) for layer in range(view.shape[0])]
        page_lm = pool.page_view(buf)[:, page]
        ordered = page_lm.transpose(0, 1) if self.token_major else page_lm
        return [_bytes_of(ordered.contiguous())]

    def _as_layer_major(self, raw: np.ndarray, payload_token_major: bool) -> np.ndarray:
        """A payload tensor's bytes as ``[layers, page_size, heads, head_dim * elem]``."""
        lay = self.layout
        row = lay.head_dim * torch.empty((), dtype=lay.dtype).element_size()
        if payload_token_major:
            return raw.reshape(lay.page_size, lay.num_layers, lay.num_heads, row).swapaxes(0, 1)
        return raw.reshape(lay.num_layers, lay.page_size, lay.num_heads, row)


def _token_major_header(codec: PageCodec) -> bytes:
    return codec._header if codec.token_major else codec._other_header


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, shared (no copy)."""
    return t.view(torch.uint8).numpy().data.cast("B")


def _page_bytes(pool: KVPool, buf: torch.Tensor, page: int) -> np.ndarray:
    """One page of one of the pool's buffers as ``[layers, page_size, heads, head_dim * elem]``
    bytes, sharing the pool's memory (strided as the layout has it)."""
    return pool.page_view(buf)[:, page].view(torch.uint8).numpy()


def _raw(t: torch.Tensor) -> bytes:
    """The bytes of a tensor in memory order (works for dtypes numpy lacks, e.g. bfloat16)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


_SIDE_MAGIC = b"HSCP"
_SIDE_HEADER = struct.Struct("<4sHBx4I16s")


class SidecarCodec:
    """Pages of one hybrid sidecar pool (``KVPool.aux[name]``: ``[layers, slots, ...]``) as
    payloads, with a header naming the pool and layout so a page of another pool, rank slice
    or shape is rejected like a corrupt one. Immutable and thread-safe."""

    def __init__(self, name: str, layout: PageLayout, slot_dims: tuple[int, ...]) -> None:
        self.name = name
        self.layout = layout
        self.page_dims = (layout.num_layers, layout.page_size, *slot_dims)
        elems = 1
        for d in self.page_dims:
            elems *= d
        self._nbytes = elems * torch.empty((), dtype=layout.dtype).element_size()
        self._header = _SIDE_HEADER.pack(_SIDE_MAGIC, _VERSION, _DTYPE_CODES[layout.dtype],
                                         layout.num_layers, layout.page_size,
                                         layout.layer_start, layout.head_start,
                                         name.encode()[:16].ljust(16, b"\0"))
        self._size = len(self._header) + self._nbytes

    @classmethod
    def for_pool(cls, pool: KVPool, name: str, *, layer_start: int = 0,
                 head_start: int = 0) -> SidecarCodec:
        layout = PageLayout.of(pool.shape, pool.page_size, layer_start=layer_start,
                               head_start=head_start)
        return cls(name, layout, pool.shape.aux_dims(name))

    @property
    def payload_bytes(self) -> int:
        """Size of every payload this codec encodes or accepts."""
        return self._size

    def fits(self, payload: bytes) -> bool:
        return len(payload) == self._size and payload[: len(self._header)] == self._header

    def read_pages(self, pool: KVPool, slots: torch.Tensor) -> list[bytes]:
        """Payloads of the sidecar pages at ``slots`` (whole pages). Reads the pool only."""
        ps = self.layout.page_size
        data = pool.read_aux(self.name, slots)
        return [self._header + _raw(data[:, i * ps : (i + 1) * ps])
                for i in range(int(slots.numel()) // ps)]

    def write_pages(self, pool: KVPool, slots: torch.Tensor, payloads: Sequence[bytes]) -> None:
        """Write one payload per page into ``slots``; every payload is checked first."""
        for p in payloads:
            if not self.fits(p):
                raise CorruptPage(f"sidecar page of {self.name!r} does not fit its layout "
                                  f"({len(p)} bytes)")
        if not payloads:
            return
        n = len(self._header)
        parts = [torch.frombuffer(bytearray(memoryview(p)[n:]), dtype=torch.uint8)
                 .view(self.layout.dtype).reshape(self.page_dims) for p in payloads]
        pool.write_aux(self.name, slots, torch.cat(parts, dim=1))


def max_payload_bytes(*codecs: PageCodec | SidecarCodec) -> int:
    """The largest payload any of ``codecs`` accepts: the read bound to give an L3 backend
    (``make_backend(..., max_payload_bytes=)``), so nothing bigger is ever read from a store."""
    return max(c.payload_bytes for c in codecs)
