"""One run, end to end: the cached run, its cache-disabled reference, the verdict, the bundle.

``run_single`` executes a single-rank run in this process. The outcome is:

* ``crash`` — the rank raised (the bundle holds the traceback and all-thread stacks);
* ``hang`` — the step watchdog saw no progress for ``watchdog_timeout_s`` (stacks are taken while
  the scheduler is still stuck, then it is interrupted);
* ``wrong-output`` — the run finished but some request's tokens differ from the reference;
* ``healthy`` — otherwise.

Every non-healthy outcome leaves a bundle whose manifest validates against ``bundle.Manifest``.

``run_multi`` launches ``tp * pp`` rank processes and reads back each rank's result; with several
DP groups (``topology.dp``) the DP controller starts every group's ranks and routes the
requests (:mod:`hicache_runtime.launch.dp_controller`), results are keyed by grid rank and the
run's requests are those of every group's entry rank; the reference is one group's run. Both
paths end the same way: every rank's :class:`~hicache_runtime.contracts.rank_result.RankResult`
(built in process for a single rank) is summarised by one builder, and a healthy run is judged
against its cache-disabled reference by one verdict.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hicache_runtime.cache.accounting import DrainAccount, drain_account, reached_drain
from hicache_runtime.config import RuntimeConfig
from hicache_runtime.contracts.bundle import (
    FiredFaultRecord,
    RankEntry,
    RunOutcome,
    bundle_writing,
    load_manifest,
    new_bundle_dir,
    write_manifest,
)
from hicache_runtime.contracts.outcome import classify
from hicache_runtime.contracts.rank_result import RankResult
from hicache_runtime.engine.evidence import dump_rank
from hicache_runtime.engine.loop import Engine, EngineResult
from hicache_runtime.engine.rank import RankRuntime, build_rank
from hicache_runtime.engine.workload import Workload
from hicache_runtime.kv.request import Req, ReqStatus
from hicache_runtime.l3.backend import StorageStats
from hicache_runtime.launch.bundles import build_manifest, kept_bundle
from hicache_runtime.launch.results import rank_result
from hicache_runtime.launch.side_channel import ProgressFn
from hicache_runtime.launch.threads import pinned_threads
from hicache_runtime.launch.watchdog import (
    StepWatchdog,
    install_interrupt_handler,
    interrupt_main_thread,
)

DEFAULT_BUNDLE_ROOT = Path("hicache-bundles")


class CachedTokens(BaseModel):
    """Prompt tokens served from each tier instead of being recomputed."""

    device: int = 0
    host: int = 0
    storage: int = 0


class Mismatch(BaseModel):
    """A request whose output differs from the cache-disabled reference."""

    rid: str
    index: int
    """First differing token position (or -1 when the request is missing on one side)."""
    expected: list[int]
    got: list[int]
    note: str = ""


TIME_DECIMALS = 3
"""Every duration in a run result is in seconds, rounded to the millisecond."""


def seconds(value: float | None) -> float | None:
    return None if value is None else round(float(value), TIME_DECIMALS)


class L3Stats(BaseModel):
    """One rank's L3 pipeline counters and its backend's (``StorageStats``)."""

    model_config = ConfigDict(extra="forbid")
    prefetch_issued: int = 0
    prefetch_revoked: int = 0
    prefetch_rate_limited: int = 0
    prefetched_tokens: int = 0
    backup_pages: int = 0
    backup_failed_pages: int = 0
    query_errors: int = 0
    """Storage calls that raised in the prefetch query thread (caught: the op hit nothing)."""
    io_errors: int = 0
    """Storage calls that raised in the prefetch IO thread (caught: the batch loaded nothing,
    the op still acked every batch)."""
    backup_errors: int = 0
    """Storage calls that raised in the backup thread (caught: the backup failed, still acked)."""
    query_shed: int = 0
    """Prefetch queries given up: queued longer than the IO budget (a slow backend)."""
    backup_shed_pages: int = 0
    """Backup pages given up when the IO budget ran out (a slow backend)."""
    late_writes_posted: int = 0
    """``abort-frees-in-flight`` only: late prefetch batches still arriving after the abort
    freed their pages (each lands when a load-back reads one of those pages)."""
    late_writes_read: int = 0
    """``abort-frees-in-flight`` only: late batches that landed on a new owner's copy as a
    load-back read it (that load read the late data); the rest were never read."""
    backend: StorageStats = Field(default_factory=StorageStats)

    @field_validator("backend", mode="after")
    @classmethod
    def _round_times(cls, b: StorageStats) -> StorageStats:
        rounded: dict[str, Any] = {k: seconds(v) if isinstance(v, float) else v
                                   for k, v in b.as_dict().items()}
        return StorageStats(**rounded)


class RankCacheStats(BaseModel):
    """One rank's cache counters (tokens, L1/L2); ``l3`` when the run has an L3 store."""

    model_config = ConfigDict(extra="forbid")
    backup_tokens: int = 0
    backup_skipped: int = 0
    load_tokens: int = 0
    load_skipped: int = 0
    evicted_device: int = 0
    evicted_host: int = 0
    l3: L3Stats | None = None


class CacheStats(BaseModel):
    """Cache counters of every rank, keyed by global rank, and their sum over the ranks: the
    same shape for one rank and for many (a single-rank run has rank 0)."""

    model_config = ConfigDict(extra="forbid")
    ranks: dict[int, RankCacheStats] = {}
    total: RankCacheStats = RankCacheStats()

    @classmethod
    def of(cls, ranks: dict[int, dict[str, Any]]) -> CacheStats:
        """From each rank's raw counters (as the rank reports them)."""
        per = {r: RankCacheStats.model_validate(raw) for r, raw in sorted(ranks.items())}
        return cls(ranks=per, total=_total(list(per.values())))


def _total(ranks: list[RankCacheStats]) -> RankCacheStats:
    def summed(model: type[BaseModel], items: list[Any]) -> dict[str, int]:
        return {name: sum(getattr(x, name) for x in items)
                for name, f in model.model_fields.items() if f.annotation is int}

    l3s = [r.l3 for r in ranks if r.l3 is not None]
    l3 = None
    if l3s:
        backend = StorageStats()
        for x in l3s:
            backend = backend + x.backend
        l3 = L3Stats(**summed(L3Stats, l3s), backend=backend)
    return RankCacheStats(**summed(RankCacheStats, ranks), l3=l3)


class LeakCheck(BaseModel):
    """The end-of-run page accounting of every rank that got to its drain (a rank that
    crashed or hung before it has none: ``complete`` is then false)."""

    model_config = ConfigDict(extra="forbid")
    complete: bool
    leaked_pages: int
    ranks: dict[int, DrainAccount] = {}

    @classmethod
    def of(cls, ranks: dict[int, dict[str, Any] | None], world: int) -> LeakCheck | None:
        """From each rank's raw account (``None`` where it did not drain); ``None`` when no
        rank drained."""
        per = {r: DrainAccount.model_validate(a) for r, a in sorted(ranks.items()) if a}
        if not per:
            return None
        return cls(complete=len(per) == world, ranks=per,
                   leaked_pages=sum(d.leaked_pages for d in per.values()))

    def describe(self) -> str:
        """The leaks in one line, e.g. ``rank 1: host_pinned=2, l3_open=1``."""
        parts = []
        for r, d in self.ranks.items():
            bad = {k: v for k, v in d.model_dump().items()
                   if v and k not in ("leaked_pages",) and not k.endswith(
                       ("_capacity", "_free", "_tree"))}
            if bad:
                parts.append(f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in bad.items()))
        return "; ".join(parts) or "no page leaked"


class RunSummary(BaseModel):
    """What ``hicache run --json`` prints: one schema for every topology (``cache_stats`` is
    always per rank plus the total; durations in seconds, rounded to the millisecond)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    outcome: RunOutcome
    requests: int
    completed: int
    aborted: int
    output_match: bool | None
    cached_tokens: CachedTokens
    steps: int
    wall_s: float
    reference_wall_s: float | None = None
    topology: dict[str, int]
    legacy: list[str] = []
    faults: list[str] = []
    faults_fired: int = 0
    bundle: str | None = None
    bundle_error: str | None = None
    """Why the run's bundle could not be written (a full disk); what was written of it is
    removed."""
    error: str | None = None
    mismatches: list[Mismatch] = []
    cache_stats: CacheStats = CacheStats()
    leaks: LeakCheck | None = None
    """End-of-run page accounting (what each rank still held once drained); ``None`` when no
    rank got to its drain."""

    @field_validator("wall_s", "reference_wall_s", mode="after")
    @classmethod
    def _round(cls, v: float | None) -> float | None:
        return seconds(v)


class ReferenceMemo:
    """Cache-disabled reference runs kept for reuse. A reference has no cache, no faults and
    no switches, so cells that differ only in those (a campaign's cells of one topology and
    seed) share one: the reference is keyed by its own config, less the machine's paths, and
    by the client-abort caps it replays. Only healthy references are kept."""

    def __init__(self) -> None:
        self._runs: dict[str, tuple[dict[str, Req], float]] = {}
        self.reused = 0

    @staticmethod
    def key(cfg: RuntimeConfig, caps: dict[str, int] | None) -> str:
        data = cfg.reference().model_dump(mode="json")
        data.pop("storage", None)  # the reference has no store: its path is the cell's
        data["observability"] = {k: v for k, v in data["observability"].items()
                                 if k not in ("bundle_dir", "trace_path")}
        return json.dumps([data, sorted((caps or {}).items())], sort_keys=True)

    def get(self, key: str) -> tuple[dict[str, Req], float] | None:
        hit = self._runs.get(key)
        self.reused += hit is not None
        return hit

    def put(self, key: str, reqs: dict[str, Req], wall_s: float) -> None:
        self._runs[key] = (reqs, wall_s)


def run(cfg: RuntimeConfig, *, compare: bool = True, progress: ProgressFn | None = None,
        bundle_root: Path | None = None, references: ReferenceMemo | None = None) -> RunSummary:
    """Run ``cfg``: in this process for one rank, as ``dp * tp * pp`` processes otherwise.
    ``references``: reuse (and keep) cache-disabled reference runs across calls."""
    if cfg.topology.grid_size == 1:
        return run_single(cfg, compare=compare, progress=progress, bundle_root=bundle_root,
                          references=references)
    return run_multi(cfg, compare=compare, progress=progress, bundle_root=bundle_root,
                     references=references)


def run_multi(cfg: RuntimeConfig, *, compare: bool = True, progress: ProgressFn | None = None,
              bundle_root: Path | None = None,
              references: ReferenceMemo | None = None) -> RunSummary:
    """Launch the ranks, then (if healthy) the cache-disabled reference of the same TP × PP
    topology; judge outputs (every rank must also agree with its DP group's rank 0) and
    summarise."""
    from hicache_runtime.launch.dp_controller import launch_dp
    from hicache_runtime.launch.launcher import launch

    bundle_root = bundle_root or cfg.observability.bundle_dir or DEFAULT_BUNDLE_ROOT
    start = launch_dp if cfg.topology.dp > 1 else launch
    res = start(cfg, bundle_root=bundle_root, progress=progress)
    try:
        summary = _summary(cfg, res.outcome, res.error, res.bundle, res.wall_s, res.results)
        summary.bundle_error = res.bundle_error
        if res.outcome is RunOutcome.HEALTHY and compare:

            def reference(caps: dict[str, int]) -> tuple[dict[str, Req], float]:
                if cfg.reference().topology.grid_size == 1:  # one DP group of one rank
                    one = run_reference(cfg, aborted=caps)
                    return one.reqs, one.wall_s
                ref = launch(cfg.reference(), bundle_root=bundle_root, caps=caps)
                try:
                    if ref.outcome is not RunOutcome.HEALTHY:
                        raise _ReferenceFailed(ref.outcome, ref.error, ref.bundle, ref.wall_s)
                    return _reqs_of(ref.results.get(0)), ref.wall_s
                finally:
                    ref.cleanup()

            def bundle_as(reason: str, mismatches: list[dict[str, Any]]) -> Path:
                return res.bundle_as(RunOutcome.WRONG_OUTPUT, reason, bundle_root, mismatches)

            _judge(summary, cfg, res.results, reference, bundle_as, references)
        return summary
    finally:
        res.cleanup()


@pinned_threads
def run_single(cfg: RuntimeConfig, *, compare: bool = True, progress: ProgressFn | None = None,
               bundle_root: Path | None = None,
               references: ReferenceMemo | None = None) -> RunSummary:
    """Run one rank in this process, then (if healthy) its reference; judge and summarise.
    The rank is closed however the run ends, an interrupt included: its L3 threads are
    stopped and joined before the caller unwinds (a campaign removes the store they write
    into when Ctrl-C reaches it)."""
    bundle_root = bundle_root or cfg.observability.bundle_dir or DEFAULT_BUNDLE_ROOT
    rt = build_rank(cfg)
    try:
        return _run_single_on(rt, cfg, compare=compare, progress=progress,
                              bundle_root=bundle_root, references=references)
    finally:
        rt.close()


def _run_single_on(rt: RankRuntime, cfg: RuntimeConfig, *, compare: bool,
                   progress: ProgressFn | None, bundle_root: Path,
                   references: ReferenceMemo | None) -> RunSummary:
    workload = Workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    engine = Engine(rt, workload, on_step=progress)
    hang: dict[str, Any] = {}
    can_interrupt = install_interrupt_handler()

    def on_stall(idle_s: float) -> None:
        reason = f"no scheduler progress for {idle_s:.1f}s (step {engine.step})"
        hang["bundle"], hang["bundle_error"] = kept_bundle(lambda: _write_bundle(
            bundle_root, cfg, rt, RunOutcome.HANG, reason, engine.step, None))
        hang["reason"] = reason
        if can_interrupt:
            interrupt_main_thread()

    watchdog = StepWatchdog(cfg.observability.watchdog_timeout_s, on_stall).start()
    engine.heartbeat = watchdog.beat
    start = time.monotonic()
    result: EngineResult | None = None
    outcome, error, bundle = RunOutcome.HEALTHY, None, None
    bundle_error: str | None = None
    drained: DrainAccount | None = None
    try:
        result = engine.run()
        drained = drain_account(rt.cache)
    except Exception as exc:
        outcome = classify(exc)
        if outcome is RunOutcome.HANG:  # the watchdog wrote the bundle while it was stuck
            error, bundle = hang.get("reason", str(exc)), hang.get("bundle")
            bundle_error = hang.get("bundle_error")
        else:
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if reached_drain(exc):  # the drain's check failed: what is left is what leaked
                drained = drain_account(rt.cache)
            bundle, bundle_error = kept_bundle(functools.partial(
                _write_bundle, bundle_root, cfg, rt, outcome, error or "", engine.step, exc))
    finally:
        watchdog.stop()
    wall = time.monotonic() - start
    results = {rt.rank.rank: rank_result(
        rt, outcome, error, result.reqs if result is not None else {}, engine.step,
        result.wall_s if result is not None else None,
        drained.model_dump() if drained else None)}
    summary = _summary(cfg, outcome, error, bundle, wall, results)
    summary.bundle_error = bundle_error
    if outcome is RunOutcome.HEALTHY and compare and result is not None:

        def reference(caps: dict[str, int]) -> tuple[dict[str, Req], float]:
            ref = run_reference(cfg, aborted=caps)
            return ref.reqs, ref.wall_s

        def bundle_as(reason: str, mismatches: list[dict[str, Any]]) -> Path:
            return _write_bundle(bundle_root, cfg, rt, RunOutcome.WRONG_OUTPUT, reason,
                                 engine.step, None, mismatches=mismatches)

        _judge(summary, cfg, results, reference, bundle_as, references)
    return summary


def run_reference(cfg: RuntimeConfig, aborted: dict[str, int] | None = None) -> EngineResult:
    """The cache-disabled twin of ``cfg`` (no faults, no legacy switches). ``aborted`` maps
    request ids the judged run's clients aborted to how many tokens they had by then; the
    reference aborts them at the same point, so prompts built on them stay identical."""
    ref_cfg = cfg.reference()
    rt = build_rank(ref_cfg)
    try:
        workload = Workload(ref_cfg.workload, ref_cfg.model.vocab_size, ref_cfg.seed,
                            client_aborts=aborted is None, caps=dict(aborted or {}))
        return Engine(rt, workload).run()
    finally:
        rt.close()


# --- the verdict -------------------------------------------------------------------------------

ReferenceRun = Callable[[dict[str, int]], tuple[dict[str, Req], float]]
"""Runs the cache-disabled reference, replaying the given client-abort caps: its requests and
wall time; raises :class:`_ReferenceFailed` when it did not end healthy."""
BundleAs = Callable[[str, list[dict[str, Any]]], Path]
"""Bundles the judged run as wrong output (reason, mismatches); returns the bundle."""


@dataclass
class _ReferenceFailed(Exception):
    """The cache-disabled reference run did not end healthy."""

    outcome: RunOutcome
    error: str | None
    bundle: Path | None
    wall_s: float


def _judge(summary: RunSummary, cfg: RuntimeConfig, results: dict[int, RankResult],
           reference: ReferenceRun, bundle_as: BundleAs,
           references: ReferenceMemo | None) -> None:
    """Compare a healthy run's outputs with its reference (run, or reused from
    ``references``) and each rank's with its DP group's rank 0; record the verdict in
    ``summary``."""
    reqs = _run_reqs(results, cfg)
    caps = {rid: len(r.output_ids) for rid, r in reqs.items()
            if r.status is ReqStatus.ABORTED and r.abort_reason == "client abort"}
    key = ReferenceMemo.key(cfg, caps)
    kept = references.get(key) if references is not None else None
    if kept is None:
        try:
            kept = reference(caps)
        except _ReferenceFailed as failed:
            summary.reference_wall_s = failed.wall_s
            _reference_failed(summary, failed)
            return
        if references is not None:
            references.put(key, *kept)
    summary.reference_wall_s = kept[1]
    summary.mismatches = compare_outputs(reqs, kept[0]) + _rank_disagreements(results, cfg)
    summary.output_match = not summary.mismatches
    if summary.mismatches:
        summary.outcome = RunOutcome.WRONG_OUTPUT
        summary.error = f"{len(summary.mismatches)} request(s) differ from the reference"
        bundle, summary.bundle_error = kept_bundle(lambda: bundle_as(
            summary.error or "", [m.model_dump() for m in summary.mismatches]))
        summary.bundle = str(bundle) if bundle is not None else None


def _reference_failed(summary: RunSummary, ref: _ReferenceFailed) -> None:
    """The cache-disabled reference run failed: the judged run cannot be judged. The summary
    says so and names the bundle the reference's ranks left (its manifest's config is the
    reference's: cache disabled, no faults)."""
    summary.error = f"reference run failed: {ref.error}"
    summary.outcome = ref.outcome if ref.outcome in (RunOutcome.CRASH, RunOutcome.HANG) \
        else RunOutcome.CRASH
    if ref.bundle is not None:
        summary.bundle = str(ref.bundle)


def _rank_disagreements(results: dict[int, RankResult], cfg: RuntimeConfig) -> list[Mismatch]:
    """Every rank must produce its DP group's rank 0's outputs (TP ranks sample the same
    tokens); a rank without a result has none."""
    out = []
    for lead in _entry_ranks(cfg):
        first = _outputs(results.get(lead))
        whose = f"rank {lead}" if cfg.topology.dp == 1 else \
            f"rank {lead} (its DP group's rank 0)"
        out += [Mismatch(rid="*", index=-1, expected=[], got=[],
                         note=f"rank {r} produced different outputs than {whose}")
                for r in range(lead + 1, lead + cfg.topology.world_size)
                if _outputs(results.get(r)) != first]
    return out


def _entry_ranks(cfg: RuntimeConfig) -> list[int]:
    """Grid ranks of every DP group's rank 0 (the rank that reads the group's requests)."""
    return [d * cfg.topology.world_size for d in range(cfg.topology.dp)]


def _run_reqs(results: dict[int, RankResult], cfg: RuntimeConfig) -> dict[str, Req]:
    """The run's requests: every DP group's, as its rank 0 finished them."""
    out: dict[str, Req] = {}
    for lead in _entry_ranks(cfg):
        out.update(_reqs_of(results.get(lead)))
    return out


def compare_outputs(got: dict[str, Req], ref: dict[str, Req]) -> list[Mismatch]:
    """Requests whose tokens differ. An aborted request is compared on the tokens it has."""
    out: list[Mismatch] = []
    for rid in sorted(set(got) | set(ref)):
        a, b = got.get(rid), ref.get(rid)
        if a is None or b is None:
            out.append(Mismatch(rid=rid, index=-1, expected=[] if b is None else b.output_ids,
                                got=[] if a is None else a.output_ids, note="missing"))
            continue
        if a.input_ids != b.input_ids:
            out.append(Mismatch(rid=rid, index=-1, expected=b.output_ids, got=a.output_ids,
                                note="prompt differs (an earlier turn diverged)"))
            continue
        n = min(len(a.output_ids), len(b.output_ids))
        partial = ReqStatus.ABORTED in (a.status, b.status)
        if not partial:
            n = max(len(a.output_ids), len(b.output_ids))
        for i in range(n):
            x = a.output_ids[i] if i < len(a.output_ids) else None
            y = b.output_ids[i] if i < len(b.output_ids) else None
            if x != y:
                out.append(Mismatch(rid=rid, index=i, expected=b.output_ids, got=a.output_ids))
                break
    return out


def _reqs_of(result: RankResult | None) -> dict[str, Req]:
    """A rank's requests, as the comparison reads them."""
    out = {}
    for rid, r in (result.requests if result is not None else {}).items():
        req = Req(rid=rid, input_ids=r.input_ids, max_new_tokens=len(r.output_ids),
                  output_ids=r.output_ids, status=ReqStatus(r.status),
                  abort_reason=r.abort_reason)
        req.cached = dict(r.cached)
        out[rid] = req
    return out


def _outputs(result: RankResult | None) -> dict[str, list[int]]:
    return {rid: r.output_ids for rid, r in (result.requests if result else {}).items()}


# --- the summary -------------------------------------------------------------------------------


def _summary(cfg: RuntimeConfig, outcome: RunOutcome, error: str | None, bundle: Path | None,
             wall: float, results: dict[int, RankResult]) -> RunSummary:
    """The run's summary before any verdict: rank 0's requests (every DP group's rank 0's),
    every rank's counters (zero for a rank without a result), faults and page accounting;
    ``error`` (else the first rank's) says what went wrong. ``steps`` is the most any DP
    group's rank 0 ran."""
    reqs = _run_reqs(results, cfg)
    cached = {"device": 0, "host": 0, "storage": 0}
    for r in reqs.values():
        for k in cached:
            cached[k] += r.cached.get(k, 0)
    errors = [f"rank {r}: {x.error}" for r, x in sorted(results.items()) if x.error]
    t = cfg.topology
    steps = max((results[r].steps for r in _entry_ranks(cfg) if r in results), default=0)
    return RunSummary(
        outcome=outcome, requests=cfg.workload.requests,
        completed=sum(1 for r in reqs.values() if r.status is ReqStatus.FINISHED),
        aborted=sum(1 for r in reqs.values() if r.status is ReqStatus.ABORTED),
        output_match=None, cached_tokens=CachedTokens(**cached),
        steps=steps, wall_s=round(wall, 3),
        topology={"tp": t.tp, "pp": t.pp, **({"dp": t.dp} if t.dp > 1 else {})},
        legacy=sorted(s.value for s in cfg.legacy), faults=[f.compact() for f in cfg.faults],
        faults_fired=_fired_count(results, bundle),
        bundle=str(bundle) if bundle else None,
        error=error or (errors[0] if errors else None),
        cache_stats=CacheStats.of({r: results[r].stats if r in results else {}
                                   for r in range(t.grid_size)}),
        leaks=LeakCheck.of({r: x.drain for r, x in results.items()}, t.grid_size))


def _fired_count(results: dict[int, RankResult], bundle: Path | None) -> int:
    """Fault firings on every rank. A rank a fault killed leaves no result; its firings are
    in the bundle's manifest (from the journal it wrote before dying), which then counts."""
    reported = sum(len(x.faults_fired) for x in results.values())
    if bundle is None:
        return reported
    try:
        return max(reported, len(load_manifest(bundle).faults_fired))
    except (OSError, ValueError):  # ValidationError is a ValueError
        return reported


def _write_bundle(root: Path, cfg: RuntimeConfig, rt: RankRuntime, outcome: RunOutcome,
                  reason: str, step: int, exc: BaseException | None,
                  mismatches: list[dict[str, Any]] | None = None) -> Path:
    """A single-rank run's bundle: this rank's dump, and the manifest."""
    bundle = new_bundle_dir(root, outcome)
    with bundle_writing(bundle):  # a full disk: nothing half-written is left as a bundle
        entry: RankEntry = dump_rank(bundle, rt, outcome, step, exc)
        fired = [FiredFaultRecord(**f.as_dict()) for f in rt.faults.fired] if rt.faults else []
        write_manifest(bundle, build_manifest(cfg, outcome, reason, [entry], fired,
                                              mismatches=mismatches or []))
    return bundle
