"""The doctor speaks the runtime's vocabulary through its names, never by respelling it.

Event kinds are :class:`~hicache_runtime.contracts.events.Ev` members: a kind the doctor spelled
as a raw string would silently stop matching the day the runtime renamed it. The doctor's own
closed vocabularies (statuses, states, finding kinds) are StrEnums whose members still read,
compare and serialise as the plain strings the report always carried.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from doctor.model.evidence import InputStatus, ThreadState
from doctor.model.findings import FindingKind, RankCondition, RankRow
from doctor.report.model import Diagnosis, DiagnosisStatus, InputSummary
from hicache_runtime.contracts.events import Ev

ROOT = Path(__file__).resolve().parents[2]
EVENT_KINDS = {v: k for k, v in vars(Ev).items() if k.isupper() and isinstance(v, str)}


def raw_event_kinds(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant in ``source`` that is an event kind."""
    return sorted((node.lineno, node.value) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value in EVENT_KINDS)


def test_the_scan_finds_a_respelled_kind() -> None:
    source = ('def f(kind):\n    """``l3.prefetch.ack`` {rid}: counted per rank."""\n'
              '    return kind == "l3.prefetch.ack" or kind in ("req.abort",)\n')
    assert raw_event_kinds(source) == [(3, "l3.prefetch.ack"), (3, "req.abort")]
    assert raw_event_kinds("if kind == Ev.PREFETCH_ACK:\n    pass\n") == []


def test_event_kinds_are_named_through_ev_by_who_emits_and_who_reads_them() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {text!r} is Ev.{EVENT_KINDS[text]}"
             for folder in ("doctor", "signatures", "hicache_runtime", "faults")
             for path in sorted((ROOT / folder).rglob("*.py"))
             if path != ROOT / "hicache_runtime" / "contracts" / "events.py"  # the definitions
             for line, text in raw_event_kinds(path.read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)


def test_vocabularies_read_as_their_strings() -> None:
    row = RankRow(rank=0, role="TP0", state=RankCondition(ThreadState.IDLE))
    assert row.state is RankCondition.IDLE
    assert row.state == "idle"
    assert f"{row.state}" == "idle"
    assert str(FindingKind.CROSSED) == "crossed"
    assert {"idle": 1}.get(row.state) == 1
    d = Diagnosis(catalog_version="1", status=DiagnosisStatus.UNREADABLE, exit_code=2, summary="",
                  ranks=[row], inputs=[InputSummary(path="x", kind="?", status=InputStatus.ERROR)])
    data = json.loads(d.model_dump_json())
    assert (data["status"], data["ranks"][0]["state"], data["inputs"][0]["status"]) == \
        ("unreadable", "idle", "error")
    again = Diagnosis.model_validate_json(d.model_dump_json())
    assert again.status is DiagnosisStatus.UNREADABLE
    assert again.ranks[0].state is RankCondition.IDLE
