"""Shrinking a failing run to the smallest fault schedule and request set that still shows the
same signature (test-case minimisation, as fuzzers do for crashing inputs).

Greedy passes, each step one real run judged by :meth:`ReplayCase.shows`; a step is kept only
when the run fails the same way, so the result always reproduces:

1. drop whole fault specs (when there are several);
2. fewer requests: bisect ``workload.requests`` down (the workload is drawn from the seed, so
   a smaller count is a different but related request set; bisection assumes "fails with N"
   roughly implies "fails with more", and only ever keeps a count that was seen failing);
3. pin each fault's schedule to what fired in the last failing run: ``count=1`` (else the
   most firings on one rank), ``rank=`` when it fired on one rank only, ``steps=`` to the
   first..last step it fired at.

The search stops when the run budget is spent; what it has by then still reproduces.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel

from faults.campaign import cell_from_config
from faults.replay import ReplayCase, TrialRecord, load_case, run_trial
from faults.runner import Observation
from faults.spec import FaultKind, FaultSpec, parse_faults
from hicache_runtime.config import RuntimeConfig
from hicache_runtime.errors import ConfigError

#: Faults whose firings carry a meaningful scheduler step (a ``steps=`` pin is sound).
_STEPPED = frozenset({FaultKind.STAGE_LAG, FaultKind.HOST_ALLOC_FAIL, FaultKind.RANK_KILL,
                      FaultKind.CRASH, FaultKind.HANG, FaultKind.DMA_LAG})

Trial = Callable[[RuntimeConfig, str], tuple[TrialRecord, Observation]]
"""Runs a candidate config (with a description of the change) and judges it."""


class CaseSummary(BaseModel):
    requests: int
    faults: list[str]
    faults_fired: int


class ShrinkResult(BaseModel):
    """``hicache inject --replay --shrink --json``."""

    bundle: str
    signature: str
    reproduced: bool
    """The unshrunk replay failed the same way (without that there is nothing to shrink)."""
    original: CaseSummary
    shrunk: CaseSummary
    runs: int
    budget_exhausted: bool
    trials: list[TrialRecord]
    final_bundle: str | None = None
    """A bundle of the smallest run that still fails the same way."""
    cell_spec: str | None = None
    """A one-cell campaign spec that reruns the shrunk case (``hicache campaign FILE``)."""


@dataclass
class _Search:
    case: ReplayCase
    trial: Trial
    max_runs: int
    cfg: RuntimeConfig
    obs: Observation
    trials: list[TrialRecord] = field(default_factory=list)

    @property
    def spent(self) -> bool:
        return len(self.trials) >= self.max_runs

    def attempt(self, cfg: RuntimeConfig, change: str) -> bool:
        """Run ``cfg``; keep it as the current case when it fails the same way."""
        if self.spent or cfg == self.cfg:
            return False
        record, obs = self.trial(cfg, change)
        self.trials.append(record)
        if record.reproduced:
            self.cfg, self.obs = cfg, obs
        return record.reproduced


def shrink(case: ReplayCase, first: TrialRecord, first_obs: Observation, *, trial: Trial,
           max_runs: int) -> ShrinkResult:
    """Shrink ``case``; ``first`` is its unshrunk replay (counted against ``max_runs``)."""
    s = _Search(case=case, trial=trial, max_runs=max_runs, cfg=case.cfg, obs=first_obs,
                trials=[first])
    original = _summary(case.cfg, first)
    if first.reproduced:
        _drop_faults(s)
        _fewer_requests(s)
        _pin_schedules(s)
    last = next((t for t in reversed(s.trials) if t.reproduced), first)
    return ShrinkResult(bundle=case.source, signature=case.signature,
                        reproduced=first.reproduced, original=original,
                        shrunk=_summary(s.cfg, last), runs=len(s.trials),
                        budget_exhausted=s.spent, trials=s.trials,
                        final_bundle=last.bundle if last.reproduced else None)


def _drop_faults(s: _Search) -> None:
    i = 0
    while len(s.cfg.faults) > 1 and i < len(s.cfg.faults):
        spec = s.cfg.faults[i]
        rest = s.cfg.faults[:i] + s.cfg.faults[i + 1:]
        if not s.attempt(s.cfg.with_overrides(faults=rest), f"drop {spec.compact()}"):
            i += 1


def _fewer_requests(s: _Search) -> None:
    lo, hi = 1, s.cfg.workload.requests
    while lo < hi and not s.spent:
        mid = (lo + hi) // 2
        if s.attempt(s.cfg.with_overrides(**{"workload.requests": mid}), f"requests={mid}"):
            hi = mid
        else:
            lo = mid + 1


def _pin_schedules(s: _Search) -> None:
    for i in range(len(s.cfg.faults)):
        pins = (_pin_count, _pin_rank, _pin_steps) if s.cfg.topology.world_size > 1 \
            else (_pin_count, _pin_steps)
        for pin in pins:
            spec = s.cfg.faults[i]
            fired = [f for f in s.obs.fired if f.spec == spec.compact()]
            for candidate in pin(spec, fired):
                faults = (*s.cfg.faults[:i], candidate, *s.cfg.faults[i + 1:])
                if s.attempt(s.cfg.with_overrides(faults=faults), f"pin {candidate.compact()}"):
                    break


def _pin_count(spec: FaultSpec, fired: list) -> list[FaultSpec]:
    per_rank = Counter(f.rank for f in fired)
    most = max(per_rank.values(), default=0)
    out = []
    if most > 1 and (spec.count is None or spec.count > 1):
        out.append(spec.model_copy(update={"count": 1}))
    if most > 2 and (spec.count is None or spec.count > most):
        out.append(spec.model_copy(update={"count": most}))
    return out


def _pin_rank(spec: FaultSpec, fired: list) -> list[FaultSpec]:
    ranks = {f.rank for f in fired}
    if len(ranks) == 1 and spec.rank is None and spec.tp is None and spec.pp is None:
        return [spec.model_copy(update={"rank": ranks.pop()})]
    return []


def _pin_steps(spec: FaultSpec, fired: list) -> list[FaultSpec]:
    if spec.kind not in _STEPPED or spec.steps is not None or not fired:
        return []
    steps = [f.step for f in fired]
    return [spec.model_copy(update={"steps": (min(steps), max(steps))})]


def _summary(cfg: RuntimeConfig, record: TrialRecord) -> CaseSummary:
    return CaseSummary(requests=cfg.workload.requests,
                       faults=[f.compact() for f in cfg.faults],
                       faults_fired=record.faults_fired)


def shrink_bundle(bundle: Path, out: Path, *, max_runs: int = 16,
                  warm: bool | None = None) -> ShrinkResult:
    """Replay ``bundle``, shrink it, and leave in ``out`` the smallest reproducing run's bundle
    (``out/bundle``) and a one-cell campaign spec that reruns it (``out/cell.yaml``)."""
    case, manifest = load_case(bundle, warm=warm)
    if out.exists() and any(out.iterdir()):
        raise ConfigError("out", f"{out} exists and is not empty", hint="pick a new --out")
    with tempfile.TemporaryDirectory(prefix="hicache-shrink-") as tmp:
        work, bundles = Path(tmp) / "work", Path(tmp) / "bundles"

        def trial(cfg: RuntimeConfig, change: str) -> tuple[TrialRecord, Observation]:
            return run_trial(case, cfg, work=work, bundle_root=bundles, change=change)

        first, first_obs = trial(case.cfg, "replay")
        result = shrink(case, first, first_obs, trial=trial, max_runs=max_runs)
        if result.final_bundle is None:
            return result
        out.mkdir(parents=True, exist_ok=True)
        final = out / "bundle"
        shutil.copytree(result.final_bundle, final)
    result.final_bundle = str(final)
    shrunk_cfg = case.cfg.with_overrides(**{"workload.requests": result.shrunk.requests},
                                         faults=_parse(result.shrunk.faults))
    cell = cell_from_config(shrunk_cfg, expect=case.signature, warm=case.warm)
    origin = manifest.origin.cell if manifest.origin else bundle.name
    spec = {"name": f"shrunk-{case.signature}",
            "description": f"{origin} shrunk by hicache inject --shrink from {bundle}",
            "cells": [cell.model_dump(exclude_defaults=True) | {"id": cell.id}]}
    cell_yaml = out / "cell.yaml"
    cell_yaml.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    result.cell_spec = str(cell_yaml)
    return result


def _parse(faults: list[str]) -> tuple[FaultSpec, ...]:
    return tuple(parse_faults(faults))
