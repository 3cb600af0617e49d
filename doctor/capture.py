"""``hicache capture``: stacks of every rank of a live job, taken at about the same time.

Targets are explicit pids, the ranks below a pid (``--tree``: a launcher, an SGLang server:
the Python processes that say they are ranks, by ``RANK`` or an SGLang scheduler's title, else
every Python process; never the run's helpers, such as the rank zygote), or the workers of a
torchrun agent (``--torchrun``). Rank ids come from each process's
``RANK`` environment variable, else from its SGLang process title (``sglang::scheduler_TP1``),
else from their order. All ``py-spy dump --json`` calls start together (one thread each, a
timeout each), so the dumps show one moment of the job. Given log files are copied (their last
``max_log_bytes`` when larger). Then every rank is dumped ``RESAMPLES`` more times,
``resample_s`` apart, and the threads whose stacks differed from the first dump are listed
(``moved``): one snapshot of a running job catches ranks inside collectives at different call
sites, which is also what a deadlock looks like; a thread that moved on is running. The result
is a directory the doctor reads::

    <out>/capture.json            CaptureManifest (pid -> rank, errors)
    <out>/rank<N>/pyspy.json      py-spy dump --json of rank N
    <out>/logs/<name>             copies of the given logs

Permission failures are explained with their fix (root, CAP_SYS_PTRACE, ptrace_scope).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from doctor.read.bundle import CaptureManifest, CaptureTarget
from hicache_runtime.contracts.bundle import now_iso
from hicache_runtime.contracts.errors import ConfigError, ToolUnavailable
from hicache_runtime.contracts.pyspy import dump as pyspy_dump
from hicache_runtime.contracts.pyspy import find_pyspy
from hicache_runtime.contracts.run_files import (
    DP_RANK_ENV,
    DP_SIZE_ENV,
    HELPER_PROCESS_ENV,
    RANK_PYSPY,
    rank_dir_name,
)

PERMISSION_HINT = (
    "py-spy must be allowed to ptrace the ranks: run the capture as root (sudo -E hicache "
    "capture ...), or give the container CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE; "
    "Kubernetes securityContext.capabilities.add: [SYS_PTRACE], or kubectl debug "
    "--profile=sysadmin), or relax Yama for same-user tracing: "
    "sudo sysctl kernel.yama.ptrace_scope=0")
RESAMPLES = 2
_TITLE = re.compile(r"sglang::scheduler(?:_DP(?P<dp>\d+))?(?:_TP(?P<tp>\d+))?(?:_PP(?P<pp>\d+))?")


@dataclass
class Target:
    pid: int
    rank: int | None = None
    tp: int | None = None
    pp: int | None = None
    cmdline: str = ""
    dp: int | None = None
    """The data-parallel group (every group numbers its ranks from 0)."""


@dataclass
class CaptureResult:
    out: Path
    manifest: CaptureManifest
    failures: list[str] = field(default_factory=list)
    hint: str | None = None


def pyspy_command() -> list[str]:
    """The py-spy executable (PATH, or next to this Python); ``ToolUnavailable`` otherwise."""
    found = find_pyspy()
    if not found:
        raise ToolUnavailable("py-spy is not installed",
                              hint="pip install py-spy (or the capture extra: pip install -e "
                                   "'.[capture]' in the hicache-doctor checkout)")
    return [found]


_WAIT_POLL_S = 0.5
_SETTLE_S = 1.0


def find_targets(pids: list[int], tree: int | None, torchrun: int | None,
                 wait_s: float = 0.0) -> list[Target]:
    """Resolve the command line's choices to processes with ranks (``ConfigError`` if none).
    ``wait_s``: how long to wait for a ``tree``/``torchrun`` root to have ranks below it (a
    job just launched is still importing, or its helpers are still forking the ranks)."""
    chosen = list(pids)
    deadline = time.monotonic() + wait_s
    for root in (tree, torchrun):
        if root is None:
            continue
        if not _alive(root):
            raise ConfigError("capture", f"no process with pid {root}")
        below, helpers = _ranks_below(root, declared_only=wait_s > 0)
        while not below and time.monotonic() < deadline and _alive(root):
            time.sleep(_WAIT_POLL_S)
            below, helpers = _ranks_below(root, declared_only=True)
        if not _alive(root):
            raise ConfigError("capture", f"pid {root} ended before it had ranks to capture")
        if below and wait_s:
            below = _settled_ranks(root, below, deadline)
        elif not below and wait_s:  # none said it is a rank: the processes there, as
            below, helpers = _ranks_below(root)  # without --wait
        if not below and helpers:
            raise ConfigError(
                "capture", f"no ranks below pid {root} yet, only the run's helper processes "
                f"({', '.join(f'{_environ(p)[HELPER_PROCESS_ENV]} pid {p}' for p in helpers)})",
                hint="the job is still starting its ranks: capture again in a moment, or "
                     "give --wait SECONDS")
        chosen += below or [root]
    if not chosen:
        raise ConfigError("capture", "nothing to capture",
                          hint="give --pid PID (repeatable), --tree PID or --torchrun PID")
    targets = [_describe(p) for p in dict.fromkeys(chosen)]
    _global_ranks(targets)
    used = {t.rank for t in targets if t.rank is not None}
    free = (r for r in range(len(targets) + len(used)) if r not in used)
    for t in targets:
        if t.rank is None:
            t.rank = next(free)
    return sorted(targets, key=lambda t: t.rank if t.rank is not None else -1)


def _settled_ranks(root: int, below: list[int], deadline: float) -> list[int]:
    """The job's ranks once all have started: as many as the ranks' environment says the job
    has (``WORLD_SIZE``, times the DP groups), or, where it does not say, once no new rank has
    appeared for :data:`_SETTLE_S`. A launcher forks its ranks one after the other, a DP
    controller its groups: the first ones alone are not the job."""
    while time.monotonic() < deadline:
        expected = _expected_ranks(below)
        if expected is not None and len(below) >= expected:
            return below
        time.sleep(_WAIT_POLL_S if expected is not None else _SETTLE_S)
        again, _ = _ranks_below(root, declared_only=True)
        if expected is None and set(again) <= set(below):
            return below
        below = again
    return below


def _expected_ranks(ranks: list[int]) -> int | None:
    """How many ranks the job has, by its ranks' environment; None where it does not say."""
    for pid in ranks:
        env = _environ(pid)
        world, groups = env.get("WORLD_SIZE", ""), env.get(DP_SIZE_ENV, "1")
        if world.isdigit() and groups.isdigit():
            return int(world) * int(groups)
    return None


def _ranks_below(root: int, *, declared_only: bool = False) -> tuple[list[int], list[int]]:
    """(the ranks below ``root``, the job's helper processes there). ``declared_only``: only
    processes that say they are ranks (while waiting for a job's ranks, the other processes
    already there, a multiprocessing resource tracker say, are not taken for them)."""
    python = [p for p in _descendants(root) if _settled(p) and _is_python(p)]
    helpers = [p for p in python if _environ(p).get(HELPER_PROCESS_ENV)]
    below = [p for p in python if p not in helpers]
    # ranks say who they are (RANK, an SGLang scheduler's title); when some do, the rest
    # (a tokenizer, a detokenizer, a data loader) are not ranks of the job
    ranks = [p for p in below if _is_rank(p)]
    below = ranks if ranks or declared_only else below
    # a rank's own children inherit its environment, RANK included (a multiprocessing
    # resource tracker, a compile worker): a process below another candidate is no rank
    return _outermost(below), helpers


def _outermost(pids: list[int]) -> list[int]:
    """The processes of ``pids`` none of whose ancestors is in ``pids``."""
    chosen = set(pids)

    def below_another(pid: int) -> bool:
        seen: set[int] = set()
        parent = _ppid(pid)
        while parent is not None and parent > 1 and parent not in seen:
            if parent in chosen:
                return True
            seen.add(parent)
            parent = _ppid(parent)
        return False

    return [p for p in pids if not below_another(p)]


def _global_ranks(targets: list[Target]) -> None:
    """One rank id per process. Every DP group numbers its ranks from 0, so ``RANK`` repeats
    across groups: a rank in group ``d`` of ``size``-rank groups becomes ``d * size + rank``
    (as the runtime numbers DP bundles). Any rank still claimed twice is given up for the
    later process, which then gets a free id: two dumps must never share a folder."""
    groups = {t.dp for t in targets if t.rank is not None}
    if len(groups) > 1:
        size = 1 + max(t.rank for t in targets if t.rank is not None)
        for t in targets:
            if t.rank is not None:
                t.rank += (t.dp or 0) * size
    seen: set[int] = set()
    for t in targets:
        if t.rank is not None and t.rank in seen:
            t.rank = None
        elif t.rank is not None:
            seen.add(t.rank)


def capture(targets: list[Target], out: Path, *, logs: Sequence[Path] = (),
            timeout_s: float = 10.0, native: bool = False, locals_: bool = False,
            pyspy: list[str] | None = None, max_log_bytes: int = 256 << 20,
            resample_s: float = 0.5) -> CaptureResult:
    """Dump every target in parallel, copy ``logs``, write ``capture.json`` under ``out``."""
    cmd = pyspy or pyspy_command()
    out.mkdir(parents=True, exist_ok=True)
    extra = (["--native"] if native else []) + (["--locals"] if locals_ else [])
    with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        results = list(pool.map(lambda t: _dump(cmd, extra, t, out, timeout_s), targets))
        for _ in range(RESAMPLES if resample_s > 0 and any(r.pyspy for r in results) else 0):
            time.sleep(resample_s)
            list(pool.map(lambda r: _resample(cmd, extra, r, out, timeout_s), results))
    manifest = CaptureManifest(created_at=now_iso(), world_size=len(targets), targets=results)
    for log in logs:
        manifest.logs.append(_copy_log(Path(log), out / "logs", max_log_bytes))
    failures = [f"rank {t.rank} (pid {t.pid}): {t.error}" for t in results if t.error]
    hint = PERMISSION_HINT if any(_is_permission(t.error) for t in results) else None
    if hint:
        manifest.notes.append(hint + _ptrace_scope())
    (out / "capture.json").write_text(manifest.model_dump_json(indent=2), encoding="utf-8")
    return CaptureResult(out, manifest, failures, hint)


def _dump(cmd: list[str], extra: list[str], t: Target, out: Path, timeout_s: float
          ) -> CaptureTarget:
    rec = CaptureTarget(pid=t.pid, rank=t.rank, tp=t.tp, pp=t.pp, dp=t.dp,
                        cmdline=t.cmdline[:500])
    # a process whose rank is unknown (or claimed twice) keeps its files under its pid
    folder = rank_dir_name(t.rank) if t.rank is not None else f"pid{t.pid}"
    rank_dir = out / folder
    rank_dir.mkdir(exist_ok=True)
    res = pyspy_dump(t.pid, command=cmd, extra=extra, timeout_s=timeout_s)
    if res.timed_out:
        rec.error = f"py-spy did not answer within {timeout_s:g}s (process stuck in the kernel?)"
        return rec
    if res.failure is not None:
        rec.error = f"cannot run py-spy: {res.failure}"
        return rec
    rec.seconds = round(res.seconds, 3)
    if not res.ok:
        rec.error = pyspy_error(res.stderr or res.stdout.decode("utf-8", "replace"),
                                res.returncode or 0)
        return rec
    (rank_dir / RANK_PYSPY).write_bytes(res.stdout)
    rec.pyspy = f"{folder}/{RANK_PYSPY}"
    return rec


def _resample(cmd: list[str], extra: list[str], rec: CaptureTarget, out: Path,
              timeout_s: float) -> None:
    """Dump ``rec`` again and list the threads whose stacks changed since its first dump."""
    if rec.pyspy is None:
        return
    res = pyspy_dump(rec.pid, command=cmd, extra=extra, timeout_s=timeout_s)
    if res.failure is not None:
        return  # no second look: the first dump stands on its own
    try:
        before = _stacks(json.loads((out / rec.pyspy).read_bytes()))
        after = _stacks(json.loads(res.stdout))
    except (OSError, ValueError):
        return
    rec.moved = sorted(set(rec.moved) | {tid for tid, frames in before.items()
                                         if after.get(tid, frames) != frames})


def _stacks(data: object) -> dict[str, tuple[tuple[object, object, object], ...]]:
    """Thread id (as the doctor names threads) -> its frames, from ``py-spy dump --json``."""
    out = {}
    for t in data if isinstance(data, list) else []:
        if isinstance(t, dict) and isinstance(t.get("frames"), list):
            tid = str(t.get("os_thread_id") or t.get("thread_id") or "?")
            out[tid] = tuple((f.get("name"), f.get("filename"), f.get("line"))
                             for f in t["frames"] if isinstance(f, dict))
    return out


def pyspy_error(output: str, returncode: int, limit: int = 500) -> str:
    """py-spy's own message from its output: the ``Error:`` line and its ``Caused by:`` chain,
    on one line. What follows (``Stack backtrace:``, printed when ``RUST_BACKTRACE`` is set) is
    py-spy's internals, not the reason, and is dropped."""
    head = re.split(r"^\s*Stack backtrace:", output, maxsplit=1, flags=re.M)[0]
    lines = [ln.strip() for ln in head.splitlines() if ln.strip()]
    message, causes, in_causes = "", [], False
    for ln in lines:
        if not message and ln.startswith("Error:"):
            message = ln.removeprefix("Error:").strip()
        elif ln.rstrip(":") == "Caused by":
            in_causes = True
        elif in_causes:
            cause = re.sub(r"^\d+:\s*", "", ln)
            if cause not in causes and cause != message:
                causes.append(cause)
    if not message:  # no anyhow-style error: what py-spy printed, in order
        message = "; ".join(lines)
    if causes:
        message += f" (caused by: {'; '.join(causes)})"
    return message[:limit] if message else f"py-spy exited with {returncode}"


def _copy_log(src: Path, dest_dir: Path, max_bytes: int) -> str:
    """Copy ``src`` under ``dest_dir`` (its tail when larger than ``max_bytes``); a name
    already taken (two ranks' ``server.log``) gets ``-2``, ``-3``: nothing is overwritten."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest, n = dest_dir / src.name, 1
    while dest.exists():
        n += 1
        dest = dest_dir / f"{src.stem}-{n}{src.suffix}"
    with src.open("rb") as fin, dest.open("wb") as fout:
        size = src.stat().st_size
        if size > max_bytes:
            fin.seek(size - max_bytes)
            fin.readline()  # start at a line boundary
        shutil.copyfileobj(fin, fout, 1 << 20)
    return f"logs/{dest.name}"


def _is_permission(error: str | None) -> bool:
    return bool(error) and bool(re.search(r"permission|not permitted|ptrace|EPERM", error or "",
                                          re.I))


def _ptrace_scope() -> str:
    try:
        value = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        return ""
    return f" (kernel.yama.ptrace_scope is {value} here)"


def _is_rank(pid: int) -> bool:
    return "RANK" in _environ(pid) or bool(_TITLE.search(_cmdline(pid)))


def _describe(pid: int) -> Target:
    env = _environ(pid)
    cmdline = _cmdline(pid)
    t = Target(pid=pid, cmdline=cmdline)
    if env.get("RANK", "").isdigit():
        t.rank = int(env["RANK"])
    m = _TITLE.search(cmdline)
    if m:
        t.tp = int(m["tp"]) if m["tp"] else None
        t.pp = int(m["pp"]) if m["pp"] else None
        t.dp = int(m["dp"]) if m["dp"] else None
    if env.get(DP_RANK_ENV, "").isdigit():
        t.dp = int(env[DP_RANK_ENV])
    return t


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = _ppid(int(entry))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [root]
    while stack:
        for c in sorted(children.get(stack.pop(), [])):
            out.append(c)
            stack.append(c)
    return out


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (state, ppid, ...), or []."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat.rsplit(")", 1)[-1].split()


def _ppid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


#: How long a process caught inside execve may take to show its new command line.
EXEC_SETTLE_S = 2.0


def _settled(pid: int) -> bool:
    """Whether ``pid`` shows a command line, waiting up to ``EXEC_SETTLE_S`` for one. A process
    inside execve already runs its new executable (``/proc/PID/exe``) while its command line
    and environment still read empty (Linux sets them when it lays out the new stack, after
    the parent's ``Popen`` has returned): read then, a helper looks like a rank with no
    environment. A zombie never settles, and is no target."""
    deadline = time.monotonic() + EXEC_SETTLE_S
    while not _cmdline(pid):
        if not _alive(pid) or _zombie(pid) or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _zombie(pid: int) -> bool:
    return _stat(pid)[:1] == ["Z"]


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in pairs}


def _is_python(pid: int) -> bool:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    return "python" in Path(exe).name or "python" in _cmdline(pid).split(" ", 1)[0] \
        or _cmdline(pid).startswith("sglang::")


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()
