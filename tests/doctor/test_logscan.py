"""The streaming scanner: the prefilter is exact, results do not depend on chunk boundaries,
line numbers are exact, and odd lines (huge, CRLF, no final newline) are handled."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import doctor.read.logscan as logscan
from doctor.model.builder import EvidenceBuilder
from doctor.model.evidence import RankHint
from doctor.read.logscan import LogScanner
from doctor.read.prefilter import TriggerIndex
from doctor.read.text.lines import LineHandler
from tests.doctor.conftest import FIXTURES

TRIGGERS = [b"Traceback (most recent call last)", b"Timed out waiting", b"rss", b"Xid",
            b"pop from empty list", b"SIGQUIT received"]
NOISE = st.sampled_from([b"Decode batch. #running-req: 4", b"x" * 50, b"", b"token usage: 0.1",
                         b"[2026-01-01 00:00:00 TP0] ok", b"\xff\xfe", b"R", b"Tim", b"ed out"])


def _naive(buf: bytes) -> list[int]:
    starts = set()
    for t in TRIGGERS:
        i = buf.find(t)
        while i != -1:
            starts.add(buf.rfind(b"\n", 0, i) + 1)
            i = buf.find(t, i + 1)
    return sorted(starts)


@given(st.lists(st.one_of(NOISE, st.sampled_from(TRIGGERS), st.binary(max_size=40)),
                max_size=60), st.binary(max_size=4096))
def test_prefilter_is_exact(parts: list[bytes], sample: bytes) -> None:
    buf = b"\n".join(p + (b" tail" if i % 3 else b"") for i, p in enumerate(parts)) + b"\n"
    index = TriggerIndex(TRIGGERS)
    index.plan(sample)  # any sample: only speed may depend on it, never the result
    assert index.lines(buf, len(buf)) == _naive(buf)
    # the path for chunks made of trigger fragments gives the same lines
    assert index._dense_lines(buf, len(buf)) == _naive(buf)


def test_a_chunk_of_trigger_fragments_takes_the_dense_path_with_the_same_lines() -> None:
    pairs = sorted({t[i:i + 2] for t in TRIGGERS for i in range(len(t) - 1)})
    dense = b" ".join(pairs) + b"\n"
    buf = dense * 50 + b"x Timed out waiting y\n" + dense * 50 + b"rss\n"
    index = TriggerIndex(TRIGGERS)
    calls: list[int] = []
    real = index._dense_lines
    index._dense_lines = lambda b, e: calls.append(e) or real(b, e)  # type: ignore[method-assign]
    assert index.lines(buf, len(buf)) == _naive(buf)
    assert calls == [len(buf)]


def _scan(data: bytes) -> tuple[dict[str, object], int]:
    sink = EvidenceBuilder()
    scanner = LogScanner(LineHandler(__import__("signatures.loader").loader.load_catalog(),
                                     sink, "x.log", RankHint()))
    scanner.scan(io.BytesIO(data))
    ev = sink.finish()
    summary = {
        str(r.rank): (sorted((k, v.count) for k, v in r.hits.items()),
                      [(e.type, e.message, str(e.source), len(e.frames)) for e in r.exceptions],
                      [(t.name, len(t.frames)) for t in r.threads])
        for r in ev.all_ranks()}
    return summary, scanner.lines


@pytest.mark.parametrize("chunk", [64, 257, 4096])
def test_results_do_not_depend_on_chunk_size(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    data = b"".join(p.read_bytes() for p in sorted(FIXTURES.glob("*/*/*.log")))
    data += b"filler line without triggers\n" * 3000
    reference = _scan(data)
    monkeypatch.setattr(logscan, "CHUNK", chunk)
    monkeypatch.setattr(logscan, "HEAD_LINES", 5)
    assert _scan(data) == reference


def test_line_numbers_are_exact_past_the_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logscan, "CHUNK", 1000)
    lines = [b"ordinary"] * 5000
    lines[4321] = b"[2026-01-01 00:00:00 TP0] SIGQUIT received. signum=None, frame=None. " \
                  b"It usually means one child failed."
    sink = EvidenceBuilder()
    from signatures.loader import load_catalog

    LogScanner(LineHandler(load_catalog(), sink, "x.log")).scan(io.BytesIO(b"\n".join(lines)))
    (hit,) = list(sink.finish().ranks[0].hits["sigquit"].kept)
    assert hit.source.line == 4322


def test_huge_line_crlf_and_missing_final_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logscan, "MAX_LINE", 10_000)
    monkeypatch.setattr(logscan, "CHUNK", 4096)
    data = (b"A" * 50_000 + b"\r\n" + b"Traceback (most recent call last):\r\n"
            b'  File "/x/sglang/a.py", line 1, in writing_check\r\n'
            b"IndexError: pop from empty list")
    summary, _ = _scan(data)
    assert ("IndexError", "pop from empty list", "x.log:4", 1) in summary["-1"][1]


SEPARATORS = {"lone CR": b"\r", "CRLF": b"\r\n", "vertical tab": b"\x0b", "form feed": b"\x0c",
              "file separator": b"\x1c", "record separator": b"\x1e",
              "NEL": "\x85".encode(), "LINE SEPARATOR": "\u2028".encode(),
              "PARAGRAPH SEPARATOR": "\u2029".encode()}


@pytest.mark.parametrize("sep", SEPARATORS.values(), ids=SEPARATORS.keys())
@pytest.mark.parametrize("chunk", [1 << 22, 7, 3])
def test_every_line_boundary_splitlines_knows_is_a_line_end(
        sep: bytes, chunk: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A log named at 0.85 with LF is named the same with any separator str.splitlines
    accepts (a lone CR gave no signature at all), also when a separator is cut by a chunk
    boundary; line numbers count the same lines."""
    from doctor.diagnose import diagnose

    monkeypatch.setattr(logscan, "CHUNK", chunk if chunk > 64 else 1 << 22)
    src = (FIXTURES / "write-ack-pop-empty" / "sglang-pp2-classic" / "server.log").read_bytes()
    text = src.replace(b"\n", sep)
    if chunk <= 64:  # feed it in tiny reads through the separator normaliser itself
        endings = logscan.LineEndings()
        out = b"".join(endings(text[i:i + chunk]) for i in range(0, len(text), chunk))
        out += endings.flush()
        assert out.replace(b"\r\n", b"\n") == src, "a separator cut by a read was lost"
        return
    log = tmp_path / "server.log"
    log.write_bytes(text)
    d = diagnose([str(log)])
    assert d.verdicts, d.summary
    assert d.verdicts[0].signature == "write-ack-pop-empty"
    assert d.verdicts[0].confidence == 0.85
    lf = {(e.line, e.text) for e in d.verdicts[0].evidence}
    assert all(line is None or line <= src.count(b"\n") + 1 for line, _ in lf)
