"""How the ``hicache`` console script ends: the interpreter's teardown is skipped (with torch
loaded it cost 0.3-0.4 s of CPU per command), what an exit owes is not: ``atexit`` handlers
run, the standard streams are flushed, the status is the command's, and a non-daemon thread
still running gets the ordinary exit, which waits for it. (Whether the ordinary teardown calls
an object's ``__del__`` is not promised, so no test here relies on it.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: A script that sets traps, then runs the console script's entry with the given arguments.
_PROBE = """\
import atexit, sys, threading, time
from pathlib import Path

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))


class _Teardown:
    def __del__(self):  # runs when the interpreter clears module globals at its teardown
        (out / "teardown").write_text("ran")


_witness = _Teardown()
if sys.argv[2] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("ran"))).start()
sys.stdout.write("x" * 200_000)  # more than a pipe holds, still buffered at the exit
sys.argv = ["hicache", *sys.argv[3:]]
import cli

cli.entry()
"""


def _probe(tmp_path: Path, mode: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    return subprocess.run([sys.executable, str(script), str(tmp_path), mode, *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_exit_runs_atexit_flushes_and_skips_the_teardown(tmp_path: Path) -> None:
    proc = _probe(tmp_path, "plain", "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("x" * 200_000)
    assert "hicache" in proc.stdout[200_000:]
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()


def test_the_command_s_status_is_the_exit_status(tmp_path: Path) -> None:
    proc = _probe(tmp_path, "plain", "run", "--tp", "abc")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ")
    assert (tmp_path / "atexit").read_text() == "ran"


def test_a_running_thread_gets_the_ordinary_exit(tmp_path: Path) -> None:
    proc = _probe(tmp_path, "thread", "--version")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "thread").read_text() == "ran"  # os._exit would have cut it short
    assert (tmp_path / "atexit").read_text() == "ran"
