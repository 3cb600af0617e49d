"""Prefetch acks voted across ops, read from the runtime's traces: an op's agreed progress that
goes down, a rank whose IO stopped an op while a peer took more acks of it, and a rank whose
only trace is its journal (it died in native code before dumping its ring).

The traces are written in the runtime's own format (``TraceEvent`` lines); the bundle the
mechanism comes from in full is ``runtime-tp2-abort-early-exit-divergence`` (a real run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from doctor.diagnose import diagnose
from hicache_runtime.contracts.bundle import TraceEvent
from hicache_runtime.contracts.events import Ev


def _ev(rank: int, seq: int, step: int, event: str, thread: str = "MainThread",
        durable: bool = False, **attrs: Any) -> dict[str, Any]:
    line = {"seq": seq, "t_ns": 1_000_000 * seq, "rank": rank, "tp": rank, "pp": 0,
            "thread": thread, "step": step, "kind": event, "attrs": attrs}
    if durable:
        line["durable"] = True
    return TraceEvent.model_validate(line).model_dump(exclude_defaults=not durable)


def _write(root: Path, rank: int, events: list[dict[str, Any]]) -> None:
    d = root / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _acks(rank: int, start: int, step: int, acks: list[tuple[str, int, int, bool]]
          ) -> list[dict[str, Any]]:
    """Agreed acks as the scheduler took them: (rid, batch, completed, done)."""
    return [_ev(rank, start + i, step, Ev.PREFETCH_ACK, rid=rid, batch=b, completed=c, done=d)
            for i, (rid, b, c, d) in enumerate(acks)]


def _facts(root: Path) -> list[str]:
    return diagnose([str(root)]).fingerprint.facts


def test_agreed_progress_that_goes_down_is_a_vote_across_ops(tmp_path: Path) -> None:
    _write(tmp_path, 1, _acks(1, 1, 10, [("a", 0, 64, False), ("a", 1, 24, False),
                                         ("a", -1, 24, True)]))
    assert "prefetch-acks-mispaired" in _facts(tmp_path)


def test_agreed_progress_that_grows_is_not(tmp_path: Path) -> None:
    for rank in (0, 1):
        _write(tmp_path, rank, _acks(rank, 1, 10, [("a", 0, 64, False), ("a", 1, 72, False),
                                                   ("a", -1, 72, True), ("b", 0, 8, False),
                                                   ("b", -1, 8, True)]))
    facts = _facts(tmp_path)
    assert "prefetch-acks-mispaired" not in facts
    assert "prefetch-acks-stopped" not in facts


def test_a_journal_stop_and_a_peer_with_more_acks_of_that_op(tmp_path: Path) -> None:
    """Rank 0 died before dumping: its journal says its IO stopped ``a`` at batch 1 (one
    ack). Rank 1 took three acks of ``a``, so its next op's acks were voted against others."""
    _write(tmp_path, 0, [
        _ev(0, 5, 9, Ev.FAULT, "hicache-prefetch-io", True, kind="mid-prefetch-abort",
            point="prefetch.batch", spec="mid-prefetch-abort:batch=1", rid="a", fatal=False),
        _ev(0, 9, 10, Ev.PREFETCH_ACK, "hicache-prefetch-io", True, rid="a", batch=1,
            stopped=True),
    ])
    _write(tmp_path, 1, [
        _ev(1, 1, 8, Ev.PREFETCH_SUBMIT, rid="a", start=0, tokens=96),
        *_acks(1, 2, 10, [("a", 0, 64, False), ("a", 1, 72, False), ("a", -1, 72, True),
                          ("b", 0, 64, False)]),
        _ev(1, 7, 11, Ev.BATCH, rids=["b"], extend=[32], prefix=[64], tokens=32, slot=0),
    ])
    d = diagnose([str(tmp_path)])
    assert {"prefetch-acks-stopped", "prefetch-acks-mispaired"} <= set(d.fingerprint.facts)
    texts = " ".join(e.text for v in d.verdicts for e in v.evidence)
    assert "rank 0 stopped acking a after 1 ack(s); rank 1 took 3 agreed acks of it" in texts
    # a journal holds a few kinds of event: rank 0's missing batches are no divergence
    assert d.first_divergence is None


def test_the_real_divergence_bundle_names_the_cause_before_the_mismatch() -> None:
    from tests.doctor.conftest import FIXTURES

    case = FIXTURES / "prefetch-abort-ack-starvation" / "runtime-tp2-abort-early-exit-divergence"
    d = diagnose([str(case / "bundle.tar.gz")])
    assert [v.signature for v in d.verdicts[:2]] == ["prefetch-abort-ack-starvation",
                                                     "collective-shape-mismatch"]
    first = d.verdicts[0]
    journal = [e for e in first.evidence if e.rank == 0 and "stopped acking" in e.text]
    assert journal
    assert (journal[0].file or "").endswith("rank0/events.jsonl")
    assert any("voted with another op" in e.text or "voted against" in e.text
               for e in first.evidence)
