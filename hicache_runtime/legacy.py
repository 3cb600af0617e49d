"""Legacy switches: named pre-fix behaviours of SGLang HiCache that the runtime can restore.

With no switch on, every protocol runs in its fixed form. Each switch restores one real
pre-fix code path, so the bug it caused can be reproduced on demand; switches compose, so a
combination restores an upstream version's state (``skip-empty-sync`` alone is 0.5.13's ack
drain, with ``local-ack-drain`` it is 0.5.5's). The names are stable: they appear on the
command line (``--legacy NAME``), in bundles, campaigns and the signature catalog.
``docs/legacy-switches.md`` gives, per switch, the upstream code it restores and what it does
not.
"""

from __future__ import annotations

from enum import Enum


class LegacySwitch(str, Enum):
    """One member per restorable pre-fix behaviour, with the upstream fix that removed it."""

    LOCAL_ACK_DRAIN = "local-ack-drain"
    """Each stage drains write/load acks by its own ``query()`` count: writes by a per-stage TP
    MIN, loads by the local count (fix: #27285 pp_sync)."""
    SKIP_EMPTY_SYNC = "skip-empty-sync"
    """The write-ack count exchange is skipped when the local in-flight set is empty, and the
    write-backup host allocation is rank-local (fix: #26923). Without ``local-ack-drain`` the
    counts are PP0's, chained down the pipeline one message per check (0.5.13)."""
    LOCAL_PREFETCH_PROGRESS = "local-prefetch-progress"
    """Prefetch hit length, terminate and settled progress are voted over each stage's TP ranks
    only; stages never agree (fix: #27010)."""
    ABORT_EARLY_EXIT = "abort-early-exit"
    """The prefetch IO thread stops acking once its op is aborted/terminated (fix: #27010)."""
    SUM_HIT_PAGES = "sum-hit-pages"
    """Sidecar hit pages counted with sum() instead of the leading run (fix: #31443)."""
    UNBOUNDED_PP_SENDS = "unbounded-pp-sends"
    """PP0 keeps every isend of the count chain, reaping only completed ones (fix: #28916)."""
    LOCAL_HOST_CAPACITY = "local-host-capacity"
    """A fixed host-pool size is converted to tokens per stage without a PP MIN (fix: #29258)."""
    WALLCLOCK_LRU = "wallclock-lru"
    """LRU ordered by time.monotonic() instead of a logical clock, one stamp taken when the
    rank finds its own copy finished (fix: #22607 item 4)."""
    ABORT_FREES_IN_FLIGHT = "abort-frees-in-flight"
    """Aborting a request frees its prefetch host pages while the IO thread's batch in flight
    still lands in them (fix: #31296)."""

    @property
    def upstream_fix(self) -> str:
        return _FIXES[self]


_FIXES = {
    LegacySwitch.LOCAL_ACK_DRAIN: "#27285",
    LegacySwitch.SKIP_EMPTY_SYNC: "#26923",
    LegacySwitch.LOCAL_PREFETCH_PROGRESS: "#27010",
    LegacySwitch.ABORT_EARLY_EXIT: "#27010",
    LegacySwitch.SUM_HIT_PAGES: "#31443",
    LegacySwitch.UNBOUNDED_PP_SENDS: "#28916",
    LegacySwitch.LOCAL_HOST_CAPACITY: "#29258",
    LegacySwitch.WALLCLOCK_LRU: "#22607",
    LegacySwitch.ABORT_FREES_IN_FLIGHT: "#31296",
}


def parse_legacy(names: list[str]) -> frozenset[LegacySwitch]:
    """Turn ``--legacy`` values into switches; unknown names raise ``ConfigError``."""
    from hicache_runtime.errors import ConfigError

    out: set[LegacySwitch] = set()
    for name in names:
        for part in filter(None, (p.strip() for p in name.split(","))):
            try:
                out.add(LegacySwitch(part))
            except ValueError:
                known = ", ".join(s.value for s in LegacySwitch)
                raise ConfigError(
                    "legacy", f"unknown switch {part!r}", hint=f"known: {known}"
                ) from None
    return frozenset(out)
