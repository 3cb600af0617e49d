"""``hicache capture`` on real child processes with the real py-spy: a launcher with two ranks
blocked at different "collective" call sites, captured and diagnosed; permission failures are
explained with their fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from doctor.capture import PERMISSION_HINT, capture, find_targets, pyspy_command
from doctor.diagnose import diagnose
from hicache_runtime.errors import ToolUnavailable

RANK = textwrap.dedent('''
    import os, sys, time
    def all_reduce():          # stands in for torch.distributed.all_reduce
        print("ready", flush=True); time.sleep(600)
    def broadcast():
        print("ready", flush=True); time.sleep(600)
    def writing_check():
        all_reduce()
    def _broadcast_reqs_across_ranks():
        broadcast()
    (writing_check if os.environ["RANK"] == "0" else _broadcast_reqs_across_ranks)()
''')
LAUNCHER = textwrap.dedent('''
    import os, subprocess, sys, time
    kids = [subprocess.Popen([sys.executable, sys.argv[1]], env={**os.environ, "RANK": str(r)},
                             stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    for k in kids:
        k.stdout.readline()
    print("ready", flush=True)
    time.sleep(600)
''')


def _have_pyspy() -> bool:
    try:
        pyspy_command()
    except ToolUnavailable:
        return False
    return True


pytestmark = pytest.mark.skipif(not _have_pyspy(), reason="py-spy is not installed")


@pytest.fixture
def job(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A launcher process with two rank children, all blocked; killed afterwards by pid."""
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"),
                             str(tmp_path / "rank.py")], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    try:
        yield proc
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)


def test_capture_a_process_tree_and_diagnose_it(job: subprocess.Popen[str],
                                                tmp_path: Path) -> None:
    targets = find_targets([], job.pid, None)
    assert [t.rank for t in targets] == [0, 1]
    log = tmp_path / "server.log"
    log.write_text("[2026-01-01 00:00:00 TP0] Decode batch. #running-req: 1\n")
    start = time.monotonic()
    result = capture(targets, tmp_path / "cap", logs=[log], timeout_s=20)
    if result.hint is not None:
        pytest.skip(f"py-spy may not ptrace in this environment: {result.failures[0]}")
    assert time.monotonic() - start < 20
    assert result.failures == []
    assert result.hint is None
    manifest = json.loads((tmp_path / "cap" / "capture.json").read_text())
    assert [t["rank"] for t in manifest["targets"]] == [0, 1]
    assert (tmp_path / "cap" / "rank1" / "pyspy.json").exists()
    assert (tmp_path / "cap" / "logs" / "server.log").exists()
    d = diagnose([str(tmp_path / "cap")])
    assert d.verdicts
    assert d.verdicts[0].signature == "collective-order-deadlock"
    assert {r.rank: r.site for r in d.ranks} == {
        0: f"writing_check (rank.py:{8})", 1: f"_broadcast_reqs_across_ranks (rank.py:{10})"}


def test_capture_command_with_explicit_pids(job: subprocess.Popen[str], tmp_path: Path) -> None:
    pids = [str(t.pid) for t in find_targets([], job.pid, None)]
    res = CliRunner().invoke(app, ["capture", "--pid", pids[0], "--pid", pids[1],
                                   "--out", str(tmp_path / "c2")])
    if "SYS_PTRACE" in res.output:
        pytest.skip("py-spy may not ptrace in this environment")
    assert res.exit_code == 0, res.output
    assert "captured 2 of 2" in res.output
    assert "hicache doctor" in res.output


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to run py-spy as an unprivileged user")
def test_permission_failure_is_explained(job: subprocess.Popen[str], tmp_path: Path) -> None:
    targets = find_targets([], job.pid, None)
    unprivileged = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                    *pyspy_command()]
    result = capture(targets, tmp_path / "cap", timeout_s=20, pyspy=unprivileged)
    assert len(result.failures) == 2
    assert "Permission Denied" in result.failures[0] or "ermission" in result.failures[0]
    assert result.hint == PERMISSION_HINT
    notes = json.loads((tmp_path / "cap" / "capture.json").read_text())["notes"]
    assert "SYS_PTRACE" in notes[0]
    assert "ptrace_scope" in notes[0]
    d = diagnose([str(tmp_path / "cap")])
    assert any("capture of rank 0" in p for p in d.problems)
