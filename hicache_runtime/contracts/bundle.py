"""Crash bundles: the versioned on-disk record of a run that crashed, hung or went wrong.

Layout::

    <bundle>/manifest.json          Manifest (this module's pydantic model)
    <bundle>/rank<N>/traceback.txt  the exception, if the rank raised
    <bundle>/rank<N>/stacks.txt     faulthandler dump of every thread (most recent call first)
    <bundle>/rank<N>/events.jsonl   the rank's event ring
    <bundle>/rank<N>/flight_recorder.json   collectives and p2p ops of every group
    <bundle>/rank<N>/state.json     RankState: queues, in-flight ops, pools, tree summary
    <bundle>/rank<N>/pyspy.json     ``py-spy dump --json`` taken by the launcher (when present)
    <bundle>/rank<N>/torch_fr.pkl   PyTorch's own Flight Recorder dump (when enabled)

The models here import only pydantic, so the doctor can read bundles without torch.
``bundle_json_schema()`` exports the JSON Schema of every file with a schema.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from enum import Enum
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hicache_runtime.contracts.errors import BundleNotWritten
from hicache_runtime.contracts.run_files import (
    MANIFEST,
    RANK_EVENTS,
    RANK_FLIGHT_RECORDER,
    RANK_STATE,
    rank_dir_name,
)

BUNDLE_SCHEMA_VERSION = "1.4"
BUNDLE_KIND = "hicache-crash-bundle"


class RunOutcome(str, Enum):
    """How a run ended."""

    HEALTHY = "healthy"
    CRASH = "crash"
    HANG = "hang"
    WRONG_OUTPUT = "wrong-output"


class RankFiles(BaseModel):
    """Paths (relative to the bundle) of one rank's files; absent ones are None."""

    model_config = ConfigDict(extra="forbid")
    traceback: str | None = None
    stacks: str | None = None
    events: str | None = None
    flight_recorder: str | None = None
    state: str | None = None
    pyspy: str | None = None
    torch_fr: str | None = None
    log: str | None = None


class RankEntry(BaseModel):
    """What the bundle holds for one rank."""

    model_config = ConfigDict(extra="forbid")
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int | None = None
    """Added in 1.2: the rank's DP group in a run of several (``rank`` is then its rank in the
    whole grid); None with one group."""
    pid: int | None = None
    outcome: RunOutcome
    exit_code: int | None = None
    error: str | None = Field(None, description="one line: exception type and message")
    step: int | None = None
    files: RankFiles = RankFiles()


class FiredFaultRecord(BaseModel):
    """One firing of an injected fault."""

    spec: str
    kind: str
    point: str
    rank: int
    step: int
    rid: str | None = None
    thread: str
    fatal: bool = False
    """The fault is the failure itself (a crash, a hang, a killed rank: its kind is not
    survivable): the rank failed on purpose, and what its peers show follows from it."""
    effect: str | None = None
    """Added in bundle 1.4: what the firing did (``FaultEffect``), as the fault event says."""


class CellOrigin(BaseModel):
    """The campaign cell a run belongs to (set by the campaign runner, read by replay)."""

    model_config = ConfigDict(extra="forbid")
    campaign: str
    cell: str
    expect: str
    warm: bool = False
    """The cell ran once without faults and switches first, to fill L3."""


class Manifest(BaseModel):
    """``manifest.json``: what ran, how it ended, and where each rank's evidence is."""

    model_config = ConfigDict(extra="forbid")
    schema_version: str = BUNDLE_SCHEMA_VERSION
    kind: str = BUNDLE_KIND
    created_at: str
    outcome: RunOutcome
    reason: str
    topology: dict[str, int]
    seed: int
    config: dict[str, Any]
    faults: list[str] = []
    faults_fired: list[FiredFaultRecord] = []
    legacy: list[str] = []
    versions: dict[str, str] = {}
    ranks: list[RankEntry] = []
    missing_ranks: list[int] = []
    mismatches: list[dict[str, Any]] = []
    """For wrong-output bundles: requests whose output differs from the cache-disabled run."""
    origin: CellOrigin | None = None
    """Added in 1.1: the campaign cell this run was, if any."""


class RankState(BaseModel):
    """``state.json``: a snapshot of one rank when the bundle was written."""

    model_config = ConfigDict(extra="allow")
    rank: int
    tp_rank: int
    pp_rank: int
    step: int
    scheduler: dict[str, Any] = {}
    cache: dict[str, Any] = {}
    threads: list[str] = []


class TraceEvent(BaseModel):
    """One line of ``events.jsonl`` (and of ``--trace`` files)."""

    model_config = ConfigDict(extra="allow")
    seq: int | None = None
    """Per-rank event number (1, 2, ...), also for events that fell out of the ring."""
    t_ns: int
    rank: int
    tp: int
    pp: int
    thread: str
    step: int
    kind: str
    attrs: dict[str, Any]
    durable: bool = False
    """Added in 1.3: the line comes from the rank's journal (``journal.jsonl``), written as it
    happened; a file of such lines holds only those few kinds of event, not the whole ring."""


class FlightRecord(BaseModel):
    """One entry of ``flight_recorder.json``: a collective or p2p op of one group."""

    model_config = ConfigDict(extra="allow")
    group: str
    seq: int
    op: str
    shapes: list[list[int]] = []
    dtype: str | None = None
    peer: int | None = None
    site: str
    state: str = Field(description="scheduled | started | completed | failed")
    thread: str
    t_start_ns: int
    t_end_ns: int | None = None


def bundle_json_schema() -> dict[str, Any]:
    """JSON Schema of every bundle file that has one, keyed by file name."""
    return {
        "schema_version": BUNDLE_SCHEMA_VERSION,
        MANIFEST: Manifest.model_json_schema(),
        RANK_STATE: RankState.model_json_schema(),
        RANK_EVENTS: TraceEvent.model_json_schema(),
        RANK_FLIGHT_RECORDER: {"type": "array", "items": FlightRecord.model_json_schema()},
    }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        out["hicache-doctor"] = version("hicache-doctor")
    except Exception:  # not installed as a distribution (running from a checkout)
        out["hicache-doctor"] = "unknown"
    # The torch that runs, when a runtime imported it; otherwise the installed one. Never
    # imported here: the doctor writes capture manifests where torch may not be installed.
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = str(torch.__version__)
    else:
        with contextlib.suppress(PackageNotFoundError):  # not installed
            out["torch"] = version("torch")
    return out


# --- writing --------------------------------------------------------------------------------


def new_bundle_dir(root: Path, outcome: RunOutcome) -> Path:
    """A fresh, uniquely named bundle directory under ``root``."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    base = root / f"{stamp}-{outcome.value}-{os.getpid()}"
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    path.mkdir(parents=True)
    return path


@contextlib.contextmanager
def bundle_writing(dest: Path) -> Iterator[Path]:
    """Write a bundle into ``dest``; when writing fails (``OSError``: a full disk, a
    read-only or vanished directory), remove what was written and raise
    :class:`BundleNotWritten` in one line. A bundle is whole once its manifest, written last,
    is there."""
    try:
        yield dest
    except OSError as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise BundleNotWritten(f"the bundle could not be written under {dest.parent}: "
                               f"{_why(exc)}") from None


def _why(exc: OSError) -> str:
    """An OSError in a few words; ``shutil.Error`` (a failed copytree) lists every file that
    failed: its first reason is the one."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list):
        first = exc.args[0][0] if exc.args[0] else None
        why = str(first[2]) if isinstance(first, tuple) and len(first) == 3 else str(exc)
        m = re.match(r"\[Errno \d+\] ([^:]+)", why)
        return m.group(1) if m else why[:200]
    return exc.strerror or str(exc)[:200]


def label_bundle(bundle: Path, label: str) -> Path:
    """Rename ``bundle`` to carry ``label`` (a campaign cell id) after its time and outcome, so
    a folder of a campaign's bundles says which cell left each; returns the new path, or the
    old one when the rename is not possible."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.")[:80]
    target = bundle.with_name(f"{bundle.name}-{slug}")
    if not slug or target.exists():
        return bundle
    try:
        bundle.rename(target)
    except OSError:
        return bundle
    return target


def rank_dir(bundle: Path, rank: int) -> Path:
    path = bundle / rank_dir_name(rank)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_text(path: Path, text: str) -> str:
    """Atomic write; returns the path relative to the bundle (two levels up)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return f"{path.parent.name}/{path.name}"


def write_json(path: Path, data: Any) -> str:
    return write_text(path, json.dumps(data, indent=1, default=str))


def write_manifest(bundle: Path, manifest: Manifest) -> Path:
    path = bundle / MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(manifest.model_dump_json(indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path


def annotate_origin(bundle: Path, origin: CellOrigin) -> None:
    """Record which campaign cell produced ``bundle`` (rewrites the manifest atomically)."""
    manifest = load_manifest(bundle)
    manifest.origin = origin
    write_manifest(bundle, manifest)


def load_manifest(bundle: Path) -> Manifest:
    """Read and validate ``manifest.json`` (raises pydantic ``ValidationError``/``OSError``)."""
    return Manifest.model_validate_json((bundle / MANIFEST).read_text(encoding="utf-8"))


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
