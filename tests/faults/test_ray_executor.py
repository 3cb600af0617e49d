"""``hicache campaign --executor ray`` on a real Ray cluster of two nodes on this machine
(``faults/campaign/ray_local.py``): a head that runs no task (``--num-cpus 0``) and a worker
node joined to it, each a ``ray start --block`` process of its own (stopped by killing its
process group, so no other cluster on the machine is touched). The cells run as tasks on the
worker node and their verdicts equal the local executor's; a worker node killed mid-cell has
that cell run again on another node, once, and the result says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from faults.campaign.cells import CampaignResult, RayOptions, run_campaign
from faults.campaign.plan import load_campaign
from faults.campaign.ray_local import LocalRayCluster
from tests.readme_blocks import narrowed, readme_line, run_line

ray = pytest.importorskip("ray", reason="the Ray executor's tests need ray "
                                        "(pip install -e '.[ray]' in the checkout)")

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

CELLS = "tp2/*/host-alloc-fail:tp=1"
"""Two cells of the default campaign, two ranks each: a fixed one that stays healthy and its
legacy twin that hangs and leaves a bundle (collective-order-deadlock)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayCluster]:
    """One cluster for the module's tests (starting one takes about 5 s of CPU); the test that
    kills a worker node adds another, so every test finds a node with 2 CPUs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        c = LocalRayCluster(tmp_path_factory.mktemp("ray"))
        try:
            yield c.start()
        finally:  # every test's driver has left (_no_driver_left)
            c.stop()


@pytest.fixture(autouse=True)
def _no_driver_left(cluster: LocalRayCluster) -> Iterator[None]:
    """A test that joined the cluster from this process leaves it before the next one."""
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_cells_on_the_cluster_get_the_local_verdicts(cluster: LocalRayCluster,
                                                     tmp_path: Path) -> None:
    """The README's Ray line (this cluster's address in place of its example), narrowed to
    two cells, against the local executor on the same cells."""
    local = run_campaign(load_campaign(), bundle_root=tmp_path / "local", only=CELLS)
    line = narrowed(readme_line("hicache campaign --executor ray"), CELLS)
    line = line.replace("--address 127.0.0.1:6379", f"--address {cluster.address}")
    proc = run_line(line, tmp_path, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    remote = CampaignResult.model_validate_json((tmp_path / "ray.json").read_text())
    assert [c.id for c in remote.cells] == [c.id for c in local.cells]
    assert [(c.passed, c.observed) for c in remote.cells] == \
        [(c.passed, c.observed) for c in local.cells]
    assert all(c.node and c.reruns == 0 for c in remote.cells)
    failed = [c for c in remote.cells if c.bundle is not None]
    assert failed, "the legacy twin leaves a bundle"
    for c in failed:  # sent back and unpacked under the driver's bundle directory
        bundle = tmp_path / (c.bundle or "")
        assert bundle.parent == tmp_path / "hicache-bundles"
        assert (bundle / "manifest.json").is_file()


def test_shards_and_resume_on_the_cluster(cluster: LocalRayCluster, tmp_path: Path) -> None:
    """``--shard`` and ``--resume`` with the Ray executor: each shard of the two cells runs its
    cell as a task and logs it; shard 1 started again with its log runs nothing (the log gets
    no new line) and gives the same result; the two shards merge into the run of both."""
    cli = [sys.executable, str(Path(__file__).resolve().parents[2] / "cli.py"), "campaign"]
    ray_args = ["--executor", "ray", "--address", cluster.address, "--only", CELLS, "--json"]

    def shard(i: int) -> dict[str, Any]:
        proc = subprocess.run([*cli, *ray_args, "--shard", f"{i}/2", "--resume",
                               f"r{i}.jsonl"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, check=False)
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
        (tmp_path / f"s{i}.json").write_text(proc.stdout)
        out: dict[str, Any] = json.loads(proc.stdout)
        return out

    first = [shard(1), shard(2)]
    assert [len(s["cells"]) for s in first] == [1, 1]
    assert all(c["node"] and c["passed"] for s in first for c in s["cells"])
    logged = (tmp_path / "r1.jsonl").read_text()
    assert len(logged.splitlines()) == 2  # the run's header and its one cell
    again = shard(1)
    assert (tmp_path / "r1.jsonl").read_text() == logged, "the done cell ran again"
    assert [(c["id"], c["passed"], c["observed"]) for c in again["cells"]] == \
        [(c["id"], c["passed"], c["observed"]) for c in first[0]["cells"]]
    merged = subprocess.run([*cli, "merge", "s1.json", "s2.json", "-o", "all.json"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            check=False)
    assert merged.returncode == 0, merged.stderr[-2000:]
    whole = json.loads((tmp_path / "all.json").read_text())
    assert sorted(c["id"] for c in whole["cells"]) == sorted(
        c["id"] for s in first for c in s["cells"])


def test_a_cell_whose_node_dies_runs_again_elsewhere(cluster: LocalRayCluster,
                                                     tmp_path: Path) -> None:
    spec = load_campaign()
    out: dict[str, object] = {}

    def campaign() -> None:
        out["result"] = run_campaign(spec, bundle_root=tmp_path / "ray",
                                     only="tp2/fixed/host-alloc-fail:tp=1",
                                     ray=RayOptions(cluster.address))

    driver = threading.Thread(target=campaign)
    driver.start()
    # mid-cell: once the cell's two rank processes run on worker A
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not _rank_processes(cluster.nodes["worker-a"].pid):
        time.sleep(0.2)
    assert _rank_processes(cluster.nodes["worker-a"].pid), "the cell never started"
    cluster.kill("worker-a")
    cluster.add("worker-b", "--address", cluster.address, "--num-cpus", "2")
    driver.join(timeout=300)
    assert not driver.is_alive()
    (cell,) = out["result"].cells  # type: ignore[attr-defined]
    assert cell.reruns == 1
    assert cell.passed, (cell.observed, cell.error)
    assert cell.observed == "healthy"


def _rank_processes(ancestor: int) -> list[int]:
    """The cell's rank processes (spawned by a Ray worker of the node ``ancestor`` started)."""
    parents: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        parents[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
    found = []
    for pid in parents:
        up = pid
        while up > 1 and up != ancestor:
            up = parents.get(up, 0)
        if up != ancestor:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd or b"rank_process" in cmd:
            found.append(pid)
    return found
