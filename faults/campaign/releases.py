"""The release matrix: a campaign's fixed cells on each release profile, judged by the doctor.

``hicache campaign --profiles sglang-0.5.13,sglang-0.5.23`` answers "which releases fail, under
what": every cell of the spec that runs no legacy switch (the switches are the profile's to
decide) runs once per profile, and the doctor names what each run left. Nothing is expected of
a release: a cell is *clean* when the run stayed healthy with outputs identical to a
cache-disabled run, and otherwise carries the signature the doctor named (or the outcome, when
it named none). :meth:`ReleaseMatrix.reproduces` lists, per signature, the profiles on which some
cell reproduced it: the catalog's ``affected:`` data is read from a matrix like this one.

A failure on a profile is the runtime's rendering of that release's protocols
(``contracts/profiles.py``; what a profile does not model is listed with it), never a
reproduction on the release itself.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel

from doctor.report.markdown import md_code, md_escape
from faults.campaign.cells import CampaignResult, CellHook, CellResult, run_campaign
from faults.campaign.plan import HEALTHY, CampaignSpec
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.profiles import unknown

RELEASE_MATRIX_KIND = "hicache-release-matrix"
RELEASE_MATRIX_SCHEMA_VERSION = "1.0"


class ReleaseMatrix(BaseModel):
    """Every (profile, cell) run of a release matrix (``--json``)."""

    kind: str = RELEASE_MATRIX_KIND
    schema_version: str = RELEASE_MATRIX_SCHEMA_VERSION
    campaign: str
    profiles: list[str]
    started_at: str
    wall_s: float
    cells: list[CellResult]
    """Ids ``<profile>/<cell id>``; ``column`` is the profile, ``row`` the cell's row."""

    def reproduces(self) -> dict[str, list[str]]:
        """Signature id -> the profiles (in matrix order) on which a cell's run ended with the
        doctor naming it."""
        out: dict[str, list[str]] = {}
        for p in self.profiles:
            for c in self.cells:
                if c.column == p and c.verdict and c.skipped is None \
                        and p not in out.setdefault(c.verdict, []):
                    out[c.verdict].append(p)
        return dict(sorted(out.items()))

    def as_campaign(self) -> CampaignResult:
        """The same runs as one campaign result, each expecting a clean run: the JUnit and
        Markdown writers of a campaign take it as it is (a release's failure is a failed
        test case there)."""
        return CampaignResult(name=f"{self.campaign} x {', '.join(self.profiles)}",
                              started_at=self.started_at, wall_s=self.wall_s, cells=self.cells)


def parse_profiles(text: str) -> list[str]:
    """``--profiles a,b``: known profile names, in order, each once."""
    names = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    problem = next(filter(None, map(unknown, names)), None) if names else unknown("")
    if problem is not None:
        raise ConfigError("--profiles", f"unknown or no profile: {problem}")
    return names


def release_spec(spec: CampaignSpec, profile: str) -> CampaignSpec:
    """``spec`` on ``profile``: its cells that run no legacy switch, each expecting a clean run
    (its ``fixed`` expectation, which in the built-in campaigns is ``healthy``)."""
    cells = [c for c in spec.cells if not c.legacy]
    matrix = [m.model_copy(update={"legacy": [[]], "expect": {"fixed": m.expect.get("fixed",
                                                                                    HEALTHY)}})
              for m in spec.matrix if [] in m.legacy]
    if not cells and not matrix:
        raise ConfigError("campaign", f"campaign {spec.name!r} has no cell without legacy "
                                      "switches: a release matrix runs those on each profile")
    return spec.model_copy(update={"name": f"{spec.name}@{profile}", "cells": cells,
                                   "matrix": matrix, "properties": [],
                                   "defaults": {**spec.defaults, "profile": profile}})


def run_release_matrix(spec: CampaignSpec, profiles: list[str], *, bundle_root: Path,
                       only: str | None = None, hook: CellHook | None = None,
                       storage_url: str | None = None) -> ReleaseMatrix:
    """Run ``spec``'s fixed cells once per profile (bundles under ``bundle_root/<profile>``)."""
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    cells: list[CellResult] = []
    for name in profiles:
        done = run_campaign(release_spec(spec, name), bundle_root=bundle_root / name, only=only,
                            hook=hook, storage_url=storage_url)
        cells += [c.model_copy(update={"id": f"{name}/{c.id}", "column": name})
                  for c in done.cells]
    return ReleaseMatrix(campaign=spec.name, profiles=profiles, started_at=started,
                         wall_s=round(time.monotonic() - t0, 2), cells=cells)


def markdown(result: ReleaseMatrix) -> str:
    """Rows (topology and faults) by profiles: ``clean`` or what the doctor named; then, per
    signature, the profiles it reproduced on."""
    rows = list(dict.fromkeys(c.row for c in result.cells))
    at = {(c.row, c.column): c for c in result.cells}
    lines = [f"# Release matrix of {md_code(result.campaign)}", "",
             f"{len(result.cells)} runs, {result.wall_s:.0f} s, started "
             f"{md_escape(result.started_at)}. A cell is `clean` (healthy, outputs identical to "
             "a cache-disabled run) or what the doctor named.", "",
             "| cell | " + " | ".join(md_code(p, table=True) for p in result.profiles) + " |",
             "|---|" + "---|" * len(result.profiles)]
    for row in rows:
        marks = []
        for p in result.profiles:
            c = at.get((row, p))
            marks.append("" if c is None else md_escape(cell_mark(c)))
        lines.append(f"| {md_code(row, table=True)} | " + " | ".join(marks) + " |")
    found = result.reproduces()
    if found:
        lines += ["", "## Where each signature reproduces", ""]
        lines += [f"- {md_code(sig)}: {', '.join(md_code(p) for p in profiles)}"
                  for sig, profiles in found.items()]
    return "\n".join(lines) + "\n"


def cell_mark(c: CellResult) -> str:
    """A matrix cell: ``skipped``, ``clean`` or what the doctor named (else the outcome)."""
    if c.skipped is not None:
        return "skipped"
    if c.passed:
        return "clean"
    return c.verdict or c.outcome
