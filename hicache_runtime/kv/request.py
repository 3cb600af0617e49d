"""Requests and their KV bookkeeping.

One :class:`Req` per generation request. Its device slots are laid out as::

    positions  0 ........... prefix_len ............ kv_len ....... len(kv_slots)
    slots      [ tree-owned, locked via last_node ][ request-owned (computed) ][ spare ]

``prefix_len`` is page-aligned (the tree stores whole pages). ``kv_slots`` always covers whole
pages; the tail after ``kv_len`` is allocated but not yet written (room for decode tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hicache_runtime.kv.radix_tree import TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


class ReqStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Req:
    """A request: prompt, generated tokens, KV slots and the tree node that protects them."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    kv_slots: torch.Tensor = field(default_factory=lambda: _EMPTY)
    kv_len: int = 0
    prefix_len: int = 0
    last_node: TreeNode | None = None
    cached: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    retractions: int = 0
    finish_step: int | None = None
    abort_reason: str | None = None
    chunked: bool = False
    """True while a prefill is split over several steps (the next chunk runs first)."""
    extend_len: int = 0
    """Tokens computed by the batch currently running this request."""
    abort_pending: bool = False
    """Aborted while its batch was in the pipeline; finished when that batch returns."""
    storage_pending: int = 0
    """Tokens its settled L3 prefetch hung into the tree, not yet counted as storage hits."""
    inserted_len: int = 0
    """Tokens this request has inserted into the tree so far (page-aligned; upstream 0.5.23's
    ``cache_inserted_len``): its later inserts count no hit on them (``past-own-inserts``)."""

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV a prefill must provide: the prompt plus every generated token."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def done(self) -> bool:
        return self.status in (ReqStatus.FINISHED, ReqStatus.ABORTED)

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_new_tokens - len(self.output_ids))

    def reset_kv(self) -> None:
        """Forget every slot (after they were freed or handed to the tree)."""
        self.kv_slots = _EMPTY
        self.kv_len = 0
        self.prefix_len = 0
        self.last_node = None
        self.chunked = False
