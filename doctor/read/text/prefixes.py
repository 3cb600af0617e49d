"""Per-line prefixes that log writers, launchers and log collectors put before the text.

A line may carry several, stacked (a collector's timestamp, then torchrun's ``[rank3]:``, then
SGLang's ``[2026-05-26 13:36:14 TP5 PP1]``). :func:`strip_prefixes` removes them all and says
what they told about the writer:

* ranks: torchrun / torch ``[rank3]:`` ``[default3]:``; SGLang tags ``TP5 PP1 DP0`` (any order,
  any subset; EP / ATTN_CP tags are ignored); vLLM ``(VllmWorker rank=2 pid=77)``,
  ``(Worker_PP1_TP0 pid=9)``, ``(EngineCore_DP0 pid=5)``; NCCL's ``[Rank 3]`` / ``[PG 0 Rank 3]``
  inside watchdog messages;
* a *stream*: the process id in ``(VllmWorkerProcess pid=2491016)`` and Ray's ``(pid=812)``,
  so that two workers' interleaved tracebacks never mix even when no rank is printed;
* the *style*: ``torch`` (every line of a rank carries it), ``sglang`` (a log record starts
  here and unprefixed lines that follow continue it), ``generic`` (any other per-line logger or
  collector prefix) or ``""`` (none).

Generic prefixes carry no rank but must go so that the text behind them parses: vLLM's
``ERROR 04-16 20:47:15 [multiproc_worker_utils.py:238]``, LMCache's ``[2025-03-01 10:00:00,123]
LMCache ERROR:``, glog's ``E1129 12:00:00.123456 123 tcp_transport.cpp:406]`` (bare or in
brackets as torch's c10 logger prints it), Python ``logging`` and loguru formats, container
runtime timestamps, docker compose service columns, syslog/journald and kubectl ``--prefix``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from doctor.model.evidence import RankHint

_TORCH = re.compile(r"\[(?:rank|default|trainer|worker|local_rank)(?P<n>\d{1,6})\]:(?: (?=\S))?"
                    # horovodrun: [3]<stderr>:, Open MPI's --tag-output: [1,3]<stderr>:
                    # (the job's id, then the rank)
                    r"|\[(?:\d{1,6},)?(?P<h>\d{1,6})\]<std(?:out|err)>:")
_SGLANG = re.compile(r"\[(?P<ts>\d{4}-\d\d-\d\d[ T_]\d\d:\d\d:\d\d(?:[.,]\d+)?)"
                     r"(?P<tags>(?: [A-Z][A-Z_]*\d+)*)\] ?")
_TAG = re.compile(r"(?<![A-Z_])(TP|PP|DP)(\d{1,6})\b")
_NAME_TAG = re.compile(r"(?:^|_)(TP|PP|DP)(\d{1,6})(?=_|$)")
_LMCACHE = re.compile(r"(?:\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)?\] )?LMCache "
                      r"(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s?:\s?")
_VLLM_PROC = re.compile(r"\((?P<name>[A-Za-z_][\w]*|)(?P<tags>(?: (?:TP|PP|DP|EP)\d{1,6})*)"
                        r"(?: rank=(?P<rank>\d{1,6}))?"
                        r"(?:,? ?pid=(?P<pid>\d{1,9}))(?:, ip=[^)]{1,64})?\) ")
_LEVEL = r"(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)"
_GENERIC = re.compile(
    # vLLM: ERROR 04-16 20:47:15 [file.py:238] (new) or ERROR 02-12 03:41:17 engine.py:135] (old)
    rf"{_LEVEL} \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? (?:\[[\w./-]+:\d+\]|[\w./-]+:\d+\]) ?"
    # glog, bare or bracketed (torch's c10 logger): E1129 12:00:00.123456 123 file.cpp:406],
    # and glog without its date and thread (E nixl_agent.cpp:921]) as some wrappers print it
    r"|\[?[IWEF](?:\d{4})?\d{4} \d\d:\d\d:\d\d\.\d+(?: +\d+)? [\w./-]+:\d+\] ?"
    r"|\[?[IWEF] [\w./-]+\.(?:cc|cpp|c|h|hpp|cu|rs):\d+\] ?"
    # TensorFlow's C++ logger: 2019-11-11 11:45:07.181990: E tensorflow/core/x/ring_alg.cc:279]
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] [\w./-]+:\d+\] ?"
    # Python logging / loguru: 2025-01-01 00:00:00,123 - name - ERROR - / ... | ERROR | mod:f:1 -
    rf"|\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)?(?: - [\w.]+)? [-|] {_LEVEL}\s*[-|]"
    r"(?: [\w.]+:[\w<>]+:\d+ -)? ?"
    rf"|{_LEVEL}:[\w.]+:"
    # syslog / journald: Jun 12 04:13:18 host python3[1234]:
    r"|[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d [\w.-]+ [\w.@/-]+(?:\[\d{1,9}\])?: "
    # kubectl logs --prefix, docker compose service column
    r"|\[pod/[^\]\s]{1,200}\] |[a-z][\w.-]{0,62}\s{1,20}\| "
)
# Container runtimes and collectors: 2026-06-12T04:13:18.902123456Z (then maybe a level);
# cloud logging exports put the severity first: ERROR 2026-06-15T14:10:59.392125190Z (CRI
# runtimes, as kubelet stores them, add the stream and a full/partial tag:
# 2026-06-24T17:38:03.765641375+02:00 stderr F <text>). A level only when it is no logger's
# own: vLLM's "INFO 02-17 17:03:44 file.py:306]" after the runtime's prefix keeps its level for
# its own prefix, which names the site. The runtime stamps every physical line, so without a
# level the stamp says nothing about where a record starts (a traceback's message goes on over
# lines that each carry one).
_CONTAINER = re.compile(
    rf"(?P<sev>{_LEVEL} )?\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)? "
    rf"(?:(?:stdout|stderr) [FP] )?(?P<level>{_LEVEL}\s++(?!\d\d-\d\d \d\d:))?")
# torch's "[Rank 4]" (or "[PG 0 Rank 4]"), and torchrun's "[rank4]" where a paste lost its ":"
_NCCL_RANK = re.compile(r"\[(?:PG [^\]]*?)?(?:Rank |rank)(?P<n>\d{1,6})\]")
# glog's level letter opens its prefix; TensorFlow's C++ logger puts it after the time
# ("2019-11-11 11:45:07.181990: E tensorflow/...")
_ERROR_LEVEL = re.compile(r"^\[?[EF](?:\d{4}){0,2} |\d: [EF] |\b(?:ERROR|CRITICAL|FATAL)\b")
_WARN_LEVEL = re.compile(r"^\[?W(?:\d{4}){0,2} |\d: W |\bWARN(?:ING)?\b")
# a path starts where a path token starts and has at most 512 characters: searched in every
# prefix, an unanchored unbounded one retried a long dotted line from each of its positions
_SITE = re.compile(r"(?:^|(?<=[^\w./-]))(?P<file>[\w./-]{1,512}\.(?:py|cpp|cc|c|h|hpp|cu|rs))"
                   r":\d{1,7}\]")
#: LMCache ends its messages with ``(file.py:360:module.path)``.
_TAIL_SITE = re.compile(r" \((?P<file>[\w./-]+\.py):\d{1,7}:(?P<module>[\w.<>]+)\)\s*$")
_MAX_PREFIXES = 6


@dataclass(frozen=True)
class Prefixed:
    """A line without its prefixes, and what they said."""

    rest: str
    hint: RankHint
    style: str
    stream: str = ""
    """A writer identity below the rank level (a process id), or ``""``."""
    site: str = ""
    """The source file the logger says the line comes from (``engine.py``,
    ``tcp_transport.cpp``), or ``""``."""
    error: bool = False
    """The logger marked the line an error (glog ``E``/``F``, ``ERROR``, ``CRITICAL``)."""
    warning: bool = False
    """The logger marked the line a warning or worse (its ``site`` is then evidence: the
    source files of a healthy server's INFO lines say nothing about a failure)."""


def strip_prefixes(line: str) -> Prefixed:
    """Remove every known prefix from ``line`` (see the module docstring)."""
    rank: int | None = None
    tp = pp = dp = None
    style, stream, site = "", "", ""
    error = warning = False
    for _ in range(_MAX_PREFIXES):
        m = _TORCH.match(line)
        if m:
            rank = int(m["n"] or m["h"]) if rank is None else rank
            line, style = line[m.end():], "torch"
            continue
        m = _VLLM_PROC.match(line)
        if m:
            if m["rank"] is not None and rank is None:
                rank = int(m["rank"])
            for tag, num in _NAME_TAG.findall(m["name"] or "") + _TAG.findall(m["tags"]):
                tp, pp, dp = _tagged(tag, int(num), tp, pp, dp)
            stream = stream or f"pid {m['pid']}"
            line, style = line[m.end():], style or "torch"
            continue
        m = _CONTAINER.match(line)
        if m:
            if m["sev"] or m["level"]:
                error = error or bool(_ERROR_LEVEL.search(m[0]))
                warning = warning or error or bool(_WARN_LEVEL.search(m[0]))
                style = style or "generic"
            line = line[m.end():]
            continue
        m = _LMCACHE.match(line) or _GENERIC.match(line)
        if m:
            at = _SITE.search(m[0]) if "]" in m[0] else None
            site = site or (at["file"] if at else "")
            error = error or bool(_ERROR_LEVEL.search(m[0]))
            warning = warning or error or bool(_WARN_LEVEL.search(m[0]))
            line, style = line[m.end():], style or "generic"
            continue
        m = _SGLANG.match(line)
        if m:
            style = "sglang" if style in ("", "generic") else style
            for tag, num in _TAG.findall(m["tags"]):
                tp, pp, dp = _tagged(tag, int(num), tp, pp, dp)
            line = line[m.end():]
            continue
        break
    if rank is None and tp is None and pp is None:
        m = _NCCL_RANK.search(line)
        if m and ("NCCL" in line or "Watchdog" in line):
            rank = int(m["n"])
    if not site and line.endswith(")"):
        tail = _TAIL_SITE.search(line)
        site = _tail_site(tail["file"], tail["module"]) if tail else ""
    return Prefixed(line, RankHint(rank=rank, tp=tp, pp=pp, dp=dp), style, stream, site, error,
                    warning)


def _tail_site(file: str, module: str) -> str:
    """The module path LMCache names after the file (``lmcache.v1.transfer_channel.base_channel``)
    as a path: its folders say which component spoke, where the file name alone does not."""
    parts = module.split(".")
    if len(parts) > 1 and f"{parts[-1]}.py" == file.rsplit("/", 1)[-1]:
        return "/".join(parts) + ".py"
    return file


def _tagged(tag: str, num: int, tp: int | None, pp: int | None,
            dp: int | None) -> tuple[int | None, int | None, int | None]:
    if tag == "TP":
        return num, pp, dp
    if tag == "PP":
        return tp, num, dp
    return tp, pp, num
