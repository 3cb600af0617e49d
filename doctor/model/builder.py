"""Collects evidence from every parser and resolves rank identities at the end.

Artifacts name their rank in different ways: a bundle or a torchrun prefix gives the global rank,
an SGLang log prefix gives ``TP1 PP0``, a Flight Recorder file name gives the global rank, a
pasted traceback gives nothing. Parsers ask :meth:`EvidenceBuilder.slot` for the record that
matches their :class:`RankHint`; :meth:`EvidenceBuilder.finish` then maps TP/PP coordinates to
global ranks (``rank = pp * tp_size + tp``, SGLang's layout) once the topology is known and
merges the records that turn out to be the same rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from doctor.model.evidence import InputRecord, KvContext, RankEvidence, RankHint, SourceRef

_Key = tuple[str, int | None, int | None, int | None]
MAX_WORLD = 65536
MAX_SLOTS = 4096
"""Distinct rank identities kept; evidence beyond them goes to the unranked record."""
MAX_RETAINED = 128 << 20
"""Trace evidence kept across all ranks, in accounted bytes (line length plus a fixed cost per
item): the per-rank caps times thousands of ranks would not be a bound on their own."""
ITEM_COST = 256


@dataclass
class Topology:
    """What the inputs say about the job's shape; each value with where it was read."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    world: int | None = None
    sources: list[str] = field(default_factory=list)

    def set(self, name: str, value: int, source: str) -> None:
        """Record ``name=value`` unless already known or implausible (a hostile log must not
        make the doctor expect a billion ranks)."""
        if not 0 < value <= MAX_WORLD or getattr(self, name) is not None:
            return
        setattr(self, name, value)
        self.sources.append(f"{name}={value} ({source})")

    @property
    def world_size(self) -> int | None:
        if self.world is not None:
            return self.world
        if self.tp is not None:
            return self.tp * (self.pp or 1)
        return None


@dataclass
class Evidence:
    """The resolved evidence of one doctor run."""

    ranks: dict[int, RankEvidence]
    unranked: RankEvidence
    topology: Topology
    inputs: list[InputRecord]
    problems: list[str]
    legacy: dict[str, SourceRef]
    faults: list[str]
    outcome: str | None
    outcome_source: SourceRef | None
    mismatches: int
    expected_ranks: set[int]
    pid_ranks: dict[int, int] = field(default_factory=dict)
    mismatch_examples: list[dict[str, object]] = field(default_factory=list)
    """The first few output mismatches a manifest lists (rid, index, expected, got, note)."""
    kv: KvContext = field(default_factory=KvContext)
    """Which KV storage and transfer layers the inputs show in use."""
    versions: dict[str, tuple[str, SourceRef]] = field(default_factory=dict)
    """The upstream versions the inputs state, by system (the first statement of each)."""

    def all_ranks(self) -> list[RankEvidence]:
        """Every rank record, the unranked one last."""
        return [self.ranks[r] for r in sorted(self.ranks)] + [self.unranked]


class EvidenceBuilder:
    """Mutable collection point. Parsers call ``slot``, ``topology.set``, ``problem``..."""

    def __init__(self) -> None:
        self._slots: dict[_Key, RankEvidence] = {}
        self.unranked = RankEvidence(rank=-1)
        self.topology = Topology()
        self.inputs: list[InputRecord] = []
        self.problems: list[str] = []
        self.legacy: dict[str, SourceRef] = {}
        self.faults: list[str] = []
        self.outcome: str | None = None
        self.outcome_source: SourceRef | None = None
        self.mismatches = 0
        self.mismatch_examples: list[dict[str, object]] = []
        self.expected_ranks: set[int] = set()
        self.pid_ranks: dict[int, int] = {}
        """pid -> global rank, from bundles and capture manifests (py-spy dumps name pids)."""
        self.kv = KvContext()
        self.versions: dict[str, tuple[str, SourceRef]] = {}
        self.retained = 0
        self.not_retained = 0
        self.moved_threads: set[tuple[int, str]] = set()
        """(pid, thread id) of threads a capture saw move between its samples."""

    def add_expected_rank(self, rank: object) -> bool:
        """Note a rank the job has; only ``0 <= rank < MAX_WORLD`` (inputs are untrusted: a
        manifest may claim a negative rank or millions of them)."""
        if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < MAX_WORLD:
            self.expected_ranks.add(rank)
            return True
        return False

    def retain(self, nbytes: int) -> bool:
        """Whether an item of trace evidence of about ``nbytes`` may still be kept (the global
        budget, :data:`MAX_RETAINED`); a refused item is counted and reported."""
        cost = nbytes + ITEM_COST
        if self.retained + cost > MAX_RETAINED:
            self.not_retained += 1
            return False
        self.retained += cost
        return True

    def slot(self, hint: RankHint) -> RankEvidence:
        """The record for the rank ``hint`` names (the unranked record if it names none)."""
        if hint.rank is not None:
            key: _Key = ("r", hint.rank, None, None)
        elif hint.tp is not None or hint.pp is not None:
            key = ("c", hint.tp or 0, hint.pp or 0, hint.dp)
        else:
            return self.unranked
        ev = self._slots.get(key)
        if ev is None and len(self._slots) >= MAX_SLOTS:
            return self.unranked
        if ev is None:
            ev = self._slots[key] = RankEvidence(rank=hint.rank if hint.rank is not None else -1)
        for attr in ("tp", "pp", "dp"):
            if getattr(ev, attr) is None and getattr(hint, attr) is not None:
                setattr(ev, attr, getattr(hint, attr))
        return ev

    def note_version(self, system: str, version: str, source: SourceRef) -> None:
        """The inputs state that ``system`` runs ``version`` (the first statement stands)."""
        if system not in self.versions and len(self.versions) < 16:
            self.versions[system] = (version[:32], source)

    def problem(self, message: str) -> None:
        if len(self.problems) < 200:
            self.problems.append(message)

    def set_outcome(self, outcome: str, source: SourceRef) -> None:
        if self.outcome is None:
            self.outcome, self.outcome_source = outcome, source

    def finish(self) -> Evidence:
        """Resolve coordinates to global ranks and merge duplicates."""
        if self.not_retained:
            self.problem(f"trace evidence reached its {MAX_RETAINED >> 20} MiB budget: "
                         f"{self.not_retained} later event(s) were read but not kept")
        topo = self.topology
        tp_size = topo.tp or _max_plus_one(k[1] for k in self._slots if k[0] == "c")
        ranks: dict[int, RankEvidence] = {}
        for key, ev in sorted(self._slots.items(), key=lambda kv: (kv[0][0] != "r", kv[0][1:])):
            if key[0] == "r":
                rank = ev.rank
            else:
                tp, pp = key[1] or 0, key[2] or 0
                rank = pp * tp_size + tp
                ev.rank = rank
            if ev.tp is None and topo.tp:
                ev.tp, ev.pp = rank % topo.tp, rank // topo.tp
            if rank in ranks:
                ranks[rank].merge(ev)
            else:
                ranks[rank] = ev
        self._assign_by_pid(ranks)
        if self.moved_threads:
            for ev in [*ranks.values(), self.unranked]:
                for t in ev.threads:
                    t.moved = t.moved or (t.pid, t.tid) in self.moved_threads
        world = topo.world_size
        expected = set(self.expected_ranks)
        if world is not None:
            expected |= set(range(min(world, MAX_WORLD)))
        return Evidence(ranks=ranks, unranked=self.unranked, topology=topo, inputs=self.inputs,
                        problems=self.problems, legacy=self.legacy, faults=self.faults,
                        outcome=self.outcome, outcome_source=self.outcome_source,
                        mismatches=self.mismatches, expected_ranks=expected,
                        pid_ranks=dict(self.pid_ranks),
                        mismatch_examples=list(self.mismatch_examples), kv=self.kv,
                        versions=dict(self.versions))


    def _assign_by_pid(self, ranks: dict[int, RankEvidence]) -> None:
        """Move unranked thread dumps whose pid is known to belong to a rank."""
        for ev in ranks.values():
            if ev.pid is not None:
                self.pid_ranks.setdefault(ev.pid, ev.rank)
        if not self.pid_ranks:
            return
        keep = RankEvidence(rank=-1)
        for t in self.unranked.threads:
            rank = self.pid_ranks.get(t.pid) if t.pid is not None else None
            if rank is None:
                keep.threads.append(t)
                continue
            target = ranks.setdefault(rank, RankEvidence(rank=rank))
            target.threads.append(t)
            target.kinds.add(t.origin)
        self.unranked.threads = keep.threads


def _max_plus_one(values: object) -> int:
    nums = [v for v in values if isinstance(v, int)]  # type: ignore[attr-defined]
    return max(nums) + 1 if nums else 1
