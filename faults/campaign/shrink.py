"""Shrinking a failing run to the smallest fault schedule and request set that still shows the
same signature (test-case minimisation, as fuzzers do for crashing inputs).

Greedy passes, each step real runs judged by :meth:`ReplayCase.shows`. Failures that depend on
thread timing reproduce only sometimes, so one failing run of a candidate proves little: a step
is kept only when ``step_runs`` runs of it in a row (default 2) all fail the same way, and the
final case is rerun ``confirm`` more times (default 3) to say how often it reproduces (k/N).
A final case that did not reproduce every time is reported ``flaky``, and so is the campaign
cell written for it. The passes:

1. drop whole fault specs (when there are several);
2. fewer requests: bisect ``workload.requests`` down (the workload is drawn from the seed, so
   a smaller count is a different but related request set; bisection assumes "fails with N"
   roughly implies "fails with more", and only ever keeps a count that was seen failing);
3. pin each fault's schedule to what fired in the last failing run: ``count=1`` (else the
   most firings on one rank), ``rank=`` when it fired on one rank only, ``steps=`` to the
   first..last step it fired at.

The search stops when the run budget (``max_runs``, the step confirmations included) is
spent; what it has by then reproduced in every run of it. The final confirmation runs come on
top of the budget.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, Field

from faults.campaign.cells import DiagnosedRun
from faults.campaign.plan import cell_from_config
from faults.campaign.replay import ReplayCase, TrialRecord, load_case, run_trial
from faults.kinds import KINDS
from faults.spec import FaultSpec, parse_faults
from hicache_runtime.config import RuntimeConfig
from hicache_runtime.contracts.errors import ConfigError

Trial = Callable[[RuntimeConfig, str], tuple[TrialRecord, DiagnosedRun]]
TrialHook = Callable[[TrialRecord, int, int], None]
"""Told of every run as it ends: the run, how many have run, how many may (budget and
confirmation runs); what ``inject --shrink`` shows while it searches."""
"""Runs a candidate config (with a description of the change) and judges it."""

DEFAULT_CONFIRM = 3
"""Reruns of the final case that say how often it reproduces."""
DEFAULT_STEP_RUNS = 2
"""Runs of a candidate, all failing the same way, before a step keeps it."""


class ShrinkTrial(TrialRecord):
    """One run of the search or of the final confirmation."""

    kept: bool = False
    """This run completed a candidate's runs and the candidate became the current case."""
    confirm: bool = False
    """A confirmation run of the final case (outside the search budget)."""


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
    """Every run made: the replay, the search (with its step confirmations) and the final
    confirmation."""
    budget_exhausted: bool
    confirm_runs: int = 0
    """Reruns of the final case after the search."""
    confirmed: int = 0
    """How many of them failed the same way."""
    flaky: bool = False
    """The final case did not fail the same way in every confirmation run: as a campaign
    cell it will not fail reliably."""
    trials: list[ShrinkTrial] = Field(default_factory=list)
    final_bundle: str | None = None
    """A bundle of the smallest run that still fails the same way."""
    cell_spec: str | None = None
    """A one-cell campaign spec that reruns the shrunk case (``hicache campaign FILE``)."""


@dataclass
class _Search:
    case: ReplayCase
    trial: Trial
    max_runs: int
    step_runs: int
    cfg: RuntimeConfig
    obs: DiagnosedRun
    record: ShrinkTrial
    """The current case's last run (its bundle is the result's)."""
    trials: list[ShrinkTrial] = field(default_factory=list)
    on_trial: TrialHook | None = None
    planned: int = 0
    """Runs the whole search may make: the budget plus the confirmation runs."""

    @property
    def spent(self) -> bool:
        return len(self.trials) >= self.max_runs

    def run(self, cfg: RuntimeConfig, change: str, *,
            confirm: bool = False) -> tuple[ShrinkTrial, DiagnosedRun]:
        record, obs = self.trial(cfg, change)
        trial = ShrinkTrial(**record.model_dump(), confirm=confirm)
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial, len(self.trials), self.planned)
        return trial, obs

    def attempt(self, cfg: RuntimeConfig, change: str) -> bool:
        """Run ``cfg`` up to ``step_runs`` times; keep it as the current case only when every
        run fails the same way (a candidate that fails once in two is not kept: the case it
        would replace fails more reliably). A candidate whose runs the budget cannot finish
        is not kept either."""
        if self.spent or cfg == self.cfg:
            return False
        for i in range(self.step_runs):
            if self.spent:
                return False
            trial, obs = self.run(cfg, change if i == 0 else f"{change} (run {i + 1})")
            if not trial.reproduced:
                return False
        trial.kept = True
        self.cfg, self.obs, self.record = cfg, obs, trial
        return True


def shrink(case: ReplayCase, first: TrialRecord, first_obs: DiagnosedRun, *, trial: Trial,
           max_runs: int, confirm: int = DEFAULT_CONFIRM,
           step_runs: int = DEFAULT_STEP_RUNS,
           on_trial: TrialHook | None = None) -> ShrinkResult:
    """Shrink ``case``; ``first`` is its unshrunk replay (counted against ``max_runs``).

    Each kept step ran ``step_runs`` times, all failing the same way; the final case then
    runs ``confirm`` more times (outside ``max_runs``) and the result says how many of those
    failed the same way, and ``flaky`` when not all did.
    """
    if confirm < 0 or step_runs < 1:
        raise ValueError(f"confirm must be >= 0 and step_runs >= 1 (got {confirm}, "
                         f"{step_runs})")
    start = ShrinkTrial(**first.model_dump(), kept=first.reproduced)
    s = _Search(case=case, trial=trial, max_runs=max_runs, step_runs=step_runs, cfg=case.cfg,
                obs=first_obs, record=start, trials=[start], on_trial=on_trial,
                planned=max_runs + (confirm if first.reproduced else 0))
    original = _summary(case.cfg, first)
    confirmed = 0
    if first.reproduced:
        _drop_faults(s)
        _fewer_requests(s)
        _pin_schedules(s)
        spent = s.spent
        for i in range(confirm):
            run, _ = s.run(s.cfg, f"confirm {i + 1}/{confirm}", confirm=True)
            confirmed += run.reproduced
    else:
        spent, confirm = s.spent, 0
    return ShrinkResult(bundle=case.source, signature=case.signature,
                        reproduced=first.reproduced, original=original,
                        shrunk=_summary(s.cfg, s.record), runs=len(s.trials),
                        budget_exhausted=spent, confirm_runs=confirm, confirmed=confirmed,
                        flaky=confirmed < confirm, trials=s.trials,
                        final_bundle=s.record.bundle if first.reproduced else None)


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
    if not KINDS[spec.kind].stepped or spec.steps is not None or not fired:
        return []
    steps = [f.step for f in fired]
    return [spec.model_copy(update={"steps": (min(steps), max(steps))})]


def _summary(cfg: RuntimeConfig, record: TrialRecord) -> CaseSummary:
    return CaseSummary(requests=cfg.workload.requests,
                       faults=[f.compact() for f in cfg.faults],
                       faults_fired=record.faults_fired)


def shrink_bundle(bundle: Path, out: Path, *, max_runs: int = 16,
                  confirm: int = DEFAULT_CONFIRM, warm: bool | None = None,
                  on_trial: TrialHook | None = None) -> ShrinkResult:
    """Replay ``bundle``, shrink it, rerun the result ``confirm`` times, and leave in ``out``
    the smallest reproducing run's bundle (``out/bundle``) and a one-cell campaign spec that
    reruns it (``out/cell.yaml``, marked flaky when the confirmation runs were not all
    failures of the same kind)."""
    case, manifest = load_case(bundle, warm=warm)
    if out.exists() and any(out.iterdir()):
        raise ConfigError("out", f"{out} exists and is not empty", hint="pick a new --out")
    with tempfile.TemporaryDirectory(prefix="hicache-shrink-") as tmp:
        work, bundles = Path(tmp) / "work", Path(tmp) / "bundles"

        def trial(cfg: RuntimeConfig, change: str) -> tuple[TrialRecord, DiagnosedRun]:
            return run_trial(case, cfg, work=work, bundle_root=bundles, change=change)

        first, first_obs = trial(case.cfg, "replay")
        if on_trial is not None:
            on_trial(first, 1, max_runs + confirm)
        result = shrink(case, first, first_obs, trial=trial, max_runs=max_runs,
                        confirm=confirm, on_trial=on_trial)
        if result.final_bundle is None:
            return result
        out.mkdir(parents=True, exist_ok=True)
        final = out / "bundle"
        shutil.copytree(result.final_bundle, final)
    result.final_bundle = str(final)
    origin = manifest.origin.cell if manifest.origin else bundle.name
    result.cell_spec = str(write_cell_spec(out / "cell.yaml", case, result, origin=origin))
    return result


def write_cell_spec(path: Path, case: ReplayCase, result: ShrinkResult, *, origin: str) -> Path:
    """Write the one-cell campaign spec that reruns ``result``'s final case to ``path``;
    a flaky case is marked so (in a leading comment, the name and the description)."""
    shrunk_cfg = case.cfg.with_overrides(**{"workload.requests": result.shrunk.requests},
                                         faults=_parse(result.shrunk.faults))
    cell = cell_from_config(shrunk_cfg, expect=case.signature, warm=case.warm)
    bundle = result.bundle
    rate = reproduction(result)
    spec = {"name": f"shrunk-{case.signature}" + ("-flaky" if result.flaky else ""),
            "description": f"{origin} shrunk by hicache inject --shrink from {bundle}; "
                           f"{rate}",
            "cells": [cell.model_dump(exclude_defaults=True) | {"id": cell.id}]}
    # The cell schema has no place for it, so the verdict on reliability is a comment (and
    # the name and description above): a flaky cell is a lead, not a regression test.
    head = f"# flaky: {rate}; as a campaign cell it will not fail every time\n" \
        if result.flaky else f"# {rate}\n"
    path.write_text(head + yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


def reproduction(result: ShrinkResult) -> str:
    """How often the final case reproduced, in words: ``reproduced 2/3 confirmation runs``."""
    if not result.confirm_runs:
        return "not confirmed (no confirmation runs)"
    return f"reproduced {result.confirmed}/{result.confirm_runs} confirmation runs"


def _parse(faults: list[str]) -> tuple[FaultSpec, ...]:
    return tuple(parse_faults(faults))
