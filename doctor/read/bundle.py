"""Manifests: a crash bundle's ``manifest.json`` and ``hicache capture``'s ``capture.json``.

A manifest says how the run ended, its topology, its legacy switches and fired faults, and for
each rank its coordinates, pid, exit code and one-line error. The per-rank files next to it are
read by the ordinary file readers (their ``rank<N>/`` directory names the rank).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from doctor.evidence import ExceptionRecord, ExitRecord, RankHint, SourceRef
from doctor.ranks.builder import EvidenceBuilder
from hicache_runtime.bundle import Manifest
from hicache_runtime.errors import DumpFormatError

CAPTURE_KIND = "hicache-capture"
CAPTURE_SCHEMA_VERSION = "1.0"
_SIGNALS = {-9: "SIGKILL", -6: "SIGABRT", -11: "SIGSEGV", -7: "SIGBUS", -15: "SIGTERM"}
_ERROR = re.compile(r"^(?P<type>[A-Za-z_][\w.]*): ?(?P<msg>.*)$")
MAX_MISMATCH_EXAMPLES = 5


class CaptureTarget(BaseModel):
    """One process ``hicache capture`` dumped."""

    model_config = ConfigDict(extra="forbid")
    pid: int
    rank: int | None = None
    tp: int | None = None
    pp: int | None = None
    cmdline: str = ""
    pyspy: str | None = Field(None, description="path of its py-spy JSON, relative")
    pyspy_text: str | None = None
    error: str | None = None
    seconds: float | None = None


class CaptureManifest(BaseModel):
    """``capture.json``: a live job's stacks, taken by ``hicache capture``."""

    model_config = ConfigDict(extra="forbid")
    schema_version: str = CAPTURE_SCHEMA_VERSION
    kind: str = CAPTURE_KIND
    created_at: str
    world_size: int | None = None
    targets: list[CaptureTarget] = []
    logs: list[str] = []
    notes: list[str] = []


def read_manifest(raw: bytes, name: str, sink: EvidenceBuilder) -> None:
    """File a bundle manifest; raises :class:`DumpFormatError` when it does not validate."""
    try:
        m = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        _salvage(raw, name, sink)
        raise DumpFormatError(f"manifest does not match the bundle schema: "
                              f"{exc.errors()[0]['msg']} at "
                              f"{'.'.join(str(x) for x in exc.errors()[0]['loc'])}") from None
    src = SourceRef(name, None)
    sink.set_outcome(m.outcome.value, src)
    for key in ("tp", "pp"):
        if key in m.topology:
            sink.topology.set(key, int(m.topology[key]), name)
    if "world_size" in m.topology:
        sink.topology.set("world", int(m.topology["world_size"]), name)
    for switch in m.legacy:
        sink.legacy.setdefault(switch, src)
    sink.faults.extend(f for f in m.faults if f not in sink.faults)
    sink.mismatches += len(m.mismatches)
    room = MAX_MISMATCH_EXAMPLES - len(sink.mismatch_examples)
    sink.mismatch_examples.extend(_mismatch(x) for x in m.mismatches[:max(0, room)])
    sink.expected_ranks |= set(m.missing_ranks)
    for f in m.faults_fired:
        sink.slot(RankHint(rank=f.rank)).events.append(
            ("fault.fired", f.model_dump(), src, f.step))
    for i, r in enumerate(m.ranks):
        _rank_entry(r.model_dump(), SourceRef(name, None), sink, i)


def _mismatch(raw: dict[str, Any]) -> dict[str, object]:
    """One mismatch as plain, bounded values (a manifest is input: never trust its sizes)."""
    out: dict[str, object] = {}
    for key in ("rid", "index", "note"):
        value = raw.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            out[key] = value if isinstance(value, int) else value[:200]
    for key in ("expected", "got"):
        value = raw.get(key)
        if isinstance(value, list):
            out[key] = [v for v in value[:8] if isinstance(v, int)]
    return out


def _rank_entry(r: dict[str, Any], src: SourceRef, sink: EvidenceBuilder, index: int) -> None:
    slot = sink.slot(RankHint(rank=r["rank"], tp=r.get("tp_rank"), pp=r.get("pp_rank")))
    slot.kinds.add("bundle")
    slot.outcome = slot.outcome or r.get("outcome")
    if r.get("pid"):
        slot.pid = r["pid"]
        sink.pid_ranks[r["pid"]] = r["rank"]
    code = r.get("exit_code")
    error, files = r.get("error"), r.get("files") or {}
    if code is not None:
        # py-spy and the log are taken by the launcher; any other file is the rank's own dump
        dumped = any(v for k, v in files.items() if k not in ("pyspy", "log"))
        slot.exits.append(ExitRecord(exit_code=code, pid=r.get("pid"), signal=_SIGNALS.get(code),
                                     root_cause=False, time=None, source=src, dumped=dumped,
                                     launcher="hicache"))
    if error and not files.get("traceback"):
        m = _ERROR.match(error)
        if m:
            slot.exceptions.append(ExceptionRecord(m["type"], m["msg"], [], src))


def _salvage(raw: bytes, name: str, sink: EvidenceBuilder) -> None:
    """Keep what a damaged manifest still says plainly (outcome, legacy switches)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return
    if not isinstance(data, dict):
        return
    src = SourceRef(name, None)
    if isinstance(data.get("outcome"), str):
        sink.set_outcome(data["outcome"], src)
    for switch in data.get("legacy") or []:
        if isinstance(switch, str):
            sink.legacy.setdefault(switch, src)


def read_capture(raw: bytes, name: str, sink: EvidenceBuilder) -> CaptureManifest:
    """File a capture manifest: pid -> rank, expected ranks, failed dumps."""
    try:
        cap = CaptureManifest.model_validate_json(raw)
    except ValidationError as exc:
        raise DumpFormatError(f"capture.json does not validate: {exc.errors()[0]['msg']}") \
            from None
    if cap.world_size:
        sink.topology.set("world", cap.world_size, name)
    for t in cap.targets:
        if t.rank is None:
            continue
        sink.pid_ranks[t.pid] = t.rank
        sink.expected_ranks.add(t.rank)
        slot = sink.slot(RankHint(rank=t.rank, tp=t.tp, pp=t.pp))
        slot.pid = slot.pid or t.pid
        slot.kinds.add("capture")
        if t.error:
            sink.problem(f"capture of rank {t.rank} (pid {t.pid}) failed: {t.error}")
    return cap
