"""The doctor's commands through typer's CliRunner: exit codes and key substrings; only the
``--json`` output is snapshotted (update with HICACHE_UPDATE_EXPECTED=1)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from tests.doctor.conftest import FIXTURES

REPO = FIXTURES.parents[2]
MIXED = "tests/fixtures/doctor/mixed/tp4-rank2-missing"
SNAPSHOT = Path(__file__).parent / "snapshots" / "mixed-tp4-rank2-missing.json"


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(REPO)  # stable relative paths in reports
    return CliRunner()


def test_doctor_names_the_signature_and_exits_0(runner: CliRunner) -> None:
    res = runner.invoke(app, ["doctor", MIXED])
    assert res.exit_code == 0, res.output
    assert "collective-order-deadlock" in res.output
    assert "missing ranks" in res.output
    assert "py-spy dump --json --pid" in res.output
    assert "writing_check" in res.output


def test_doctor_json_is_stable(runner: CliRunner) -> None:
    res = runner.invoke(app, ["doctor", MIXED, "--json"])
    assert res.exit_code == 0
    data = json.loads(res.output)
    assert data["verdicts"][0]["signature"] == "collective-order-deadlock"
    assert 0.6 <= data["verdicts"][0]["confidence"] <= 1.0
    assert any(e["file"] and e["file"].startswith(MIXED) for e in data["verdicts"][0]["evidence"])
    if os.environ.get("HICACHE_UPDATE_EXPECTED") == "1":
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(json.dumps(data, indent=2) + "\n")
    assert data == json.loads(SNAPSHOT.read_text())


def test_doctor_no_known_signature_exits_1(runner: CliRunner) -> None:
    res = runner.invoke(app, ["doctor", "tests/fixtures/doctor/no-fit/idle-hang-dp4"])
    assert res.exit_code == 1
    assert "every rank idle" in res.output


def test_doctor_unreadable_and_bad_usage_exit_2(runner: CliRunner, tmp_path: Path) -> None:
    res = runner.invoke(app, ["doctor", str(tmp_path / "nope")])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        f"error: no input could be read ({tmp_path / 'nope'}: not found)"]
    res = runner.invoke(app, ["doctor", MIXED, "--json", "--markdown"])
    assert res.exit_code == 2
    assert "one of --json and --markdown" in res.output
    res = runner.invoke(app, ["doctor"])
    assert res.exit_code == 2


def test_doctor_reads_stdin_and_writes_markdown(runner: CliRunner, tmp_path: Path) -> None:
    log = (FIXTURES / "write-ack-pop-empty/sglang-pp2-classic/server.log").read_bytes()
    out = tmp_path / "report.md"
    res = runner.invoke(app, ["doctor", "-", "--markdown", "--out", str(out)], input=log)
    assert res.exit_code == 0
    text = out.read_text()
    assert text.startswith("# hicache doctor: write-ack-pop-empty")
    assert "| `<stdin>:" in text  # where: a code span (paths are artifact text)
    assert "## Ranks" in text


def test_doctor_verbose_shows_the_rule_log(runner: CliRunner) -> None:
    res = runner.invoke(app, ["doctor", "tests/fixtures/doctor/no-fit/unrelated-pop-fooocus",
                              "-v"])
    assert res.exit_code == 1
    assert "similar to write-ack-pop-empty" in res.output
    assert "message alone" in res.output
    assert "rule log" in res.output


def test_hostile_markup_in_evidence_is_printed_verbatim(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "x.log").write_text("Traceback (most recent call last):\n  File \"/a/sglang/"
                                    "x.py\", line 1, in writing_check\nIndexError: [/bold red] "
                                    "[link=file:///etc/passwd]pop from empty list\n")
    res = runner.invoke(app, ["doctor", str(tmp_path)])
    assert res.exit_code in (0, 1)
    assert "[link=file:///etc/passwd]" in res.output


def test_signatures_list_show_schema(runner: CliRunner) -> None:
    res = runner.invoke(app, ["signatures", "list", "--json"])
    ids = [s["id"] for s in json.loads(res.output)["signatures"]]
    assert res.exit_code == 0
    assert len(ids) == 16
    assert ids[0] == "write-ack-pop-empty"
    res = runner.invoke(app, ["signatures", "list"])
    assert res.exit_code == 0
    assert "tree-invariant-violation" in res.output
    res = runner.invoke(app, ["signatures", "show", "pp-sync-send-leak"])
    assert res.exit_code == 0
    assert "#28916" in res.output
    res = runner.invoke(app, ["signatures", "show", "pp-sync-send-leak", "--json"])
    cell = json.loads(res.output)["campaign"]["cell"]
    assert cell == "pp2/unbounded-pp-sends/stage-lag:pp=1,ms=10"
    res = runner.invoke(app, ["signatures", "show", "nope"])
    assert res.exit_code == 2
    assert "known:" in res.output
    res = runner.invoke(app, ["signatures", "schema"])
    schema = json.loads(res.output)
    assert set(schema) == {"catalog", "diagnosis", "capture", "bundle"}


def test_runbook_for_every_signature(runner: CliRunner, tmp_path: Path) -> None:
    res = runner.invoke(app, ["runbook", "--out", str(tmp_path), "--html"])
    assert res.exit_code == 0
    files = {p.name for p in tmp_path.iterdir()}
    assert "index.md" in files
    assert "collective-order-deadlock.html" in files
    text = (tmp_path / "write-ack-pop-empty.md").read_text()
    for section in ("## Overview", "## Severity", "## How to confirm", "## Diagnosis path",
                    "## Mitigation", "## Upstream fix", "## Verify with a campaign cell",
                    "## Escalation"):
        assert section in text
    assert "hicache campaign --only 'pp2/skip-empty-sync/host-alloc-fail:pp=1'" in text
    res = runner.invoke(app, ["runbook", "-s", "host-memory-growth"])
    assert res.exit_code == 0
    assert res.output.startswith("# host-memory-growth")


def test_runbook_from_a_diagnosis(runner: CliRunner, tmp_path: Path) -> None:
    diag = tmp_path / "diagnosis.json"
    res = runner.invoke(app, ["doctor", MIXED, "--json", "--out", str(diag)])
    assert res.exit_code == 0
    res = runner.invoke(app, ["runbook", "--from", str(diag)])
    assert res.exit_code == 0
    assert res.output.startswith("# Incident runbook: collective-order-deadlock")
    assert re.search(r"`tests/fixtures/doctor/mixed/tp4-rank2-missing/\S+`", res.output)
    assert "py-spy dump --json --pid" in res.output
    assert "## Playbook" in res.output
    (tmp_path / "bad.json").write_text("{}")
    res = runner.invoke(app, ["runbook", "--from", str(tmp_path / "bad.json")])
    assert res.exit_code == 2
    assert "not a diagnosis" in res.output


def test_capture_without_targets_is_bad_usage(runner: CliRunner) -> None:
    res = runner.invoke(app, ["capture"])
    assert res.exit_code == 2
    assert "--pid" in res.output
    res = runner.invoke(app, ["capture", "--tree", "999999999"])
    assert res.exit_code == 2
    assert "no process" in res.output


@pytest.mark.parametrize("args", [["doctor", MIXED], ["doctor", MIXED, "--json"],
                                  ["--help"], ["faults", "list"], ["trace", "schema"]])
def test_a_closed_pipe_ends_quietly_with_sigpipes_status(args: list[str]) -> None:
    """``hicache ... | head``: the reader went away before anything was written. No message,
    and 128 + SIGPIPE: not 1, which from the doctor means "no signature fits"."""
    import signal
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-c", "import cli; cli.main()", *args],
                              stdout=w, stderr=subprocess.PIPE, cwd=REPO, timeout=120,
                              check=False)
    finally:
        os.close(w)
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr.decode()[-2000:]
    assert proc.stderr == b""


BUNDLES = {  # fixture bundle -> the signature it shows
    "write-ack-pop-empty/bundle-pp2-local-ack-drain": "write-ack-pop-empty",
    "tree-invariant-violation/bundle-tp1-integrity": "tree-invariant-violation",
    "rank-divergence-detected/bundle-tp2-consensus": "rank-divergence-detected",
}


def _bundle_folder(tmp_path: Path) -> Path:
    """A ``hicache-bundles/`` folder with three runs' bundles written an hour apart, plus a
    stray log that belongs to none of them."""
    import shutil

    root = tmp_path / "hicache-bundles"
    for hour, case in enumerate(BUNDLES):
        dest = root / f"run-{hour}" / Path(case).name
        shutil.copytree(FIXTURES / case, dest, ignore=shutil.ignore_patterns("expected.json"))
        manifest = json.loads((dest / "manifest.json").read_text())
        manifest["created_at"] = f"2026-11-20T0{hour}:00:00+00:00"
        (dest / "manifest.json").write_text(json.dumps(manifest))
    (root / "notes.log").write_text("INFO nothing happened here\n")
    return root


def test_a_folder_of_bundles_is_one_incident_each_newest_first(
        runner: CliRunner, tmp_path: Path) -> None:
    root = _bundle_folder(tmp_path)
    res = runner.invoke(app, ["doctor", str(root), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["kind"] == "hicache-incidents"
    incidents = out["incidents"]
    assert [i["created_at"][:13] for i in incidents[:3]] == [
        "2026-11-20T02", "2026-11-20T01", "2026-11-20T00"]
    wanted = list(BUNDLES.values())[::-1]
    assert [i["diagnosis"]["verdicts"][0]["signature"] for i in incidents[:3]] == wanted
    for inc in incidents[:3]:  # no incident read another one's ranks
        assert all(inc["bundle"] in s["path"] for s in inc["diagnosis"]["inputs"]), inc["bundle"]
    assert incidents[3]["bundle"] is None  # the stray log: an incident of its own
    assert incidents[3]["diagnosis"]["exit_code"] == 1

    table = runner.invoke(app, ["doctor", str(root)])
    assert table.exit_code == 0, table.output
    assert "4 incidents, newest first" in table.output
    rows = [ln for ln in table.output.splitlines() if re.match(r"\W+[1-4] ", ln)]
    assert len(rows) == 4, table.output
    assert "bundle-tp2-consensus" in rows[0]

    md = runner.invoke(app, ["doctor", str(root), "--markdown"])
    assert md.exit_code == 0
    assert md.output.count("# Incident ") == 4


def test_one_bundle_in_a_folder_is_still_one_diagnosis(runner: CliRunner, tmp_path: Path) -> None:
    import shutil

    case = next(iter(BUNDLES))
    shutil.copytree(FIXTURES / case, tmp_path / "b" / "only")
    res = runner.invoke(app, ["doctor", str(tmp_path / "b"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["kind"] != "hicache-incidents"
