"""The radix tree over page-aligned token keys, with node state for every tier.

A node holds a run of tokens (a multiple of the page size) and, per tier, where its KV lives:
``value`` (device slots, ``None`` once evicted from L1), ``host_value`` (host slots, ``None``
until backed up to L2) and ``hash_value`` (one L3 key per page). Structural rules, checked by
:meth:`RadixTree.check_structure`:

* a device-resident node's parent is device-resident (L1 eviction removes leaves first);
* an evicted node has a host copy (otherwise it is deleted, not evicted);
* a backed-up node's parent is backed up: host residency is contiguous from the root, so a
  load-back of an evicted path always finds every page it needs.

Host pages are protected by page pins (``host_pins.py``), not per-node counters. Locks are
path-based as in SGLang: ``inc_lock_ref`` walks to the root, so a locked node's
ancestors are locked too. ``evictable_size`` and ``protected_size`` count device tokens in
unlocked and locked nodes. The LRU clock is injected (logical by default, wall clock for the
``wallclock-lru`` legacy switch) so ranks that perform the same operations agree on victims.
A match or insert stamps every node it walks, including one it ends inside, before splitting
it, so eviction order follows SGLang's ``RadixCache`` (tests/runtime/test_tree_oracle.py drives
both side by side).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hicache_runtime.contracts.errors import InvariantViolation
from hicache_runtime.contracts.events import Ev, EventSink
from hicache_runtime.kv.evict_order import LRU, EvictOrder

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class TreeNode:
    """One edge of the radix tree. Identity is the object; ``id`` is for logs and op maps."""

    id: int
    key: list[int]
    parent: TreeNode | None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    value: torch.Tensor | None = None
    host_value: torch.Tensor | None = None
    hash_value: list[str] | None = None
    lock_ref: int = 0
    hit_count: int = 0
    last_access: float = 0.0
    creation: float = 0.0
    """The clock's stamp when the node was made (``fifo``/``filo``; a split's upper part
    keeps it, as 0.5.23 ``unified_tree_core.py`` ``_split_node`` L1476 does)."""
    priority: int = 0
    """``priority`` eviction's first key: upstream the highest priority of a request that
    inserted the node. No workload here gives a request a priority, so it stays 0."""
    depth_tokens: int = 0
    """Tokens from the root to the node's end (``tlru``: ``_tlru_cached_prefix_len``)."""
    history_tokens: int = 0
    """The deepest ``depth_tokens`` its branch has reached, not lowered by eviction
    (``tlru``: ``_tlru_history_len``)."""

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self.key)}, dev={self.value is not None}, "
                f"host={self.host_value is not None}, lock={self.lock_ref})")


class MatchResult(NamedTuple):
    """What a prefix match found.

    ``device_indices`` are valid only while ``last_device_node`` is locked. ``host_hit_length``
    tokens below it are on L2 only, ending at ``last_host_node``.
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


class InsertResult(NamedTuple):
    """``prefix_len``: leading tokens whose device copy already existed (caller frees its own
    duplicate slots for them); ``revived``: evicted nodes that took the caller's slots;
    ``new_node``: the leaf created for the unmatched tail, if any; ``last_node``: deepest node."""

    prefix_len: int
    last_node: TreeNode
    new_node: TreeNode | None
    revived: list[TreeNode]
    matched: list[TreeNode]


class RadixTree:
    """Page-aligned radix tree. Not thread-safe: only the scheduler thread touches it."""

    def __init__(self, page_size: int, clock: Callable[[], float] | None = None,
                 events: EventSink | None = None, order: EvictOrder = LRU) -> None:
        self.page_size = page_size
        self.events = events  # splits are recorded here (the other tree events by the cache)
        self.order = order  # which leaf L1 and L2 eviction take first
        self._ids = itertools.count(1)
        self._logical = itertools.count(1)
        self.clock: Callable[[], float] = clock or (lambda: float(next(self._logical)))
        self.root = TreeNode(id=0, key=[], parent=None, value=_EMPTY, host_value=_EMPTY)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0

    # --- queries ------------------------------------------------------------------------------

    def align(self, n: int) -> int:
        return n - n % self.page_size

    def match(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``. Splits nodes at the match boundary and
        touches (LRU) every matched node. Mutates the tree shape, never its contents."""
        key = key[: self.align(len(key))]
        self.root.last_access = self.clock()
        device_parts: list[torch.Tensor] = []
        last_device = last_host = self.root
        host_len = 0
        for child in self._descend(self.root, key):
            if child.value is not None and host_len == 0:
                device_parts.append(child.value)
                last_device = child
            else:
                if child.host_value is None:
                    raise InvariantViolation(
                        f"evicted node {child.id} has no host copy (tokens {len(child.key)})"
                    )
                host_len += len(child.key)
            last_host = child
        indices = torch.cat(device_parts) if device_parts else _EMPTY
        return MatchResult(indices, last_device, last_host, host_len)

    # --- mutation ------------------------------------------------------------------------------

    def insert(self, key: list[int], value: torch.Tensor,
               counted_from: int | None = 0) -> InsertResult:
        """Insert ``key`` with device slots ``value`` (same length, page-aligned).

        Existing device-resident nodes keep their slots (the caller's are duplicates); evicted
        nodes on the path are revived with the caller's slots; the unmatched tail becomes a new
        leaf. Hit counts (selective write-through) go up by one for each present node and the
        new leaf that end past ``counted_from`` tokens; ``None`` counts none (the release's
        hit-counting policy decides, ``contracts/profiles.py`` ``HitCounting``)."""
        n_key = self.align(len(key))
        key, value = key[:n_key], value[:n_key]
        self.root.last_access = self.clock()
        node, done, prefix_len = self.root, 0, 0
        revived: list[TreeNode] = []
        matched: list[TreeNode] = []
        for child in self._descend(self.root, key):
            n = len(child.key)
            if child.value is None:
                child.value = value[done : done + n].clone()
                self.evictable_size += n
                revived.append(child)
            elif not revived:
                prefix_len += n
                if counted_from is not None and done + n > counted_from:
                    child.hit_count += 1
                matched.append(child)
            node, done = child, done + n
        new_node = None
        if done < len(key):
            new_node = self._add_child(node, key[done:], value[done:].clone())
            # its first insert counts as a hit, unless this insert counts none
            new_node.hit_count = int(counted_from is not None)
            node = new_node
        return InsertResult(prefix_len, node, new_node, revived, matched)

    def insert_host(self, parent: TreeNode, key: list[int], host_value: torch.Tensor,
                    hash_value: list[str] | None) -> tuple[int, int]:
        """Hang host-only pages (an L3 prefetch result) below ``parent``.

        Existing nodes along ``key`` are walked first (their tokens are *present*); the walk
        stops at a node without a host copy, since host residency must stay contiguous from
        the root. The rest becomes one new host-only leaf. Returns ``(present, added)``: the
        caller frees ``host_value[:present]`` and ``host_value[present + added:]``."""
        if parent is not self.root and parent.host_value is None:
            return 0, 0
        node, present = parent, 0
        for child in self._descend(parent, key):
            if child.host_value is None:
                return present, 0
            node, present = child, present + len(child.key)
        if present == len(key):
            return present, 0
        rest = key[present:]
        new = TreeNode(id=next(self._ids), key=list(rest), parent=node, value=None,
                       host_value=host_value[present:].clone(),
                       hash_value=None if hash_value is None
                       else hash_value[present // self.page_size :])
        new.last_access = new.creation = self.clock()
        self._place(new, node)
        node.children[self._child_key(rest)] = new
        return present, len(rest)

    def _descend(self, node: TreeNode, key: list[int]) -> Iterator[TreeNode]:
        """Walk down from ``node`` along ``key``: every child whose first page matches, split
        at the end of the common run and touched (LRU). The caller has consumed
        ``len(child.key)`` tokens of ``key`` per child yielded."""
        offset = 0
        while offset < len(key):
            rest = key[offset:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                return
            n = self._common_len(child.key, rest)
            # Stamp before splitting, as SGLang's RadixCache does: the remainder of a node a
            # match or insert ends inside counts as just used too (the upper part inherits
            # the stamp), so L1 eviction picks the same victims as upstream.
            child.last_access = self.clock()
            if n < len(child.key):
                child = self.split(child, n)
            yield child
            node, offset = child, offset + n

    def split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; returns the new upper node (same locks/refs)."""
        if n <= 0 or n >= len(child.key) or n % self.page_size:
            raise InvariantViolation(f"bad split of node {child.id} at {n}")
        assert child.parent is not None
        upper = TreeNode(
            id=next(self._ids), key=child.key[:n], parent=child.parent,
            value=None if child.value is None else child.value[:n],
            host_value=None if child.host_value is None else child.host_value[:n],
            hash_value=(None if child.hash_value is None
                        else child.hash_value[: n // self.page_size]),
            lock_ref=child.lock_ref, hit_count=child.hit_count,
            last_access=child.last_access, creation=child.creation, priority=child.priority,
            depth_tokens=child.parent.depth_tokens + n, history_tokens=child.history_tokens,
        )
        child.parent.children[self._child_key(child.key)] = upper
        child.key = child.key[n:]
        if child.value is not None:
            child.value = child.value[n:]
        if child.host_value is not None:
            child.host_value = child.host_value[n:]
        if child.hash_value is not None:
            child.hash_value = child.hash_value[n // self.page_size :]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        if self.events is not None:
            self.events.emit(Ev.SPLIT, node=child.id, upper=upper.id, at=n)
        return upper

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from L1 eviction."""
        while node is not self.root:
            if node.value is None:
                raise InvariantViolation(f"lock of evicted node {node.id}")
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref`. Underflow is an invariant violation."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise InvariantViolation(f"lock_ref underflow on node {node.id}")
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            assert node.parent is not None
            node = node.parent

    def drop_device(self, node: TreeNode) -> torch.Tensor:
        """Mark an unlocked node evicted from L1; returns its device slots to free."""
        if node.lock_ref or node.value is None:
            raise InvariantViolation(f"drop_device of locked or evicted node {node.id}")
        slots, node.value = node.value, None
        self.evictable_size -= len(node.key)
        return slots

    def attach_device(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Give an evicted node device slots again (load-back)."""
        if node.value is not None:
            raise InvariantViolation(f"attach_device to resident node {node.id}")
        node.value = slots
        self.evictable_size += len(node.key)

    def delete_leaf(self, node: TreeNode) -> None:
        """Remove a childless node from the tree (its slots must already be released)."""
        if node.children or node is self.root or node.lock_ref:
            raise InvariantViolation(f"delete of non-leaf, locked or root node {node.id}")
        if node.value is not None:
            self.evictable_size -= len(node.key)
        assert node.parent is not None
        del node.parent.children[self._child_key(node.key)]

    # --- traversal ----------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def device_leaves(self) -> list[TreeNode]:
        """Device-resident nodes none of whose children is device-resident (L1 victims)."""
        return [n for n in self.nodes() if n.value is not None
                and all(c.value is None for c in n.children.values())]

    def host_leaves(self) -> list[TreeNode]:
        """Evicted, childless nodes holding only a host copy (L2 victims)."""
        return [n for n in self.nodes() if n.value is None and not n.children
                and n.host_value is not None]

    def path_to_root(self, node: TreeNode) -> list[TreeNode]:
        out = []
        while node is not self.root:
            out.append(node)
            assert node.parent is not None
            node = node.parent
        return out

    def token_counts(self) -> dict[str, int]:
        dev = host = both = 0
        for n in self.nodes():
            dev += len(n.key) if n.value is not None else 0
            host += len(n.key) if n.host_value is not None else 0
            both += len(n.key) if n.value is not None and n.host_value is not None else 0
        return {"device": dev, "host": host, "both": both}

    def summary(self) -> dict[str, int]:
        """A small JSON-friendly description for state snapshots."""
        nodes = list(self.nodes())
        counts = self.token_counts()
        return {
            "nodes": len(nodes), "device_tokens": counts["device"],
            "host_tokens": counts["host"], "evictable": self.evictable_size,
            "protected": self.protected_size,
            "locked_nodes": sum(1 for n in nodes if n.lock_ref),
            "depth": max((len(self.path_to_root(n)) for n in nodes), default=0),
        }

    def check_structure(self) -> None:
        """Raise :class:`InvariantViolation` naming the first broken structural rule."""
        evictable = protected = 0
        ps = self.page_size
        for n in self.nodes():
            p = n.parent
            assert p is not None
            if p.children.get(self._child_key(n.key)) is not n:
                raise InvariantViolation(f"stale parent/child link at node {n.id}")
            if not n.key or len(n.key) % ps:
                raise InvariantViolation(f"node {n.id} key length {len(n.key)} not page-aligned")
            for name, val in (("value", n.value), ("host_value", n.host_value)):
                if val is not None and val.numel() != len(n.key):
                    raise InvariantViolation(f"node {n.id} {name} has {val.numel()} slots "
                                             f"for {len(n.key)} tokens")
            if n.value is None and n.host_value is None:
                raise InvariantViolation(f"evicted node {n.id} has no host copy")
            if n.value is not None and p is not self.root and p.value is None:
                raise InvariantViolation(f"device node {n.id} under evicted parent {p.id}")
            if n.host_value is not None and p is not self.root and p.host_value is None:
                raise InvariantViolation(f"host copy of node {n.id} not contiguous from root")
            if n.lock_ref < 0:
                raise InvariantViolation(f"negative lock_ref on node {n.id}")
            if n.value is None and n.lock_ref:
                raise InvariantViolation(f"evicted node {n.id} is locked ({n.lock_ref})")
            if sum(c.lock_ref for c in n.children.values()) > n.lock_ref:
                raise InvariantViolation(f"node {n.id} lock_ref below its children's")
            if n.value is not None:
                if n.lock_ref:
                    protected += len(n.key)
                else:
                    evictable += len(n.key)
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise InvariantViolation(
                f"tree accounting: evictable {self.evictable_size} (actual {evictable}), "
                f"protected {self.protected_size} (actual {protected})"
            )

    # --- internals ----------------------------------------------------------------------------

    def _add_child(self, parent: TreeNode, key: list[int], value: torch.Tensor) -> TreeNode:
        node = TreeNode(id=next(self._ids), key=list(key), parent=parent, value=value)
        node.last_access = node.creation = self.clock()
        self._place(node, parent)
        parent.children[self._child_key(key)] = node
        self.evictable_size += len(key)
        return node

    @staticmethod
    def _place(node: TreeNode, parent: TreeNode) -> None:
        """A new node's depth, and its branch's high-water depth raised to it up the path
        (0.5.23 ``unified_tree_core.py`` ``_set_tlru_lens_and_raise_history`` L191-209)."""
        node.depth_tokens = parent.depth_tokens + len(node.key)
        node.history_tokens = max(node.history_tokens, node.depth_tokens)
        up: TreeNode | None = parent
        while up is not None and up.history_tokens < node.depth_tokens:
            up.history_tokens = node.depth_tokens
            up = up.parent

    def _child_key(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _common_len(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return self.align(n)
