"""The radix tree and its L1 eviction, side by side with SGLang's own ``RadixCache``.

Both trees get the same operations with the same device slots: insert, match, lock the matched
node, unlock it, evict. They must agree on every insert's prefix length, every match's slots,
the evictable/protected sizes, the whole structure (keys, slots and lock counts per node) and
the order in which eviction frees slots. Ours is a real one-rank ``HiCache`` with L2 off, so its
L1 eviction deletes leaves, as ``RadixCache.evict`` does.

The oracle is ``sglang/srt/mem_cache/radix_cache.py`` of an installed sglang 0.5.23 (installed
with ``--no-deps`` by the README's test command). Importing it the normal way
pulls in SGLang's whole serving stack (triton, transformers, pyzmq, msgspec, pillow, starlette,
...), none of which the tree uses, so the loader below runs SGLang's own files for the tree
(``radix_cache.py``, ``base_prefix_cache.py``, ``cache_init_params.py``, ``evict_policy.py``,
``component_type.py``) and gives the modules they import only for KV events, metrics and pool
types small stand-ins: events off, metrics off, as a ``RadixCache.create_simulated`` tree runs.
Its ``time.monotonic`` becomes a counter, like our logical LRU clock, so no two stamps tie (with
ties SGLang's heap order would depend on set iteration order).

The first tests pin the smallest cases where SGLang's order was not followed; they need no
sglang.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import sys
import time
from array import array
from pathlib import Path
from types import ModuleType
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from hicache_runtime.contracts.events import Ev
from hicache_runtime.kv.radix_tree import TreeNode
from tests.helpers import CacheRig

SGLANG_VERSION = "0.5.23"


# --- the oracle: SGLang's RadixCache ---------------------------------------------------------


class _EventsOff:
    """``KVCacheEventRecorder`` with ``enabled=False``, whose contract is that every
    ``record_*`` call is a no-op."""

    def __init__(self, enabled: bool, **_: object) -> None:
        if enabled:
            raise RuntimeError("the oracle runs with KV cache events off")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("record_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


class _LogicalTime:
    """The ``time`` module as radix_cache.py sees it: ``monotonic`` counts calls."""

    def __init__(self) -> None:
        self._ticks = itertools.count(1)
        self.perf_counter = time.perf_counter

    def monotonic(self) -> float:
        return float(next(self._ticks))


def _off(*_: object, **__: object) -> Any:
    raise RuntimeError("metrics are off in the oracle")


def _stand_in(name: str, **attrs: object) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _split_hash(hashes: list[str] | None, split_len: int, page_size: int
                ) -> tuple[list[str] | None, list[str] | None]:
    if hashes is None:
        return None, None
    pages = split_len // page_size
    return hashes[:pages], hashes[pages:]


def _load_stand_ins(pkg: Path) -> None:
    # Bare packages: sglang/__init__.py starts the serving stack and sglang/srt/utils/__init__.py
    # star-imports utils/common.py (triton, PIL, starlette, transformers). The tree needs neither.
    _stand_in("sglang", __path__=[str(pkg)])
    _stand_in("sglang.srt.utils", __path__=[str(pkg / "srt" / "utils")])
    _stand_in("sglang.srt.utils.common", ceil_align=lambda x, y: -(-x // y) * y)
    # Pool types appear only in annotations; metrics and the runtime context only when
    # enable_metrics is set.
    _stand_in("sglang.srt.mem_cache.allocator",
              BaseTokenToKVPoolAllocator=type("BaseTokenToKVPoolAllocator", (), {}))
    _stand_in("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=type("ReqToTokenPool", (), {}))
    _stand_in("sglang.srt.observability.metrics_collector",
              STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
              RadixCacheMetricsCollector=type("RadixCacheMetricsCollector", (), {}),
              radix_cache_metric_labels=_off, resolve_collector_class=_off)
    _stand_in("sglang.srt.runtime_context", get_observability=_off, get_parallel=_off)
    names = type("LoRANameTable", (), {})
    _stand_in("sglang.srt.mem_cache.events", KVCacheEventRecorder=_EventsOff,
              LoRANameTable=names, KvEventLoraNames=type("KvEventLoraNames", (names,), {}))
    # mem_cache/utils.py imports triton kernels; the tree uses two helpers from it, and the
    # eviction strategy comes from SGLang's own evict_policy.py.
    policy = importlib.import_module("sglang.srt.mem_cache.evict_policy")
    strategies = {"lru": policy.LRUStrategy, "lfu": policy.LFUStrategy,
                  "fifo": policy.FIFOStrategy, "mru": policy.MRUStrategy,
                  "filo": policy.FILOStrategy, "priority": policy.PriorityStrategy,
                  "slru": policy.SLRUStrategy}
    _stand_in("sglang.srt.mem_cache.utils", split_node_hash_value=_split_hash,
              get_eviction_strategy=lambda name, config=None: strategies[name.lower()]())


def load_sglang_radix_cache() -> tuple[ModuleType | None, str]:
    """SGLang's radix_cache module, or ``None`` and why it is not available."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None, (f"sglang is not installed: pip install --no-deps sglang=={SGLANG_VERSION} "
                      "(the README's test command)")
    if dist.version != SGLANG_VERSION:
        return None, f"sglang {dist.version} is installed; the oracle is sglang {SGLANG_VERSION}"
    if "sglang" in sys.modules:
        return None, "sglang is already imported in this process; the oracle loads it alone"
    pkg = Path(str(dist.locate_file("sglang")))
    before = set(sys.modules)
    try:
        _load_stand_ins(pkg)
        module = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    except Exception as exc:
        return None, f"sglang {SGLANG_VERSION}'s radix_cache.py did not load: {exc!r}"
    finally:
        # The loaded modules keep what they imported; nothing else sees a partial sglang.
        for name in set(sys.modules) - before:
            if name == "sglang" or name.startswith("sglang."):
                del sys.modules[name]
    module.time = _LogicalTime()  # type: ignore[attr-defined]
    return module, ""


ORACLE, ORACLE_MISSING = load_sglang_radix_cache()
needs_oracle = pytest.mark.skipif(ORACLE is None, reason=ORACLE_MISSING)


class _FreeLog:
    """The token allocator a simulated RadixCache frees evicted slots into: records them."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[list[int]] = []

    def free_segment(self, values: torch.Tensor, start_pos: int = 0) -> None:
        self.freed.append(values.tolist())


class SglangTree:
    """SGLang's RadixCache, driven through its public API."""

    def __init__(self, page_size: int, policy: str = "lru") -> None:
        assert ORACLE is not None
        self.m = ORACLE
        self.log = _FreeLog()
        # as RadixCache.create_simulated builds it, with the eviction policy named
        self.cache = ORACLE.RadixCache(ORACLE.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.log,
            page_size=page_size, eviction_policy=policy))

    def _key(self, tokens: list[int]) -> Any:
        return self.m.RadixKey(token_ids=array("q", tokens))

    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        return int(self.cache.insert(self.m.InsertParams(key=self._key(tokens),
                                                         value=slots)).prefix_len)

    def match(self, tokens: list[int]) -> tuple[list[int], Any]:
        res = self.cache.match_prefix(self.m.MatchPrefixParams(key=self._key(tokens)))
        node = res.last_device_node
        indices = self.cache.path_device_indices(node).tolist()
        assert len(indices) == res.device_prefix_len
        return indices, node

    def lock(self, node: Any) -> None:
        self.cache.inc_lock_ref(node)

    def unlock(self, node: Any) -> None:
        self.cache.dec_lock_ref(node)

    def evict(self, num_tokens: int) -> tuple[int, list[list[int]]]:
        self.log.freed.clear()
        res = self.cache.evict(self.m.EvictParams(num_tokens=num_tokens))
        return int(res.num_tokens_evicted), list(self.log.freed)

    def sizes(self) -> tuple[int, int]:
        return self.cache.evictable_size(), self.cache.protected_size()

    def shape(self) -> list[Any]:
        def walk(node: Any) -> list[Any]:
            return sorted((list(c.key.token_ids), c.value.tolist(), c.lock_ref, walk(c))
                          for c in node.children.values())
        return walk(self.cache.root_node)


# --- ours: a one-rank HiCache with L2 off -------------------------------------------------------


class OurTree:
    """Our radix tree inside a real HiCache (L2 off), driven as SglangTree is."""

    def __init__(self, page_size: int, policy: str = "lru",
                 settings: dict[str, int] | None = None) -> None:
        self.rig = CacheRig.make(**{"cache.enable_hicache": False, "cache.page_size": page_size,
                                    "cache.device_tokens": 8192,
                                    "cache.eviction_policy": policy,
                                    "cache.eviction_policy_config": settings or {}})
        self.cache = self.rig.cache
        self.tree = self.cache.tree
        self.victims: list[int] = []
        self.rig.rt.tracer.observer = self._observe

    def _observe(self, kind: str, attrs: dict[str, Any]) -> None:
        if kind == Ev.EVICT:
            self.victims.extend(attrs["victims"])

    def alloc(self, num_tokens: int) -> torch.Tensor:
        slots = self.cache.device.alloc(num_tokens)
        assert slots is not None, "the test pool is sized never to run out"
        return slots

    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        res = self.tree.insert(tokens, slots)
        self.cache.device.free(slots[: res.prefix_len])  # duplicates of cached pages
        return res.prefix_len

    def match(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        res = self.tree.match(tokens)
        return res.device_indices.tolist(), res.last_device_node

    def lock(self, node: TreeNode) -> None:
        self.cache.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.cache.unlock(node)

    def evict(self, num_tokens: int) -> tuple[int, list[list[int]]]:
        slots = {n.id: n.value.tolist() for n in self.tree.nodes() if n.value is not None}
        self.victims.clear()
        evicted = self.cache.evict(num_tokens)
        return evicted, [slots[i] for i in self.victims]

    def sizes(self) -> tuple[int, int]:
        return self.tree.evictable_size, self.tree.protected_size

    def shape(self) -> list[Any]:
        def walk(node: TreeNode) -> list[Any]:
            return sorted((list(c.key), c.value.tolist() if c.value is not None else None,
                           c.lock_ref, walk(c)) for c in node.children.values())
        return walk(self.tree.root)

    def close(self) -> None:
        self.rig.close()


def _insert_all(ours: OurTree, seqs: list[list[int]]) -> None:
    for tokens in seqs:
        ours.insert(tokens, ours.alloc(len(tokens)))


# --- the smallest cases ---------------------------------------------------------------------


def test_insert_ending_inside_a_node_stamps_its_remainder() -> None:
    """Page size 1: insert [2, 2] (slots 0, 1), [1] (slot 2), [2] (ends inside [2, 2]).
    SGLang stamps [2, 2] before splitting it, so its remainder (slot 1) is newer than [1]:
    evicting everything frees slot 2, then 1, then 0."""
    ours = OurTree(page_size=1)
    try:
        _insert_all(ours, [[2, 2], [1], [2]])
        assert ours.evict(10) == (3, [[2], [1], [0]])
        ours.cache.check_integrity(0, [])
    finally:
        ours.close()


def test_match_ending_inside_a_node_stamps_its_remainder() -> None:
    """Page size 4: insert eight 1s (slots 0-7), four 2s (slots 8-11), then match four 1s.
    The match ends inside the first node, whose remainder (slots 4-7) then counts as just
    used: eviction frees 8-11 first."""
    ours = OurTree(page_size=4)
    try:
        _insert_all(ours, [[1] * 8, [2] * 4])
        assert ours.match([1] * 4)[0] == [0, 1, 2, 3]
        assert ours.evict(100) == (12, [[8, 9, 10, 11], [4, 5, 6, 7], [0, 1, 2, 3]])
    finally:
        ours.close()


@needs_oracle
def test_sglang_frees_the_smallest_case_in_the_same_order() -> None:
    ours = OurTree(page_size=1)
    try:
        theirs = SglangTree(page_size=1)
        for tokens in ([2, 2], [1], [2]):
            slots = ours.alloc(len(tokens))
            assert ours.insert(tokens, slots.clone()) == theirs.insert(tokens, slots.clone())
        assert theirs.evict(10) == (3, [[2], [1], [0]])
        assert ours.evict(10) == (3, [[2], [1], [0]])
    finally:
        ours.close()


# --- eviction policies RadixCache cannot stand for -----------------------------------------


@pytest.mark.parametrize(("policy", "freed"), [("fifo", [[1], [0], [2]]),
                                               ("filo", [[2], [1], [0]])])
def test_fifo_keeps_a_split_s_creation_stamp(policy: str, freed: list[list[int]]) -> None:
    """Page size 1: insert [2, 2] (slots 0, 1), [1] (slot 2), then [2], which splits [2, 2].
    The upper part keeps the node's creation stamp, as 0.5.23's HiCache tree does
    (``unified_tree_core.py`` ``_split_node`` L1476), so fifo frees it before [1], which is
    younger. (RadixCache stamps the upper part at the split, ``radix_cache.py`` L680: it would
    free [1] second.) filo frees the youngest first: [1], then the split pair, lower first."""
    ours = OurTree(page_size=1, policy=policy)
    try:
        _insert_all(ours, [[2, 2], [1], [2]])
        assert ours.evict(10) == (3, freed)
    finally:
        ours.close()


@needs_oracle
def test_radix_cache_stamps_a_split_s_upper_part_anew() -> None:
    """The difference the test above names, shown on RadixCache itself."""
    theirs = SglangTree(page_size=1, policy="fifo")
    ours = OurTree(page_size=1)
    try:
        for tokens in ([2, 2], [1], [2]):
            theirs.insert(tokens, ours.alloc(len(tokens)))
        assert theirs.evict(10) == (3, [[1], [2], [0]])
    finally:
        ours.close()


@pytest.mark.parametrize(("policy", "freed"), [
    ("lru", [list(range(8)), [24, 25], list(range(8, 16))]),
    ("tlru", [[24, 25], list(range(8)), list(range(8, 16))]),
])
def test_tlru_frees_a_conversation_s_tail_past_its_budget_first(
        policy: str, freed: list[list[int]]) -> None:
    """Page size 1, tlru with threshold 4 (0.5.23 ``evict_policy.py`` ``TLRUStrategy``
    L49-81): an old 8-token prompt A (slots 0-7); a conversation B of 8 tokens (8-15) that
    grows to 10 (its tail in slots 24, 25 of the 10 it was given). B's new tail lies past
    its budget (10 + 0 - 4 = 6 tokens; 8 are cached without it), so tlru frees it before
    the older A, which has no spare tokens
    (budget 8 - 4 = 4 > 0 without it). B's head then stays within budget: the branch's
    high-water depth (10) does not shrink as its tail goes, so A goes next. lru frees by age."""
    ours = OurTree(page_size=1, policy=policy,
                   settings={"threshold": 4} if policy == "tlru" else None)
    try:
        _insert_all(ours, [[9] * 8, list(range(1, 9))])
        b = list(range(1, 11))
        slots = ours.alloc(10)
        ours.insert(b, slots)
        assert ours.evict(100) == (18, freed)
    finally:
        ours.close()


# --- random sequences, side by side ---------------------------------------------------------


def _pages(page_size: int) -> list[list[int]]:
    """Three page contents; with pages of several tokens two of them share all but the last
    token, so matches also end inside a page (and round down to the page boundary)."""
    if page_size == 1:
        return [[1], [2], [3]]
    return [[1] * page_size, [1] * (page_size - 1) + [2], [2] * page_size]


def _sequences(page_size: int) -> st.SearchStrategy[list[int]]:
    pages = _pages(page_size)
    return st.builds(lambda picks, tail: [t for p in picks for t in pages[p]] + tail,
                     st.lists(st.integers(0, 2), max_size=6),
                     st.lists(st.integers(1, 2), max_size=page_size - 1))


class SideBySide(RuleBasedStateMachine):
    """The same operations on both trees; every answer and the whole state must agree."""

    page_size = 1
    policy = "lru"
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.ours = OurTree(self.page_size, self.policy)
        self.theirs = SglangTree(self.page_size, self.policy)

    def teardown(self) -> None:
        self.ours.close()

    def _aligned(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % self.page_size]

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        tokens = self._aligned(data.draw(_sequences(self.page_size)))
        if not tokens:
            return
        slots = self.ours.alloc(len(tokens))
        assert self.ours.insert(tokens, slots.clone()) == self.theirs.insert(tokens, slots)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tokens = data.draw(_sequences(self.page_size))
        assert self.ours.match(tokens)[0] == self.theirs.match(tokens)[0]

    @rule(target=held, data=st.data())
    def match_and_lock(self, data: st.DataObject) -> tuple[TreeNode, Any]:
        tokens = data.draw(_sequences(self.page_size))
        (mine, my_node), (theirs, their_node) = self.ours.match(tokens), self.theirs.match(tokens)
        assert mine == theirs
        self.ours.lock(my_node)
        self.theirs.lock(their_node)
        return my_node, their_node

    @rule(pair=consumes(held))
    def unlock(self, pair: tuple[TreeNode, Any]) -> None:
        self.ours.unlock(pair[0])
        self.theirs.unlock(pair[1])

    @rule(num_tokens=st.integers(1, 4 * 16))
    def evict(self, num_tokens: int) -> None:
        assert self.ours.evict(num_tokens) == self.theirs.evict(num_tokens)

    @invariant()
    def same_state(self) -> None:
        assert self.ours.sizes() == self.theirs.sizes()
        assert self.ours.shape() == self.theirs.shape()


class SideBySidePage4(SideBySide):
    page_size = 4


class SideBySidePage16(SideBySide):
    page_size = 16


# The other eviction policies RadixCache runs, at one page size each (fifo and filo: see
# test_fifo_keeps_a_split_s_creation_stamp; tlru: RadixCache keeps no branch depths).
class SideBySideLfu(SideBySidePage4):
    policy = "lfu"


class SideBySideMru(SideBySidePage4):
    policy = "mru"


class SideBySideSlru(SideBySidePage4):
    policy = "slru"


class SideBySidePriority(SideBySidePage4):
    policy = "priority"


TestSideBySidePage1 = needs_oracle(SideBySide.TestCase)
TestSideBySidePage4 = needs_oracle(SideBySidePage4.TestCase)
TestSideBySidePage16 = needs_oracle(SideBySidePage16.TestCase)
TestSideBySideLfu = needs_oracle(SideBySideLfu.TestCase)
TestSideBySideMru = needs_oracle(SideBySideMru.TestCase)
TestSideBySideSlru = needs_oracle(SideBySideSlru.TestCase)
TestSideBySidePriority = needs_oracle(SideBySidePriority.TestCase)
for _case in (TestSideBySidePage1, TestSideBySidePage4, TestSideBySidePage16, TestSideBySideLfu,
              TestSideBySideMru, TestSideBySideSlru, TestSideBySidePriority):
    _case.settings = settings(_case.settings, stateful_step_count=40)
del _case  # a module-level TestCase name would be collected a second time
