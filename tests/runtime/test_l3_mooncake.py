"""The L3 tier end to end on a real Mooncake Store (``mooncake_master`` and a segment holder on
loopback): a second run served from the store, the master killed and restarted mid-run (the
run stays healthy, the doctor names the backend failure from the client's own log lines), a
crash bundle carrying those lines, ``hicache run --storage mooncake`` with its private store,
and the same at tp2 x pp2.

Skipped, with the reason, where the Mooncake client is not installed.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from doctor.diagnose import diagnose
from faults.spec import parse_fault
from hicache_runtime.config import RuntimeConfig
from hicache_runtime.engine.rank import RankRuntime
from hicache_runtime.l3.backend import StorageBackend
from hicache_runtime.l3.backends import mooncake_client as mc
from hicache_runtime.l3.backends.mooncake_master import LocalMooncakeStore, mooncake_binary
from hicache_runtime.launch.run import run, run_single
from tests.readme_blocks import bash_env, command, port_free, readme_block, readme_line, run_line
from tests.runtime.test_l3 import healthy, l3_config
from tests.runtime.test_l3_redis import backend_stats, built_ranks, l3_backend, storage_ops

__all__ = ["built_ranks"]  # the fixture, shared with the Redis tests

MISSING = None if mc.mooncake_installed() and mooncake_binary("mooncake_master") else \
    "the Mooncake client is not installed (pip install -e '.[mooncake]' in the checkout)"
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """One model thread: the store's processes and the L3 threads share two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalMooncakeStore]:
    with LocalMooncakeStore(segment_mib=64, workdir=tmp_path / "mooncake") as running:
        yield running


def mooncake_config(url: str, **overrides: object) -> RuntimeConfig:
    """``l3_config`` (small pools: L2 cannot hold the working set) on Mooncake, with frequent
    reconnect probes and a generous prefetch deadline (see ``redis_config``)."""
    base: dict[str, object] = {"storage.backend": "mooncake", "storage.url": url,
                               "storage.path": None, "storage.reconnect_backoff_s": 0.05,
                               "storage.prefetch_timeout_base_s": 20.0}
    base.update(overrides)
    return l3_config(Path("unused"), **base)


class KillAndRestart:
    """Progress callback ``(step, finished, total)`` that takes the master away mid-run.

    Kills it once a quarter of the requests finished; restarts it (same ports, empty; the
    holder remounts its segment) ``down_steps`` steps later, once ``noticed()`` says the
    backend saw the outage; then slows each step by 10 ms until ``back()`` says the backend
    reconnected, so its backoff expires while requests still call it. Without ``noticed`` and
    ``back`` (ranks in other processes) it goes by steps alone.
    """

    def __init__(self, store: LocalMooncakeStore, noticed: Callable[[], bool] = lambda: True,
                 back: Callable[[], bool] = lambda: True, down_steps: int = 8) -> None:
        self.store = store
        self.noticed = noticed
        self.back = back
        self.down_steps = down_steps
        self.killed_at: int | None = None
        self.restarted_at: int | None = None
        self.reconnected_at: int | None = None

    def __call__(self, step: int, finished: int, total: int) -> None:
        if self.killed_at is None:
            if finished >= total // 4:
                self.store.kill_master()
                self.killed_at = step
        elif self.restarted_at is None:
            if step >= self.killed_at + self.down_steps and self.noticed():
                self.store.restart_master()
                self.restarted_at = step
        elif self.reconnected_at is None:
            if self.back():
                self.reconnected_at = step
            else:
                time.sleep(0.01)


def top_verdict(paths: list[str]) -> tuple[str | None, str]:
    """The doctor's first signature for ``paths`` and the text of its evidence."""
    d = diagnose(paths)
    if not d.verdicts:
        return None, ""
    v = d.verdicts[0]
    return v.signature, json.dumps(v.model_dump(mode="json"))


def test_second_run_is_served_from_mooncake(store: LocalMooncakeStore,
                                            bundle_root: Path) -> None:
    cfg = mooncake_config(store.url)
    first = run_single(cfg, compare=False, bundle_root=bundle_root)  # fills the store
    healthy(first)
    assert backend_stats(first)["stored"] > 0
    s = run_single(cfg, bundle_root=bundle_root)
    healthy(s)
    assert s.output_match is True
    assert s.cached_tokens.storage > 0
    backend = backend_stats(s)
    assert backend["hits"] > 0
    assert backend["set_skipped"] > 0  # pages the first run stored, found in the store
    assert backend["errors"] == backend["outages"] == backend["corrupt"] == 0


def test_master_killed_mid_run_disables_then_reenables_l3(
        store: LocalMooncakeStore, built_ranks: list[RankRuntime], bundle_root: Path,
        tmp_path: Path) -> None:
    def backend() -> StorageBackend:
        return l3_backend(built_ranks[0])

    outage = KillAndRestart(store, noticed=lambda: backend().stats().outages > 0,
                            back=lambda: backend().stats().reconnects > 0)
    s = run_single(mooncake_config(store.url), progress=outage, bundle_root=bundle_root)
    healthy(s)  # served from L1/L2 while the master was away; outputs identical
    assert s.output_match is True
    assert outage.reconnected_at is not None, (
        f"no reconnect: killed at step {outage.killed_at}, restarted at {outage.restarted_at}, "
        f"run ended at step {s.steps}")
    stats = backend_stats(s)
    assert stats["outages"] == stats["reconnects"] == 1
    assert stats["errors"] > 0
    assert storage_ops(built_ranks[0]) == ["outage", "reconnect"]
    assert s.cache_stats.total.l3 is not None
    assert s.cache_stats.total.l3.backup_pages > 0
    # The client's own log of this run: the doctor names the failure from it, in its words.
    log = getattr(backend(), "client_log", lambda: None)()
    assert log is not None
    assert "master_client.cpp" in log
    (tmp_path / "client.log").write_text(log)
    signature, evidence = top_verdict([str(tmp_path / "client.log")])
    assert signature == "storage-backend-failure"
    assert "master_client.cpp" in evidence


def test_crash_bundle_carries_the_client_log(store: LocalMooncakeStore,
                                             bundle_root: Path) -> None:
    """A run that fails after the master went away: its bundle holds the Mooncake client's
    own lines about the lost master, and the doctor reads them there."""
    killed: list[int] = []

    def kill_at_20(step: int, finished: int, total: int) -> None:
        if not killed and step >= 20:
            store.kill_master()
            killed.append(step)

    cfg = mooncake_config(store.url, faults=(parse_fault("crash:point=scheduler.step,step=45"),))
    s = run_single(cfg, progress=kill_at_20, bundle_root=bundle_root)
    assert s.outcome.value == "crash"
    assert s.bundle is not None
    client_log = Path(s.bundle) / "rank0" / "storage-client.log"
    assert client_log.is_file()
    text = client_log.read_text()
    assert re.search(r"^E\d{4} .*master_client\.cpp:\d+\] .*failed", text, re.M), text[-2000:]
    verdicts = [v.signature for v in diagnose([s.bundle]).verdicts]
    assert "storage-backend-failure" in verdicts


def test_cli_without_url_runs_on_a_private_store(tmp_path: Path) -> None:
    """The README's line, as written."""
    res = run_line(readme_line("hicache run --storage mooncake --host"), tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout)
    assert (summary["outcome"], summary["output_match"]) == ("healthy", True)
    said = re.search(r"started a private mooncake store for this run at "
                     r"mooncake://127\.0\.0\.1:(\d+)\?metadata=", res.stderr)
    assert said, res.stderr[-2000:]
    with pytest.raises(ConnectionRefusedError):  # stopped with the run
        socket.create_connection(("127.0.0.1", int(said.group(1))), timeout=1).close()


def test_the_readme_store_that_outlives_runs(tmp_path: Path) -> None:
    """The README's lines for a store of one's own, as written: the master with its metadata
    server and a segment holder in the background, a run on them, then both stopped. The
    lines name their ports (50051, 50052, 8080, and the master's admin port 9003, which the
    line that waits for the holder's segment asks): where one is taken here, the test skips.
    Without that wait, a full run once had the run store nothing (the holder or the master
    not ready yet on a loaded machine)."""
    lines = [command(ln) for ln in readme_block("pip install -e '.[mooncake]'")[2:]]
    assert [ln.split()[:2] for ln in lines[:3]] == [
        ["mooncake_master", "-rpc_port"], ["mooncake_client", "-host"], ["timeout", "60"]]
    taken = [p for p in (50051, 50052, 8080, 9003) if not port_free(p)]
    if taken:
        pytest.skip(f"the README's ports {taken} are taken here")
    script = "set -e\n" + "\n".join(lines) + "\nstatus=$?; kill %1 %2; wait; exit $status"
    # Not MC_LOG_DIR, which this process set when it loaded the client library: with it the
    # segment holder initialises glog twice and aborts (LocalMooncakeStore drops it too).
    env = {k: v for k, v in bash_env().items() if k != "MC_LOG_DIR"}
    proc = run_line(script, tmp_path, env)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    summary = json.loads(proc.stdout)
    assert (summary["outcome"], summary["output_match"]) == ("healthy", True)
    l3 = summary["cache_stats"]["ranks"]["0"]["l3"]
    assert l3["backend"]["stored"] > 0, (json.dumps(l3), proc.stderr[-3000:])
    assert "private" not in proc.stderr  # the run used the store the lines started


@pytest.mark.slow
@pytest.mark.multiproc
def test_tp2xpp2_second_run_from_l3_then_master_killed(store: LocalMooncakeStore,
                                                       bundle_root: Path) -> None:
    """The second run reads what the first stored until the master dies a quarter of the
    way in (every rank degrades to L1/L2), then comes back; outputs match throughout. (One
    run does both: a run of its own only to show L3 hits cost a fifth of the suite's
    Mooncake time, and the hits before the outage show the same.)"""
    cfg = mooncake_config(store.url, **{"topology.tp": 2, "topology.pp": 2,
                                        "observability.check_integrity_every": 0,
                                        # half of l3_config's: four ranks, three runs
                                        "workload.requests": 32})
    healthy(run(cfg, compare=False, bundle_root=bundle_root))  # fills the store
    outage = KillAndRestart(store)
    second = run(cfg, progress=outage, bundle_root=bundle_root)
    healthy(second)
    assert second.output_match is True
    assert second.cached_tokens.storage > 0, "read from the store before the outage"
    assert outage.restarted_at is not None
    per_rank = {r: (c.l3.backend.outages if c.l3 else 0)
                for r, c in second.cache_stats.ranks.items()}
    assert all(n >= 1 for n in per_rank.values()), per_rank
