"""Release profiles: what the runtime runs to stand for one SGLang release, by name.

A profile is the set of protocols a release shipped, as far as this runtime models them: the
legacy switches whose pre-fix code the release still ran (from the switch registry: a switch is
in ``sglang-X`` when X is in its ``broken_in`` and its fidelity is ``release``), and how host
(L2) pages are allocated. Everything else a release did differently is listed with the profile
(:attr:`Profile.not_modelled`), so a result is never read as more than it is.

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


@dataclass(frozen=True)
class Profile:
    """One named profile."""

    name: str
    release: str | None
    """The SGLang version, or None for ``proposed``."""
    summary: str
    host_alloc: HostAlloc
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


#: The policies every release's tree runs differently from this runtime (cited in
#: ``docs/legacy-switches.md``, "Profiles"); none of them is modelled yet.
_POLICIES_0523 = (
    "prefetch into a full L2 with sidecar pools: upstream trims the pools' pages with the KV's "
    "(allocate_storage_hit L796-829); here such a prefetch is revoked whole (without sidecar "
    "pools the partial fallback is modelled: the page-aligned prefix that fits, at least the "
    "prefetch threshold, taken per rank)",
    "timeout prefetch policy: upstream's clock starts at the first blocked admission poll and "
    "never expires once the KV has landed (unified_radix_cache.py L2259-2283), budget base + "
    "per_ki_token x requested tokens / 1024 (1.0 s, 0.25 s); here the clock starts at "
    "submission",
    "write_through_selective: upstream counts a node's hits on inserts past the request's own "
    "inserted length (unified_tree_core.py L1371-1373); here a request's own chunk re-inserts "
    "count too",
    "eviction: upstream offers lru, lfu, fifo, mru, filo, priority, slru and tlru "
    "(evict_policy.py), all over a logical clock; here LRU only",
)
_POLICIES_0520 = (
    "prefetch into a full L2 with sidecar pools: revoked whole here; upstream trims them with "
    "the KV (unified_radix_cache.py _try_alloc_storage_hit L2733-2746; without sidecar pools "
    "the partial fallback is modelled)",
    "timeout prefetch policy: upstream's clock starts at op creation, budget base + agreed hit "
    "pages x per-page (L2056-2061)",
    "write_through_selective: upstream skips every chunked insert and counts the request's own "
    "chunk nodes at its final insert (unified_tree_core.py L1010-1029)",
    "eviction: upstream offers lru, lfu, fifo, mru, filo, priority, slru; here LRU only",
)
_HIRADIX = (
    "the default tree is HiRadixCache, whose every eviction policy orders by time.monotonic() "
    "(radix_cache.py TreeNode.__init__); the wall clock alone changes no decision while ranks "
    "run the same operations in the same order, and wallclock-lru's trigger is this runtime's "
    "own (synthetic), so the profile keeps the logical clock",
    "prefetch into a full L2: upstream falls back to the page-aligned part of the requested "
    "span that fits, before the L3 query; here the fallback comes after the query, on the "
    "agreed hit (0.5.20's order)",
)


def _profiles(*profiles: Profile) -> Mapping[str, Profile]:
    out = {p.name: p for p in profiles}
    if len(out) != len(profiles):
        raise RuntimeError("release profiles: a name is repeated")
    return MappingProxyType(out)


PROFILES: Mapping[str, Profile] = _profiles(
    Profile("sglang-0.5.5", "0.5.5", "HiRadixCache with per-stage ack drains and TP-only "
            "prefetch votes, before PP-aware HiCache", HostAlloc.PER_RANK, (
                *_HIRADIX,
                "0.5.5 releases an incomplete prefetch's tail twice (_page_transfer L642-644 and "
                "prefetch_io_aux_func L655-658; HostKVCache.free does not check)",
            )),
    Profile("sglang-0.5.13", "0.5.13", "HiRadixCache with PP0's counts chained down the "
            "pipeline (#27285), the empty-set skip still in, TP-only prefetch votes",
            HostAlloc.PER_RANK, _HIRADIX),
    Profile("sglang-0.5.16", "0.5.16", "HiRadixCache with every rank entering the ack "
            "exchange (#26923), bounded PP sends (#28916), PP-MIN host sizing (#29258); "
            "prefetch still voted over TP only", HostAlloc.PER_RANK, _HIRADIX),
    Profile("sglang-0.5.20", "0.5.20", "the unified radix tree on a logical clock; every "
            "protocol fix this runtime models is in", HostAlloc.PER_RANK, _POLICIES_0520),
    Profile("sglang-0.5.23", "0.5.23", "the release the default runtime stands for",
            HostAlloc.PER_RANK, _POLICIES_0523),
    Profile("proposed", None, "no release: the fixed protocols plus the all-rank host "
            "allocation vote of #31425 (open), so that one rank's failed allocation cannot "
            "make the trees diverge", HostAlloc.AGREED, _POLICIES_0523),
)

DEFAULT_PROFILE = "sglang-0.5.23"


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
        "switches": [{"switch": s.value, "fixed_by": list(REGISTRY[s].fixes)}
                     for s in sorted(p.switches, key=lambda s: s.value)],
        "left_out": {s.value: why for s, why in sorted(p.left_out.items(),
                                                       key=lambda kv: kv[0].value)},
        "not_modelled": list(p.not_modelled),
    }
