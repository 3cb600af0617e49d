"""Running campaign cells and judging them.

A cell passes when what happened matches its expectation *by production shape*: a ``healthy``
cell must end healthy with outputs identical to the cache-disabled run; a signature cell must
fail and the doctor, reading the bundle the run left, must name one of the expected signature
ids first. "Something failed" is never enough.
"""

from __future__ import annotations

import fnmatch
import re
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from faults.campaign import HEALTHY, NO_SIGNATURE, CampaignSpec, CellSpec
from faults.spec import parse_faults
from hicache_runtime.bundle import CellOrigin, FiredFaultRecord, annotate_origin, load_manifest
from hicache_runtime.config import RuntimeConfig, check_run_limits, load_config
from hicache_runtime.legacy import parse_legacy

if TYPE_CHECKING:
    from hicache_runtime.run import RunSummary

RESULT_SCHEMA_VERSION = "1.0"


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


class CampaignResult(BaseModel):
    """A whole campaign (``--json``)."""

    schema_version: str = RESULT_SCHEMA_VERSION
    name: str
    started_at: str
    wall_s: float
    cells: list[CellResult]

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.cells)

    @property
    def failed(self) -> int:
        return len(self.cells) - self.passed


CellHook = Callable[[CellSpec, CellResult | None], None]
"""Called with (cell, None) when a cell starts and (cell, result) when it ends."""


def select(spec: CampaignSpec, only: str | None,
           seeds: list[int] | None = None) -> list[CellSpec]:
    """The cells to run; ``only`` is a glob over cell ids; ``seeds`` reruns every selected cell
    once per seed (ids get ``/seed<N>``): how often a timing-dependent cell holds."""
    cells = [c for c in spec.expand() if only is None or fnmatch.fnmatchcase(c.id, only)]
    if not seeds:
        return cells
    return [c.model_copy(update={"seed": s, "id": f"{c.id}/seed{s}"})
            for c in cells for s in seeds]


def run_campaign(spec: CampaignSpec, *, bundle_root: Path, only: str | None = None,
                 seeds: list[int] | None = None,
                 hook: CellHook | None = None) -> CampaignResult:
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="hicache-campaign-") as work:
        for cell in select(spec, only, seeds):
            if hook is not None:
                hook(cell, None)
            result = run_cell(spec, cell, Path(work), bundle_root)
            if hook is not None:
                hook(cell, result)
            results.append(result)
    return CampaignResult(name=spec.name, started_at=started,
                          wall_s=round(time.monotonic() - t0, 2), cells=results)


def cell_config(spec: CampaignSpec, cell: CellSpec, work: Path,
                bundle_root: Path) -> RuntimeConfig:
    """The runtime config of a cell: campaign defaults, then the cell's overrides."""
    data: dict[str, object] = {**spec.defaults, **cell.config}
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


class Observation(BaseModel):
    """What one run showed, read the way a cell is judged (``hicache inject --json``)."""

    outcome: str
    output_match: bool | None
    bundle: str | None
    error: str | None
    faults_fired: int
    fired: list[FiredFaultRecord] = []
    signature: str | None = None
    """The doctor's top signature for the bundle (None when healthy or nothing fit)."""
    confidence: float | None = None

    @property
    def observed(self) -> str:
        """``healthy``, the signature the doctor names, or ``no-signature``."""
        if self.outcome == "healthy" and self.output_match is not False:
            return HEALTHY
        return self.signature or NO_SIGNATURE


def observe(cfg: RuntimeConfig, *, warm: bool, compare: bool, bundle_root: Path) -> Observation:
    """Run ``cfg`` (after a fault-free, switch-free warm-up run when ``warm``) and, if it left
    a bundle, let the doctor name its signature."""
    from hicache_runtime.run import run

    if warm:
        warmup = run(cfg.with_overrides(faults=(), legacy=frozenset()), compare=False,
                     bundle_root=bundle_root)
        if warmup.outcome.value != HEALTHY:
            return _observe_summary(warmup, "warm-up run failed: ")
    return _observe_summary(run(cfg, compare=compare, bundle_root=bundle_root))


def _observe_summary(summary: RunSummary, prefix: str = "") -> Observation:
    """A run's summary as an observation: the bundle it names (the judged run's, the
    reference's or the warm-up's, whichever failed) is the one the doctor reads."""
    obs = Observation(outcome=summary.outcome.value, output_match=summary.output_match,
                      bundle=summary.bundle,
                      error=f"{prefix}{summary.error}" if prefix else summary.error,
                      faults_fired=summary.faults_fired)
    if summary.bundle is not None:
        from doctor.diagnose import diagnose

        obs.fired = _fired(Path(summary.bundle))
        if obs.observed != HEALTHY:
            diagnosis = diagnose([summary.bundle])
            top = diagnosis.verdicts[0] if diagnosis.verdicts else None
            obs.signature = top.signature if top else None
            obs.confidence = top.confidence if top else None
    return obs


def _fired(bundle: Path) -> list[FiredFaultRecord]:
    try:
        return load_manifest(bundle).faults_fired
    except (OSError, ValueError):
        return []


def run_cell(spec: CampaignSpec, cell: CellSpec, work: Path, bundle_root: Path) -> CellResult:
    """Run one cell (after its warm-up run, if any) and judge it."""
    t0 = time.monotonic()
    try:
        cfg = cell_config(spec, cell, work, bundle_root)
        obs = observe(cfg, warm=cell.warm, compare=cell.compare, bundle_root=bundle_root)
    except Exception as exc:  # a cell that cannot even run is a failed cell, not a crash
        return CellResult(id=cell.id, expect=cell.expect, observed="error", passed=False,
                          outcome="error", wall_s=round(time.monotonic() - t0, 2),
                          error=f"{type(exc).__name__}: {exc}".splitlines()[0],
                          detail="the cell could not run")
    if obs.bundle is not None:
        annotate_origin(Path(obs.bundle), CellOrigin(campaign=spec.name, cell=cell.id,
                                                     expect=cell.expect, warm=cell.warm))
    result = CellResult(id=cell.id, expect=cell.expect, observed=obs.observed, passed=False,
                        outcome=obs.outcome, output_match=obs.output_match,
                        verdict=obs.signature, confidence=obs.confidence, bundle=obs.bundle,
                        error=obs.error, faults_fired=obs.faults_fired,
                        wall_s=round(time.monotonic() - t0, 2))
    _judge(cell, result)
    return result


def _judge(cell: CellSpec, r: CellResult) -> None:
    expected = cell.expected
    r.passed = r.observed in expected
    if r.passed:
        r.detail = "healthy, outputs identical to the cache-disabled run" \
            if r.observed == HEALTHY else f"{r.outcome}; the doctor names {r.observed} " \
            f"({r.confidence:.2f})"
    elif HEALTHY in expected:
        r.detail = f"expected healthy, got {r.outcome}" + (f" ({r.observed})"
                                                            if r.verdict else "")
    else:
        r.detail = f"expected {cell.expect}, got {r.outcome} / {r.observed}"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:120]
