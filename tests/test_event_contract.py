"""The runtime -> doctor event contract (``hicache_runtime/contracts/event_payloads.py``).

* every event kind has a payload model and every model a kind;
* every field the doctor reads from an event is a field some model names (a read of a field
  the runtime never writes is how the doctor's prefetch-hole fact went dead: it read
  ``pages_ok``/``committed`` that only hand-written fixtures carried), and the decision fields
  it compares across ranks are fields of their kind;
* with strict events on, an event that is not what its model says is refused when recorded;
  the whole test suite runs with them on (``tests/conftest.py``), so every event the runtime
  makes in any test (in rank processes too) is held to its model;
* every event of the stored real bundles is what its model says (those written before a field
  was added lack it: the doctor reads every field with ``.get``).
"""

from __future__ import annotations

import ast
import io
import json
import tarfile
from pathlib import Path

import pytest

from doctor.read.trace import DECISIONS
from hicache_runtime.contracts.event_payloads import (
    PAYLOADS,
    STRICT_ENV,
    EventContractError,
    check_event,
    fields_of,
)
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.telemetry.tracer import Tracer

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "doctor"
#: Names the doctor gives an event's attributes where it reads them.
_ATTR_NAMES = {"attrs", "a"}


def _reads(tree: ast.AST) -> set[str]:
    """Literal keys read from a variable named like an event's attributes: ``attrs.get("x")``,
    ``attrs["x"]``, ``"x" in attrs``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get" and isinstance(node.func.value, ast.Name) \
                and node.func.value.id in _ATTR_NAMES and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            out.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                and node.value.id in _ATTR_NAMES and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str):
            out.add(node.slice.value)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 \
                and isinstance(node.ops[0], ast.In) and isinstance(node.left, ast.Constant) \
                and isinstance(node.comparators[0], ast.Name) \
                and node.comparators[0].id in _ATTR_NAMES:
            out.add(str(node.left.value))
    return out


def test_every_kind_has_a_payload_model() -> None:
    kinds = {v for k, v in vars(Ev).items() if k.isupper()}
    assert kinds == set(PAYLOADS)


def test_every_field_the_doctor_reads_is_one_the_runtime_writes() -> None:
    written = set().union(*(fields_of(k) for k in PAYLOADS))
    unknown = {}
    for path in sorted((ROOT / "doctor").rglob("*.py")):
        for key in _reads(ast.parse(path.read_text(), str(path))) - written:
            unknown.setdefault(key, []).append(str(path.relative_to(ROOT)))
    assert not unknown, f"the doctor reads event fields no payload model names: {unknown}"
    for kind, (subject, fields) in DECISIONS.items():
        named = fields_of(kind)
        assert set(fields) <= named, (kind, set(fields) - named)
        assert subject is None or subject in named, (kind, subject)


def test_the_scan_sees_a_drifted_read() -> None:
    """The scan above finds reads written the ways the doctor writes them."""
    code = 'x = attrs.get("pages_ok"); y = a["committed"]; z = "holes" in attrs'
    assert _reads(ast.parse(code)) == {"pages_ok", "committed", "holes"}


def test_strict_events_refuse_what_the_model_does_not_say(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    tracer = Tracer(RankInfo())
    tracer.emit(Ev.PREFETCH_SUBMIT, rid="r", start=0, tokens=64)
    with pytest.raises(EventContractError, match="pages_ok"):
        tracer.emit(Ev.PREFETCH_SETTLE, rid="r", completed=64, local=64, consensus=64,
                    hit_pages=4, inserted=64, pages_ok=[True])
    with pytest.raises(EventContractError, match="tokens"):
        tracer.emit(Ev.PREFETCH_SUBMIT, rid="r", start=0)  # a field missing
    with pytest.raises(EventContractError, match="no payload model"):
        tracer.emit("l3.prefetch.terminate", rid="r")
    with pytest.raises(EventContractError):
        tracer.emit(Ev.BATCH, decode="yes", rids=[], extend=[], prefix=[], tokens=0, slot=0)
    monkeypatch.delenv(STRICT_ENV)
    Tracer(RankInfo()).emit(Ev.PREFETCH_SUBMIT, rid="r", start=0)  # off: recorded as given


def _fixture_events() -> list[tuple[str, int, dict[str, object]]]:
    """Every event line of the doctor's fixtures: the real runtime bundles (archives) and the
    few shapes written by ``tools/bundle_cases.py`` (plain files)."""
    out: list[tuple[str, int, dict[str, object]]] = []

    def take(where: str, lines: list[str]) -> None:
        for n, line in enumerate(lines, 1):
            ev = json.loads(line) if line.strip() else None
            if isinstance(ev, dict) and "kind" in ev and "attrs" in ev:
                out.append((where, n, ev))

    for archive in sorted(FIXTURES.glob("*/runtime-*/bundle.tar.gz")):
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                fh = tar.extractfile(member) if member.name.endswith(".jsonl") else None
                if fh is not None:
                    text = io.TextIOWrapper(fh, encoding="utf-8").read()
                    take(f"{archive.parent.name}/{member.name}", text.splitlines())
    for path in sorted(FIXTURES.glob("*/*/**/*.jsonl")):
        take(str(path.relative_to(FIXTURES)), path.read_text().splitlines())
    return out


def test_the_stored_bundles_and_traces_hold_to_the_models() -> None:
    events = _fixture_events()
    assert len(events) > 1000
    assert any("bundle-tp2-consensus" in where for where, _, _ in events)
    bad = []
    for where, n, ev in events:
        try:
            # stored from earlier versions: fields added since may be missing
            check_event(str(ev["kind"]), ev["attrs"], older=True)  # type: ignore[arg-type]
        except EventContractError as exc:
            bad.append(f"{where}:{n}: {exc}")
    assert not bad, "\n".join(bad[:20])
