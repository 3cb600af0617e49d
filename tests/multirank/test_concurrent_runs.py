"""Runs at once never get in each other's way: the rendezvous store lives in the launcher, on
a port it holds from before the ranks start until they are gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.launch.launcher import launch
from tests.multirank.conftest import mr_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 3


def _descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (ranks are the children of the launcher's zygote)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _listening_inodes(port: int) -> set[str]:
    """Inodes of TCP sockets listening on ``port`` (``/proc/net/tcp`` and ``tcp6``: the store
    listens dual-stack)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def _my_socket_inodes() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def test_the_launcher_holds_the_rendezvous_port(bundle_root: Path) -> None:
    """While ranks run, the socket listening on their ``MASTER_PORT`` belongs to the launcher:
    no rank binds a number it was handed (another job could have taken it by then)."""
    seen: list[tuple[int, bool]] = []

    def check(step: int, finished: int, total: int) -> None:
        if seen:
            return
        for pid in _descendants(os.getpid()):
            try:
                env = _environ(pid)
            except OSError:
                continue
            if env.get("RANK") == "0" and "MASTER_PORT" in env:
                port = int(env["MASTER_PORT"])
                seen.append((port, bool(_listening_inodes(port) & _my_socket_inodes())))
                return

    cfg = mr_config(**{"topology.tp": 2, "workload.requests": 12})
    res = launch(cfg, bundle_root=bundle_root, progress=check)
    try:
        assert res.outcome is RunOutcome.HEALTHY, res.error
    finally:
        res.cleanup()
    assert seen, "the progress hook saw the ranks"
    port, held_here = seen[0]
    assert held_here, f"port {port} is not listened on by the launcher"


def test_two_runs_at_once_both_healthy(tmp_path: Path) -> None:
    """Two multi-rank runs (each with its reference run) side by side, several times."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    failures = []
    for i in range(ROUNDS):
        procs = [subprocess.Popen(
            [sys.executable, str(ROOT / "cli.py"), "run", "--tp", "2", "--requests", "8",
             "--json", "--bundle-dir", str(tmp_path / f"bundles{i}{j}")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for j in range(2)]
        for j, p in enumerate(procs):
            out, err = p.communicate(timeout=300)
            try:
                summary = json.loads(out)
            except ValueError:
                failures.append(f"round {i} run {j}: exit {p.returncode}: {err[-500:]}")
                continue
            if summary["outcome"] != "healthy" or p.returncode != 0:
                failures.append(f"round {i} run {j}: {summary['outcome']}: {summary['error']}")
    assert not failures, failures
    assert not list(tmp_path.glob("hicache-run-*")), "every run removed its run directory"
