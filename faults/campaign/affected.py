"""A release matrix's findings as the catalog's verified ``affected:`` data.

``hicache signatures affected MATRIX.json`` reads the JSON of ``hicache campaign
--profiles ... --json`` and writes ``signatures/catalog/affected.yaml``: per signature, the
profiles on which a cell of the matrix ended with the doctor naming it, and the profiles on
which the row of the signature's own campaign cell (the fault that exposes it) ran clean. The
loader attaches it to each signature (``Signature.affected``); ``hicache signatures show``
prints it, the runbook names the first release on which the signature no longer reproduces,
and the doctor weighs a signature against the release a report states.

The matrix file is read as untrusted input (bounded, validated); the output path is the
packaged catalog's unless ``--out`` names another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from faults.campaign.plan import faults_label
from faults.campaign.releases import RELEASE_MATRIX_KIND, ReleaseMatrix
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.legacy import parse_legacy
from hicache_runtime.contracts.profiles import synthetic
from signatures.models import Catalog

MAX_MATRIX_BYTES = 32 << 20
HEADER = ("# Generated from a release matrix run by `hicache signatures affected`; do not\n"
          "# edit by hand. A profile is the runtime's rendering of a release's protocols\n"
          "# (hicache profiles show NAME), not the release itself.\n")


def signature_row(cell: str) -> str:
    """The matrix row of a catalog campaign cell id (``pp2/skip-empty-sync/host-alloc-fail:
    pp=1`` -> ``pp2 host-alloc-fail:pp=1``), as ``plan.matrix_place`` writes rows."""
    topology, _mode, faults = cell.split("/", 2)
    return f"{topology} {faults_label([] if faults == 'none' else [faults])}"


def _release_exposed(cell: str) -> bool:
    """Whether the switches of a catalog campaign cell all run what a release ran."""
    mode = cell.split("/", 2)[1]
    return mode == "fixed" or not synthetic(parse_legacy(mode.split("+")))


def affected(matrix: ReleaseMatrix, catalog: Catalog, command: str) -> dict[str, Any]:
    """The ``affected.yaml`` document for ``matrix``."""
    found = matrix.reproduces()
    rows = {c.row for c in matrix.cells}
    out: dict[str, Any] = {}
    for sig in catalog.signatures:
        cell = sig.campaign.cell if sig.campaign is not None else None
        row = signature_row(cell) if cell is not None else None
        if row not in rows or (cell is not None and not _release_exposed(cell)):
            # a grafted or synthetic switch exposes it: no profile turns that switch on, so
            # its fault running clean on a profile says nothing about the release
            row = None
        if sig.id not in found and row is None:
            continue  # the matrix neither ran its fault nor saw it: nothing verified
        clean = [c.column for c in matrix.cells
                 if row is not None and c.row == row and c.passed and c.skipped is None]
        out[sig.id] = {
            "reproduces": found.get(sig.id, []),
            "row": row,
            "clean": [p for p in matrix.profiles if p in clean],
            "cells": [c.id for c in matrix.cells if c.verdict == sig.id and not c.passed],
        }
    return {"campaign": matrix.campaign, "command": command, "run_at": matrix.started_at,
            "profiles": list(matrix.profiles), "signatures": out}


def write_affected(matrix_path: Path, out: Path | None = None) -> tuple[Path, int]:
    """Read the matrix JSON at ``matrix_path`` (untrusted: bounded and validated) and write
    its ``affected.yaml`` to ``out`` (default: the packaged catalog's). Returns the path and
    how many signatures it holds; ``ConfigError`` for a file that is no release matrix."""
    from signatures.loader import load_catalog

    if not matrix_path.is_file() or matrix_path.stat().st_size > MAX_MATRIX_BYTES:
        raise ConfigError("matrix", f"{matrix_path}: not a file of at most "
                                    f"{MAX_MATRIX_BYTES >> 20} MiB")
    data = matrix_path.read_text(encoding="utf-8", errors="replace")
    try:
        matrix = ReleaseMatrix.model_validate_json(data)
    except ValueError as exc:
        raise ConfigError("matrix", f"{matrix_path}: not a release matrix "
                                    f"({str(exc).splitlines()[0][:200]})") from None
    if matrix.kind != RELEASE_MATRIX_KIND:
        raise ConfigError("matrix", f"{matrix_path}: kind {matrix.kind[:40]!r}, not "
                                    f"{RELEASE_MATRIX_KIND!r}")
    command = f"hicache campaign --profiles {','.join(matrix.profiles)}"
    doc = affected(matrix, load_catalog(), command)
    import signatures

    target = out or Path(signatures.__file__).resolve().parent / "catalog" / "affected.yaml"
    target.write_text(HEADER + yaml.safe_dump(doc, sort_keys=False, width=100),
                      encoding="utf-8")
    return target, len(doc["signatures"])
