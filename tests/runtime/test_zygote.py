"""Ranks forked from the zygote behave as cold-started processes do: their own command line,
environment, log, descriptors and exit status; none outlives the zygote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache_runtime.launch import zygote

pytestmark = pytest.mark.skipif(not zygote.usable(), reason="no fork-based launch here")

TARGET = "tests.runtime.zygote_target"


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def zyg(monkeypatch: pytest.MonkeyPatch) -> zygote.Zygote:
    # the zygote runs with -P (no working directory on its path): the test target is found
    # through PYTHONPATH, as any module outside the installed packages would be
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    z = zygote.Zygote()
    yield z
    z.close()


def _argv(*args: str) -> list[str]:
    return [sys.executable, "-m", TARGET, *args]


def test_exit_codes_as_popen_reports_them(zyg: zygote.Zygote, tmp_path: Path) -> None:
    env = dict(os.environ)
    assert zyg.spawn(_argv("exit", "0"), env, tmp_path / "a.log").wait(30) == 0
    assert zyg.spawn(_argv("exit", "3"), env, tmp_path / "b.log").wait(30) == 3
    assert zyg.spawn(_argv("abort"), env, tmp_path / "c.log").wait(30) == -signal.SIGABRT
    p = zyg.spawn(_argv("sleep", "30"), env, tmp_path / "d.log")
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    os.killpg(p.pid, signal.SIGTERM)  # a session of its own: its pid is its group id
    assert p.wait(30) == -signal.SIGTERM
    p.kill()  # after the exit was reported: no signal goes to a pid someone else may hold


_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def test_a_rank_that_gets_an_earlier_rank_s_pid_is_not_taken_for_it(zyg: zygote.Zygote,
                                                                      tmp_path: Path) -> None:
    """The kernel reuses pids (pid_max is often 32768; a test session forks far more ranks):
    a new rank with the pid of one that exited earlier is alive until it exits itself. Before,
    it read as exited with the old code: a launcher took a running rank for a finished one,
    never signalled it and missed its result. The reuse is made, not waited for: the pid
    namespace's last pid is set so that the next fork gets the old one."""
    if not os.access(_LAST_PID, os.W_OK):
        pytest.skip("cannot choose the next pid here (no writable ns_last_pid)")
    env = dict(os.environ)
    first = zyg.spawn(_argv("exit", "0"), env, tmp_path / "a.log")
    assert first.wait(30) == 0
    for _ in range(20):  # other processes on the machine may fork in between: try again
        _LAST_PID.write_text(str(first.pid - 1))
        again = zyg.spawn(_argv("sleep", "30"), env, tmp_path / "b.log")
        if again.pid == first.pid:
            break
        again.kill()
        again.wait(30)
    else:
        pytest.skip("another process took the pid each time")
    assert again.poll() is None, "a live rank read as exited"
    again.terminate()  # and it can be signalled: it is no longer taken for the exited one
    assert again.wait(30) == -signal.SIGTERM


def test_a_rank_shows_its_own_command_line_and_environment(zyg: zygote.Zygote,
                                                           tmp_path: Path) -> None:
    env = {**os.environ, "RANK": "3", "HICACHE_TEST_MARK": "x" * 300}
    p = zyg.spawn(_argv("sleep", "30"), env, tmp_path / "r.log")
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            cmd = Path(f"/proc/{p.pid}/cmdline").read_bytes()
            if TARGET.encode() in cmd:
                break
            time.sleep(0.02)
        assert cmd.rstrip(b"\0").split(b"\0") == [a.encode() for a in _argv("sleep", "30")]
        environ = Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
        assert b"RANK=3" in environ
        assert b"HICACHE_TEST_MARK=" + b"x" * 300 in environ
        assert os.getsid(p.pid) == p.pid
    finally:
        p.kill()
        p.wait(30)


def test_the_zygote_shows_its_command_line_without_its_padding(zyg: zygote.Zygote) -> None:
    """It starts with thousands of blanks of room for the ranks' command lines; ``ps`` and
    /proc show its own arguments only."""
    pid = zyg.proc.pid
    deadline = time.monotonic() + 10
    own = [b"-m", b"hicache_runtime.launch.zygote"]
    while time.monotonic() < deadline:
        # Until its own arguments show: Popen returns once exec closed the child's
        # close-on-exec pipe, which the kernel does before it records where the new
        # arguments lie, and a read in between is empty (a loaded full run hit it).
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        if b" " * 64 not in b"".join(cmd) and cmd[-3:-1] == own:
            break
        time.sleep(0.02)
    assert cmd[-3:-1] == own, (cmd[:6], zyg.proc.poll())
    assert len(b" ".join(cmd)) < 400, cmd
    ps = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True,
                        check=False).stdout
    assert "hicache_runtime.launch.zygote" in ps
    assert len(ps.strip()) < 400, len(ps)


def test_log_and_passed_descriptors(zyg: zygote.Zygote, tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    assert zyg.spawn(_argv("print"), dict(os.environ), log).wait(30) == 0
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]
    r, w = os.pipe()
    try:
        fd = 200  # a number the child must see it under, whatever the zygote received it as
        os.dup2(w, fd)
        p = zyg.spawn(_argv("echo-fd", str(fd)), dict(os.environ), tmp_path / "q.log",
                      pass_fds=(fd,))
        assert p.wait(30) == 0, (tmp_path / "q.log").read_text()
        os.close(fd)
        os.close(w)
        assert os.read(r, 100) == b"through the passed descriptor\n"
    finally:
        os.close(r)


def test_a_rank_s_collections_leave_the_imported_objects_alone(zyg: zygote.Zygote,
                                                               tmp_path: Path) -> None:
    """What the zygote imported (torch, the runtime) is frozen before any fork: a rank's
    collection walks only what the rank itself made, so it does not copy the pages it shares
    with the zygote (bench/process_cpu.py measures the CPU that saves)."""
    log = tmp_path / "gc.log"
    assert zyg.spawn(_argv("gc"), dict(os.environ), log).wait(30) == 0
    walked, frozen = (int(x) for x in log.read_text().split())
    assert frozen > 100_000, frozen  # torch and the runtime: about 185,000 here
    assert walked < frozen / 10, (walked, frozen)


def test_no_rank_outlives_the_zygote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The target must be importable (as in the fixture): without it the rank failed on its
    # import within a millisecond, and when that beat the kill below it reported exit 1
    # (seen once under load).
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    z = zygote.Zygote()
    p = z.spawn(_argv("sleep", "60"), dict(os.environ), tmp_path / "s.log")
    z.proc.kill()  # the zygote dies (as it does when its launcher dies: its socket closes)
    z.proc.wait(30)
    assert p.wait(30) == -signal.SIGKILL  # reported once the zygote's socket closed
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{p.pid}").exists():
        state = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        assert not Path(f"/proc/{p.pid}").exists(), "the rank outlived its zygote"
    with pytest.raises(zygote.ZygoteError):
        z.spawn(_argv("exit", "0"), dict(os.environ), tmp_path / "t.log")
    z.close()


def test_the_launcher_forks_ranks_from_one_zygote(tmp_path: Path) -> None:
    from hicache_runtime.contracts.bundle import RunOutcome
    from hicache_runtime.launch.launcher import launch
    from tests.multirank.conftest import mr_config

    cfg = mr_config(**{"topology.tp": 2, "workload.requests": 4})
    pids = []
    for _ in range(2):
        res = launch(cfg, bundle_root=tmp_path)
        try:
            assert res.outcome is RunOutcome.HEALTHY, res.error
            assert res.exit_codes == {0: 0, 1: 0}
        finally:
            res.cleanup()
        pids.append(zygote.shared().proc.pid)
    assert pids[0] == pids[1], "the second launch reused the warm zygote"


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_stray_module_where_hicache_runs_is_not_imported(tmp_path: Path) -> None:
    """A timeit.py in the working directory shadowed the standard library's in the zygote
    (python -m puts the working directory first on the path): every rank failed to start with
    an ImportError from torch. Ranks and the zygote run with -P."""
    (tmp_path / "timeit.py").write_text("raise SystemExit('the stray module was imported')\n")
    (tmp_path / "random.py").write_text("raise SystemExit('the stray module was imported')\n")
    proc = subprocess.run([str(Path(sys.executable).with_name("hicache")), "run", "--tp", "2",
                           "--requests", "4", "--json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"outcome": "healthy"' in proc.stdout
