"""One bundle for a run of several DP groups, assembled from every group's run directory.

Each DP group is a torch.distributed world of its own (see
:mod:`hicache_runtime.launch.dp_controller`), so its ranks number themselves from 0 and write
their files under ``<run>/dp<d>/`` exactly as a run of one group does. The bundle names every
rank by its place in the whole grid (``rank<g>/``, ``g = d * tp * pp + r``) and says which
group it belongs to, so a reader never confuses group 1's rank 0 with group 0's:

* each rank's manifest entry gets ``rank = g`` and ``dp_rank = d``, its file paths the new
  folder; fired faults and missing ranks are renumbered alike;
* the files that name a rank inside are renumbered too: every event of ``events.jsonl``
  (``rank``, plus ``dp``), ``state.json`` (``rank``, plus ``dp_rank``) and the peers of
  ``flight_recorder.json`` (a peer is a rank of the same group's world);
* the manifest's topology has ``dp`` and ``world_size`` is the whole grid;
* the controller's own event ring (its routing decisions and broadcasts) is
  ``controller/events.jsonl``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hicache_runtime.config import RuntimeConfig
from hicache_runtime.contracts.bundle import (
    FiredFaultRecord,
    RankEntry,
    RankFiles,
    RunOutcome,
    bundle_writing,
    load_manifest,
    new_bundle_dir,
    write_manifest,
)
from hicache_runtime.contracts.run_files import (
    RANK_DIRS,
    RANK_EVENTS,
    RANK_FLIGHT_RECORDER,
    RANK_STATE,
    RunDir,
    in_bundle,
    rank_dir_name,
)
from hicache_runtime.launch.bundles import RankExit, build_manifest, write_run_bundle

CONTROLLER_DIR = "controller"
"""The controller's folder in a bundle (its ``events.jsonl``)."""


def group_dir(run_dir: Path, group: int) -> Path:
    """A DP group's run directory inside the controller's."""
    return run_dir / f"dp{group}"


def write_dp_bundle(run_dir: Path, cfg: RuntimeConfig, bundle_root: Path, outcome: RunOutcome,
                    reason: str, exits: Mapping[int, RankExit], pyspy: Mapping[int, str | None],
                    mismatches: list[dict[str, Any]],
                    controller_events: list[dict[str, Any]]) -> Path:
    """Write the bundle of a run of ``cfg.topology.dp`` groups under ``bundle_root``; ``exits``
    and ``pyspy`` are keyed by grid rank. Returns the bundle's folder."""
    dest = new_bundle_dir(bundle_root, outcome)
    with bundle_writing(dest):  # a full disk: nothing half-written is left as a bundle
        return _assemble(run_dir, cfg, dest, outcome, reason, exits, pyspy, mismatches,
                         controller_events)


def _assemble(run_dir: Path, cfg: RuntimeConfig, dest: Path, outcome: RunOutcome, reason: str,
              exits: Mapping[int, RankExit], pyspy: Mapping[int, str | None],
              mismatches: list[dict[str, Any]], controller_events: list[dict[str, Any]]) -> Path:
    per = cfg.topology.world_size
    staging = run_dir / "assembly"
    entries: list[RankEntry] = []
    fired: list[FiredFaultRecord] = []
    missing: list[int] = []
    for d in range(cfg.topology.dp):
        first = d * per
        local_exits = {g - first: RankExit(g - first, ex.returncode, ex.pid)
                       for g, ex in exits.items() if first <= g < first + per}
        local_pyspy = {g - first: p for g, p in pyspy.items() if first <= g < first + per}
        # the group's own bundle, as a run of one group writes it, then renumbered into ours
        part = write_run_bundle(group_dir(run_dir, d), cfg, staging, outcome, reason,
                                local_exits, local_pyspy, [])
        manifest = load_manifest(part)
        for entry in manifest.ranks:
            entries.append(_move_rank(part, dest, entry, d, first))
        fired += [f.model_copy(update={"rank": first + f.rank}) for f in manifest.faults_fired]
        missing += [first + r for r in manifest.missing_ranks]
        shutil.rmtree(part, ignore_errors=True)
    if controller_events:
        folder = dest / CONTROLLER_DIR
        folder.mkdir()
        with (folder / RANK_EVENTS).open("w", encoding="utf-8") as fh:
            for ev in controller_events:
                fh.write(json.dumps(ev, default=str) + "\n")
    manifest = build_manifest(cfg, outcome, reason, entries, fired, missing_ranks=missing,
                              mismatches=mismatches)
    manifest.topology = {"tp": cfg.topology.tp, "pp": cfg.topology.pp, "dp": cfg.topology.dp,
                         "world_size": cfg.topology.grid_size}
    write_manifest(dest, manifest)
    return dest


def _move_rank(part: Path, dest: Path, entry: RankEntry, group: int, first: int) -> RankEntry:
    """Copy one rank's folder to its grid-rank folder, renumbering what names a rank."""
    local, grid = entry.rank, first + entry.rank
    src = part / rank_dir_name(local)
    out = dest / rank_dir_name(grid)
    if src.is_dir():
        shutil.copytree(src, out)
    else:
        out.mkdir(parents=True)
    _renumber_events(out / RANK_EVENTS, grid, group)
    _renumber_state(out / RANK_STATE, grid, group)
    _renumber_peers(out / RANK_FLIGHT_RECORDER, first)
    files = {k: in_bundle(grid, Path(v).name) if v else None
             for k, v in entry.files.model_dump().items()}
    return entry.model_copy(update={"rank": grid, "dp_rank": group,
                                    "files": RankFiles(**files)})


def _renumber_events(path: Path, grid: int, group: int) -> None:
    if not path.is_file():
        return
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:  # a line cut short by the dump: kept as it is
            lines.append(line)
            continue
        if isinstance(ev, dict):
            ev["rank"], ev["dp"] = grid, group
            line = json.dumps(ev, default=str)
        lines.append(line)
    path.write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")


def _renumber_state(path: Path, grid: int, group: int) -> None:
    data = _read_json(path)
    if isinstance(data, dict):
        data["rank"], data["dp_rank"] = grid, group
        path.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")


def _renumber_peers(path: Path, first: int) -> None:
    data = _read_json(path)
    if not isinstance(data, list) or not first:
        return
    for rec in data:
        if isinstance(rec, dict) and isinstance(rec.get("peer"), int):
            rec["peer"] += first
    path.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def has_rank_dumps(run_dir: Path, groups: int) -> bool:
    """Whether any group's ranks left bundle files (worth keeping when a run is cut short)."""
    return any(any(RunDir(group_dir(run_dir, d)).bundle.glob(f"{RANK_DIRS}/*"))
               for d in range(groups))
