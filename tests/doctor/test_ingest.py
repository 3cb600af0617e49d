"""Inputs: directories, tar.gz archives, gzip files, stdin, and bad input that must not stop
the analysis."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

from doctor.diagnose import diagnose
from tests.doctor.conftest import FIXTURES, case_inputs

CASE = FIXTURES / "write-ack-pop-empty" / "sglang-pp2-classic"


def _tar(case: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w:gz") as tar:
        for f in case_inputs(case):
            tar.add(f, arcname=f"incident/{Path(f).relative_to(case)}")
    return dest


def test_tar_gz_of_a_bundle_is_read_without_extracting(tmp_path: Path) -> None:
    archive = _tar(FIXTURES / "rank-divergence-detected" / "bundle-tp2-consensus",
                   tmp_path / "bundle.tar.gz")
    d = diagnose([str(archive)])
    assert d.verdicts[0].signature == "rank-divergence-detected"
    assert any("bundle.tar.gz!incident/rank0/events.jsonl" in i.path for i in d.inputs)
    assert list(tmp_path.iterdir()) == [archive]


def test_gzip_log_and_stdin_stream_give_the_same_verdict(tmp_path: Path) -> None:
    raw = (CASE / "server.log").read_bytes()
    gz = tmp_path / "server.log.gz"
    gz.write_bytes(gzip.compress(raw))
    by_file = diagnose([str(gz)])
    by_stream = diagnose(streams=[("<stdin>", io.BytesIO(raw))])
    assert by_file.verdicts[0].signature == by_stream.verdicts[0].signature == \
        "write-ack-pop-empty"
    assert by_file.verdicts[0].evidence[0].file.endswith("server.log")


def test_bad_inputs_are_listed_and_the_rest_is_analysed(tmp_path: Path) -> None:
    (tmp_path / "core.bin").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "empty.log").write_bytes(b"")
    (tmp_path / "broken.json").write_text('[{"thread_name": "x", "frames": [')
    (tmp_path / "pyspy-rank9.json").write_text('[{"thread_name": "x", "frames": 3}]')
    (tmp_path / "manifest.json").write_text('{"kind": "hicache-crash-bundle", "outcome": "crash"}')
    (tmp_path / "nccl_trace_rank_0").write_bytes(b"\x80\x04\x95garbage")
    (tmp_path / "server.log").write_bytes((CASE / "server.log").read_bytes())
    d = diagnose([str(tmp_path), str(tmp_path / "does-not-exist")])
    assert d.verdicts[0].signature == "write-ack-pop-empty"
    status = {Path(i.path).name: i.status for i in d.inputs}
    assert status["core.bin"] == "error"
    assert status["does-not-exist"] == "error"
    assert status["manifest.json"] == "error"
    assert status["nccl_trace_rank_0"] == "error"
    assert status["server.log"] == "read"
    assert status["empty.log"] == "read"


def test_nothing_readable_is_exit_2(tmp_path: Path) -> None:
    (tmp_path / "core.bin").write_bytes(b"\x00\x01\x02" * 1000)
    d = diagnose([str(tmp_path / "core.bin"), str(tmp_path / "missing")])
    assert (d.status, d.exit_code) == ("unreadable", 2)


def test_a_stored_diagnosis_is_not_read_as_evidence(tmp_path: Path) -> None:
    d = diagnose([str(CASE)])
    (tmp_path / "diagnosis.json").write_text(d.model_dump_json())
    again = diagnose([str(CASE), str(tmp_path / "diagnosis.json")])
    assert [v.signature for v in again.verdicts] == [v.signature for v in d.verdicts]
    assert "skipped" in again.inputs[-1].message


def test_symlinks_are_not_followed_and_nested_archives_are_bounded(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path)
    inner = _tar(CASE, tmp_path / "inner.tar.gz")
    outer = tmp_path / "outer.tar.gz"
    with tarfile.open(outer, "w:gz") as tar:
        tar.add(inner, arcname="inner.tar.gz")
    inner.unlink()
    d = diagnose([str(tmp_path)])
    assert d.verdicts[0].signature == "write-ack-pop-empty"
    assert all("loop" not in i.path for i in d.inputs)


def test_an_empty_directory_is_said_to_be_empty(tmp_path: Path) -> None:
    """Not "1 read", not "output that records no failure", not "send more than the one
    failure line": nothing was given."""
    import render

    (tmp_path / "empty").mkdir()
    d = diagnose([str(tmp_path / "empty")])
    assert d.summary == "no failure evidence: the inputs are empty"
    assert d.lookalikes == []
    assert d.missing == []
    assert "0 read, 0 unreadable, 1 empty" in str(render._doctor_head(d).columns[1]._cells)
