"""``hicache capture`` on real child processes with the real py-spy: a launcher with two ranks
blocked at different "collective" call sites, captured and diagnosed; permission failures are
explained with their fix."""

from __future__ import annotations

import json
import os
import re
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
from doctor.capture import (
    PERMISSION_HINT,
    Target,
    capture,
    find_targets,
    pyspy_command,
    pyspy_error,
)
from doctor.diagnose import diagnose
from hicache_runtime.contracts.errors import ToolUnavailable
from tests.readme_blocks import readme_line, run_line

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
#: A healthy rank of a live job: always inside a "collective", but at another call site every
#: 0.3 s (seven sites in turn; the two ranks three sites apart). One snapshot of it looks like a
#: deadlock; two snapshots a second apart never show the same stack.
MOVING_RANK = textwrap.dedent('''
    import itertools, os, time
    def all_reduce():          # stands in for torch.distributed.all_reduce
        time.sleep(0.3)
    def step0(): all_reduce()
    def step1(): all_reduce()
    def step2(): all_reduce()
    def step3(): all_reduce()
    def step4(): all_reduce()
    def step5(): all_reduce()
    def step6(): all_reduce()
    steps = [step0, step1, step2, step3, step4, step5, step6]
    print("ready", flush=True)
    for i in itertools.count(3 * int(os.environ["RANK"])):
        steps[i % 7]()
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


def _launch(tmp_path: Path, rank_source: str) -> Iterator[subprocess.Popen[str]]:
    (tmp_path / "rank.py").write_text(rank_source)
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


@pytest.fixture
def job(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A launcher process with two rank children, all blocked; killed afterwards by pid."""
    yield from _launch(tmp_path, RANK)


@pytest.fixture
def healthy_job(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A launcher with two ranks that keep moving from one collective call site to the next."""
    yield from _launch(tmp_path, MOVING_RANK)


@pytest.fixture
def looping_job(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Like ``healthy_job``, but rank 0 always enters the collective from the same line (a loop
    over layers), so each of its samples shows the same stack."""
    yield from _launch(tmp_path, MOVING_RANK.replace(
        "steps[i % 7]()", "steps[0 if os.environ['RANK'] == '0' else i % 7]()"))


def test_capture_a_process_tree_and_diagnose_it(job: subprocess.Popen[str],
                                                tmp_path: Path) -> None:
    """The README's capture line on a live job (its launcher's pid filled in), then the
    doctor on what it wrote."""
    targets = find_targets([], job.pid, None)
    assert [t.rank for t in targets] == [0, 1]
    log = tmp_path / "server.log"
    log.write_text("[2026-01-01 00:00:00 TP0] Decode batch. #running-req: 1\n")
    line = readme_line("hicache capture --tree <launcher pid>").replace("<launcher pid>",
                                                                        str(job.pid))
    start = time.monotonic()
    proc = run_line(line, tmp_path, timeout=120)
    if "SYS_PTRACE" in proc.stdout + proc.stderr:
        pytest.skip(f"py-spy may not ptrace in this environment: {proc.stdout[-500:]}")
    assert time.monotonic() - start < 30
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "captured 2 of 2" in proc.stdout
    (cap,) = tmp_path.glob("capture-*")  # the line names no --out: a dated folder here
    manifest = json.loads((cap / "capture.json").read_text())
    assert [t["rank"] for t in manifest["targets"]] == [0, 1]
    assert all(t["error"] is None for t in manifest["targets"]), manifest["targets"]
    assert (cap / "rank1" / "pyspy.json").exists()
    assert (cap / "logs" / "server.log").exists()
    assert [t["moved"] for t in manifest["targets"]] == [[], []]  # stuck: same stacks twice
    d = diagnose([str(cap)])
    assert d.verdicts
    assert d.verdicts[0].signature == "collective-order-deadlock"
    assert {r.rank: r.site for r in d.ranks} == {
        0: f"writing_check (rank.py:{8})", 1: f"_broadcast_reqs_across_ranks (rank.py:{10})"}


def test_capture_of_a_healthy_live_job_reports_no_failure(healthy_job: subprocess.Popen[str],
                                                          tmp_path: Path) -> None:
    """Caught inside collectives at different call sites, like a deadlock; but the second
    sample shows every rank moved on, so nothing is blocked and no signature is suggested."""
    targets = find_targets([], healthy_job.pid, None)
    result = capture(targets, tmp_path / "cap", timeout_s=20)
    if result.hint is not None:
        pytest.skip(f"py-spy may not ptrace in this environment: {result.failures[0]}")
    assert result.failures == []
    assert all(t.moved for t in result.manifest.targets), result.manifest.targets
    d = diagnose([str(tmp_path / "cap")])
    assert [r.state for r in d.ranks] == ["active", "active"]
    assert d.blocked_sites == []
    assert (d.verdicts, d.near_misses) == ([], [])
    assert d.exit_code == 1
    assert d.summary == ("no failure evidence: a live job, every captured rank moved between "
                         "the capture's samples")
    res = CliRunner().invoke(app, ["doctor", str(tmp_path / "cap")])
    assert "world 2 " in res.output
    assert "None" not in res.output  # was: world 2 (tp=None pp=None)


def test_a_rank_seen_at_the_same_call_is_running_when_its_peers_moved(
        looping_job: subprocess.Popen[str], tmp_path: Path) -> None:
    """A collective completes on all ranks of its group or on none: rank 1 left the collective
    it was caught in, so rank 0, caught in a collective at the same line each time, is not
    stuck either."""
    targets = find_targets([], looping_job.pid, None)
    result = capture(targets, tmp_path / "cap", timeout_s=20)
    if result.hint is not None:
        pytest.skip(f"py-spy may not ptrace in this environment: {result.failures[0]}")
    assert [bool(t.moved) for t in result.manifest.targets] == [False, True]
    d = diagnose([str(tmp_path / "cap")])
    assert [r.state for r in d.ranks] == ["active", "active"]
    assert (d.verdicts, d.near_misses, d.blocked_sites) == ([], [], [])


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


@pytest.fixture
def not_python() -> Iterator[subprocess.Popen[bytes]]:
    """A live process py-spy cannot read (no Python in it); killed afterwards by pid."""
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_failed_dump_shows_pyspy_own_message(not_python: subprocess.Popen[bytes],
                                               tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # With RUST_BACKTRACE set py-spy ends its output with a Rust backtrace; its last line
    # ("10: main") used to be the error shown.
    monkeypatch.setenv("RUST_BACKTRACE", "1")
    result = capture([Target(pid=not_python.pid, rank=0)], tmp_path / "cap", timeout_s=20)
    assert len(result.failures) == 1
    error = result.manifest.targets[0].error or ""
    assert "py_spy::" not in error
    assert "backtrace" not in error.lower()
    assert not re.match(r"\d+:", error)
    assert re.search(r"python|permission|process", error, re.I), error


def test_pyspy_error_is_the_same_with_and_without_a_backtrace() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    texts = []
    for flag in ("1", "0"):
        proc = subprocess.run([*pyspy_command(), "dump", "--pid", str(dead.pid)],
                              capture_output=True, text=True, timeout=30, check=False,
                              env={**os.environ, "RUST_BACKTRACE": flag})
        assert proc.returncode != 0
        texts.append(pyspy_error(proc.stderr, proc.returncode))
    assert texts[0] == texts[1]
    assert texts[0].startswith("Failed to")
    assert pyspy_error("", 3) == "py-spy exited with 3"


def test_capture_json(job: subprocess.Popen[str], tmp_path: Path) -> None:
    pids = [str(t.pid) for t in find_targets([], job.pid, None)]
    res = CliRunner().invoke(app, ["capture", "--pid", pids[0], "--pid", pids[1], "--json",
                                   "--out", str(tmp_path / "c3")])
    if "SYS_PTRACE" in res.output:
        pytest.skip("py-spy may not ptrace in this environment")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["out"] == str(tmp_path / "c3")
    assert out["failures"] == []
    assert [t["rank"] for t in out["manifest"]["targets"]] == [0, 1]
    assert all(t["pyspy"] for t in out["manifest"]["targets"])


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("grid", [("--tp", "2"), ("--dp", "2", "--tp", "2")],
                         ids=["tp2", "dp2-tp2"])
def test_capture_a_live_hicache_run_finds_its_ranks_not_the_zygote(
        tmp_path: Path, grid: tuple[str, ...]) -> None:
    """The README's live capture: ``hicache run --tp 2`` with rank 1 hung, ``hicache capture
    --tree <its pid> --wait``, asked as soon as the run starts (it waits for every group's
    ranks): the ranks captured, each into its own folder (every DP group has a
    rank 0), and no helper: not the zygote that forks them, not a process a rank started
    (a DP group's multiprocessing resource tracker inherits RANK; it was taken for ranks 4
    and 5, and the doctor saw a world of 6)."""
    world = 2 * (2 if "--dp" in grid else 1)
    hicache = Path(sys.executable).with_name("hicache")
    run = subprocess.Popen([str(hicache), "run", *grid, "--requests", "8",
                            "--fault", "hang:rank=1,point=scheduler.step,step=3",
                            "--protocol-timeout", "120", "--watchdog-timeout", "120"],
                           cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        # right after the launch: --wait waits for the ranks, not for the launcher or zygote
        res = CliRunner().invoke(app, ["capture", "--tree", str(run.pid), "--wait", "120",
                                       "--out", str(tmp_path / "cap"), "--json"])
        if "ptrace" in res.output:
            pytest.skip("py-spy may not ptrace in this environment")
        assert res.exit_code == 0, res.output
        manifest = json.loads((tmp_path / "cap" / "capture.json").read_text())
        assert sorted(t["rank"] for t in manifest["targets"]) == list(range(world))
        assert all("rank_process" in t["cmdline"] for t in manifest["targets"]), \
            [t["cmdline"] for t in manifest["targets"]]
        dumps = sorted(p.parent.name for p in (tmp_path / "cap").glob("rank*/*.json"))
        assert len(set(dumps)) == world, dumps
        d = diagnose([str(tmp_path / "cap")])
        assert d.topology.get("world_size") == world, d.topology
    finally:
        os.killpg(run.pid, 9)
        run.wait(timeout=30)


def test_helpers_alone_are_no_ranks_yet(tmp_path: Path) -> None:
    """Captured before the ranks are forked: only the zygote is below the launcher. It is not
    recorded as "rank 0" (it used to be, and the doctor then saw a healthy world of one)."""
    from hicache_runtime.contracts.errors import ConfigError
    from hicache_runtime.contracts.run_files import HELPER_PROCESS_ENV

    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f'''
            import os, subprocess, sys, time
            env = {{**os.environ, "{HELPER_PROCESS_ENV}": "zygote"}}
            kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                   env=env)
            print("ready", flush=True)
            time.sleep(600)
        ''')], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "ready"
        try:
            got = find_targets([], parent.pid, None)
        except ConfigError as e:
            why = str(e)
        else:
            # what the process table looked like: this failed twice in full suites under
            # load and never alone, so the message has to say why
            from doctor.capture import _cmdline, _descendants, _environ, _is_python

            seen = [(p, _is_python(p), _environ(p).get(HELPER_PROCESS_ENV), _cmdline(p)[:80])
                    for p in _descendants(parent.pid)]
            pytest.fail(f"no ConfigError: targets {got}; below the parent {seen}")
        assert "only the run's helper processes" in why
    finally:
        os.killpg(parent.pid, 9)
        parent.wait(timeout=10)




def test_a_helper_caught_inside_execve_is_read_once_it_settles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process inside execve already runs its new executable while its command line and
    environment read empty (Linux lays them out after the parent's Popen has returned): a
    helper caught then was recorded as "rank 0" in full suites under load. That window is
    made here for 0.2 s on the helper: the capture waits it out and sees the helper."""
    from doctor import capture as cap
    from hicache_runtime.contracts.errors import ConfigError
    from hicache_runtime.contracts.run_files import HELPER_PROCESS_ENV

    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f'''
            import os, subprocess, sys, time
            env = {{**os.environ, "{HELPER_PROCESS_ENV}": "zygote"}}
            kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                   env=env)
            print(kid.pid, flush=True)
            time.sleep(600)
        ''')], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout is not None
        kid = int(parent.stdout.readline())
        until = time.monotonic() + 0.2
        real_cmdline, real_environ = cap._cmdline, cap._environ
        monkeypatch.setattr(cap, "_cmdline", lambda p: "" if p == kid and time.monotonic() < until
                            else real_cmdline(p))
        monkeypatch.setattr(cap, "_environ", lambda p: {} if p == kid and time.monotonic() < until
                            else real_environ(p))
        with pytest.raises(ConfigError, match="only the run's helper processes"):
            find_targets([], parent.pid, None)
    finally:
        os.killpg(parent.pid, 9)
        parent.wait(timeout=10)

DP_LAUNCHER = textwrap.dedent('''
    import os, subprocess, sys, time
    kids = [subprocess.Popen([sys.executable, sys.argv[1]], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "RANK": str(r), "HICACHE_DP_RANK": str(d)})
            for d in (0, 1) for r in (0, 1)]
    for k in kids:
        k.stdout.readline()
    print("ready", flush=True)
    time.sleep(600)
''')


def test_ranks_of_two_dp_groups_and_logs_of_one_name_never_overwrite(tmp_path: Path) -> None:
    """Every DP group numbers its ranks from 0: four processes used to land in two rank
    folders (each saying "ok"), and two ranks' server.log in one file."""
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "launcher.py").write_text(DP_LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"),
                             str(tmp_path / "rank.py")], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        targets = find_targets([], proc.pid, None)
        assert sorted(t.rank for t in targets) == [0, 1, 2, 3]
        assert sorted((t.dp, t.rank) for t in targets) == [(0, 0), (0, 1), (1, 2), (1, 3)]
        logs = []
        for host in ("a", "b"):
            (tmp_path / host).mkdir()
            logs.append(tmp_path / host / "server.log")
            logs[-1].write_text(f"[2026-01-01 00:00:00 TP0] from {host}\n")
        result = capture(targets, tmp_path / "cap", logs=logs, timeout_s=20, resample_s=0)
        if result.hint is not None:
            pytest.skip(f"py-spy may not ptrace in this environment: {result.failures[0]}")
        assert sorted(p.parent.name for p in (tmp_path / "cap").glob("rank*/pyspy.json")) == \
            ["rank0", "rank1", "rank2", "rank3"]
        copies = sorted((tmp_path / "cap" / "logs").iterdir())
        assert [p.name for p in copies] == ["server-2.log", "server.log"]
        assert {p.read_text() for p in copies} == {log.read_text() for log in logs}
        assert result.manifest.logs == ["logs/server.log", "logs/server-2.log"]
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)
