"""A stable fingerprint of a failure, so recurring unknown crashes group together.

The fingerprint is the hash of what the failure *is*, with everything that differs between
occurrences taken out:

* the failing exception as ``Type: message`` with numbers, addresses, ids, quoted paths and
  request ids replaced by placeholders (``shape '[N, -1, N]' is invalid for input of size N``);
* the innermost in-app functions of its stack (names only: no files, no line numbers);
* for hangs, the collective and the calling function each blocked group waits in;
* without an exception, the first lines the loggers marked as errors, normalised alike, and
  the upstream messages (:mod:`signatures.index`) the failure lines were printed from;
* the log patterns, facts and look-alikes that fired (their ids).

Ranks never enter it, so the same failure on rank 3 of one run and rank 0 of another gives the
same fingerprint; neither do paths, line numbers, timestamps or pids.
"""

from __future__ import annotations

import hashlib
import re

from doctor.facts.factset import FactSet
from doctor.model.builder import Evidence
from doctor.model.evidence import ThreadState
from doctor.model.findings import BlockedSite
from doctor.model.frames import FrameClassifier
from doctor.ranks.table import failing_exception, is_comm_error
from doctor.report.model import Fingerprint
from signatures.fact_names import Fact
from signatures.index import load_index
from signatures.linear import linear

MAX_FUNCTIONS = 4
MAX_ERRORS = 3
_MARKER_KEY = re.compile(r"[+~-]\d+$")
_OUTCOME = {Fact.HANG, Fact.CRASH, Fact.WRONG_OUTPUT, Fact.NO_FAILURE}
#: RE2 (linear time): the path and the dashed-id patterns retried every start position in
#: ``re`` (3.4 s and 0.55 s on 8000 characters of one message).
_NORMALISE = [
    (linear(r"(?:/[\w.@+-]+)+/([\w.-]+)"), r"\1"),          # paths: keep the file name
    (linear(r"\b0x[0-9a-fA-F]+\b"), "X"),                   # addresses
    (linear(r"\b[0-9a-f]{8}(?:-?[0-9a-f]{4}){3}-?[0-9a-f]{12}\b"), "ID"),  # uuids
    (linear(r"\b[0-9a-fA-F]{16,}\b"), "ID"),                # hashes, request ids
    (linear(r"\b\w*\d\w*-\w*\d\w*(?:-\w+)*\b"), "ID"),      # chatcmpl-2c45..., host-3f2
    (linear(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?"), "N"),        # numbers
    (linear(r"\s+"), " "),
]


def normalise(text: str, limit: int = 160) -> str:
    """A message with what varies between occurrences replaced by placeholders."""
    for rx, repl in _NORMALISE:
        text = rx.sub(repl, text)
    return text.strip()[:limit]


def fingerprint(ev: Evidence, frames: FrameClassifier, sites: list[BlockedSite],
                facts: FactSet, lookalikes: list[str]) -> Fingerprint:
    excs = []
    funcs: list[str] = []
    for r in ev.all_ranks():
        exc = failing_exception(r, frames)
        if exc is None or (is_comm_error(exc) and sites):
            continue
        excs.append(f"{exc.type or '(cut off)'}: {normalise(exc.message)}")
        if not funcs:
            funcs = _innermost(exc.frames, frames)
    if not funcs:
        for r in ev.all_ranks():
            crashed = [t for t in r.threads if t.fatal]
            if crashed:
                funcs = _innermost(crashed[0].frames, frames)
                excs.append(f"Fatal: {crashed[0].fatal}")
                break
    if not funcs and not sites:  # a hang or a stall: where the busy threads are
        busy = [t for r in ev.all_ranks() for t in r.threads
                if frames.state(t) in (ThreadState.ACTIVE, ThreadState.CRASHED)]
        funcs = _innermost(busy[0].frames, frames) if busy else []
    errors = sorted({normalise(text, 100) for r in ev.all_ranks()
                     for text, _ in list(r.errors)[:MAX_ERRORS]})[:MAX_ERRORS]
    blocked = sorted({f"{s.op} from {s.site.split(' (')[0]} ({s.role})" for s in sites})
    # shared pattern ids only: marker keys are positions in the catalog, not names
    logs = sorted({pid for r in ev.all_ranks() for pid in r.hits
                   if pid != "memory-sample" and not _MARKER_KEY.search(pid)})
    fact_ids = sorted(f.value for f in facts if f not in _OUTCOME)
    exception = sorted(set(excs))[0] if excs else None
    upstream = _upstream(ev) if exception is None else []
    # the upstream texts the catalog's markers found (by what they say, not by their place in
    # the catalog): an INFO line such as "action=client_expired" still tells failures apart
    marked = sorted({normalise(h.text, 100) for r in ev.all_ranks()
                     for pid, stats in r.hits.items() if _MARKER_KEY.search(pid)
                     for h in list(stats.kept)[:1]})[:MAX_ERRORS] if exception is None else []
    basis = [f"exception {exception}" if exception else "", *[f"function {f}" for f in funcs],
             *[f"blocked {b}" for b in blocked], *[f"log {p}" for p in logs],
             *([] if exception else [f"error {e}" for e in errors]),
             *[f"upstream {u}" for u in upstream], *[f"marked {m}" for m in marked],
             *[f"site {x}" for x in (_sites(ev) if exception is None else [])],
             *[f"fact {f}" for f in fact_ids], *[f"look-alike {x}" for x in sorted(lookalikes)]]
    digest = hashlib.sha1("\n".join(b for b in basis if b).encode()).hexdigest()[:12]
    return Fingerprint(id=f"fp-{digest}", exception=exception, functions=funcs,
                       blocked=blocked, logs=logs, facts=fact_ids,
                       lookalikes=sorted(lookalikes), upstream=upstream)


MAX_UPSTREAM = 4


def _sites(ev: Evidence) -> list[str]:
    """The source files the warning lines name (file names only), at most ``MAX_UPSTREAM``:
    what tells apart inputs that hold no failure line the doctor could read."""
    return sorted({site.rsplit("/", 1)[-1] for r in ev.all_ranks() for site in r.sites})[
        :MAX_UPSTREAM]


def _upstream(ev: Evidence) -> list[str]:
    """The upstream templates of the failure lines (after :func:`resolve_lines`), the most
    printed first, at most ``MAX_UPSTREAM``."""
    seen: dict[int, int] = {}
    for r in ev.all_ranks():
        for fl in r.failure_lines.values():
            if fl.template >= 0:
                seen[fl.template] = seen.get(fl.template, 0) + fl.count
    if not seen:
        return []
    index = load_index()
    top = sorted(seen, key=lambda t: (-seen[t], t))[:MAX_UPSTREAM]
    return sorted(f"{t.system} {t.file} {t.function}: {t.text[:120]}"
                  for t in (index.templates[i] for i in top))


#: Frames that say nothing about *which* failure it is, wherever things are installed: the
#: standard library, torch's internals, the interpreter, native libraries.
_PLUMBING = re.compile(r"(^|/)lib/python3(\.\d+)?/(?!site-packages|dist-packages)|(^|/)torch/|"
                       r"\.so(\.\d+)*$|^<|^\(cut off\)$|^(threading|runpy|contextlib|"
                       r"functools|multiprocessing/\w+)\.py$")
# the blank before an address is taken from its first character only (a run of blanks was
# retried from every one of its positions)
_ADDRESS = re.compile(r"(?:^|(?<=\S))\s*(?:\[0x[0-9a-fA-F]+\]|\+\s*0x[0-9a-fA-F]+)")
_BARE_ADDRESS = re.compile(r"^\s*(?:0x)?[0-9a-fA-F]{8,}\s*$")  # a frame with no symbol


def _innermost(stack: list, frames: FrameClassifier) -> list[str]:
    """The innermost function names that are not plumbing (bare: ``Class.method`` becomes
    ``method``; native addresses dropped). Independent of where a library is installed: a
    source checkout and a site-packages install give the same list."""
    out: list[str] = []
    for f in stack:
        if _PLUMBING.search(f.file) or f.func.startswith("_Py") or _BARE_ADDRESS.match(f.func):
            continue
        name = _ADDRESS.sub("", f.func).rsplit(".", 1)[-1]
        if name not in out:
            out.append(name)
        if len(out) >= MAX_FUNCTIONS:
            break
    return out
