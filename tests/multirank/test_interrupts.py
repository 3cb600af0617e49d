"""Stopping a run from outside leaves nothing behind but what the user needs: no rank
process, no ``$TMPDIR/hicache-run-*`` directory, and any bundle already written, kept and
named. A rank lost during the reference run is reported with the bundle it left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache_runtime.contracts.bundle import load_manifest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[2]
_WAIT_S = 120.0


def _start(tmp: Path, bundles: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    cfg = tmp.parent / "config.json"  # short protocol timeouts: a lost rank is seen quickly
    cfg.write_text(json.dumps({"observability": {"protocol_timeout_s": 4.0,
                                                 "watchdog_timeout_s": 15.0}}))
    return subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), "run", "--tp", "2", "--json",
         "--config", str(cfg), "--bundle-dir", str(bundles), *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_interactive_sigint)


def _interactive_sigint() -> None:
    """Run as a terminal would: a suite started in the background (``pytest &``) has SIGINT
    ignored, its children inherit that, and a command rightly keeps an ignored signal ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(what: str, cond: object, proc: subprocess.Popen[str]) -> object:
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        got = cond()  # type: ignore[operator]
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def _processes_under(path: Path) -> list[str]:
    """Command lines of live processes that name ``path`` (rank processes name their run
    directory, which lies under the run's TMPDIR)."""
    out = []
    needle = str(path).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            out.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
    return out


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if b"hicache_runtime.launch.rank_process" in cmd and str(run_dir).encode() in cmd \
                and f"\0RANK={rank}\0".encode() in b"\0" + env:
            return int(entry)
    return None


def _assert_nothing_left(tmp: Path) -> None:
    deadline = time.monotonic() + 10.0
    while _processes_under(tmp) and time.monotonic() < deadline:
        time.sleep(0.1)  # PR_SET_PDEATHSIG kills are asynchronous
    assert not _processes_under(tmp), _processes_under(tmp)
    assert not list(tmp.glob("hicache-run-*")), list(tmp.iterdir())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_ranks_and_removes_the_run_dir(sig: signal.Signals,
                                                          tmp_path: Path) -> None:
    tmp, bundles = tmp_path / "tmp", tmp_path / "bundles"
    tmp.mkdir()
    proc = _start(tmp, bundles, "--requests", "400")
    _wait_for("ranks to make progress", lambda: list(tmp.glob("hicache-run-*/progress.json")),
              proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err  # the shell's convention: a supervisor sees why
    assert f"interrupted by {sig.name}" in err, err
    assert "Traceback" not in err, err
    _assert_nothing_left(tmp)


def test_a_signal_while_ranks_dump_keeps_the_bundle(tmp_path: Path) -> None:
    tmp, bundles = tmp_path / "tmp", tmp_path / "bundles"
    tmp.mkdir()
    proc = _start(tmp, bundles, "--requests", "24",
                  "--fault", "crash:rank=1,point=model.forward,step=6")
    _wait_for("rank 1's dump", lambda: list(tmp.glob("hicache-run-*/bundle/rank1/entry.json")),
              proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    line = next((x for x in err.splitlines() if "bundle is kept at" in x), None)
    assert line is not None, err
    kept = Path(line.rsplit(" at ", 1)[1].strip())
    assert kept.parent == bundles
    manifest = load_manifest(kept)
    assert any(e.rank == 1 and e.files.traceback for e in manifest.ranks)
    _assert_nothing_left(tmp)


def test_a_rank_killed_in_the_reference_run_is_reported_with_its_bundle(
        tmp_path: Path) -> None:
    tmp, bundles = tmp_path / "tmp", tmp_path / "bundles"
    tmp.mkdir()
    proc = _start(tmp, bundles, "--requests", "24")

    def reference_rank() -> int | None:
        for cfg in tmp.glob("hicache-run-*/config.json"):
            try:
                data = json.loads(cfg.read_text())
            except (OSError, ValueError):
                continue
            if not data["cache"]["enable_prefix_cache"]:
                return _rank_pid(cfg.parent, 1)
        return None

    pid = _wait_for("the reference run's rank 1", reference_rank, proc)
    os.kill(int(pid), signal.SIGKILL)  # type: ignore[arg-type]
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    summary = json.loads(out)
    assert summary["outcome"] == "crash"
    assert summary["error"].startswith("reference run failed: rank 1 exited with code -9"), \
        summary["error"]
    assert summary["bundle"], "the summary names the bundle the reference run left"
    manifest = load_manifest(Path(summary["bundle"]))
    assert manifest.config["cache"]["enable_prefix_cache"] is False
    assert next(e for e in manifest.ranks if e.rank == 1).exit_code == -9
    _assert_nothing_left(tmp)


@pytest.mark.parametrize(("after_s", "sig"), [(0.3, signal.SIGTERM), (1.0, signal.SIGTERM),
                                               (1.4, signal.SIGINT), (1.8, signal.SIGTERM),
                                               (2.6, signal.SIGINT)])
def test_a_signal_early_in_a_run_leaves_nothing_and_no_traceback(
        after_s: float, sig: signal.Signals, tmp_path: Path) -> None:
    """A signal while the ranks are still being started (tp2 x pp2): a rank forked but not yet
    known to the launcher used to recreate the run directory after its removal, and the zygote
    died with a BrokenPipeError traceback (5 of 5 trials). Whatever phase the signal hits."""
    tmp, bundles = tmp_path / "tmp", tmp_path / "bundles"
    tmp.mkdir()
    proc = _start(tmp, bundles, "--pp", "2", "--requests", "8")
    time.sleep(after_s)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    # 0: it had already finished; -N: it was still importing, before any handler or run
    # directory existed (the default action, which a shell reports as 128 + N too)
    assert proc.returncode in (0, 128 + sig, -sig), err
    assert "Traceback" not in err, err
    _assert_nothing_left(tmp)
