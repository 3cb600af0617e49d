"""Running campaign cells and judging them.

A cell passes when what happened matches its expectation *by production shape*: a ``healthy``
cell must end healthy with outputs identical to the cache-disabled run; a signature cell must
fail and the doctor, reading the bundle the run left, must name one of the expected signature
ids first. "Something failed" is never enough.

In a property campaign each cell is also judged on every property the spec names (see
:func:`judge_properties`): held, violated, or unchecked (the run never got where the property
can be read: a crashed run has no outputs to compare and no drain to account). The result adds
one :class:`PropertyResult` per property.
"""

from __future__ import annotations

import builtins
import fnmatch
import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from faults.campaign.plan import (
    HEALTHY,
    NO_SIGNATURE,
    CampaignSpec,
    CellSpec,
    Property,
    matrix_place,
)
from faults.spec import parse_faults
from hicache_runtime.config import RuntimeConfig, check_run_limits, load_config
from hicache_runtime.contracts.bundle import (
    CellOrigin,
    FiredFaultRecord,
    annotate_origin,
    label_bundle,
    load_manifest,
)
from hicache_runtime.contracts.legacy import REGISTRY, parse_legacy
from hicache_runtime.contracts.profiles import synthetic
from hicache_runtime.l3.registry import takes_url

if TYPE_CHECKING:
    from hicache_runtime.launch.run import ReferenceMemo, RunSummary

RESULT_SCHEMA_VERSION = "1.2"


class CellResult(BaseModel):
    """What one cell did and whether that is what it had to do."""

    id: str
    expect: str
    observed: str
    """``healthy``, the doctor's top signature, ``no-signature``, or the outcome."""
    passed: bool
    outcome: str
    output_match: bool | None = None
    verdict: str | None = None
    confidence: float | None = None
    wall_s: float
    bundle: str | None = None
    error: str | None = None
    faults_fired: int = 0
    detail: str = ""
    faults: list[str] = []
    leaked_pages: int | None = None
    """Pages the ranks still held at drain (None: no rank got to its drain)."""
    leaks: str | None = None
    """Where they were held, one line (``rank 1: host_pinned=2``)."""
    properties: dict[str, bool | None] = {}
    """Property campaigns: each property held (true), violated (false) or unchecked (null)."""
    skipped: str | None = None
    """Why the cell did not run on this machine (its L3 backend's client is not installed):
    it neither passed nor failed."""
    row: str = ""
    column: str = ""
    """Where the campaign's matrix shows it (``plan.matrix_place``)."""
    fingerprint: str | None = None
    """The doctor's fingerprint of a failed run: cells that failed alike share it."""
    not_a_release: dict[str, str] = {}
    """The cell's switches that no release ran as the runtime does, each with its fidelity
    (``grafted`` or ``synthetic``): its failure is a reproduction, not evidence about a
    release (``contracts/legacy.py`` ``Fidelity``)."""
    node: str | None = None
    """The Ray executor: the node (host name) the cell ran on; None when run locally."""
    reruns: int = 0
    """The Ray executor: how many times the cell was submitted again because the worker or
    node running it died (``ray_executor.RERUNS`` at most)."""

    @property
    def rerun_note(self) -> str | None:
        """What the reports say of a cell that ran again, else None."""
        if not self.reruns:
            return None
        return (f"ran again {self.reruns} time(s): the Ray worker or node running it died"
                + (f"; its verdict is from {self.node}" if self.node else ""))


class PropertyViolation(BaseModel):
    """A cell in which a property did not hold."""

    cell: str
    faults: list[str]
    outcome: str
    observed: str
    bundle: str | None = None
    detail: str = ""


class PropertyResult(BaseModel):
    """One property over the whole campaign: the cells it could be read in, and where it
    failed."""

    property: str
    meaning: str
    checked: int
    violations: int
    unchecked: list[str] = []
    """Cells in which the property could not be read (e.g. outputs of a run that crashed)."""
    violating: list[PropertyViolation] = []

    @builtins.property  # the field ``property`` hides the builtin in this class body
    def holds(self) -> bool:
        return self.violations == 0


class CampaignResult(BaseModel):
    """A whole campaign (``--json``)."""

    schema_version: str = RESULT_SCHEMA_VERSION
    name: str
    started_at: str
    wall_s: float
    cells: list[CellResult]
    properties: list[PropertyResult] = []
    """Property campaigns only: one entry per property the spec names, in its order."""
    references_reused: int = 0
    """Cells judged against a cache-disabled reference run an earlier cell already ran."""
    warmups_reused: int = 0
    """Cells whose L3 store was filled from an earlier cell's warm-up of the same config."""
    shard: str | None = None
    """``I/N`` when this is one shard of a run (``--shard``); None for a whole run."""
    selection: list[str] = []
    """A shard: the ids of every cell of the whole run, in its order (what a merge checks
    completeness and order against)."""

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.cells)

    @property
    def skipped(self) -> int:
        return sum(c.skipped is not None for c in self.cells)

    @property
    def failed(self) -> int:
        return len(self.cells) - self.passed - self.skipped

    def failure_groups(self) -> list[tuple[str, list[CellResult]]]:
        """The cells that did not behave, grouped by what failed: the doctor's fingerprint
        (else what was observed), largest group first; 40 failures of one mechanism are one
        group with a representative bundle (its first cell's)."""
        groups: dict[str, list[CellResult]] = {}
        for c in self.cells:
            if not c.passed and c.skipped is None:
                groups.setdefault(c.fingerprint or f"{c.outcome}: {c.observed}", []).append(c)
        return sorted(groups.items(), key=lambda kv: -len(kv[1]))


CellHook = Callable[[CellSpec, CellResult | None], None]
"""Called with (cell, None) when a cell starts and (cell, result) when it ends."""


def select(spec: CampaignSpec, only: str | None,
           seeds: list[int] | None = None) -> list[CellSpec]:
    """The cells to run; ``only`` is a glob over cell ids; ``seeds`` runs every selected cell
    once per seed (ids get ``/seed<N>``): how often a timing-dependent cell holds. A matrix's
    own seeds are replaced, not multiplied: its cells of one run but another seed are one cell,
    so ``seeds=[0]`` runs a five-seed matrix once (the ids its seed-0 cells have)."""
    cells = [c for c in spec.expand() if only is None or fnmatch.fnmatchcase(c.id, only)]
    if not seeds:
        return cells
    return [c.model_copy(update={"seed": s, "id": f"{base}/seed{s}"})
            for base, c in seed_bases(cells).items() for s in seeds]


def seed_bases(cells: list[CellSpec]) -> dict[str, CellSpec]:
    """One cell per id without its ``/seed<N>`` suffix: what ``--seeds`` runs once per seed."""
    bases: dict[str, CellSpec] = {}
    for c in cells:
        bases.setdefault(c.id.removesuffix(f"/seed{c.seed}"), c)
    return bases


def run_campaign(spec: CampaignSpec, *, bundle_root: Path, only: str | None = None,
                 seeds: list[int] | None = None, hook: CellHook | None = None,
                 storage_url: str | None = None, shard: tuple[int, int] | None = None,
                 resume: Path | None = None, ray: RayOptions | None = None) -> CampaignResult:
    """Run the selected cells (``shard``: only the I-th of N balanced subsets of them,
    ``faults/campaign/shards.py``; ``resume``: append each result to that log and take the
    results a previous run of the same cells left there, ``faults/campaign/resume.py``;
    ``ray``: as tasks of a Ray cluster, ``faults/campaign/ray_executor.py``, else one after
    the other here)."""
    from hicache_runtime.launch.run import ReferenceMemo  # torch: imported once a cell runs

    started = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="hicache-campaign-") as work:
        memo = CampaignMemo(Path(work) / "warm", ReferenceMemo())
        chosen = select(spec, only, seeds)
        selection = [c.id for c in chosen]
        if shard is not None:
            from faults.campaign.shards import shard as shard_of

            chosen = shard_of(spec, chosen, *shard)
        log = None
        if resume is not None:
            from faults.campaign.resume import ResumeLog

            log = ResumeLog(resume, spec.name, [c.id for c in chosen])
        try:
            if ray is None:
                for cell in chosen:
                    if hook is not None:
                        hook(cell, None)
                    result = log.done.get(cell.id) if log is not None else None
                    if result is None:
                        result = run_cell(spec, cell, Path(work), bundle_root, memo=memo,
                                          storage_url=storage_url)
                        if log is not None:
                            log.append(result)
                    if hook is not None:
                        hook(cell, result)
                    results.append(result)
            else:
                results = _run_on_ray(spec, chosen, bundle_root, ray, log, hook, storage_url)
        finally:
            if log is not None:
                log.close()
    return CampaignResult(name=spec.name, started_at=started,
                          wall_s=round(time.monotonic() - t0, 2), cells=results,
                          properties=property_results(spec, results),
                          references_reused=memo.references.reused,
                          warmups_reused=memo.warm_reused,
                          shard=f"{shard[0]}/{shard[1]}" if shard is not None else None,
                          selection=selection if shard is not None else [])


@dataclass(frozen=True)
class RayOptions:
    """``--executor ray``: the cluster (None: a Ray instance of this process's own) and
    whether bundles stay on the nodes."""

    address: str | None = None
    keep_bundles: bool = False


def _run_on_ray(spec: CampaignSpec, chosen: list[CellSpec], bundle_root: Path,
                ray: RayOptions, log: Any, hook: CellHook | None,
                storage_url: str | None) -> list[CellResult]:
    """The cells as Ray tasks, in the campaign's order; each result logged (``resume``) and
    told to the hook as it comes."""
    from faults.campaign.ray_executor import run_on_ray

    done = {c.id: log.done[c.id] for c in chosen if log is not None and c.id in log.done}
    todo = [c for c in chosen if c.id not in done]
    for cell in chosen:
        if hook is not None and cell.id in done:
            hook(cell, None)
            hook(cell, done[cell.id])
    for cell, result in run_on_ray(spec, todo, bundle_root=bundle_root, address=ray.address,
                                   storage_url=storage_url, keep_bundles=ray.keep_bundles):
        if log is not None:
            log.append(result)
        if hook is not None:
            hook(cell, None)
            hook(cell, result)
        done[cell.id] = result
    return [done[c.id] for c in chosen]


@dataclass
class CampaignMemo:
    """Runs one campaign's cells share instead of repeating them.

    * the cache-disabled reference (:class:`~hicache_runtime.launch.run.ReferenceMemo`): it has no
      cache, faults or switches, so cells of one topology, seed and workload share it;
    * the warm-up: a fault-free, switch-free run whose only effect a cell keeps is the L3
      store it filled. With the file backend that store is copied aside once and into each
      later cell of the same config (faults and switches aside) before its judged run.
    """

    root: Path
    references: ReferenceMemo
    warm_stores: dict[str, Path] = field(default_factory=dict)
    warm_reused: int = 0

    @staticmethod
    def warm_key(cfg: RuntimeConfig) -> str | None:
        if cfg.storage.backend != "file":
            return None  # another backend's store cannot be copied into place
        data = cfg.with_overrides(faults=(), legacy=frozenset()).model_dump(mode="json")
        data["storage"].pop("path", None)
        data["observability"] = {k: v for k, v in data["observability"].items()
                                 if k not in ("bundle_dir", "trace_path")}
        return json.dumps(data, sort_keys=True)

    def restore(self, cfg: RuntimeConfig) -> bool:
        """Fill ``cfg``'s store from an earlier warm-up of the same config; False if none."""
        key = self.warm_key(cfg)
        saved = self.warm_stores.get(key) if key is not None else None
        if saved is None or cfg.storage.path is None:
            return False
        shutil.copytree(saved, cfg.storage.path, dirs_exist_ok=True)
        self.warm_reused += 1
        return True

    def keep(self, cfg: RuntimeConfig) -> None:
        """Copy aside the store a healthy warm-up of ``cfg`` filled."""
        key = self.warm_key(cfg)
        if key is None or cfg.storage.path is None or key in self.warm_stores \
                or not Path(cfg.storage.path).is_dir():
            return
        saved = self.root / f"store{len(self.warm_stores)}"
        shutil.copytree(cfg.storage.path, saved)
        self.warm_stores[key] = saved


def cell_config(spec: CampaignSpec, cell: CellSpec, work: Path, bundle_root: Path,
                storage_url: str | None = None) -> RuntimeConfig:
    """The runtime config of a cell: campaign defaults, then the cell's overrides; the places
    it writes (bundles, the file store) are the campaign's, and a store kept in a server
    (Redis, Mooncake) is the one the command line named (``storage_url``), never one from the
    spec."""
    data: dict[str, object] = {**spec.defaults, **cell.config}
    backend = data.get("storage.backend")
    if storage_url is not None and isinstance(backend, str) and takes_url(backend):
        data["storage.url"] = storage_url
    data.update({"topology.tp": cell.tp, "topology.pp": cell.pp, "seed": cell.seed,
                 "faults": tuple(parse_faults(cell.faults)),
                 "legacy": parse_legacy(cell.legacy),
                 "observability.bundle_dir": bundle_root})
    if data.get("storage.backend") == "file" and not data.get("storage.path"):
        data["storage.path"] = work / _safe(cell.id) / "l3"
    cfg = load_config(data)
    # A spec built in code skips the loader's checks: the sizes are checked here too.
    check_run_limits(cfg, memory=False)
    return cfg


class DiagnosedRun(BaseModel):
    """What one run showed, read the way a cell is judged: how it ended and the signature the
    doctor names in its bundle (``hicache inject --json``)."""

    outcome: str
    output_match: bool | None
    bundle: str | None
    error: str | None
    faults_fired: int
    fired: list[FiredFaultRecord] = []
    signature: str | None = None
    """The doctor's top signature for the bundle (None when healthy or nothing fit)."""
    confidence: float | None = None
    fingerprint: str | None = None
    """The doctor's fingerprint of the failure (equal ids: the same failure)."""
    leaked_pages: int | None = None
    """Pages the judged run's ranks held at drain (None: no rank got to its drain)."""
    leaks_complete: bool = False
    """Every rank got to its drain (so a zero ``leaked_pages`` covers the whole run)."""
    leaks: str | None = None

    @property
    def observed(self) -> str:
        """``healthy``, the signature the doctor names, or ``no-signature``."""
        if self.outcome == "healthy" and self.output_match is not False:
            return HEALTHY
        return self.signature or NO_SIGNATURE


def run_and_diagnose(cfg: RuntimeConfig, *, warm: bool, compare: bool, bundle_root: Path,
                     memo: CampaignMemo | None = None) -> DiagnosedRun:
    """Run ``cfg`` (after a fault-free, switch-free warm-up run when ``warm``) and, if it left
    a bundle, let the doctor name its signature. ``memo``: warm-ups and cache-disabled
    reference runs to reuse (a campaign's)."""
    from hicache_runtime.l3.registry import private_store

    # A cell whose backend can start a store (mooncake) and names none gets one of its own,
    # shared by its warm-up run.
    with private_store(cfg) as (cfg, _):
        return _run_and_diagnose(cfg, warm=warm, compare=compare, bundle_root=bundle_root,
                                 memo=memo)


def _run_and_diagnose(cfg: RuntimeConfig, *, warm: bool, compare: bool, bundle_root: Path,
                      memo: CampaignMemo | None) -> DiagnosedRun:
    from hicache_runtime.launch.run import run

    if warm and not (memo is not None and memo.restore(cfg)):
        warmup = run(cfg.with_overrides(faults=(), legacy=frozenset()), compare=False,
                     bundle_root=bundle_root)
        if warmup.outcome.value != HEALTHY:
            return _diagnosed(warmup, "warm-up run failed: ")
        if memo is not None:
            memo.keep(cfg)
    return _diagnosed(run(cfg, compare=compare, bundle_root=bundle_root,
                          references=memo.references if memo is not None else None))


def _diagnosed(summary: RunSummary, prefix: str = "") -> DiagnosedRun:
    """A run's summary with the doctor's verdict: the bundle it names (the judged run's, the
    reference's or the warm-up's, whichever failed) is the one the doctor reads."""
    done = DiagnosedRun(outcome=summary.outcome.value, output_match=summary.output_match,
                        bundle=summary.bundle,
                        error=f"{prefix}{summary.error}" if prefix else summary.error,
                        faults_fired=summary.faults_fired)
    if summary.leaks is not None and not prefix:  # a warm-up's drain is not the cell's
        done.leaked_pages = summary.leaks.leaked_pages
        done.leaks_complete = summary.leaks.complete
        done.leaks = summary.leaks.describe()
    if summary.bundle is not None:
        from doctor.diagnose import diagnose

        done.fired = _fired(Path(summary.bundle))
        if done.observed != HEALTHY:
            diagnosis = diagnose([summary.bundle])
            top = diagnosis.verdicts[0] if diagnosis.verdicts else None
            done.signature = top.signature if top else None
            done.confidence = top.confidence if top else None
            done.fingerprint = diagnosis.fingerprint.id if diagnosis.fingerprint else None
    return done


def _fired(bundle: Path) -> list[FiredFaultRecord]:
    try:
        return load_manifest(bundle).faults_fired
    except (OSError, ValueError):
        return []


def identity(cell: CellSpec) -> dict[str, Any]:
    """What every result of ``cell`` says about which cell it is."""
    row, column = matrix_place(cell)
    weak = {s.value: REGISTRY[s].fidelity.value for s in synthetic(parse_legacy(cell.legacy))}
    return {"id": cell.id, "expect": cell.expect, "faults": list(cell.faults), "row": row,
            "column": column, "not_a_release": weak}


def run_cell(spec: CampaignSpec, cell: CellSpec, work: Path, bundle_root: Path, *,
             memo: CampaignMemo | None = None, storage_url: str | None = None) -> CellResult:
    """Run one cell (after its warm-up run, if any) and judge it."""
    from hicache_runtime.l3.registry import unavailable

    t0 = time.monotonic()
    try:
        cfg = cell_config(spec, cell, work, bundle_root, storage_url)
        missing = unavailable(cfg.storage)
        if missing is not None:
            return CellResult(**identity(cell), observed="skipped", passed=False,
                              outcome="skipped", wall_s=0.0, skipped=missing,
                              detail=f"skipped: {missing}",
                              properties={p.value: None for p in spec.properties})
        done = run_and_diagnose(cfg, warm=cell.warm, compare=cell.compare,
                                bundle_root=bundle_root, memo=memo)
    except Exception as exc:  # a cell that cannot even run is a failed cell, not a crash
        return CellResult(**identity(cell), observed="error", passed=False,
                          outcome="error", wall_s=round(time.monotonic() - t0, 2),
                          error=f"{type(exc).__name__}: {exc}".splitlines()[0],
                          detail="the cell could not run",
                          properties={p.value: None for p in spec.properties})
    bundle = done.bundle
    if bundle is not None:
        annotate_origin(Path(bundle), CellOrigin(campaign=spec.name, cell=cell.id,
                                                 expect=cell.expect, warm=cell.warm))
        bundle = str(label_bundle(Path(bundle), cell.id))
    result = CellResult(**identity(cell), observed=done.observed, passed=False,
                        outcome=done.outcome, output_match=done.output_match,
                        verdict=done.signature, confidence=done.confidence, bundle=bundle,
                        fingerprint=done.fingerprint,
                        error=done.error, faults_fired=done.faults_fired,
                        wall_s=round(time.monotonic() - t0, 2),
                        leaked_pages=done.leaked_pages, leaks=done.leaks)
    if spec.properties:
        result.properties = judge_properties(spec.properties, done)
    _judge(cell, result)
    return result


def judge_properties(props: list[Property], done: DiagnosedRun) -> dict[str, bool | None]:
    """Each property held (True), violated (False) or could not be read (None).

    * no-crash / no-hang: read from the outcome of every run the cell made (a warm-up or a
      reference run that failed is the cell's outcome);
    * no-wrong-token: needs outputs compared with the reference, so a run that crashed or hung
      leaves it unchecked;
    * no-leaked-page: needs the ranks' end-of-run accounting: violated as soon as one rank that
      drained held a page; held only when every rank drained and none did.
    """
    out: dict[str, bool | None] = {}
    for p in props:
        if p is Property.NO_CRASH:
            out[p.value] = done.outcome != "crash"
        elif p is Property.NO_HANG:
            out[p.value] = done.outcome != "hang"
        elif p is Property.NO_WRONG_TOKEN:
            out[p.value] = done.output_match
        elif p is Property.NO_LEAKED_PAGE:
            if done.leaked_pages:
                out[p.value] = False
            else:
                out[p.value] = True if done.leaked_pages == 0 and done.leaks_complete else None
    return out


def property_results(spec: CampaignSpec, cells: list[CellResult]) -> list[PropertyResult]:
    """One result per property the spec names (none for a campaign without properties)."""
    out = []
    for p in spec.properties:
        verdicts = [(c, c.properties.get(p.value)) for c in cells]
        bad = [c for c, v in verdicts if v is False]
        out.append(PropertyResult(
            property=p.value, meaning=p.meaning,
            checked=sum(v is not None for _, v in verdicts), violations=len(bad),
            unchecked=[c.id for c, v in verdicts if v is None],
            violating=[PropertyViolation(cell=c.id, faults=c.faults, outcome=c.outcome,
                                         observed=c.observed, bundle=c.bundle,
                                         detail=_violation_detail(p, c)) for c in bad]))
    return out


def _violation_detail(p: Property, c: CellResult) -> str:
    if p is Property.NO_LEAKED_PAGE:
        return f"{c.leaked_pages} page(s) held at drain: {c.leaks}"
    doctor = f"; the doctor names {c.verdict}" if c.verdict else ""
    return (c.error or c.detail) + doctor


def _judge(cell: CellSpec, r: CellResult) -> None:
    expected = cell.expected
    violated = [name for name, held in r.properties.items() if held is False]
    r.passed = r.observed in expected and not violated
    if violated and r.observed in expected:
        r.detail = f"{r.outcome}, but violates {', '.join(violated)}"
        return
    if r.passed:
        if r.observed == HEALTHY:
            r.detail = "healthy, outputs identical to the cache-disabled run"
        elif r.confidence is None:  # an expected no-signature: nothing was named
            r.detail = f"{r.outcome}; the doctor names no known signature, as expected"
        else:
            r.detail = f"{r.outcome}; the doctor names {r.observed} ({r.confidence:.2f})"
    elif HEALTHY in expected:
        r.detail = f"expected healthy, got {r.outcome}" + (f" ({r.observed})"
                                                            if r.verdict else "")
    elif r.observed == HEALTHY and cell.faults and not r.faults_fired:
        # not evidence that the switch is harmless: the run never met what exposes it
        r.detail = (f"expected {cell.expect}, got healthy, but no fault fired: the workload "
                    "never reached the fault's point")
    else:
        r.detail = f"expected {cell.expect}, got {r.outcome} / {r.observed}"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:120]
