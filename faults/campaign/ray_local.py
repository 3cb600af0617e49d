"""A Ray cluster of several nodes on this machine, for trying the Ray executor, its tests and
``bench/campaign.py``: each node one ``ray start --block`` process in a process group of its
own, so stopping it (or killing it, as a lost node) touches no other Ray on the machine.

Loopback only, and with Ray's token authentication off (``RAY_AUTH_MODE=disabled``, set for the
nodes and for this process's driver by :meth:`LocalRayCluster.start`): nothing outside the
machine can reach it, and its processes need no token to share.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hicache_runtime.contracts.errors import StorageUnavailable
from hicache_runtime.l3.backends.redis_server import free_port


class LocalRayCluster:
    """A head and worker nodes on 127.0.0.1; ``address`` is what ``--address`` takes."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}

    def start(self, head_cpus: int = 0, worker_cpus: int = 2, timeout_s: float = 90.0
              ) -> LocalRayCluster:
        """The head (``head_cpus``: 0 keeps tasks off it) and one worker node, waited for."""
        os.environ["RAY_AUTH_MODE"] = "disabled"  # this process's driver joins it too
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.add("head", "--head", "--port", str(self.port), "--num-cpus", str(head_cpus),
                 "--include-dashboard=false")
        self.add("worker-a", "--address", self.address, "--num-cpus", str(worker_cpus))
        self.wait_for(head_cpus + worker_cpus, timeout_s)
        return self

    def add(self, name: str, *args: str) -> None:
        """Start node ``name`` (``ray start --block`` with ``args``)."""
        ray_bin = str(Path(sys.executable).with_name("ray"))
        with (self.workdir / f"{name}.log").open("wb") as log:
            self.nodes[name] = subprocess.Popen(
                [ray_bin, "start", "--block", "--node-ip-address", "127.0.0.1",
                 "--disable-usage-stats", *args], stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True, cwd=self.workdir)

    def wait_for(self, cpus: int, timeout_s: float = 90.0) -> None:
        """Until the cluster counts ``cpus`` CPUs on live nodes (asked by a short-lived
        driver, so this process keeps no connection a later ``ray.init`` would reuse)."""
        # the probe's own node is 127.0.0.1 too: left to itself a driver takes the machine's
        # outward address for its node, where no raylet of this cluster is
        probe = (f"import ray, time\nray.init(address={self.address!r}, log_to_driver=False, "
                 "_node_ip_address='127.0.0.1')\n"
                 f"deadline = time.time() + {timeout_s}\n"
                 f"while ray.cluster_resources().get('CPU', 0) != {cpus}:\n"
                 "    if time.time() > deadline:\n"
                 "        raise SystemExit(f'CPUs: {ray.cluster_resources()}')\n"
                 "    time.sleep(0.2)\n")
        deadline = time.monotonic() + timeout_s
        while True:  # the head's GCS takes a few seconds before a driver can join
            try:
                done = subprocess.run([sys.executable, "-c", probe], env=self.env,
                                      cwd=self.workdir, timeout=timeout_s + 30,
                                      capture_output=True, check=False)
                code, err = done.returncode, done.stderr
            except subprocess.TimeoutExpired as exc:  # a driver stuck joining: another try
                code, err = -1, exc.stderr or b""
            if code == 0:
                return
            if time.monotonic() > deadline:
                tail = err.decode(errors="replace").strip().splitlines()[-1:]
                raise StorageUnavailable(f"the local Ray cluster at {self.address} did not "
                                         f"come up: {' '.join(tail)[:300]}")
            time.sleep(1.0)

    def kill(self, name: str) -> None:
        """SIGKILL node ``name``: its raylet, its workers and what they started (a lost
        node, when it is not the head)."""
        proc = self.nodes.pop(name)
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self) -> None:
        for name in list(self.nodes):
            self.kill(name)

    def __enter__(self) -> LocalRayCluster:
        return self if self.nodes else self.start()  # ``with c.start(...)`` starts it once

    def __exit__(self, *exc: object) -> None:
        self.stop()
