"""Page payloads: one host page of K and V as bytes, and back into a host pool.

A payload is a 32-byte layout header followed by K then V, each ``[layers, page_size, heads,
head_dim]`` in the pool's dtype, C-contiguous. The header records the layout (dtype, sizes and
which layers/heads of the model this rank owns), and :meth:`PageCodec.decode` rejects a payload
whose layout differs from the reader's. That matters because a key only says *which prefix*;
the header says *which slice of the KV*: e.g. with shared (MLA-style) keys and a head-sharded
model, another TP rank's page has the same key but different heads, and must not be served.

Integrity (checksums, truncation) is the envelope's job (``envelope.py``, applied by every
backend); this module only deals with layout. ``PageCodec`` is immutable and thread-safe; the
pool methods read or write the pool tensors named in their docstrings and nothing else.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache_runtime.contracts.errors import CorruptPage
from hicache_runtime.kv.pools import KVPool, KVShape

_MAGIC = b"HKVP"
_VERSION = 1
_HEADER = struct.Struct("<4sHBx6I")
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

    def header(self) -> bytes:
        if self.dtype not in _DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} has no page payload code")
        return _HEADER.pack(_MAGIC, _VERSION, _DTYPE_CODES[self.dtype], self.num_layers,
                            self.num_heads, self.head_dim, self.page_size, self.layer_start,
                            self.head_start)


def describe_header(payload: bytes) -> str:
    """A readable account of a payload's header, for error messages."""
    if len(payload) < HEADER_SIZE:
        return f"{len(payload)} bytes (shorter than a header)"
    magic, version, code, layers, heads, dim, ps, l0, h0 = _HEADER.unpack_from(payload)
    if magic != _MAGIC:
        return f"bad magic {magic!r}"
    dtype = _CODE_DTYPES.get(code, f"code {code}")
    return (f"v{version} {dtype} layers {l0}+{layers} heads {h0}+{heads} head_dim {dim} "
            f"page_size {ps}")


class PageCodec:
    """Encodes and decodes the pages of one layout. Immutable after construction."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self._header = layout.header()
        self._size = layout.payload_bytes

    @classmethod
    def for_pool(cls, pool: KVPool, *, layer_start: int = 0, head_start: int = 0) -> PageCodec:
        return cls(PageLayout.of(pool.shape, pool.page_size, layer_start=layer_start,
                                 head_start=head_start))

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
        k = raw[:n].view(self.layout.dtype).reshape(self.layout.page_dims)
        v = raw[n:].view(self.layout.dtype).reshape(self.layout.page_dims)
        return k, v

    def check(self, payload: bytes) -> None:
        """Raise :class:`CorruptPage` unless ``payload`` fits this codec's layout."""
        if len(payload) != self._size or payload[:HEADER_SIZE] != self._header:
            raise CorruptPage(
                f"page layout mismatch: payload has {describe_header(payload)} "
                f"({len(payload)} bytes), reader wants {describe_header(self._header)} "
                f"({self._size} bytes)"
            )

    def fits(self, payload: bytes) -> bool:
        """Whether ``payload`` fits this codec's layout (no exception)."""
        return len(payload) == self._size and payload[:HEADER_SIZE] == self._header

    # --- pool pages -------------------------------------------------------------------------

    def read_pages(self, pool: KVPool, slots: torch.Tensor) -> list[bytes]:
        """Payloads of the pages whose slots are ``slots`` (a multiple of ``page_size`` long,
        page-aligned runs as the allocator hands out). Reads the pool; mutates nothing.

        The caller must keep the pages from being freed and reused while this runs (the
        backup path protects host pages until its ack).
        """
        npages = self._npages(slots)
        if npages == 0:
            return []
        k, v = pool.read_pages(slots)  # [layers, npages * page_size, heads, dim] copies
        ps = self.layout.page_size
        return [self.encode(k[:, i * ps : (i + 1) * ps].contiguous(),
                            v[:, i * ps : (i + 1) * ps].contiguous()) for i in range(npages)]

    def write_pages(self, pool: KVPool, slots: torch.Tensor, payloads: Sequence[bytes]) -> None:
        """Write one payload per page into ``slots`` of ``pool`` (its K and V tensors).

        Every payload is checked first; on a mismatch :class:`CorruptPage` is raised and the
        pool is left untouched. The caller owns ``slots`` (allocated, not visible to readers
        until it publishes them).
        """
        npages = self._npages(slots)
        if npages != len(payloads):
            raise ValueError(f"{npages} pages of slots but {len(payloads)} payloads")
        if npages == 0:
            return
        decoded = [self.decode(p) for p in payloads]
        k = torch.cat([d[0] for d in decoded], dim=1)
        v = torch.cat([d[1] for d in decoded], dim=1)
        pool.write_pages(slots, k, v)

    def _npages(self, slots: torch.Tensor) -> int:
        n = int(slots.numel())
        if n % self.layout.page_size:
            raise ValueError(f"{n} slots is not a whole number of {self.layout.page_size}-slot "
                             f"pages")
        return n // self.layout.page_size


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
