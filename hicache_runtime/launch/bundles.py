"""Bundle manifests: the one place a run's :class:`~hicache_runtime.contracts.bundle.Manifest`
is built, and the bundle of a multi-rank run assembled from its run directory.

:func:`build_manifest` serves both paths: a single-rank run (one rank entry, written in the
caller's process) and a multi-rank run, whose ranks left their files and ``entry.json`` under
``<run>/bundle``; :func:`write_run_bundle` folds those into the manifest, with each rank's exit
code, log and py-spy dump, copied under a bundle root (the launcher) or in place (rank 0 under
``torchrun``, where nobody else is left to do it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache_runtime.config import RuntimeConfig
from hicache_runtime.contracts.bundle import (
    FiredFaultRecord,
    Manifest,
    RankEntry,
    RankFiles,
    RunOutcome,
    bundle_writing,
    new_bundle_dir,
    now_iso,
    versions,
    write_manifest,
)
from hicache_runtime.contracts.errors import BundleNotWritten, DumpFormatError
from hicache_runtime.contracts.outcome import classify_exit, describe_exit
from hicache_runtime.contracts.rank_result import read_rank_result
from hicache_runtime.contracts.run_files import (
    RANK_DIRS,
    RANK_ENTRY,
    RANK_EVENTS,
    RANK_FAULTS_FIRED,
    RANK_JOURNAL,
    RANK_LOG,
    RANK_STATE,
    RunDir,
    in_bundle,
)
from hicache_runtime.contracts.topology import RankInfo


@dataclass(frozen=True)
class RankExit:
    """How a rank process ended, as far as the bundle is concerned (``None``: not known)."""

    rank: int
    returncode: int | None
    pid: int | None = None


def build_manifest(cfg: RuntimeConfig, outcome: RunOutcome, reason: str,
                   ranks: list[RankEntry], fired: Iterable[FiredFaultRecord], *,
                   missing_ranks: Iterable[int] = (),
                   mismatches: Iterable[dict[str, Any]] = ()) -> Manifest:
    """The manifest of a run of ``cfg``: what ran (config, faults, switches, versions), how
    it ended, and each rank's entry."""
    return Manifest(
        created_at=now_iso(), outcome=outcome, reason=reason,
        topology={"tp": cfg.topology.tp, "pp": cfg.topology.pp,
                  "world_size": cfg.topology.world_size},
        seed=cfg.seed, config=cfg.model_dump(mode="json"),
        faults=[f.compact() for f in cfg.faults], faults_fired=list(fired),
        legacy=sorted(s.value for s in cfg.legacy), versions=versions(), ranks=ranks,
        missing_ranks=list(missing_ranks), mismatches=list(mismatches))


def kept_bundle(write: Callable[[], Path]) -> tuple[Path | None, str | None]:
    """Write a bundle; when it cannot be written (a full disk), no bundle and why, so the run
    still ends with its summary (the failure it had is still the failure to report)."""
    try:
        return write(), None
    except BundleNotWritten as exc:
        return None, str(exc)


def write_run_bundle(run_dir: Path, cfg: RuntimeConfig, bundle_root: Path | None,
                     outcome: RunOutcome, reason: str, exits: Mapping[int, RankExit],
                     pyspy: Mapping[int, str | None],
                     mismatches: list[dict[str, Any]]) -> Path:
    """Turn ``<run>/bundle`` into a bundle: copied to a fresh folder under ``bundle_root``, or
    left where it is (``bundle_root`` None). Returns the bundle's folder."""
    run = RunDir(run_dir)
    entries, missing = [], []
    for r, ex in sorted(exits.items()):
        entry = _rank_entry(run, cfg, ex, outcome, pyspy.get(r))
        if entry.files.stacks is None and entry.files.pyspy is None:
            missing.append(r)
        entries.append(entry)
    fired = [f for r in exits for f in _fired(run, r)]
    if bundle_root is None:
        return _finish(run.bundle, cfg, outcome, reason, entries, fired, missing, mismatches)
    dest = new_bundle_dir(bundle_root, outcome)
    with bundle_writing(dest):  # a full disk: nothing half-written is left as a bundle
        if run.bundle.exists():
            shutil.copytree(run.bundle, dest, dirs_exist_ok=True)
        return _finish(dest, cfg, outcome, reason, entries, fired, missing, mismatches)


def _finish(dest: Path, cfg: RuntimeConfig, outcome: RunOutcome, reason: str,
            entries: list[RankEntry], fired: list[FiredFaultRecord], missing: list[int],
            mismatches: list[dict[str, Any]]) -> Path:
    """Fold the ranks' own files into the manifest and write it, last."""
    for name in (RANK_ENTRY, RANK_FAULTS_FIRED, RANK_JOURNAL):
        for stale in dest.glob(f"{RANK_DIRS}/{name}"):
            stale.unlink()
    write_manifest(dest, build_manifest(cfg, outcome, reason, entries, fired,
                                        missing_ranks=missing, mismatches=mismatches))
    return dest


def write_manifest_in_place(run_dir: Path, cfg: RuntimeConfig, outcome: RunOutcome,
                            reason: str) -> Path:
    """Without a launcher (``torchrun``): turn ``<run>/bundle`` into a bundle where it lies,
    from whatever rank dumps are there (exit codes unknown)."""
    exits = {r: RankExit(r, None) for r in range(cfg.topology.world_size)}
    return write_run_bundle(run_dir, cfg, None, outcome, reason, exits, {}, [])


def _rank_entry(run: RunDir, cfg: RuntimeConfig, ex: RankExit, outcome: RunOutcome,
                pyspy: str | None) -> RankEntry:
    r = ex.rank
    d = run.rank_bundle(r)
    d.mkdir(parents=True, exist_ok=True)
    if run.log(r).exists():
        shutil.copy(run.log(r), d / RANK_LOG)
    try:
        entry = RankEntry.model_validate_json((d / RANK_ENTRY).read_text())
        if entry.outcome is RunOutcome.HEALTHY:
            entry.outcome = outcome  # a clean rank of a run judged wrong afterwards
    except (OSError, ValueError):
        info = RankInfo.of(r, cfg.topology.tp, cfg.topology.pp)
        entry = RankEntry(rank=r, tp_rank=info.tp_rank, pp_rank=info.pp_rank, pid=ex.pid,
                          outcome=classify_exit(ex.returncode, outcome),
                          error=f"no dump: exited with code {ex.returncode}"
                          f"{describe_exit(ex.returncode)}", files=RankFiles())
    entry.exit_code = ex.returncode
    journal = d / RANK_JOURNAL
    if journal.exists() and not (d / RANK_EVENTS).exists():
        # died before dumping its ring: what it journaled is all that is left of its trace
        journal.replace(d / RANK_EVENTS)
        entry.files.events = in_bundle(r, RANK_EVENTS)
    entry.files.pyspy = pyspy or entry.files.pyspy
    entry.files.log = in_bundle(r, RANK_LOG) if (d / RANK_LOG).exists() else None
    return entry


def _fired(run: RunDir, rank: int) -> list[FiredFaultRecord]:
    """Faults fired on a rank: from its result, else from its state dump, else from the
    journal a fault that killed it left (see ``FaultInjector.write_journal``)."""
    try:
        result = read_rank_result(run.result(rank))
    except DumpFormatError:
        result = None
    if result is not None:
        return list(result.faults_fired)
    for name, key in ((RANK_STATE, "faults_fired"), (RANK_FAULTS_FIRED, None)):
        path = run.rank_bundle(rank) / name
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        fired = data.get(key, []) if key and isinstance(data, dict) else data
        try:
            out = [FiredFaultRecord.model_validate(f) for f in fired] \
                if isinstance(fired, list) else []
        except ValueError:  # pydantic's ValidationError included: a record cut short
            continue
        return out
    return []
