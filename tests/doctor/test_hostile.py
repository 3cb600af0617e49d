"""The doctor's memory contract, tested on the hostile corpus (:mod:`tests.doctor.hostile`).

Each hostile input is generated at test time and given to ``hicache doctor`` (and ``hicache
trace export``) in a child process capped at 1.5 GiB of address space. The run must end in a
report or a one-line error with the documented exit code, within a generous time, and its peak
RSS must stay far below the cap: the cap only keeps a regression from taking the machine down,
the RSS bound is what fails. The small, fast checks of the bounded readers come first.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import threading
from pathlib import Path

import pytest

from doctor.diagnose import diagnose
from doctor.model.builder import MAX_RETAINED, MAX_WORLD, EvidenceBuilder
from doctor.model.findings import EvidenceItem
from doctor.read.dumps import _sizes, _text, parse_rank_list
from doctor.report.bounds import clip_texts, rank_ranges
from doctor.report.model import Diagnosis, NearMiss
from hicache_runtime.contracts.jsonl import iter_lines
from tests.doctor import hostile
from tests.doctor.hostile import run_capped

#: Peak RSS allowed for any hostile input (the doctor's baseline is 60-90 MB).
RSS_MB = 400
WALL_S = 120


# --- bounded readers (fast) ----------------------------------------------------------------


def test_iter_lines_skips_over_long_lines_without_holding_them() -> None:
    data = b"a\n" + b"x" * 5000 + b"\nb\n" + b"y" * 5000
    assert list(iter_lines(io.BytesIO(data), max_line=100, chunk=64)) == [
        (1, b"a"), (2, None), (3, b"b"), (4, None)]
    assert list(iter_lines(io.BytesIO(b"a\nb"), max_line=1)) == [(1, b"a"), (2, b"b")]
    assert list(iter_lines(io.BytesIO(b""))) == []
    line = b"z" * 100
    assert list(iter_lines(io.BytesIO(line + b"\n"), max_line=100, chunk=7)) == [(1, line)]


@pytest.mark.parametrize("layout", [
    # (what comes before, hole size, what comes after): a hole inside the over-long line's
    # skipped rest, one that ends where a line does, one that runs to the end of the file
    (b"a\n" + b"x" * 300, 1 << 20, b"y\nb\nc\n"),
    (b"x" * 300, 3 << 16, b"\nd\n"),
    (b"a\n" + b"x" * 300, 1 << 20, b""),
    (b"a\n", 1 << 16, b"q\nr\n"),  # a hole shorter than the limit is a line of NULs
], ids=["mid-line", "before-a-newline", "to-the-end", "short"])
def test_a_sparse_file_reads_as_its_dense_copy(tmp_path: Path,
                                               layout: tuple[bytes, int, bytes]) -> None:
    """A reader that jumps over the holes of a sparse file while it skips an over-long line
    gives exactly what reading every NUL byte gives."""
    head, hole, tail = layout
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as fh:
        fh.write(head)
        fh.seek(len(head) + hole)
        fh.write(tail)
        fh.truncate(len(head) + hole + len(tail))
    dense = sparse.read_bytes()
    for max_line, chunk in ((100, 64), (5000, 4096), (1 << 20, 1 << 20)):
        with open(sparse, "rb") as fh:
            got = list(iter_lines(fh, max_line=max_line, chunk=chunk))
        assert got == list(iter_lines(io.BytesIO(dense), max_line=max_line, chunk=chunk))


def test_rank_list_is_parsed_never_evaluated() -> None:
    assert parse_rank_list("[0, 1, 2]") == [0, 1, 2]
    assert parse_rank_list("(3,)") == [3]
    assert parse_rank_list(" [] ") == []
    for bad in ("1+1+1", "[1+1]", "[-1]", "[0x10]", "[1, 2", "__import__('os')", "[1e5]",
                "[" + "1," * 70_000 + "1]", "[" + "1" * 20 + "]", "[١]"):
        assert parse_rank_list(bad) is None, bad
    assert parse_rank_list("1+" * 9_000_000 + "1") is None  # 18 MB: refused on its length


def test_fr_fields_never_expand_shared_references() -> None:
    many = ["x" * 100_000] * 10_000  # str() of it: 1 GB
    assert _text(many) == "?"
    assert _text("y" * 10_000) == "y" * 512 + "… [9488 more characters]"
    assert _text(10 ** 5000) == "?"  # str() of it raises (int digit limit)
    sizes = _sizes([many, [[many] * 1000] * 1000])
    assert len(sizes) < 300


def test_ranges_and_clipping() -> None:
    assert rank_ranges([5, 0, 1, 2, 3, 7]) == "0-3, 5, 7 (6 ranks)"
    assert rank_ranges([2]) == "2"
    assert rank_ranges(list(range(0, 100, 2)), max_ranges=3) == \
        "0, 2, 4, and 47 more rank(s) (50 ranks)"
    d = Diagnosis(catalog_version="x", status="no-known-signature", exit_code=1,
                  summary="s" * 10_000,
                  near_misses=[NearMiss(signature="n", score=0.5, because="b" * 9000)],
                  topology={"k" * 5000: "v" * 5000},
                  observations=["o" * 5000], problems=["ok"])
    d.verdicts = []
    item = EvidenceItem(text="t" * 20_000)
    d.lookalikes = []
    clip_texts(d)
    clip_texts(item)
    texts = [d.summary, d.near_misses[0].because, d.observations[0], item.text,
             *d.topology, *d.topology.values()]
    assert all(len(t) < 4200 and "more characters]" in t for t in texts)
    assert d.problems == ["ok"]


def test_trace_evidence_has_one_budget_across_ranks() -> None:
    sink = EvidenceBuilder()
    for rank in range(4):
        assert sink.add_expected_rank(rank)
    assert not sink.add_expected_rank(-3)
    assert not sink.add_expected_rank(MAX_WORLD)
    assert not sink.add_expected_rank(True)
    assert sink.retain(MAX_RETAINED // 2)
    assert not sink.retain(MAX_RETAINED // 2)  # the item's own cost tips it over
    ev = sink.finish()
    assert ev.expected_ranks == {0, 1, 2, 3}
    assert any("1 later event(s) were read but not kept" in p for p in ev.problems)


# --- inputs that are not files --------------------------------------------------------------


def test_empty_file_and_empty_directory_agree(tmp_path: Path) -> None:
    (tmp_path / "empty.log").write_bytes(b"")
    (tmp_path / "dir").mkdir()
    for path in (tmp_path / "empty.log", tmp_path / "dir"):
        d = diagnose([str(path)])
        assert (d.exit_code, d.status) == (1, "no-known-signature"), path
        assert d.summary == "no failure evidence: the inputs are empty"


def test_missing_path_and_devices_are_unreadable_not_empty(tmp_path: Path) -> None:
    d = diagnose([str(tmp_path / "nope")])
    assert (d.exit_code, d.status) == (2, "unreadable")
    assert d.summary == f"no input could be read ({tmp_path / 'nope'}: not found)"
    assert not any("failure evidence" in o for o in d.observations)
    d = diagnose(["/dev/zero"])
    assert d.exit_code == 2
    assert "not a regular file (a character device)" in d.summary


def test_a_fifo_is_read_as_a_stream(tmp_path: Path) -> None:
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    text = (hostile.REPO / "tests/fixtures/doctor/write-ack-pop-empty/sglang-pp2-classic/"
            "server.log").read_bytes()

    def write() -> None:
        with fifo.open("wb") as fh:
            fh.write(text)

    writer = threading.Thread(target=write)
    writer.start()
    d = diagnose([str(fifo)])
    writer.join(timeout=10)
    assert d.verdicts
    assert d.verdicts[0].signature == "write-ack-pop-empty"


def test_a_directory_file_swapped_for_a_fifo_is_refused_not_waited_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory's files are checked on the descriptor that reads them: a file replaced by
    a FIFO between the walk's look and the open (here the walk hands over the FIFO itself)
    would otherwise block in open() forever, with no writer coming."""
    import doctor.read.ingest as ingest

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.log").write_text("hello\n")
    fifo = logs / "b.log"
    os.mkfifo(fifo)
    real_walk = ingest._walk
    monkeypatch.setattr(ingest, "_walk", lambda root, sink: [*real_walk(root, sink), fifo])
    done: list[Diagnosis] = []
    t = threading.Thread(target=lambda: done.append(diagnose([str(logs)])), daemon=True)
    t.start()
    t.join(timeout=20)
    assert done, "the doctor waited on a FIFO in a directory"
    refused = [i for i in done[0].inputs if i.path.endswith("b.log")]
    assert refused, done[0].inputs
    assert "not a regular file (a FIFO)" in refused[0].message


def test_malformed_events_are_counted_not_fatal(tmp_path: Path) -> None:
    path = hostile.malformed_events(tmp_path)
    d = diagnose([str(path)])
    (rec,) = d.inputs
    assert rec.status == "read", rec
    assert any("malformed trace line" in p for p in d.problems)


def test_shared_reference_pickle_reads_in_memory(tmp_path: Path) -> None:
    path = hostile.fr_shared_refs(tmp_path / "fr")
    d = diagnose([str(path)])
    (rec,) = d.inputs
    assert (rec.status, rec.message) == ("read", "20 entries")


def test_pickle_of_nested_shared_lists_is_refused_quickly(tmp_path: Path) -> None:
    path = hostile.fr_expanding_refs(tmp_path / "fr")
    assert len(pickle.dumps(pickle.loads(path.read_bytes()))) < 20_000
    d = diagnose([str(path)])
    (rec,) = d.inputs
    assert rec.status == "error"
    assert "more than 5,000,000 values" in rec.message


# --- the hostile corpus under an address-space cap (subprocesses) -----------------------------


def _inputs(out: str) -> dict[str, dict[str, object]]:
    data = json.loads(out)
    return {Path(i["path"]).name: i for i in data["inputs"]}


def _ok(run: hostile.Capped) -> None:
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.peak_rss_mb < RSS_MB, f"peak RSS {run.peak_rss_mb:.0f} MB"
    assert run.wall_s < WALL_S, f"{run.wall_s:.0f} s"


@pytest.mark.slow
@pytest.mark.parametrize(("case", "inputs"), [
    ("fr-shared-refs", {"nccl_trace_rank_0": ("read", "20 entries")}),
    ("fr-expanding-refs", {"nccl_trace_rank_1": ("error", "more than 5,000,000 values")}),
    ("fr-many-lists", {"nccl_trace_rank_0": ("error", "would build more than 256 MiB")}),
    ("fr-literal-ranks", {"nccl_trace_rank_0": ("read", "1 entries")}),
    ("gz-1gib-line", {"events.jsonl.gz": ("read", "gzip stream"),
                      "events.jsonl": ("read", "2 events kept")}),
    ("sparse-2gib-events", {"events.jsonl": ("read", "128 events kept")}),
    ("manifest-million-ranks", {"manifest.json": ("error", "larger than 4 MiB")}),
    ("manifest-rank-claims", {"manifest.json": ("read", "")}),
    ("frame-name-16mb", {"rank0.pyspy.json": ("read", "1 threads")}),
    ("json-empty-lists", {"flight_recorder.json": ("error", "would build more than 256 MiB")}),
])
def test_doctor_on_hostile_input(case: str, inputs: dict[str, tuple[str, str]],
                                 tmp_path: Path) -> None:
    target = hostile.CASES[case](tmp_path / "in")
    arg = str(target.parent if case.startswith(("gz-", "sparse-")) else target)
    run = run_capped(["doctor", "--json", arg], tmp_path)
    _ok(run)
    assert run.rc in (1, 2), run.stderr
    seen = _inputs(run.stdout)
    for name, (status, message) in inputs.items():
        assert seen[name]["status"] == status, seen[name]
        assert message in str(seen[name]["message"]), seen[name]
    data = json.loads(run.stdout)
    if case == "fr-literal-ranks":
        assert data["missing_rank_count"] == 0
    if case in ("gz-1gib-line", "sparse-2gib-events"):
        assert any("skipped 1 malformed trace line" in p for p in data["problems"])
    if case == "manifest-rank-claims":
        assert data["missing_rank_count"] == 65534  # 2..65535: the most a job can have
        assert data["missing_rank_ranges"] == "2-65535 (65534 ranks)"
        assert len(data["missing_ranks"]) == 256
        assert len(data["ranks"]) <= 34
        assert all(r["rank"] >= 0 and "-" not in r["role"] for r in data["ranks"])
        assert any("outside 0..65535" in p for p in data["problems"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["frame-name-16mb", "manifest-rank-claims"])
def test_rich_report_of_hostile_input_is_fast(case: str, tmp_path: Path) -> None:
    target = hostile.CASES[case](tmp_path / "in")
    run = run_capped(["doctor", str(target)], tmp_path)
    _ok(run)
    assert run.wall_s < 60
    assert run.rc in (0, 1)
    assert len(run.stdout) < 100_000
    if case == "frame-name-16mb":
        assert "more characters]" in run.stdout
    else:
        assert "2-65535 (65534 ranks)" in run.stdout
        assert "rank -3" not in run.stdout
        assert "PP-" not in run.stdout


# --- trace export -----------------------------------------------------------------------------


def _one_line_error(run: hostile.Capped, text: str) -> None:
    _ok(run)
    assert run.rc == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("error: ")
    assert text in lines[0]


@pytest.mark.slow
def test_trace_export_refuses_dev_zero(tmp_path: Path) -> None:
    bundle = hostile.events_dev_zero(tmp_path / "bundle")
    run = run_capped(["trace", "export", str(bundle), "-o", "out.json"], tmp_path, timeout_s=60)
    _one_line_error(run, "not a regular file (a character device)")
    assert not (tmp_path / "out.json").exists()


def test_trace_export_of_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    """It used to open the file before checking what it was: a FIFO hung it forever."""
    bundle = hostile.events_fifo(tmp_path / "bundle")
    run = run_capped(["trace", "export", str(bundle), "-o", "out.json"], tmp_path, timeout_s=60)
    _one_line_error(run, "not a regular file (a FIFO)")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_trace_export_of_a_sparse_2gib_line(tmp_path: Path) -> None:
    empty = hostile.sparse_events(tmp_path / "a", events=0)
    run = run_capped(["trace", "export", str(empty), "-o", "out.json"], tmp_path)
    _one_line_error(run, "no trace events")
    one = hostile.sparse_events(tmp_path / "b")
    run = run_capped(["trace", "export", str(one), "-o", "out.json"], tmp_path)
    _ok(run)
    assert run.rc == 0, run.stderr
    assert "wrote 128 events" in run.stdout
    assert "1 over-long line(s)" in run.stdout
    assert len(json.loads((tmp_path / "out.json").read_text())["traceEvents"]) == 130


@pytest.mark.slow
def test_trace_export_of_malformed_events(tmp_path: Path) -> None:
    good = hostile.malformed_events(tmp_path / "good")
    run = run_capped(["trace", "export", str(good), "-o", "out.json"], tmp_path)
    _ok(run)
    assert run.rc == 0, run.stderr
    assert f"wrote 2 events to out.json; skipped {len(hostile.MALFORMED_EVENTS)} malformed " \
           "line(s)" in run.stdout
    events = json.loads((tmp_path / "out.json").read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] != "M"] == ["a.b", "req.abort"]
    bad = hostile.malformed_events(tmp_path / "bad", good=False)
    run = run_capped(["trace", "export", str(bad), "-o", "out2.json"], tmp_path)
    _one_line_error(run, f"{len(hostile.MALFORMED_EVENTS)} line(s), none of them an event")
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    run = run_capped(["trace", "export", str(empty), "-o", "out3.json"], tmp_path)
    _one_line_error(run, "no trace events in")
    assert "wrote 0 events" not in run.stdout


def test_a_capped_run_s_peak_is_its_own_not_the_test_process_s(tmp_path: Path) -> None:
    """A test worker that holds 300 MB when it starts the command: the figure stays the
    command's (a child forked from the worker itself reported the worker's pages)."""
    held = bytearray(b"x" * (300 << 20))  # resident here at the fork
    run = run_capped(["--version"], tmp_path)
    assert run.rc == 0, run.stderr
    assert 10 < run.peak_rss_mb < 200, run.peak_rss_mb
    assert len(held) == 300 << 20
