"""How a page is stored: this project's checksummed envelope (the default), or the raw bytes
SGLang's own backends write (``storage.format: upstream``), so the tools can work on a store a
deployment wrote and a deployment can read a store the runtime wrote.

Upstream's file backend (``HiCacheFile``, every release read: 0.5.23
``mem_cache/hicache_storage.py`` ``HiCacheFile.set`` L883-927 and ``get`` L846-881; the write side
``cache_controller.py`` ``_generic_page_set`` L1403-1408) stores one file per page,
``<page hash><suffix>.bin``, holding ``get_data_page(...).flatten()`` of the host pool with no
header: K then V, each ``[layers, page_size, heads, head_dim]`` for a ``layer_first`` or
``page_first_direct`` pool, ``[page_size, layers, heads, head_dim]`` for ``page_first``
(0.5.23 ``pool_host/mha.py`` ``get_data_page`` L713-725, ``init_kv_buffer`` L305-339). That is
this project's page payload (``pages.py``) without its 32-byte layout header, so the two convert
by dropping or adding that header. Upstream's Mooncake backend keeps the same bytes as two
objects, K and V, named ``<model>_<page hash>_<tp rank>[_<pp rank>]_k`` / ``_v`` (0.5.23
``storage/mooncake_store/mooncake_store.py`` L630-644, L1313-1335; from a ``page_first`` or
``page_first_direct`` pool only, L1319-1323).

What the raw format gives up, as upstream does: no checksum (a flipped byte is served), and no
layout in the bytes (a reader with another host layout, dtype or head count reads garbage; the
size check catches only a different size). A reader assumes its own pool's order, as
``set_from_flat_data_page`` does (L735-767). Only MHA-style pages without sidecar pools have an
upstream form here: upstream's MLA page is one latent row per token, not a K and a V.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_runtime.contracts.errors import CorruptPage
from hicache_runtime.contracts.l3_backends import StorageFormat
from hicache_runtime.contracts.profiles import release_tuple

__all__ = ["StorageFormat", "UpstreamPages", "mooncake_prefix", "pp_problem"]


@dataclass(frozen=True)
class UpstreamPages:
    """Converts this rank's page payloads to and from upstream's raw page bytes.

    ``header`` is the payload header of this rank's pages in its pool's own order (what a
    read is taken to be; ``pages.PageLayout.header``); ``payload_bytes`` the size of a
    payload with it. Torch-free, like every backend module: the config imports backends."""

    header: bytes
    payload_bytes: int
    key_prefix: str = ""
    """Upstream's Mooncake key prefix: the served model name, ``/`` made ``-`` (0.5.23
    ``mooncake_store.py`` L456-474, ``_tag_keys`` L782-785)."""
    rank_part: str = "0"
    """Upstream's Mooncake rank part of a key: the TP rank, then ``_<pp rank>`` with PP
    (L630-644)."""

    @property
    def raw_bytes(self) -> int:
        """The size of an upstream page file."""
        return self.payload_bytes - len(self.header)

    def to_raw(self, key: str, payload: bytes) -> bytes:
        """The upstream bytes of a payload of this rank's layout (its header dropped). A
        payload of another layout or order raises ``ValueError``: it would be stored as bytes
        that read back as something else."""
        if len(payload) != self.payload_bytes or not payload.startswith(self.header):
            raise ValueError(f"{key}: the page is not in this rank's layout and pool order; "
                             "an upstream page carries no layout to tell")
        return payload[len(self.header):]

    def kv_keys(self, object_key: str) -> tuple[str, str]:
        """The two objects upstream's Mooncake backend keeps a page in: K and V
        (``[<prefix>_]<page hash>_<rank part>_k`` and ``_v``, L1313-1335)."""
        base = f"{object_key[:64]}_{self.rank_part}"
        if self.key_prefix:
            base = f"{self.key_prefix}_{base}"
        return base + "_k", base + "_v"

    def from_raw(self, key: str, raw: bytes) -> bytes:
        """The payload of an upstream page read from the store: this rank's header before its
        bytes. Raises :class:`CorruptPage` when its size is not this rank's page size
        (upstream raises for a short file and truncates a long one; both are misses here)."""
        if len(raw) != self.raw_bytes:
            raise CorruptPage(f"{key}: an upstream page of {len(raw)} bytes; this rank's pages "
                              f"are {self.raw_bytes} (another model, dtype, layout or page "
                              "size wrote it)")
        return self.header + raw


MODEL_PREFIX_SINCE = (0, 5, 17)
"""The first release whose Mooncake keys start with the model name (0.5.20
``mooncake_store.py`` L424-433; 0.5.16's keys have none, L541-545)."""


def pp_problem(backend: str, since: tuple[int, ...], release: str | None, pp: int) -> str | None:
    """Why a release's upstream keys cannot hold a ``pp``-stage run, or None: before
    ``since`` its keys name no pipeline stage (0.5.5: ``hicache_storage.py`` L182-186,
    ``mooncake_store.py`` L280-295), so the stages would write one object."""
    if pp > 1 and release_tuple(release) < since:
        return f"SGLang {release}'s {backend} keys name no pipeline stage: stages would " \
               "write one object"
    return None


def mooncake_prefix(model: str, release: str | None) -> str:
    """The Mooncake key prefix the release writes for ``model``: its name with ``/`` made
    ``-`` from 0.5.17, nothing before."""
    return model.replace("/", "-") if release_tuple(release) >= MODEL_PREFIX_SINCE else ""
