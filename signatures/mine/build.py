"""Build the upstream index: every system of the plan, every version, every message template.

``python -m signatures.mine`` reads ``plan.yaml``, gets each version's sources
(:mod:`signatures.mine.sources`), extracts templates from its Python and C/C++ files
(:mod:`~signatures.mine.python_src`, :mod:`~signatures.mine.cpp_src`), merges the versions (a
template present in several versions is one row with a version mask; its line is the newest
version's) and writes ``signatures/index/data/<system>.json.gz`` deterministically: the same
sources give the same bytes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from signatures.index.model import FORMAT, Provenance, SystemFile, pack, write_system
from signatures.index.tokens import template_words
from signatures.loader import read_own_yaml
from signatures.mine import cpp_src, python_src
from signatures.mine.python_src import Found
from signatures.mine.sources import (
    Selection,
    SourceError,
    dir_files,
    dir_provenance,
    git_dir,
    git_files,
    git_revision,
    wheel,
    wheel_files,
)

PLAN = Path(__file__).with_name("plan.yaml")
DATA = Path(__file__).resolve().parent.parent / "index" / "data"
_CPP = (".cpp", ".cc", ".cxx", ".h", ".hpp", ".cu", ".cuh", ".in")


@dataclass(frozen=True)
class SystemPlan:
    name: str
    kind: str
    """wheel, git or dir."""
    where: str
    """The distribution, the repository (owner/name) or the directory's name."""
    versions: tuple[str, ...]
    selection: Selection


@dataclass(frozen=True)
class Config:
    cache: Path
    git_roots: tuple[Path, ...] = ()
    dirs: dict[str, Path] = field(default_factory=dict)


def load_plan(path: Path = PLAN) -> list[SystemPlan]:
    raw = read_own_yaml(path)
    out = []
    for name, spec in raw["systems"].items():
        kind = next(k for k in ("wheel", "git", "dir") if k in spec)
        sel = Selection(tuple(spec["include"]), tuple(spec.get("exclude", ())),
                        tuple(spec.get("suffixes", (".py",))))
        out.append(SystemPlan(name, kind, str(spec[kind]),
                              tuple(str(v) for v in spec["versions"]), sel))
    return out


def extract_file(path: str, data: bytes) -> list[Found]:
    """The templates of one source file, by its kind."""
    if path.endswith(".py"):
        return list(python_src.extract(data, path))
    if path.endswith(_CPP):
        return list(cpp_src.extract(data))
    return []


def extract_files(files: Iterable[tuple[str, bytes]]) -> list[tuple[str, Found]]:
    return [(path, f) for path, data in files for f in extract_file(path, data)]


def _unit(plan: SystemPlan, version: str, cfg: Config) -> tuple[Provenance,
                                                                list[tuple[str, Found]]]:
    """One version of one system: where it came from and its templates."""
    sel = plan.selection
    if plan.kind == "wheel":
        path, prov = wheel(plan.where, version, cfg.cache)
        return prov, extract_files(wheel_files(path, sel))
    if plan.kind == "git":
        gd = git_dir(plan.where, list(cfg.git_roots))
        prov = git_revision(gd, version, plan.where, version)
        return prov, extract_files(git_files(gd, version, sel))
    root = cfg.dirs.get(plan.where)
    if root is None or not root.is_dir():
        raise SourceError(f"{plan.name}: give its sources with --source {plan.where}=DIR")
    return dir_provenance(root, plan.where, version), extract_files(dir_files(root, sel))


def merge(system: str, versions: list[tuple[Provenance, list[tuple[str, Found]]]]) -> SystemFile:
    """One system's data file from its versions' templates (oldest version first)."""
    rows: dict[tuple[str, str, str, str, str], list[int]] = {}
    for bit, (_prov, found) in enumerate(versions):
        for path, f in found:
            key = (f.text, path, f.function, f.level.value, f.exception)
            row = rows.setdefault(key, [0, 0])
            row[0] |= 1 << bit
            row[1] = f.line  # the newest version's line wins
    files = sorted({k[1] for k in rows})
    funcs = sorted({k[2] for k in rows})
    fi = {f: i for i, f in enumerate(files)}
    fn = {f: i for i, f in enumerate(funcs)}
    table = sorted(([text, fi[path], fn[func], level, exc, line, mask]
                    for (text, path, func, level, exc), (mask, line) in rows.items()),
                   key=lambda r: (r[1], r[5], r[0], r[2], r[3], r[4]))
    words = [template_words(str(r[0])) for r in table]
    vocab = sorted({w for ws in words for w in ws if w is not None})
    vi = {w: i for i, w in enumerate(vocab)}
    ids = np.array([vi[w] if w is not None else -1 for ws in words for w in ws], dtype=np.int32)
    offsets = np.cumsum([0, *(len(ws) for ws in words)], dtype=np.int64).astype(np.int32)
    return SystemFile.model_validate({
        "format": FORMAT, "system": system,
        "versions": [p.model_dump() for p, _ in versions], "files": files,
        "functions": funcs, "vocab": vocab, "tokens": pack(ids), "offsets": pack(offsets),
        "templates": table})


def build(plans: list[SystemPlan], cfg: Config, out: Path, jobs: int = 2,
          log: bool = True) -> dict[str, int]:
    """Build every planned system into ``out``; returns the template count per system."""
    counts: dict[str, int] = {}
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {p.name: [pool.submit(_unit, p, v, cfg) for v in p.versions] for p in plans}
        for p in plans:
            t0 = time.monotonic()
            versions = [f.result() for f in futures[p.name]]
            data = merge(p.name, versions)
            write_system(out / f"{p.name}.json.gz", data)
            counts[p.name] = len(data.templates)
            if log:
                print(f"{p.name}: {len(p.versions)} versions, {len(data.templates)} templates "
                      f"({time.monotonic() - t0:.1f} s after its predecessors)", file=sys.stderr)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m signatures.mine",
                                 description="Build the upstream index (signatures/index/data/) "
                                             "from upstream's sources.")
    ap.add_argument("--plan", type=Path, default=PLAN, help="the plan (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=DATA, help="where the data files go")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hicache-mine",
                    help="where downloaded wheels are kept")
    ap.add_argument("--git-root", type=Path, action="append", default=[],
                    help="a directory of local git copies (<owner>+<name>/ or <name>/)")
    ap.add_argument("--source", action="append", default=[], metavar="NAME=DIR",
                    help="a directory of sources for a `dir:` system of the plan")
    ap.add_argument("--only", action="append", default=[], help="build only these systems")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    dirs = {}
    for s in args.source:
        name, sep, d = s.partition("=")
        if not sep:
            ap.error(f"--source takes NAME=DIR, not {s!r}")
        dirs[name] = Path(d)
    plans = [p for p in load_plan(args.plan) if not args.only or p.name in args.only]
    unknown = set(args.only) - {p.name for p in plans}
    if unknown:
        ap.error(f"unknown systems: {', '.join(sorted(unknown))}")
    cfg = Config(args.cache, tuple(args.git_root), dirs)
    t0 = time.monotonic()
    try:
        counts = build(plans, cfg, args.out, args.jobs)
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{sum(counts.values())} templates from {len(counts)} systems in "
          f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0
