"""Replaying the run a crash bundle came from.

A bundle's manifest holds the whole validated config (topology, seed, workload, faults, legacy
switches), so the run can be repeated exactly: same requests, same fault draws. Replay runs it
again and says whether it fails the *same way*: the doctor must name the same signature for
the new bundle as for the original (or, where nothing fit the original, the same outcome).

Storage isolation: a file-backed L3 gets a fresh directory per run, so a replay (or a shrink
trial) never reads pages an earlier one left; cells that ran ``warm`` repeat their fault-free
warm-up first. A Redis-backed L3 is reused as configured (its server must be reachable).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from faults.runner import HEALTHY, NO_SIGNATURE, Observation, observe
from hicache_runtime.bundle import Manifest, RunOutcome, load_manifest
from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.errors import ConfigError, DumpFormatError

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

    def shows(self, obs: Observation) -> bool:
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


def load_case(bundle: Path, *, warm: bool | None = None) -> tuple[ReplayCase, Manifest]:
    """Read what ran from ``bundle`` and what it showed (the doctor's verdict)."""
    from doctor.diagnose import diagnose

    try:
        manifest = load_manifest(bundle)
    except FileNotFoundError:
        raise DumpFormatError(f"{bundle} holds no manifest.json",
                              hint="replay takes a crash bundle directory") from None
    except (OSError, ValidationError, ValueError) as exc:
        raise DumpFormatError(f"{bundle}/manifest.json is not a bundle manifest: "
                              f"{str(exc).splitlines()[0]}") from None
    if manifest.outcome is RunOutcome.HEALTHY:
        raise ConfigError("bundle", f"{bundle} records a healthy run: nothing to replay")
    try:
        cfg = load_config(manifest.config)
    except ConfigError as exc:
        raise ConfigError("bundle", f"{bundle}: its config no longer validates: {exc}",
                          hint="it was written by another version of hicache") from None
    diagnosis = diagnose([str(bundle)])
    top = diagnosis.verdicts[0].signature if diagnosis.verdicts else NO_SIGNATURE
    origin_warm = manifest.origin.warm if manifest.origin else False
    case = ReplayCase(cfg=cfg, warm=origin_warm if warm is None else warm, signature=top,
                      outcome=manifest.outcome.value, source=str(bundle))
    return case, manifest


def run_trial(case: ReplayCase, cfg: RuntimeConfig, *, work: Path, bundle_root: Path,
              change: str) -> tuple[TrialRecord, Observation]:
    """Run ``cfg`` in isolation (fresh file L3) and judge it against ``case``."""
    t0 = time.monotonic()
    cfg = isolate(cfg, work / f"trial{next(_TRIAL)}")
    obs = observe(cfg, warm=case.warm, compare=True, bundle_root=bundle_root)
    record = TrialRecord(change=change, requests=cfg.workload.requests,
                         faults=[f.compact() for f in cfg.faults], reproduced=case.shows(obs),
                         observed=obs.observed, outcome=obs.outcome,
                         wall_s=round(time.monotonic() - t0, 2), bundle=obs.bundle,
                         faults_fired=obs.faults_fired)
    return record, obs


def replay(bundle: Path, *, work: Path, bundle_root: Path,
           warm: bool | None = None) -> ReplayResult:
    """Repeat the run behind ``bundle`` once; see the module docstring."""
    case, manifest = load_case(bundle, warm=warm)
    record, obs = run_trial(case, case.cfg, work=work, bundle_root=bundle_root,
                            change="replay")
    return ReplayResult(bundle=str(bundle), signature=case.signature, outcome=case.outcome,
                        cell=manifest.origin.cell if manifest.origin else None,
                        reproduced=record.reproduced,
                        same_fault_schedule=_schedule(manifest.faults_fired)
                        == _schedule(obs.fired), trial=record)


def isolate(cfg: RuntimeConfig, where: Path) -> RuntimeConfig:
    """``cfg`` with a file-backed L3 moved to a fresh directory under ``where``."""
    if cfg.storage.backend != "file":
        return cfg
    return cfg.with_overrides(**{"storage.path": where / "l3"})


def _schedule(fired: list[Any]) -> list[tuple[str, int, int]]:
    return sorted((f.kind, f.rank, f.step) for f in fired)
