"""Legacy switches: named pre-fix behaviours of SGLang HiCache that the runtime can restore.

With no switch on, every protocol runs in its fixed form. Each switch restores one real
pre-fix code path, so the bug it caused can be reproduced on demand; switches compose, so a
combination restores an upstream version's state (``skip-empty-sync`` alone is 0.5.13's ack
drain, with ``local-ack-drain`` it is 0.5.5's). The names are stable: they appear on the
command line (``--legacy NAME``), in bundles, campaigns and the signature catalog.
``docs/legacy-switches.md`` gives, per switch, the upstream code it restores and what it does
not. The campaign cell id (which switches run under which faults, on which topology) is
written and read here too, at the end.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any


class LegacySwitch(str, Enum):
    """One member per restorable pre-fix behaviour; ``REGISTRY`` holds its upstream fix, the
    versions it restores and the campaign recipe that exposes it."""

    LOCAL_ACK_DRAIN = "local-ack-drain"
    """Each stage drains write/load acks by its own ``query()`` count: writes by a per-stage TP
    MIN, loads by the local count."""
    SKIP_EMPTY_SYNC = "skip-empty-sync"
    """The write-ack count exchange is skipped when the local in-flight set is empty, and the
    write-backup host allocation is rank-local. Without ``local-ack-drain`` the
    counts are PP0's, chained down the pipeline one message per check (0.5.13)."""
    LOCAL_PREFETCH_PROGRESS = "local-prefetch-progress"
    """Prefetch hit length, terminate and settled progress are voted over each stage's TP ranks
    only; stages never agree."""
    ABORT_EARLY_EXIT = "abort-early-exit"
    """The prefetch IO thread stops acking once its op is aborted/terminated."""
    SUM_HIT_PAGES = "sum-hit-pages"
    """Sidecar hit pages counted with sum() instead of the leading run."""
    UNBOUNDED_PP_SENDS = "unbounded-pp-sends"
    """PP0 keeps every isend of the count chain, reaping only completed ones."""
    LOCAL_HOST_CAPACITY = "local-host-capacity"
    """A fixed host-pool size is converted to tokens per stage without a PP MIN."""
    WALLCLOCK_LRU = "wallclock-lru"
    """LRU ordered by time.monotonic() instead of a logical clock, one stamp taken when the
    rank finds its own copy finished."""
    PER_RANK_CHUNK_TIMING = "per-rank-chunk-timing"
    """Dynamic chunking: every rank times its own stage at start-up and fits its own latency
    model, dropping the samples PP0 broadcast."""
    ABORT_FREES_IN_FLIGHT = "abort-frees-in-flight"
    """Aborting a request frees its prefetch host pages while the IO thread's batch in flight
    still lands in them."""
    ABORT_CHUNKED_ON_THE_SPOT = "abort-chunked-on-the-spot"
    """An abort of a request between two chunks of its prefill tears it down where and when
    it arrives (rank 0, mid-step) instead of riding the next step's plan to every rank."""

    @property
    def upstream_fix(self) -> str:
        """The upstream PR that removed this behaviour (the first, where several did)."""
        return REGISTRY[self].fixes[0]


@dataclass(frozen=True)
class Exposure:
    """One row of the default campaign that exposes a switch: the switch under these faults
    fails as ``expect`` says, and the fixed protocols under the same faults stay healthy."""

    faults: tuple[str, ...]
    """Fault specs in their compact form (as cell ids write them); empty for none."""
    expect: tuple[str, ...]
    """Signature ids any of which passes the cell; the first is the usual one."""
    tp: int = 1
    pp: int = 1
    config: Mapping[str, Any] = field(default_factory=dict)
    """Dotted config overrides on top of the default campaign's defaults."""
    warm: bool = False
    """A fault-free run fills L3 first."""


class Fidelity(str, Enum):
    """How faithfully a switch reproduces what a release ran (``docs/legacy-switches.md``)."""

    RELEASE = "release"
    """The release's own pre-fix code path, met by the trigger that release met: a run with
    it is evidence about the releases in ``broken_in``."""
    GRAFTED = "grafted"
    """The release's pre-fix piece carried onto this runtime's post-fix protocols, a
    combination no release shipped: the failure shows what the fix guards against, not what a
    release did."""
    SYNTHETIC = "synthetic"
    """A trigger or a code path no release had (a stronger or a relocated form of the
    pre-fix hazard): a reproduction, never evidence about a release."""


@dataclass(frozen=True)
class SwitchEntry:
    """Everything the project states about one switch, in one place. The README table, the
    default campaign, the catalog's campaign cells, the doctor's runtime fixtures and
    ``docs/legacy-switches.md`` are checked against it (``tests/test_single_source.py``)."""

    switch: LegacySwitch
    fixes: tuple[str, ...]
    """Upstream SGLang PRs that removed the behaviour, e.g. ``#27285``."""
    broken_in: tuple[str, ...]
    """Released SGLang versions (of 0.5.5, 0.5.13, 0.5.16, 0.5.20, 0.5.23, the ones read line
    by line) that run the pre-fix code this switch restores; empty when none does."""
    exposures: tuple[Exposure, ...]
    fidelity: Fidelity = Fidelity.RELEASE
    fidelity_note: str = ""
    """Why the switch is grafted or synthetic (empty for ``release``)."""

    @property
    def in_profiles(self) -> bool:
        """Release profiles turn on only switches that run what a release ran."""
        return self.fidelity is Fidelity.RELEASE


def _entries(*entries: SwitchEntry) -> Mapping[LegacySwitch, SwitchEntry]:
    out = {e.switch: e for e in entries}
    missing = set(LegacySwitch) - set(out)
    if missing or len(out) != len(entries):  # a module-load error, not a late KeyError
        raise RuntimeError(f"legacy registry: missing or repeated switches {missing}")
    return MappingProxyType(out)


_FILE_L3 = {"storage.backend": "file", "cache.host_tokens": 768}
#: Long prompts chunked several times under dynamic chunking; a short profile (12 sizes).
_DYNAMIC_CHUNKING = {"scheduler.enable_dynamic_chunking": True,
                     "scheduler.dynamic_chunking_samples": 12, "workload.kind": "long_context",
                     "workload.long_context_tokens": 768, "cache.device_tokens": 2048,
                     "workload.requests": 8, "observability.consensus_check": True}

REGISTRY: Mapping[LegacySwitch, SwitchEntry] = _entries(
    SwitchEntry(LegacySwitch.LOCAL_ACK_DRAIN, ("#27285",), ("0.5.5",), (
        Exposure(("dma-lag:pp=1,ms=30",), ("prefix-length-mismatch", "write-ack-pop-empty"),
                 pp=2, config={"cache.device_tokens": 256}),
    )),
    SwitchEntry(LegacySwitch.SKIP_EMPTY_SYNC, ("#26923",), ("0.5.5", "0.5.13"), (
        Exposure(("host-alloc-fail:tp=1",), ("collective-order-deadlock",), tp=2,
                 config={"workload.requests": 24}),
        Exposure(("host-alloc-fail:pp=1",), ("write-ack-pop-empty",), pp=2,
                 config={"cache.device_tokens": 2048}),
    )),
    SwitchEntry(LegacySwitch.LOCAL_PREFETCH_PROGRESS, ("#27010",), ("0.5.5", "0.5.13", "0.5.16"), (
        # the stages' different prefetch lengths fail PP1 in its reshape, or (a loaded machine
        # times the acks so) first in its ack drain, which pops PP0's count
        Exposure(("storage-shortfall:pp=1,mode=short,pages=3",),
                 ("prefix-length-mismatch", "write-ack-pop-empty"),
                 pp=2, config=_FILE_L3, warm=True),
    )),
    SwitchEntry(LegacySwitch.ABORT_EARLY_EXIT, ("#27010",), ("0.5.5", "0.5.13", "0.5.16"), (
        # two pages per L3 batch: any op of three pages or more reaches batch 1 (at eight,
        # whether one came before the run ended depended on the seed and the machine's load)
        Exposure(("mid-prefetch-abort:batch=1",), ("prefetch-abort-ack-starvation",), tp=2,
                 config={**_FILE_L3, "storage.io_batch_pages": 2}),
    ), Fidelity.GRAFTED, "the releases with the early break had no per-batch acks: the "
       "starvation needs #27010's ack protocol, which none of them ran"),
    SwitchEntry(LegacySwitch.SUM_HIT_PAGES, ("#31443",), ("0.5.13", "0.5.16"), (
        Exposure(("storage-shortfall:mode=holes,pages=1,at=1,pool=sidecar",),
                 ("prefetch-gap-overcount",),
                 config={**_FILE_L3, "model.sidecars": ["all_pages"]}, warm=True),
    ), Fidelity.GRAFTED, "the exposure runs sum() on otherwise fixed prefetch protocols; "
       "0.5.13 and 0.5.16 counted so on hybrid models only, beside their other pre-fix "
       "prefetch paths"),
    SwitchEntry(LegacySwitch.UNBOUNDED_PP_SENDS, ("#28916",), ("0.5.13",), (
        Exposure(("stage-lag:pp=1,ms=10",), ("pp-sync-send-leak",), pp=2,
                 config={"workload.requests": 24}),
    )),
    SwitchEntry(LegacySwitch.LOCAL_HOST_CAPACITY, ("#29258",), ("0.5.5", "0.5.13"), (
        # No fault: three layers over two stages give the stages different per-token sizes.
        Exposure((), ("host-capacity-divergence",), pp=2,
                 config={"model.num_layers": 3, "cache.host_bytes": 1572864,
                         "cache.host_tokens": None}),
    )),
    SwitchEntry(LegacySwitch.WALLCLOCK_LRU, ("#22607",), ("0.5.5", "0.5.13", "0.5.16"), (
        # a hold in steps, not a lag in time: a 100 ms lag hid inside one step once steps
        # took longer than that on a loaded machine, and the run stayed healthy now and then
        Exposure(("dma-lag:rank=1,hold=3",), ("lru-clock-divergence",), tp=2,
                 config={"cache.device_tokens": 1024, "cache.host_tokens": 512,
                         "workload.requests": 48, "observability.consensus_check": True}),
    ), Fidelity.SYNTHETIC, "the wall clock is the releases' own; the stamp taken when a rank "
       "finds its own copy finished is this runtime's trigger, not theirs"),
    SwitchEntry(LegacySwitch.PER_RANK_CHUNK_TIMING, ("#37669", "#37675"),
                ("0.5.13", "0.5.16"), (
        # PP0's start-up forwards (step 0) are slowed per token: its own fit leans linear and
        # keeps continuation chunks near the base; PP1's stays quadratic and cuts them small.
        # PP1 fails on PP0's first continuation chunk, unless the consensus check names the
        # divergent chunk decision first.
        Exposure(("compute-lag:pp=0,steps=0-0,ms=500",),
                 ("prefix-length-mismatch", "rank-divergence-detected"), pp=2,
                 config=_DYNAMIC_CHUNKING),
    ), Fidelity.SYNTHETIC, "upstream dropped only the attention-CP broadcast's result (ranks "
       "part with CP > 1); this runtime has no CP and lets every rank of the pipeline fit "
       "its own samples"),
    SwitchEntry(LegacySwitch.ABORT_FREES_IN_FLIGHT, ("#31296", "#31668"), ("0.5.13", "0.5.16"), (
        Exposure(("mid-prefetch-abort:batch=0",), ("prefetch-abort-use-after-free",), tp=2,
                 config={**_FILE_L3, "workload.requests": 96}),
    ), Fidelity.SYNTHETIC, "upstream freed only sidecar pools' pages under a read in flight; "
       "the switch frees the op's KV pages too"),
    SwitchEntry(LegacySwitch.ABORT_CHUNKED_ON_THE_SPOT, ("#28086",), (), (
        # A large L1: no eviction follows the teardown before the batches part.
        Exposure(("chunked-abort:chunk=0",), ("collective-shape-mismatch",), tp=2,
                 config={"cache.device_tokens": 2048}),
    ), Fidelity.SYNTHETIC, "no release tore a chunked request down on the spot: 0.5.13 ran "
       "its remaining chunks on every rank"),
)


def parse_legacy(names: list[str]) -> frozenset[LegacySwitch]:
    """Turn ``--legacy`` values into switches; unknown names raise ``ConfigError``."""
    from hicache_runtime.contracts.errors import ConfigError, nearest

    out: set[LegacySwitch] = set()
    for name in names:
        for part in filter(None, (p.strip() for p in name.split(","))):
            try:
                out.add(LegacySwitch(part))
            except ValueError:
                known = [s.value for s in LegacySwitch]
                close = nearest(part, known)
                raise ConfigError(
                    "legacy", f"unknown switch {part!r}"
                    + (f"; did you mean {close!r}?" if close else ""),
                    hint=f"the switches: {', '.join(known)}.") from None
    return frozenset(out)

# --- campaign cell ids ------------------------------------------------------------------------
# A switch is exercised by campaign cells (an Exposure above is one), named
# ``<topology>/<mode>/<faults>[/seed<N>]``: ``tp2pp2/fixed/dma-lag:pp=1,ms=30`` or
# ``tp2/abort-frees-in-flight+sum-hit-pages/none/seed3``: the topology (``tp1`` for one rank),
# the switches joined by ``+`` in sorted order (or ``fixed``), the faults' compact specs joined
# by ``;`` (or ``none``), and the seed when a campaign runs several. The campaign writes ids
# (``faults/campaign/plan.py``), the catalog names the cell that shows each signature
# (``signatures/models.py``); both go through :func:`format_cell_id` and :func:`parse_cell_id`,
# the one grammar. A fault spec may hold ``/`` (a request-id glob), so the faults are whatever
# lies between the mode and an optional trailing ``/seed<N>``.

FIXED = "fixed"
"""The mode of a cell with no legacy switch."""
NO_FAULTS = "none"
"""The faults part of a cell with no fault."""

_TOPOLOGY = re.compile(r"tp\d+(?:pp\d+)?|pp\d+")
_MODE = re.compile(r"[a-z][a-z0-9-]*(?:\+[a-z][a-z0-9-]*)*")
_SEED = re.compile(r"/seed(\d{1,9})$")


@dataclass(frozen=True)
class CellId:
    """A cell id's parts."""

    topology: str
    switches: tuple[str, ...]
    """The legacy switches, sorted; empty for a ``fixed`` cell."""
    faults: str
    """The faults' compact specs joined by ``;``, or ``none``."""
    seed: int | None = None

    @property
    def mode(self) -> str:
        return mode_label(self.switches)

    def __str__(self) -> str:
        text = f"{self.topology}/{self.mode}/{self.faults}"
        return text if self.seed is None else f"{text}/seed{self.seed}"

    def fixed_twin(self) -> CellId:
        """The same cell with every switch off."""
        return CellId(self.topology, (), self.faults, self.seed)


def topology_label(tp: int, pp: int) -> str:
    """``tp2pp2``, ``pp2``, ``tp2``; ``tp1`` for one rank."""
    return "".join(p for p in (f"tp{tp}" if tp > 1 else "", f"pp{pp}" if pp > 1 else "")
                   if p) or "tp1"


def mode_label(switches: list[str] | tuple[str, ...]) -> str:
    """The legacy switches of a cell joined in sorted order, or ``fixed``."""
    return "+".join(sorted(switches)) or FIXED


def format_cell_id(tp: int, pp: int, switches: list[str] | tuple[str, ...], faults: str,
                   seed: int | None = None) -> str:
    """The id of a cell; ``faults`` is already its label (compact specs joined, or ``none``)."""
    return str(CellId(topology_label(tp, pp), tuple(sorted(switches)), faults or NO_FAULTS,
                      seed))


def parse_cell_id(text: str) -> CellId | None:
    """The parts of a cell id, or None when ``text`` is not one."""
    seed = None
    m = _SEED.search(text)
    if m is not None:
        seed, text = int(m.group(1)), text[:m.start()]
    topology, sep, rest = text.partition("/")
    mode, sep2, faults = rest.partition("/")
    if not (sep and sep2 and faults and _TOPOLOGY.fullmatch(topology)
            and _MODE.fullmatch(mode)) or any(c.isspace() for c in faults):
        return None
    switches = () if mode == FIXED else tuple(mode.split("+"))
    if FIXED in switches or list(switches) != sorted(switches):
        return None
    return CellId(topology, switches, faults, seed)
