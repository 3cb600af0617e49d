"""``py-spy dump --json`` of one process: the one way the launcher, a rank under ``torchrun``
and ``hicache capture`` take a Python stack dump of a live process.

:func:`dump` finds the executable (unless given a command), runs it with a timeout and returns
what happened, without raising; :func:`write_into` stores a dump in a rank's bundle folder, or
the reason it failed with :data:`PTRACE_HINT`. Torch-free: the doctor's capture uses it too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hicache_runtime.contracts.run_files import RANK_PYSPY, RANK_PYSPY_ERR

PYSPY_TIMEOUT_S = 15.0
PTRACE_HINT = ("py-spy needs ptrace: run as root, or give the container SYS_PTRACE "
               "(docker --cap-add SYS_PTRACE), or relax kernel.yama.ptrace_scope "
               "(sysctl -w kernel.yama.ptrace_scope=0); install it with `pip install py-spy`.")


def find_pyspy() -> str | None:
    """The py-spy executable: on ``PATH``, else next to this Python (a venv not activated)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


@dataclass
class PySpyDump:
    """One ``py-spy dump`` of ``pid``. ``failure``: py-spy could not be run, or did not answer
    in time (``subprocess.TimeoutExpired``); otherwise its exit code and output."""

    pid: int
    stdout: bytes = b""
    stderr: str = ""
    returncode: int | None = None
    failure: OSError | subprocess.TimeoutExpired | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None and self.returncode == 0 and bool(self.stdout.strip())

    @property
    def timed_out(self) -> bool:
        return isinstance(self.failure, subprocess.TimeoutExpired)


def dump(pid: int, *, command: Sequence[str] | None = None, extra: Sequence[str] = (),
         timeout_s: float = PYSPY_TIMEOUT_S) -> PySpyDump:
    """``<command> dump --json <extra> --pid <pid>``. ``command`` defaults to the py-spy found
    by :func:`find_pyspy` (or the one next to this Python, whose absence is then the failure);
    it may be a prefix such as ``setpriv ... py-spy``."""
    cmd = list(command) if command else [
        find_pyspy() or str(Path(sys.executable).with_name("py-spy"))]
    res = PySpyDump(pid=pid)
    start = time.monotonic()
    try:
        proc = subprocess.run([*cmd, "dump", "--json", *extra, "--pid", str(pid)],
                              capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        res.failure = exc
        return res
    res.seconds = time.monotonic() - start
    res.stdout, res.returncode = proc.stdout, proc.returncode
    res.stderr = proc.stderr.decode("utf-8", "replace")
    return res


def write_into(rank_dir: Path, res: PySpyDump) -> str | None:
    """Store ``res`` in a rank's bundle folder: ``pyspy.json`` (its path relative to the bundle
    is returned), else ``pyspy.err.txt`` saying why, with :data:`PTRACE_HINT`."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    if res.failure is not None:
        (rank_dir / RANK_PYSPY_ERR).write_text(f"py-spy failed: {res.failure}\n{PTRACE_HINT}\n",
                                               encoding="utf-8")
        return None
    if not res.ok:
        (rank_dir / RANK_PYSPY_ERR).write_text(res.stderr + "\n" + PTRACE_HINT + "\n",
                                               encoding="utf-8")
        return None
    (rank_dir / RANK_PYSPY).write_bytes(res.stdout)
    return f"{rank_dir.name}/{RANK_PYSPY}"
