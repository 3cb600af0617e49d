"""Release profiles: what the runtime runs to stand for one SGLang release, by name.

A profile is the set of protocols a release shipped, as far as this runtime models them: the
legacy switches whose pre-fix code the release still ran (from the switch registry: a switch is
in ``sglang-X`` when X is in its ``broken_in`` and its fidelity is ``release``), how host
(L2) pages are allocated, and the tree policies this runtime models (:class:`Policies`: the
``timeout`` prefetch clock and budget, ``write_through_selective`` hit counting, the eviction
orders the release offers). Everything
else a release did differently is listed with the profile (:attr:`Profile.not_modelled`), so
a result is never read as more than it is.

The releases read line by line are the wheels of 0.5.5, 0.5.13, 0.5.16, 0.5.20 and 0.5.23
(``docs/legacy-switches.md`` cites each file and line). ``proposed`` is no release: the fixed
protocols plus the all-rank host-allocation vote of SGLang PR #31425 (open), the strongest
protocols this runtime has. The default profile is ``sglang-0.5.23``.

Torch-free: the config, the command line and the doctor read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from hicache_runtime.contracts.legacy import REGISTRY, Fidelity, LegacySwitch


class HostAlloc(str, Enum):
    """How a write-backup or a prefetch takes host pages."""

    PER_RANK = "per-rank"
    """Each rank allocates from its own pool, evicts once and retries, and acts on its own
    outcome; a prefetch that does not fit takes the page-aligned prefix that does (at least
    the prefetch threshold): every release (0.5.23 ``unified_radix_cache.py``
    ``_execute_kv_backup`` L1737-1762 and ``hybrid_cache_controller.py``
    ``allocate_storage_hit`` L796-829; 0.5.20
    ``_execute_kv_backup`` L1577-1589 and ``_try_alloc_storage_hit`` L2684-2760). Ranks stay
    alike only while their pools do."""
    AGREED = "agreed"
    """Reserve, vote over every TP and PP rank, then commit or abort together, all or nothing:
    PR #31425's proposal, in no release (``cache/host_space.py`` ``alloc_host_agreed``)."""


class TimeoutClock(str, Enum):
    """When the ``timeout`` prefetch policy's clock starts."""

    SUBMISSION = "submission"
    """When the prefetch is created: 0.5.5 to 0.5.20 (``PrefetchOperation.start_time``, set
    in its ``__init__``; 0.5.16 ``cache_controller.py`` L206; 0.5.20 L2056-2061)."""
    FIRST_BLOCKED_POLL = "first-blocked-poll"
    """At the first admission poll that finds the prefetch unfinished; a prefetch whose pages
    have all landed never expires (0.5.23 ``unified_radix_cache.py``
    ``_start_storage_prefetch_wait`` L2259-2270, ``_prefetch_deadline_expired`` L2272-2283)."""


class TimeoutBudget(str, Enum):
    """What the ``timeout`` policy's budget grows with: ``base + per_ki_token x tokens /
    1024``."""

    HIT_TOKENS = "hit-tokens"
    """The pages L3 holds (the agreed hit): 0.5.5 ``hiradix_cache.py``
    ``_prefetch_timeout_check_linear_func`` L565-571, 0.5.16 L1483-1487 (there capped at
    ``prefetch_timeout_max``, default 30 s), 0.5.20 L2056-2061."""
    REQUESTED_TOKENS = "requested-tokens"
    """The span asked for, in whole pages (0.5.23 L2265-2268, with ``prefetch_timeout_per_page
    = page_size / 1024 x per_ki_token``, ``storage_attachment.py`` L291-293)."""


class HitCounting(str, Enum):
    """Which inserts count as hits for ``write_through_selective``."""

    SKIP_CHUNKED = "skip-chunked"
    """A chunk's insert counts nothing; the request's final insert counts every node it walks,
    its own chunks' included (0.5.5 ``hiradix_cache.py`` ``_inc_hit_count`` L266-270, 0.5.16
    L970-974; 0.5.20 ``unified_tree_core.py`` L1010-1029)."""
    PAST_OWN_INSERTS = "past-own-inserts"
    """Every insert counts the nodes that end past what the request itself inserted before
    (0.5.23 ``unified_tree_core.py`` ``_finish_insert_walk_node`` L1368-1375 and
    ``_should_backup_after_insert`` L1430-1440; ``cache_inserted_len``,
    ``unified_radix_cache.py`` L1185 and L1255)."""


class EvictionPolicy(str, Enum):
    """The order in which L1 and L2 eviction take unlocked leaves (SGLang
    ``--radix-eviction-policy``; ``evict_policy.py``, each strategy's ``get_priority``: the
    smallest goes first)."""

    LRU = "lru"
    """Least recently used: ``last_access_time``."""
    LFU = "lfu"
    """Least frequently used: ``(hit_count, last_access_time)``."""
    FIFO = "fifo"
    """Oldest node first: ``creation_time``."""
    MRU = "mru"
    """Most recently used first: ``-last_access_time``."""
    FILO = "filo"
    """Newest node first: ``-creation_time``."""
    PRIORITY = "priority"
    """Lowest request priority first, then LRU: ``(priority, last_access_time)``."""
    SLRU = "slru"
    """Segmented LRU: nodes hit fewer than ``protected_threshold`` (2) times first, LRU within
    a segment: ``(hit_count >= protected_threshold, last_access_time)``."""
    TLRU = "tlru"
    """Tail-optimised LRU (arXiv:2510.15152): nodes past the branch's TTFT budget
    (``threshold``, ``next_prompt_estimate``, in tokens) first, then LRU."""


EVICTION_SETTINGS: Mapping[EvictionPolicy, tuple[str, ...]] = MappingProxyType({
    **dict.fromkeys(EvictionPolicy, ()),
    EvictionPolicy.SLRU: ("protected_threshold",),
    EvictionPolicy.TLRU: ("threshold", "next_prompt_estimate"),
})
"""The settings each policy takes (its strategy's constructor arguments, 0.5.23
``evict_policy.py``; the rest take none)."""


_SINCE_0505 = frozenset({EvictionPolicy.LRU, EvictionPolicy.LFU, EvictionPolicy.FIFO,
                         EvictionPolicy.MRU, EvictionPolicy.FILO})
"""0.5.5 ``evict_policy.py`` L16-39; ``radix_cache.py`` L223-232 picks one by name."""
_SINCE_0513 = _SINCE_0505 | {EvictionPolicy.PRIORITY, EvictionPolicy.SLRU}
"""0.5.13 to 0.5.20 ``evict_policy.py`` L41-65 (``PriorityStrategy``, ``SLRUStrategy``)."""
_SINCE_0523 = _SINCE_0513 | {EvictionPolicy.TLRU}
"""0.5.23 ``evict_policy.py`` L49-81 (``TLRUStrategy``); ``utils.py`` L60-69 names all eight."""


@dataclass(frozen=True)
class Policies:
    """The policies a release's tree runs that this runtime models."""

    timeout_clock: TimeoutClock
    timeout_budget: TimeoutBudget
    hit_counting: HitCounting
    eviction_policies: frozenset[EvictionPolicy] = _SINCE_0523
    """The eviction orders the release offers (``--radix-eviction-policy``); LRU is every
    release's default."""


RELEASE_POLICIES_0505 = Policies(TimeoutClock.SUBMISSION, TimeoutBudget.HIT_TOKENS,
                                 HitCounting.SKIP_CHUNKED, _SINCE_0505)
"""0.5.5."""
RELEASE_POLICIES_0520 = Policies(TimeoutClock.SUBMISSION, TimeoutBudget.HIT_TOKENS,
                                 HitCounting.SKIP_CHUNKED, _SINCE_0513)
"""0.5.13 to 0.5.20."""
RELEASE_POLICIES_0523 = Policies(TimeoutClock.FIRST_BLOCKED_POLL,
                                 TimeoutBudget.REQUESTED_TOKENS, HitCounting.PAST_OWN_INSERTS,
                                 _SINCE_0523)


@dataclass(frozen=True)
class Profile:
    """One named profile."""

    name: str
    release: str | None
    """The SGLang version, or None for ``proposed``."""
    summary: str
    host_alloc: HostAlloc
    policies: Policies
    not_modelled: tuple[str, ...] = ()
    """What the release did that this runtime does not reproduce under this profile."""

    @property
    def switches(self) -> frozenset[LegacySwitch]:
        """The legacy switches the profile turns on (derived from the switch registry)."""
        if self.release is None:
            return frozenset()
        return frozenset(e.switch for e in REGISTRY.values()
                         if self.release in e.broken_in and e.in_profiles)

    @property
    def left_out(self) -> dict[LegacySwitch, str]:
        """Switches whose pre-fix code the release ran but which the profile leaves off,
        each with why (grafted or synthetic: a combination or a trigger no release had)."""
        if self.release is None:
            return {}
        return {e.switch: f"{e.fidelity.value}: {e.fidelity_note}" for e in REGISTRY.values()
                if self.release in e.broken_in and not e.in_profiles}


#: The policies a release's tree runs that this runtime does not model (cited in
#: ``docs/legacy-switches.md``, "Profiles"); those it models are the profile's ``policies``.
_POLICIES_0523 = (
    "prefetch into a full L2 with sidecar pools: upstream trims the pools' pages with the KV's "
    "(allocate_storage_hit L796-829); here such a prefetch is revoked whole (without sidecar "
    "pools the partial fallback is modelled: the page-aligned prefix that fits, at least the "
    "prefetch threshold, taken per rank)",
    "priority eviction: the workloads here give every request priority 0, so it orders as "
    "LRU does (upstream takes a request's priority from its API call)",
)
_POLICIES_0520 = (
    "prefetch into a full L2 with sidecar pools: revoked whole here; upstream trims them with "
    "the KV (unified_radix_cache.py _try_alloc_storage_hit L2733-2746; without sidecar pools "
    "the partial fallback is modelled)",
    "priority eviction: the workloads here give every request priority 0, so it orders as "
    "LRU does (upstream takes a request's priority from its API call)",
)
_TIMEOUT_CAP = (
    "timeout prefetch policy: the budget is capped at prefetch_timeout_max and its defaults "
    "are 2.0 s + 0.1 s per 1024 tokens, at most 30 s (hicache_storage.py "
    "PrefetchTimeoutConfig); here it is uncapped, 1.0 s + 0.25 s unless configured")
_HIRADIX = (
    "the default tree is HiRadixCache, whose every eviction policy orders by time.monotonic() "
    "(radix_cache.py TreeNode.__init__); the wall clock alone changes no decision while ranks "
    "run the same operations in the same order, and wallclock-lru's trigger is this runtime's "
    "own (synthetic), so the profile keeps the logical clock",
    "prefetch into a full L2: upstream falls back to the page-aligned part of the requested "
    "span that fits, before the L3 query; here the fallback comes after the query, on the "
    "agreed hit (0.5.20's order)",
    "fifo and filo eviction: a split's upper node is new (hiradix_cache.py _split_node makes "
    "a TreeNode, stamped at the split: 0.5.5 L811-818); here it keeps the split node's "
    "creation stamp, as 0.5.23 does",
)


def _profiles(*profiles: Profile) -> Mapping[str, Profile]:
    out = {p.name: p for p in profiles}
    if len(out) != len(profiles):
        raise RuntimeError("release profiles: a name is repeated")
    return MappingProxyType(out)


PROFILES: Mapping[str, Profile] = _profiles(
    Profile("sglang-0.5.5", "0.5.5", "HiRadixCache with per-stage ack drains and TP-only "
            "prefetch votes, before PP-aware HiCache", HostAlloc.PER_RANK,
            RELEASE_POLICIES_0505, (
                *_HIRADIX,
                "0.5.5 releases an incomplete prefetch's tail twice (_page_transfer L642-644 and "
                "prefetch_io_aux_func L655-658; HostKVCache.free does not check)",
            )),
    Profile("sglang-0.5.13", "0.5.13", "HiRadixCache with PP0's counts chained down the "
            "pipeline (#27285), the empty-set skip still in, TP-only prefetch votes",
            HostAlloc.PER_RANK, RELEASE_POLICIES_0520, (*_HIRADIX, _TIMEOUT_CAP)),
    Profile("sglang-0.5.16", "0.5.16", "HiRadixCache with every rank entering the ack "
            "exchange (#26923), bounded PP sends (#28916), PP-MIN host sizing (#29258); "
            "prefetch still voted over TP only", HostAlloc.PER_RANK, RELEASE_POLICIES_0520,
            (*_HIRADIX, _TIMEOUT_CAP)),
    Profile("sglang-0.5.20", "0.5.20", "the unified radix tree on a logical clock; every "
            "protocol fix this runtime models is in", HostAlloc.PER_RANK,
            RELEASE_POLICIES_0520, _POLICIES_0520),
    Profile("sglang-0.5.23", "0.5.23", "the release the default runtime stands for",
            HostAlloc.PER_RANK, RELEASE_POLICIES_0523, _POLICIES_0523),
    Profile("proposed", None, "no release: the fixed protocols plus the all-rank host "
            "allocation vote of #31425 (open), so that one rank's failed allocation cannot "
            "make the trees diverge", HostAlloc.AGREED, RELEASE_POLICIES_0523, _POLICIES_0523),
)

DEFAULT_PROFILE = "sglang-0.5.23"


def release_tuple(release: str | None) -> tuple[int, ...]:
    """``"0.5.16"`` as ``(0, 5, 16)``, to compare releases; None (no release: ``proposed``)
    as newer than any."""
    return (999,) if release is None else tuple(int(p) for p in release.split("."))


def unknown(name: object) -> str | None:
    """Why ``name`` is no profile (naming the known ones), or None."""
    if isinstance(name, str) and name in PROFILES:
        return None
    shown = repr(name)
    shown = shown if len(shown) <= 66 else shown[:63] + "..."
    return f"unknown profile {shown} (known: {', '.join(PROFILES)})"


def profile(name: str) -> Profile:
    """The profile called ``name``; ``KeyError`` says why there is none."""
    problem = unknown(name)
    if problem is not None:
        raise KeyError(problem)
    return PROFILES[name]


def synthetic(switches: frozenset[LegacySwitch]) -> list[LegacySwitch]:
    """The switches of a run that no release ran as this runtime does (grafted or
    synthetic), sorted: a failure with one of them on is no evidence about a release."""
    return sorted((s for s in switches if REGISTRY[s].fidelity is not Fidelity.RELEASE),
                  key=lambda s: s.value)


def describe(p: Profile) -> dict[str, object]:
    """What ``hicache profiles show`` prints (and ``--json`` gives): the profile, its switches
    with their fixes, the switches its release ran that it leaves off and why, and what is
    not modelled."""
    return {
        "name": p.name, "release": p.release, "summary": p.summary,
        "default": p.name == DEFAULT_PROFILE, "host_alloc": p.host_alloc.value,
        "policies": {"prefetch_timeout_clock": p.policies.timeout_clock.value,
                     "prefetch_timeout_budget": p.policies.timeout_budget.value,
                     "write_through_hit_counting": p.policies.hit_counting.value,
                     "eviction_policies": [e.value for e in EvictionPolicy
                                           if e in p.policies.eviction_policies]},
        "switches": [{"switch": s.value, "fixed_by": list(REGISTRY[s].fixes)}
                     for s in sorted(p.switches, key=lambda s: s.value)],
        "left_out": {s.value: why for s, why in sorted(p.left_out.items(),
                                                       key=lambda kv: kv[0].value)},
        "not_modelled": list(p.not_modelled),
    }
