"""The hostile corpus: inputs built to cost the doctor (or ``trace export``) time or memory.

Every case is generated at test time (nothing big is stored): sparse files, multi-member gzip
streams (one compressed megabyte of ``a`` repeated, so a 1 GiB line costs a megabyte on disk and
no time to build), pickles written opcode by opcode. :func:`run_capped` runs a command under an
address-space cap and reports its exit code, output, wall time and the peak RSS of that very
process (``wait4``, measured from a small interpreter that starts it), so a regression shows as
a number, not as a machine that swapped to death.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AS_LIMIT = 3 << 29  # 1.5 GiB
GiB = 1 << 30


@dataclass
class Capped:
    """What a capped run did."""

    rc: int
    stdout: str
    stderr: str
    wall_s: float
    peak_rss_mb: float


#: Runs the command as its own child and writes that child's peak RSS (``wait4``) to argv[1],
#: then ends as the child did. The peak of a child forked from the test process itself counts
#: the test process's pages at the fork (Linux keeps the pre-exec image's high-water mark
#: across exec): a test worker grown to 415 MB made a 168 MB doctor read as 415 MB. Forked
#: from this small interpreter instead, the figure is the command's own.
_MEASURE = """\
import os, signal, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
sys.exit(os.WEXITSTATUS(status))
"""


def own_peak_rss_mb() -> float:
    """This process's own peak RSS (``VmHWM``). ``ru_maxrss`` of a process forked from a big
    one and exec'd counts the big one's pages (as :data:`_MEASURE` says), so a child that
    reports its own peak reads this instead."""
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(ln.split()[1]) for ln in fh if ln.startswith("VmHWM:")) / 1024


def run_capped(args: list[str], tmp: Path, timeout_s: float = 300,
               limit: int = AS_LIMIT) -> Capped:
    """Run ``python cli.py ARGS`` with ``RLIMIT_AS`` = ``limit``; kill it after ``timeout_s``."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out, err, rss = tmp / "capped.out", tmp / "capped.err", tmp / "capped.rss"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100", "NO_COLOR": "1"}
    rss.unlink(missing_ok=True)  # a figure of an earlier run in ``tmp`` is not this run's
    start = time.monotonic()
    with out.open("wb") as fo, err.open("wb") as fe:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _MEASURE, str(rss), sys.executable,
                                 str(REPO / "cli.py"), *args], stdout=fo, stderr=fe,
                                stdin=subprocess.DEVNULL, cwd=tmp, env=env, preexec_fn=cap,
                                start_new_session=True)
        # the command and the process measuring it are one group: a timeout kills both
        timer = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        try:
            proc.wait()
        finally:
            timer.cancel()
    peak_kb = int(rss.read_text()) if rss.exists() else 0
    return Capped(rc=proc.returncode, stdout=out.read_text(errors="replace"),
                  stderr=err.read_text(errors="replace"), wall_s=time.monotonic() - start,
                  peak_rss_mb=peak_kb / 1024)


# --- Flight Recorder pickles -------------------------------------------------------------------


def fr_shared_refs(d: Path) -> Path:
    """A small FR pickle whose string fields are lists of 10,000 references to one 100 KB
    string: ``str()`` of any of them is a 1 GB string. Twenty entries share them (walking it all
    visits about two million values, under the reader's limit, so it is read, not refused)."""
    d.mkdir(parents=True)
    big = "x" * 100_000
    many = [big] * 10_000
    frame = {"name": many, "filename": many, "line": 1}
    entry = {"process_group": (many, many), "collective_seq_id": 0, "p2p_seq_id": 0,
             "profiling_name": many, "state": many, "input_sizes": [many, [many]],
             "thread_name": many, "frames": [frame] * 2}
    entries = [{**entry, "collective_seq_id": i, "record_id": i} for i in range(20)]
    data = {"version": "2.10", "pg_config": {"0": {"ranks": many}}, "pg_status": {},
            "entries": entries}
    path = d / "nccl_trace_rank_0"
    path.write_bytes(pickle.dumps(data, protocol=4))
    return path


def fr_expanding_refs(d: Path) -> Path:
    """Shared lists nested so that walking them visits 10**12 values (a few KB of pickle)."""
    d.mkdir(parents=True)
    level: list[object] = [1] * 1000
    for _ in range(3):
        level = [level] * 1000
    data = {"version": "2.10", "entries": [{"collective_seq_id": 0, "input_sizes": level}]}
    path = d / "nccl_trace_rank_1"
    path.write_bytes(pickle.dumps(data, protocol=4))
    return path


def fr_many_lists(d: Path, count: int = 30_000_000) -> Path:
    """A 30 MB pickle of 30 million empty lists (2 GB once loaded), written opcode by opcode:
    PROTO 4, EMPTY_LIST, MARK, EMPTY_LIST * count, APPENDS, STOP."""
    d.mkdir(parents=True)
    path = d / "nccl_trace_rank_0"
    with path.open("wb") as fh:
        fh.write(b"\x80\x04](")
        for _ in range(count // 1_000_000):
            fh.write(b"]" * 1_000_000)
        fh.write(b"e.")
    return path


def fr_literal_ranks(d: Path) -> Path:
    """``pg_config.ranks`` as an 18 MB expression string ``1+1+...`` (``ast.literal_eval`` of
    it takes gigabytes, then fails)."""
    d.mkdir(parents=True)
    data = {"version": "2.10", "pg_config": {"0": {"ranks": "1+" * 9_000_000 + "1"}},
            "pg_status": {}, "entries": [
                {"process_group": ("0", "default"), "collective_seq_id": 1,
                 "profiling_name": "gloo:all_reduce", "state": "completed",
                 "input_sizes": [[4]], "frames": []}]}
    path = d / "nccl_trace_rank_0"
    path.write_bytes(pickle.dumps(data, protocol=4))
    return path


# --- traces and logs ---------------------------------------------------------------------------


EVENT = {"t_ns": 1, "rank": 0, "tp": 0, "pp": 0, "thread": "main", "step": 3,
         "kind": "req.abort", "attrs": {"rid": "r1", "reason": "test"}}


def gz_one_long_line(d: Path, line_bytes: int = GiB) -> Path:
    """``rank0/events.jsonl.gz``: an event, one line of ``line_bytes`` (1 GiB), an event; about
    1 MB compressed (gzip members of a compressed megabyte, concatenated)."""
    path = d / "rank0" / "events.jsonl.gz"
    path.parent.mkdir(parents=True)
    mib = gzip.compress(b"a" * (1 << 20), compresslevel=9)
    with path.open("wb") as fh:
        fh.write(gzip.compress((json.dumps(EVENT) + "\n" + '{"kind": "x", "pad": "').encode()))
        for _ in range(line_bytes >> 20):
            fh.write(mib)
        fh.write(gzip.compress(('"}\n' + json.dumps({**EVENT, "step": 4}) + "\n").encode()))
    return path


def sparse_events(d: Path, size: int = 2 * GiB, events: int = 128) -> Path:
    """``rank0/events.jsonl``: ``events`` event lines (16 KB: enough text for the file to be
    taken for a trace), then a hole to ``size`` bytes (NUL bytes, no newline): a 2 GiB line that
    takes no disk space."""
    path = d / "rank0" / "events.jsonl"
    path.parent.mkdir(parents=True)
    with path.open("wb") as fh:
        fh.write((json.dumps(EVENT) + "\n").encode() * events)
        fh.truncate(size)
    return path


def events_dev_zero(d: Path) -> Path:
    """A bundle whose ``rank0/events.jsonl`` is ``/dev/zero`` (a symlink to it)."""
    path = d / "rank0" / "events.jsonl"
    path.parent.mkdir(parents=True)
    path.symlink_to("/dev/zero")
    return d


def events_fifo(d: Path) -> Path:
    """A bundle whose ``rank0/events.jsonl`` is a FIFO nobody writes to."""
    path = d / "rank0" / "events.jsonl"
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    return d


MALFORMED_EVENTS = [
    '{"t_ns": 5, "kind": "a.b", "attrs": []}',  # attrs not an object (was AttributeError)
    '{"t_ns": "soon", "kind": "a.b", "attrs": {}}',  # time not an int
    '{"t_ns": 5, "kind": "a.b", "rank": "abc", "attrs": {}}',  # rank not an int (ValueError)
    '{"t_ns": 5, "kind": 7, "attrs": {}}',
    '{"t_ns": 5, "attrs": {}}',
    '[1, 2, 3]',
    '"just a string"',
    "[" * 100_000 + "]" * 100_000,  # nesting past the JSON decoder's recursion limit
    '{"t_ns": 5, "kind": "a.b", "rank": -4, "attrs": {}}',
    "not json at all",
    "\x00\x01\x02",
]


ODD_EVENTS = [
    '{"t_ns": 5, "kind": "a.b", "attrs": {"t0_ns": "x", "dur_ns": {}}}',  # an event; no span
    json.dumps(EVENT),
]


def malformed_events(d: Path, good: bool = True) -> Path:
    """A JSONL file of malformed events (and two events when ``good``)."""
    d.mkdir(parents=True, exist_ok=True)
    path = d / "events.jsonl"
    lines = list(MALFORMED_EVENTS) + (ODD_EVENTS if good else [])
    path.write_text("\n".join(lines) + "\n")
    return path


# --- manifests and stacks ----------------------------------------------------------------------


def _manifest(**over: object) -> dict[str, object]:
    return {"schema_version": "1.1", "kind": "hicache-crash-bundle",
            "created_at": "2026-01-01T00:00:00+00:00", "outcome": "crash", "reason": "x",
            "topology": {"tp": 2, "pp": 1, "world_size": 2}, "seed": 0, "config": {}, **over}


def manifest_million_ranks(d: Path) -> Path:
    """A manifest claiming a million missing ranks (7 MB of JSON)."""
    d.mkdir(parents=True)
    path = d / "manifest.json"
    path.write_text(json.dumps(_manifest(missing_ranks=list(range(1_000_000)))))
    return path


def manifest_rank_claims(d: Path) -> Path:
    """A manifest under the size cap that claims 300,000 missing ranks (most beyond any real
    job), negative ranks, and rank entries with negative coordinates."""
    d.mkdir(parents=True)
    entry = {"rank": 0, "tp_rank": 0, "pp_rank": 0, "outcome": "crash", "exit_code": 1,
             "error": "RuntimeError: boom"}
    ranks = [entry, {**entry, "rank": -3, "tp_rank": 1, "pp_rank": -2},
             {**entry, "rank": 1, "tp_rank": -1, "pp_rank": -1}]
    path = d / "manifest.json"
    path.write_text(json.dumps(_manifest(missing_ranks=[-3, -1, *range(2, 300_000)],
                                         ranks=ranks), separators=(",", ":")))
    return path


def frame_name_16mb(d: Path) -> Path:
    """A py-spy dump whose frame name and file name are 16 MB each."""
    d.mkdir(parents=True)
    name = "f" * (16 << 20)
    threads = [{"pid": 7, "thread_id": 1, "os_thread_id": 7, "thread_name": "MainThread",
                "active": True, "frames": [
                    {"name": name, "filename": "/x/" + name + ".py", "line": 3},
                    {"name": "all_reduce", "filename": "torch/distributed/distributed_c10d.py",
                     "line": 2501}]}]
    path = d / "rank0.pyspy.json"
    path.write_text(json.dumps(threads))
    return path


def json_of_empty_lists(d: Path, mb: int = 40) -> Path:
    """A ``flight_recorder.json`` of ``[[],[],...]``: 40 MB of text, 14 million lists once
    parsed."""
    d.mkdir(parents=True)
    path = d / "flight_recorder.json"
    with path.open("wb") as fh:
        fh.write(b"[")
        block = b"[]," * 100_000
        for _ in range(mb * (1 << 20) // len(block)):
            fh.write(block)
        fh.write(b"[]]")
    return path


CASES: dict[str, Callable[[Path], Path]] = {
    "fr-shared-refs": fr_shared_refs,
    "fr-expanding-refs": fr_expanding_refs,
    "fr-many-lists": fr_many_lists,
    "fr-literal-ranks": fr_literal_ranks,
    "gz-1gib-line": gz_one_long_line,
    "sparse-2gib-events": sparse_events,
    "manifest-million-ranks": manifest_million_ranks,
    "manifest-rank-claims": manifest_rank_claims,
    "frame-name-16mb": frame_name_16mb,
    "json-empty-lists": json_of_empty_lists,
}
