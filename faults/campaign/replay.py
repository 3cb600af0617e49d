"""Replaying the run a crash bundle came from.

A bundle's manifest holds the whole validated config (topology, seed, workload, faults, legacy
switches), so the run can be repeated exactly: same requests, same fault draws. Replay runs it
again and says whether it fails the *same way*: the doctor must name the same signature for
the new bundle as for the original (or, where nothing fit the original, the same outcome).

The bundle is untrusted input (see ``faults.campaign.replay_guard`` and docs/threat-model.md): its
config runs only after paths, URLs and output locations are taken out of it and its sizes are
checked against caps; everything a replay writes lies under its own work and bundle directories.

Storage isolation: a file-backed L3 gets a fresh directory per run, so a replay (or a shrink
trial) never reads pages an earlier one left; cells that ran ``warm`` repeat their fault-free
warm-up first. A bundle whose run used Redis replays against a private file store unless the
user names a server (``storage_url``, ``--storage-url``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from faults.campaign.cells import HEALTHY, NO_SIGNATURE, DiagnosedRun, run_and_diagnose
from faults.campaign.replay_guard import (
    GuardedConfig,
    ReplayPlan,
    guard_config,
    printable,
    read_manifest,
    temp_files_under,
)
from hicache_runtime.config import RuntimeConfig
from hicache_runtime.contracts.bundle import Manifest, RunOutcome
from hicache_runtime.contracts.errors import ConfigError

_TRIAL = itertools.count()


@dataclass(frozen=True)
class ReplayCase:
    """A run to repeat and the failure it must show."""

    cfg: RuntimeConfig
    warm: bool
    signature: str
    """The doctor's signature for the original bundle, or ``no-signature``."""
    outcome: str
    source: str
    """The original bundle."""

    def shows(self, obs: DiagnosedRun) -> bool:
        """Whether ``obs`` is the same failure (same signature; same outcome if none fit)."""
        if obs.observed == HEALTHY:
            return False
        if self.signature == NO_SIGNATURE:
            return obs.observed == NO_SIGNATURE and obs.outcome == self.outcome
        return obs.observed == self.signature


class TrialRecord(BaseModel):
    """One run made by a replay or a shrink step."""

    change: str
    requests: int
    faults: list[str]
    reproduced: bool
    observed: str
    outcome: str
    wall_s: float
    bundle: str | None = None
    faults_fired: int = 0


class ReplayResult(BaseModel):
    """``hicache inject --replay --json``."""

    bundle: str
    signature: str
    outcome: str
    cell: str | None = None
    reproduced: bool
    same_fault_schedule: bool
    """The replay's fault firings (kind, rank, step) equal the original's."""
    trial: TrialRecord
    plan: ReplayPlan | None = None
    """What ran, as shown before it ran (the bundle's config after the replay's guards)."""


def plan(bundle: Path, *, output: Path | None = None, warm: bool | None = None,
         storage_url: str | None = None) -> tuple[ReplayPlan, GuardedConfig, Manifest]:
    """What replaying ``bundle`` would run, checked against the caps; runs nothing, and does
    not yet let the doctor read the bundle."""
    manifest = read_manifest(bundle)
    if manifest.outcome is RunOutcome.HEALTHY:
        raise ConfigError("bundle", f"{bundle} records a healthy run: nothing to replay")
    guarded = guard_config(manifest.config, storage_url=storage_url)
    cfg, origin = guarded.cfg, manifest.origin
    the_plan = ReplayPlan(
        bundle=str(bundle), outcome=manifest.outcome.value,
        cell=printable(origin.cell) if origin else None, tp=cfg.topology.tp,
        pp=cfg.topology.pp, world_size=cfg.topology.world_size, seed=cfg.seed,
        requests=cfg.workload.requests,
        warm=(origin.warm if origin else False) if warm is None else warm,
        faults=[f.compact() for f in cfg.faults], legacy=sorted(s.value for s in cfg.legacy),
        storage=guarded.storage, output=str(output) if output is not None else None,
        notes=list(guarded.notes))
    return the_plan, guarded, manifest


def load_case(bundle: Path, *, warm: bool | None = None,
              storage_url: str | None = None) -> tuple[ReplayCase, Manifest]:
    """Read what ran from ``bundle`` (guarded, see :func:`plan`) and what it showed (the
    doctor's verdict)."""
    case, manifest, _ = _load(bundle, None, warm, storage_url)
    return case, manifest


def _load(bundle: Path, output: Path | None, warm: bool | None,
          storage_url: str | None) -> tuple[ReplayCase, Manifest, ReplayPlan]:
    from doctor.diagnose import diagnose

    the_plan, guarded, manifest = plan(bundle, output=output, warm=warm,
                                       storage_url=storage_url)
    diagnosis = diagnose([str(bundle)])
    top = diagnosis.verdicts[0].signature if diagnosis.verdicts else NO_SIGNATURE
    case = ReplayCase(cfg=guarded.cfg, warm=the_plan.warm, signature=top,
                      outcome=manifest.outcome.value, source=str(bundle))
    return case, manifest, the_plan


def run_trial(case: ReplayCase, cfg: RuntimeConfig, *, work: Path, bundle_root: Path,
              change: str) -> tuple[TrialRecord, DiagnosedRun]:
    """Run ``cfg`` in isolation (fresh file L3) and judge it against ``case``."""
    t0 = time.monotonic()
    where = work / f"trial{next(_TRIAL)}"
    cfg = isolate(cfg, where)
    with temp_files_under(where / "tmp"):
        obs = run_and_diagnose(cfg, warm=case.warm, compare=True, bundle_root=bundle_root)
    record = TrialRecord(change=change, requests=cfg.workload.requests,
                         faults=[f.compact() for f in cfg.faults], reproduced=case.shows(obs),
                         observed=obs.observed, outcome=obs.outcome,
                         wall_s=round(time.monotonic() - t0, 2), bundle=obs.bundle,
                         faults_fired=obs.faults_fired)
    return record, obs


def replay(bundle: Path, *, work: Path, bundle_root: Path, warm: bool | None = None,
           storage_url: str | None = None) -> ReplayResult:
    """Repeat the run behind ``bundle`` once; see the module docstring. Files go under
    ``work`` (scratch: stores, run directories) and ``bundle_root`` (the new bundle) only."""
    case, manifest, the_plan = _load(bundle, bundle_root, warm, storage_url)
    record, obs = run_trial(case, case.cfg, work=work, bundle_root=bundle_root,
                            change="replay")
    return ReplayResult(bundle=str(bundle), signature=case.signature, outcome=case.outcome,
                        cell=printable(manifest.origin.cell) if manifest.origin else None,
                        reproduced=record.reproduced,
                        same_fault_schedule=_schedule(manifest.faults_fired)
                        == _schedule(obs.fired), trial=record, plan=the_plan)


def isolate(cfg: RuntimeConfig, where: Path) -> RuntimeConfig:
    """``cfg`` with a file-backed L3 moved to a fresh directory under ``where``."""
    if cfg.storage.backend != "file":
        return cfg
    return cfg.with_overrides(**{"storage.path": where / "l3"})


def _schedule(fired: list[Any]) -> list[tuple[str, int, int]]:
    return sorted((f.kind, f.rank, f.step) for f in fired)
