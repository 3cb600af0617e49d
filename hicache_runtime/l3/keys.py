"""L3 object keys: prefix-chained page hashes plus a per-rank suffix, as SGLang forms them.

A page of ``page_size`` tokens gets ``SHA256(prior digest bytes || token ids as uint32 LE)``,
hex encoded, where the prior digest is the hash of the page before it (none for the first page
of a chain). A page hash therefore names the *whole prefix* up to and including that page, so a
lookup can never match a page whose earlier context differs.

The write side (backup) and the read side (prefetch) must build identical chains: the tree
stores each node's hashes (``TreeNode.hash_value``) and a child's chain is extended from its
parent's last hash with :func:`extend_chain`; the prefetch side recomputes the chain from the
request's tokens seeded with the last hash of the deepest host-resident node. A mismatch between
the two silently turns every L3 lookup into a miss.

Object keys add a rank suffix (SGLang's file backend): MHA shards heads over TP ranks, so each
TP rank stores its own object (``_<model>_<tp_rank>_<tp_size>``); MLA-style replicated KV is
shared by all TP ranks (``_<model>``). With PP > 1 ``_<pp_size>_<pp_rank>`` is appended, since
each stage holds different layers. Page hashes are lowercase hex and never contain ``_``, so
the suffix starts at the first ``_`` of an object key.

Everything here is a pure function or an immutable value; all of it is thread-safe.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache_runtime.config import ModelConfig
    from hicache_runtime.contracts.topology import RankInfo

_MAX_TOKEN = 2**32 - 1
_HASH_HEX_LEN = 64


def page_hash(tokens: Sequence[int], prior: str | None = None) -> str:
    """The hash of one page: ``SHA256(bytes.fromhex(prior) || uint32 LE tokens)``, hex.

    ``prior`` is the previous page's hash (``None`` or ``""`` starts a chain). Raises
    ``ValueError`` for a token id outside ``[0, 2**32)`` or a prior that is not hex.
    """
    h = hashlib.sha256()
    if prior:
        h.update(bytes.fromhex(prior))
    h.update(_token_bytes(tokens))
    return h.hexdigest()


def extend_chain(parent_last: str | None, tokens: Sequence[int], page_size: int) -> list[str]:
    """Hashes of the full pages of ``tokens``, chained onto ``parent_last``.

    ``parent_last`` is the last page hash of the parent node (``None`` at the root). A trailing
    partial page has no hash (it is never stored in L3) and is ignored. Splitting a token run
    at a page boundary and extending twice gives the same hashes as extending once.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    out: list[str] = []
    prior = parent_last
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prior = page_hash(tokens[start : start + page_size], prior)
        out.append(prior)
    return out


def chain_hashes(tokens: Sequence[int], page_size: int) -> list[str]:
    """Hashes of the full pages of a token sequence that starts at the root."""
    return extend_chain(None, tokens, page_size)


def sidecar_hash(page_hash_hex: str, pool: str) -> str:
    """The page hash under which a hybrid sidecar pool stores its part of a page: derived from
    the KV page's hash, so it names the same prefix, but a separate object (pools can miss
    independently, as SGLang's per-pool hits do)."""
    return hashlib.sha256(f"{pool}:{page_hash_hex}".encode()).hexdigest()


def model_id(model: ModelConfig) -> str:
    """A short id of a model config, used as the ``<model>`` part of key suffixes.

    The tiny transformer's weights are a pure function of its config, so two configs that
    differ in any field (seed, sizes, dtype) must never read each other's KV: the id hashes
    the whole config.
    """
    digest = hashlib.blake2b(model.model_dump_json().encode(), digest_size=6).hexdigest()
    return f"tiny-{digest}"


def key_suffix(model: str, rank: RankInfo, *, shared_across_tp: bool = False) -> str:
    """The per-rank suffix SGLang's file backend appends to page hashes.

    ``shared_across_tp`` is the MLA-style layout (``single_writer``): no TP part, so every TP
    rank of a stage reads the one object its writer stored. ``/`` in a model path becomes
    ``-``, as SGLang does, so a suffix is a valid file name part.
    """
    name = model.replace("/", "-")
    suffix = f"_{name}" if shared_across_tp else f"_{name}_{rank.tp_rank}_{rank.tp_size}"
    if rank.pp_size > 1:
        suffix += f"_{rank.pp_size}_{rank.pp_rank}"
    return suffix


@dataclass(frozen=True, slots=True)
class KeyScheme:
    """Turns page hashes into this rank's object keys. Immutable and thread-safe."""

    suffix: str

    @classmethod
    def for_rank(cls, model: str, rank: RankInfo, *, shared_across_tp: bool = False) -> KeyScheme:
        return cls(key_suffix(model, rank, shared_across_tp=shared_across_tp))

    def object_key(self, page_hash_hex: str) -> str:
        """``<page hash><suffix>``; raises ``ValueError`` for a malformed page hash."""
        if "_" in page_hash_hex or "/" in page_hash_hex or not page_hash_hex:
            raise ValueError(f"not a page hash: {page_hash_hex!r}")
        return page_hash_hex + self.suffix

    def object_keys(self, page_hashes: Sequence[str]) -> list[str]:
        return [self.object_key(h) for h in page_hashes]

    def owns(self, object_key: str) -> bool:
        """Whether ``object_key`` carries exactly this suffix (used by ``clear``)."""
        head, sep, tail = object_key.partition("_")
        return bool(head) and bool(sep) and "_" + tail == self.suffix


def is_page_hash(text: str) -> bool:
    """Whether ``text`` looks like a page hash built here (64 lowercase hex digits)."""
    return len(text) == _HASH_HEX_LEN and all(c in "0123456789abcdef" for c in text)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    ids = [int(t) for t in tokens]
    try:
        return struct.pack(f"<{len(ids)}I", *ids)
    except struct.error:
        bad = next((t for t in ids if not 0 <= t <= _MAX_TOKEN), None)
        raise ValueError(f"token id {bad} does not fit in uint32") from None
