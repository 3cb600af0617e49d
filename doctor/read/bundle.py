"""Manifests: a crash bundle's ``manifest.json`` and ``hicache capture``'s ``capture.json``.

A manifest says how the run ended, its topology, its legacy switches and fired faults, and for
each rank its coordinates, pid, exit code and one-line error. The per-rank files next to it are
read by the ordinary file readers (their ``rank<N>/`` directory names the rank).

A manifest is untrusted (bundles are attached to issues and sent around): it is read only up to
``MAX_MANIFEST_BYTES``, its lists are cut to what the report can use before the schema builds
objects from them, and a rank outside ``0 <= rank < MAX_WORLD`` (negative, or a claim of millions
of ranks) is dropped and counted, never filed.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeGuard

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from doctor.model.builder import MAX_SLOTS, MAX_WORLD, EvidenceBuilder
from doctor.model.evidence import ExceptionRecord, ExitRecord, RankHint, SourceRef
from hicache_runtime.contracts.bundle import Manifest
from hicache_runtime.contracts.errors import DumpFormatError, first_problem
from hicache_runtime.contracts.event_payloads import fields_of
from hicache_runtime.contracts.events import Ev

CAPTURE_KIND = "hicache-capture"
CAPTURE_SCHEMA_VERSION = "1.1"
_SIGNALS = {-9: "SIGKILL", -6: "SIGABRT", -11: "SIGSEGV", -7: "SIGBUS", -15: "SIGTERM"}
_ERROR = re.compile(r"^(?P<type>[A-Za-z_][\w.]*): ?(?P<msg>.*)$")
MAX_MISMATCH_EXAMPLES = 5
MAX_MANIFEST_BYTES = 4 << 20
"""A real manifest is a few KB (a few hundred KB with many output mismatches)."""
MAX_LIST = 1024
"""Entries kept of a manifest's faults, fired faults and legacy switches."""
MAX_ERROR_TEXT = 4096


class CaptureTarget(BaseModel):
    """One process ``hicache capture`` dumped."""

    model_config = ConfigDict(extra="forbid")
    pid: int
    rank: int | None = None
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cmdline: str = ""
    pyspy: str | None = Field(None, description="path of its py-spy JSON, relative")
    pyspy_text: str | None = None
    error: str | None = None
    seconds: float | None = None
    moved: list[str] = Field([], description="ids of the threads whose stacks differed between "
                                             "the capture's two samples (running, not stuck)")


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
    data = _manifest_json(raw, "manifest")
    mismatches = data.get("mismatches")
    n_mismatches = len(mismatches) if isinstance(mismatches, list) else 0
    _bound_manifest(data, name, sink)
    try:
        m = Manifest.model_validate(data)
    except ValidationError as exc:
        _salvage(data, name, sink)
        where, what = first_problem(exc)
        raise DumpFormatError(f"manifest does not match the bundle schema: {what} at "
                              f"{where}") from None
    src = SourceRef(name, None)
    sink.set_outcome(m.outcome.value, src)
    for key in ("tp", "pp", "dp"):
        if key in m.topology:
            sink.topology.set(key, int(m.topology[key]), name)
    if "world_size" in m.topology:
        sink.topology.set("world", int(m.topology["world_size"]), name)
    for switch in m.legacy:
        sink.legacy.setdefault(switch[:200], src)
    sink.faults.extend(f[:200] for f in m.faults if f[:200] not in sink.faults)
    sink.mismatches += n_mismatches
    room = MAX_MISMATCH_EXAMPLES - len(sink.mismatch_examples)
    sink.mismatch_examples.extend(_mismatch(x) for x in m.mismatches[:max(0, room)])
    for missing in m.missing_ranks:
        sink.add_expected_rank(missing)
    fault_fields = fields_of(Ev.FAULT)
    for f in m.faults_fired:  # as the rank's own fault event would have said it
        if _valid_rank(f.rank):
            sink.slot(RankHint(rank=f.rank)).events.append(
                (Ev.FAULT, f.model_dump(include=set(fault_fields)), src, f.step))
    for i, entry in enumerate(m.ranks):
        _rank_entry(entry.model_dump(), SourceRef(name, None), sink, i)


def _manifest_json(raw: bytes, what: str) -> dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise DumpFormatError(f"{what} of {len(raw)} bytes is larger than the "
                              f"{MAX_MANIFEST_BYTES >> 20} MiB a real one needs; refused")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise DumpFormatError(f"{what} is not JSON ({str(exc)[:200]})") from None
    if not isinstance(data, dict):
        raise DumpFormatError(f"{what} is not a JSON object")
    return data


def _valid_rank(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_WORLD


def _bound_manifest(data: dict[str, Any], name: str, sink: EvidenceBuilder) -> None:
    """Cut the manifest's lists to what the report uses and drop impossible ranks, before the
    schema turns a million entries into a million objects."""
    if isinstance(data.get("mismatches"), list):
        data["mismatches"] = data["mismatches"][:MAX_MISMATCH_EXAMPLES]
    for key in ("faults", "faults_fired", "legacy"):
        if isinstance(data.get(key), list):
            data[key] = data[key][:MAX_LIST]
    dropped = 0
    missing = data.get("missing_ranks")
    if isinstance(missing, list):
        kept = sorted({r for r in missing if _valid_rank(r)})
        dropped += len(missing) - sum(1 for r in missing if _valid_rank(r))
        data["missing_ranks"] = kept
    ranks = data.get("ranks")
    if isinstance(ranks, list):
        valid = [r for r in ranks if isinstance(r, dict) and _valid_rank(r.get("rank"))]
        dropped += len(ranks) - len(valid)
        if len(valid) > MAX_SLOTS:
            sink.problem(f"{name}: {len(valid)} rank entries; the first {MAX_SLOTS} were read")
        data["ranks"] = valid[:MAX_SLOTS]
        for r in data["ranks"]:
            if isinstance(r.get("error"), str):
                r["error"] = r["error"][:MAX_ERROR_TEXT]
    if dropped:
        sink.problem(f"{name}: {dropped} rank(s) outside 0..{MAX_WORLD - 1} (negative or "
                     "impossible) ignored")


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
    tp, pp, dp = r.get("tp_rank"), r.get("pp_rank"), r.get("dp_rank")
    slot = sink.slot(RankHint(rank=r["rank"], tp=tp if _valid_rank(tp) else None,
                              pp=pp if _valid_rank(pp) else None,
                              dp=dp if _valid_rank(dp) else None))
    slot.kinds.add("bundle")
    if r.get("pid"):
        slot.pid = r["pid"]
        sink.pid_ranks[r["pid"]] = r["rank"]
    code = r.get("exit_code")
    error, files = r.get("error"), r.get("files") or {}
    if code is not None:
        # py-spy and the log are taken by the launcher; any other file is the rank's own dump
        dumped = any(v for k, v in files.items() if k not in ("pyspy", "log"))
        slot.exits.append(ExitRecord(exit_code=code, pid=r.get("pid"), signal=_SIGNALS.get(code),
                                     root_cause=False, source=src, dumped=dumped,
                                     launcher="hicache"))
    if error and not files.get("traceback"):
        m = _ERROR.match(error)
        if m:
            slot.exceptions.append(ExceptionRecord(m["type"], m["msg"], [], src))


def _salvage(data: dict[str, Any], name: str, sink: EvidenceBuilder) -> None:
    """Keep what a damaged manifest still says plainly (outcome, legacy switches)."""
    src = SourceRef(name, None)
    if isinstance(data.get("outcome"), str):
        sink.set_outcome(data["outcome"][:64], src)
    legacy = data.get("legacy")
    for switch in legacy if isinstance(legacy, list) else []:
        if isinstance(switch, str):
            sink.legacy.setdefault(switch[:200], src)


def read_capture(raw: bytes, name: str, sink: EvidenceBuilder) -> CaptureManifest:
    """File a capture manifest: pid -> rank, expected ranks, failed dumps, and the threads that
    moved between its two samples (a live job making progress, not a hang)."""
    data = _manifest_json(raw, "capture.json")
    targets = data.get("targets")
    if isinstance(targets, list):
        data["targets"] = targets[:MAX_SLOTS]
    try:
        cap = CaptureManifest.model_validate(data)
    except ValidationError as exc:
        raise DumpFormatError(f"capture.json does not validate: "
                              f"{first_problem(exc)[1]}") from None
    if cap.world_size:
        sink.topology.set("world", cap.world_size, name)
    for t in cap.targets:
        if not _valid_rank(t.rank):
            continue
        sink.pid_ranks[t.pid] = t.rank
        sink.add_expected_rank(t.rank)
        slot = sink.slot(RankHint(rank=t.rank, tp=t.tp if _valid_rank(t.tp) else None,
                                  pp=t.pp if _valid_rank(t.pp) else None))
        slot.pid = slot.pid or t.pid
        slot.kinds.add("capture")
        for tid in t.moved[:MAX_LIST]:
            sink.moved_threads.add((t.pid, tid[:64]))
        if t.error:
            sink.problem(f"capture of rank {t.rank} (pid {t.pid}) failed: {t.error[:300]}")
    return cap
