"""Mechanisms read through the upstream index: which component failed, and how.

Every piece of evidence that can name a component is read here:

* a failure or warning line matched to the upstream template that printed it (the template's
  file is the component, its text the kind of failure); a line no template fits but whose
  logger named a source file counts by that file (code, not text);
* an exception: its message matched to a template, and the component of the code that raised it
  (the innermost frame a component owns); a traceback cut before its exception line says only
  where something failed (``unknown``, partial);
* a thread that died of a fatal signal: the component on its stack crashed.

Two components serve more than one master. A transfer engine (Mooncake's, NIXL's) moves KV for
a storage tier and for prefill/decode disaggregation alike: its failures are the store's when
the input shows a store and no disaggregation, the disaggregation's when it shows that, and
nobody's otherwise. A distributed file system (3FS) serves training data as well as a KV cache:
its failures count only when the input shows a KV cache in use.

When the input states the release it runs (``sglang==0.5.5``), a template absent from that
release weakens its reading.
"""

from __future__ import annotations

import re
from dataclasses import replace

from doctor.model.builder import Evidence
from doctor.model.evidence import ExceptionRecord, FailureLine, Frame, RankEvidence
from doctor.model.frames import checks_configuration
from doctor.ranks.table import is_comm_error
from signatures.index import UpstreamIndex
from signatures.index.components import Component
from signatures.index.failures import (
    FailureKind,
    classify,
    exception_named,
    interpreter_message,
    names_host_pool,
)
from signatures.index.model import Level, Template
from signatures.matching import EvidenceKind, MechanismHit, Witness

#: How much a reading weakens when the release the input states lacks the template.
ABSENT_FROM_RELEASE = 0.6
#: The raising frame reads at full strength; each caller further out a step less.
FRAME_STEP = 0.15
MAX_FRAMES_READ = 3
MAX_FATAL_FRAMES = 8
"""A crashed thread's innermost frames are often native ones no component owns."""
TRUNCATED_STRENGTH = 0.6
SITE_STRENGTH = 0.6
UNNAMED_STORE_STRENGTH = 0.8
"""A transfer engine's failure read as a store's when the input shows a KV store at work
whose system it does not name, and no disaggregation: likely, not certain."""
RAISED_COUNT = 3
"""A failure that raised ended the run: it stands for every retry it would have had, so it
meets a mechanism's ``min_count``."""
_KNOWN_TYPES = ("AssertionError", "RuntimeError", "ValueError", "KeyError", "IndexError",
                "TypeError", "AttributeError", "MemoryError", "TimeoutError", "ConnectionError")
MIN_MESSAGE = 8
#: What shows a KV cache in use (for components that also serve others).
_KV_WORDS = re.compile(r"(?i)hicache|lmcache|kv[ _-]?cache|mooncake|prefix cach|kv_offload|"
                       r"sglang|vllm")
_KV_ROLES = {"storage", "controller", "host-pool", "tree", "pool"}
#: The interpreter names the module an import could not find: that module's component failed
#: to load (a storage client library missing, or a release that moved it).
_NAMED_MODULE = re.compile(r"No module named '([\w.]{2,200})'|cannot import name '\w+' from "
                           r"'([\w.]{2,200})'")
NAMED_MODULE_STRENGTH = 1.0
#: An interpreter message about an attribute or the arguments of a call blames the caller: the
#: code that reached into another component wrongly, not the component it reached into.
_API_MISUSE = ("AttributeError", "TypeError", "NameError")


def resolve_lines(ev: Evidence, index: UpstreamIndex) -> None:
    """Match every rank's scanned failure lines to the upstream template that printed them;
    a line no template fits stays when its logger named a source file (by that file)."""

    def match(fl: FailureLine) -> FailureLine | None:
        matches = index.match(fl.text, limit=8)
        if fl.site and matches:
            # the logger named its source file: of equal readings, the template built there;
            # a reading from another file only when it explains the line from its start (a
            # logged exception's message is built elsewhere), never one that fits a phrase
            # in the middle of a line that file did not print
            base = fl.site.rsplit("/", 1)[-1]
            matches.sort(key=lambda m: not m.template.file.endswith("/" + base))
            if not matches[0].template.file.endswith("/" + base):
                matches = [m for m in matches if m.anchored]
        if matches:
            return replace(fl, template=matches[0].template.id,
                           similarity=matches[0].similarity)
        return fl if fl.site else None

    for r in ev.all_ranks():
        r.resolve_failure_lines(match)


def mechanisms(ev: Evidence, index: UpstreamIndex) -> list[MechanismHit]:
    """Every mechanism the evidence shows, with its witness (see the module docstring)."""
    raw: list[MechanismHit] = []
    for r in ev.all_ranks():
        raw += _lines(r, ev, index)
        for e in r.exceptions:
            raw += _exception(r, e, ev, index)
        for t in r.threads:
            if t.fatal:
                hit = _frames_hit(t.frames, index, FailureKind.CRASH, Witness(
                    f"rank {r.rank}: Fatal Python error: {t.fatal} on a stack in "
                    "{component} code", t.source.file, t.source.line, r.rank), False,
                    depth=MAX_FATAL_FRAMES)
                raw += [hit] if hit else []
    return _in_context(raw, ev, index)


#: Which system a store the input names belongs to (``KvContext.store`` holds those names).
_STORE_SYSTEMS = (("mooncake", "mooncake"), ("client_service", "mooncake"),
                  ("real_client", "mooncake"), ("master_", "mooncake"), ("nixl", "nixl"),
                  ("lmcache", "lmcache"), ("hf3fs", "hf3fs"), ("3fs", "hf3fs"),
                  ("infini", "other"), ("kvbm", "other"))


def _system(component: str) -> str:
    """``mooncake`` of ``transfer.mooncake`` or ``storage.mooncake``."""
    return component.rpartition(".")[2]


def _in_context(raw: list[MechanismHit], ev: Evidence,
                index: UpstreamIndex) -> list[MechanismHit]:
    """Resolve shared components: a transfer engine works for a store of its own system when
    the input shows one (Mooncake's engine under Mooncake Store, NIXL's under a NIXL storage
    plug-in), for disaggregation when the input shows that, for the KV store the input shows
    at work when it names no system and nothing shows disaggregation (vLLM-Ascend's KV pool
    "Storing KV cache for 1 out of 1 blocks" beside Mooncake's tcp_transport errors; weaker,
    ``UNNAMED_STORE_STRENGTH``), and for nobody known otherwise; a file system's failures are
    a KV cache's only when the input shows a KV cache in use: a store's own failure, a store
    the lines name, or a logger of a KV store's own module at work on any line (AIBrix's
    ``vineyard_llm_cache.py`` logging its set-up before Vineyard's client fails to connect)."""
    pd = ev.kv.pd or any(h.role == "pd" for h in raw)
    own = [h for h in raw if not h.context]
    stores = {_system(h.component) for h in own if h.role == "storage"}
    for site in sorted(ev.kv.sites):
        comp = index.component(site)
        if comp is not None and comp.role == "storage" and not comp.context:
            stores.add(_system(comp.id))
    for name in ev.kv.store:
        low = name.lower()
        stores |= {system for key, system in _STORE_SYSTEMS if key in low}
    kv_in_use = bool(stores) or any(h.role in _KV_ROLES for h in own) \
        or any(_KV_WORDS.search(s) for s in ev.kv.store)
    out = []
    for h in raw:
        if h.context == "kv-cache" and not kv_in_use:
            continue
        if h.role == "transfer":
            if _system(h.component) in stores:
                h = replace(h, role="storage")
            elif pd:
                h = replace(h, role="pd")
            elif ev.kv.store and not stores:
                h = replace(h, role="storage",
                            strength=round(h.strength * UNNAMED_STORE_STRENGTH, 3),
                            witness=replace(h.witness, text=h.witness.text
                                            + " — under the KV store the input shows at work"))
            else:
                continue
        out.append(h)
    return out


def _release_factor(t: Template, ev: Evidence, index: UpstreamIndex) -> tuple[float, str]:
    """1.0, or ``ABSENT_FROM_RELEASE`` with a note when the input states a release of the
    template's system that the index holds and the template is not in it."""
    stated = ev.versions.get(t.system)
    if stated is None:
        return 1.0, ""
    version = stated[0].lstrip("v")
    known = {v.lstrip("v") for v in index.versions(t.system)}
    if version in known and version not in {v.lstrip("v") for v in t.versions}:
        return ABSENT_FROM_RELEASE, f"; not in {t.system} {version}, the release the input states"
    return 1.0, ""


def _named_module_hit(text: str, index: UpstreamIndex, witness: Witness,
                      count: int) -> MechanismHit | None:
    """An import failure, read by the module it names (``No module named 'lmcache.v1'``)."""
    m = _NAMED_MODULE.search(text)
    if m is None:
        return None
    path = (m[1] or m[2]).replace(".", "/")
    comp = index.component(f"?:{path}/") or index.component(f"?:{path}.py")
    if comp is None:
        return None
    return MechanismHit(comp.role, comp.id, FailureKind.CONFIG.value, NAMED_MODULE_STRENGTH,
                        EvidenceKind.TEXT, replace(witness, text=witness.text
                                                   + f" — the module of {comp.id}"), count,
                        context=comp.context)


def _line_kind(t: Template, text: str) -> FailureKind | None:
    """What a line matched to ``t`` states: the template's kind, or the line's own when the
    template says less (its wildcards held an ``AssertionError()``, say)."""
    kind = classify(t.text, t.level, t.exception)
    if kind in (None, FailureKind.IO):
        own = classify(text, None, exception_named(text))
        if own is not None and own is not FailureKind.IO:
            return own
        if kind is None and own is FailureKind.IO and t.level is not Level.INFO:
            return own
    return kind


def _role(role: str, kind: FailureKind, text: str) -> str:
    """A component's role, but a capacity failure whose message names a host-side pool is
    the host pool's; a storage tier's too when it names the host's own memory (LMCache's
    local CPU tier under pressure), not the tier's (a Mooncake DRAM segment is the store)."""
    if kind is FailureKind.CAPACITY and role != "host-pool" \
            and names_host_pool(text, own_memory_only=role == "storage"):
        return "host-pool"
    return role


def _template_hit(t: Template, sim: float, text: str, src_file: str, src_line: int | None,
                  rank: int, count: int, ev: Evidence, index: UpstreamIndex,
                  kind: FailureKind | None = None) -> MechanismHit | None:
    comp = index.template_component(t)
    kind = kind or _line_kind(t, text)
    if comp is None or kind is None:
        return None
    factor, note = _release_factor(t, ev, index)
    who = f"rank {rank}: " if rank >= 0 else ""
    # the role reads the template as well as the line: a line may be the message's opening
    # sentence only, and the host memory it is about is named in the next
    role = _role(comp.role, kind, f"{text} {t.text}")
    return MechanismHit(role, comp.id, kind.value, round(sim * factor, 3),
                        EvidenceKind.TEXT, Witness(
                            f"{who}{text[:200]} — printed by {t.where()}, {comp.id}{note}",
                            src_file, src_line, rank), count, context=comp.context)


def _lines(r: RankEvidence, ev: Evidence, index: UpstreamIndex) -> list[MechanismHit]:
    out = []
    who = f"rank {r.rank}: " if r.rank >= 0 else ""
    for fl in r.failure_lines.values():
        named = _named_module_hit(fl.text, index, Witness(
            f"{who}{fl.text[:200]}", fl.source.file, fl.source.line, r.rank), fl.count)
        if named is not None:
            out.append(named)
            continue
        if fl.template >= 0:
            t = index.templates[fl.template]
            hit = _template_hit(t, fl.similarity, fl.text, fl.source.file, fl.source.line,
                                r.rank, fl.count, ev, index)
            if hit is not None:
                out.append(hit)
            continue
        comp = index.component(fl.site)
        level = Level.ERROR if fl.level == "error" else Level.WARNING if fl.level else None
        kind = classify(fl.text, level)
        if comp is None or kind is None:
            continue
        out.append(MechanismHit(comp.role, comp.id, kind.value, SITE_STRENGTH, EvidenceKind.CODE,
                                Witness(f"{who}{fl.text[:200]} — logged from {fl.site}, "
                                        f"{comp.id}", fl.source.file, fl.source.line, r.rank),
                                fl.count, partial=True, context=comp.context))
    return out


def _type(e: ExceptionRecord) -> str:
    """The exception's short type, completed when a paste cut it mid-word (``Asserti``)."""
    short = e.short_type
    if len(short) >= 5 and short not in _KNOWN_TYPES:
        for known in _KNOWN_TYPES:
            if known.startswith(short):
                return known
    return short


def _exception_kind(e: ExceptionRecord, t: Template | None) -> FailureKind | None:
    """The failure an exception states: its type first when the type says it, then the
    message (through its template when one matched). An assertion that fails while the
    process is still starting, or in a function that works out a configuration (a stack cut
    above it hides the phase), checks a configuration, not state built at run time."""
    short = _type(e)
    kind = classify(e.message, None, short)
    if t is not None:
        tk = classify(t.text, t.level, t.exception)
        if tk is not None and not (kind in (FailureKind.INDEX, FailureKind.SHAPE,
                                            FailureKind.CAPACITY) and tk != kind):
            kind = tk
    if kind in (FailureKind.INVARIANT, FailureKind.INDEX) and checks_configuration(e.frames):
        return FailureKind.CONFIG
    return kind


def _exception(r: RankEvidence, e: ExceptionRecord, ev: Evidence,
               index: UpstreamIndex) -> list[MechanismHit]:
    who = f"rank {r.rank}: " if r.rank >= 0 else ""
    if e.truncated:
        hit = _frames_hit(e.frames, index, FailureKind.UNKNOWN, Witness(
            f"{who}a traceback cut before its exception line, in {{component}} code",
            e.source.file, e.source.line, r.rank), True)
        return [replace(hit, strength=round(hit.strength * TRUNCATED_STRENGTH, 3))] if hit \
            else []
    out: list[MechanismHit] = []
    named = _named_module_hit(e.message, index, Witness(
        f"{who}{e.text[:200]}", e.source.file, e.source.line, r.rank), RAISED_COUNT)
    if named is not None:
        return [named]
    text = e.message.strip()
    if not text and e.frames and e.frames[0].code.lstrip().startswith("assert "):
        text = e.frames[0].code.strip()  # a bare assert: its condition is on the frame
    t: Template | None = None
    if len(text) >= MIN_MESSAGE:
        matches = index.match(text[:1000])
        if matches:
            # of equal readings, the one that raises what was raised (the same message is an
            # assert in one place and a raise in another)
            m = next((x for x in matches if x.similarity >= matches[0].similarity
                      and _raises(x.template, e)), matches[0])
            t = m.template
            sim = m.similarity
            if t.exception and not _raises(t, e):
                sim *= 0.85  # another exception type than upstream raises there
            hit = _template_hit(t, sim, e.text, e.source.file, e.source.line, r.rank,
                                RAISED_COUNT, ev, index, _exception_kind(e, t))
            if hit is not None:
                out.append(hit)
    kind = _exception_kind(e, t)
    if kind is not None and not is_comm_error(e):
        misuse = _type(e) in _API_MISUSE and interpreter_message(e.message)
        hit = _frames_hit(e.frames, index, kind, Witness(
            f"{who}{e.text[:200]} raised in {{component}} code", e.source.file, e.source.line,
            r.rank), False, skip_roles=("comm",) if misuse else ())
        if hit is not None:
            out.append(replace(hit, count=RAISED_COUNT,
                               role=_role(hit.role, kind, e.message)))
    return out


def _raises(t: Template, e: ExceptionRecord) -> bool:
    """Whether upstream's code at ``t`` raises the type ``e`` is."""
    return t.exception == e.short_type or (t.level is Level.ASSERT
                                           and e.short_type == "AssertionError")


def _frames_hit(frames: list[Frame], index: UpstreamIndex, kind: FailureKind,
                witness: Witness, partial: bool, depth: int = MAX_FRAMES_READ,
                skip_roles: tuple[str, ...] = ()) -> MechanismHit | None:
    """The component of the innermost frames (the code that raised or crashed); a caller
    further out reads weaker. Frames of ``skip_roles`` are passed over (the library a caller
    misused is not where the fault is)."""
    seen = 0
    for f in frames:
        if not f.file or f.file == "(cut off)":
            continue
        comp: Component | None = index.component(f.file)
        if comp is not None and comp.role in skip_roles:
            continue
        if comp is None:
            seen += 1
            if seen >= depth:
                return None
            continue
        strength = round(max(0.55, 1.0 - FRAME_STEP * min(seen, MAX_FRAMES_READ)), 3)
        where = f"{f.func} ({f.file.rsplit('/', 1)[-1]})"
        role = comp.role
        if role == "transfer":
            # a transfer engine called by a store (or by disaggregation) further out on the
            # same stack works for that caller
            callers = [index.component(g.file) for g in frames[frames.index(f) + 1:] if g.file]
            role = next((c.role for c in callers if c is not None
                         and c.role in ("storage", "pd")), role)
        return MechanismHit(role, comp.id, kind.value, strength, EvidenceKind.CODE,
                            replace(witness, text=witness.text.replace("{component}", comp.id)
                                    + f": {where}"), 1, partial=partial, context=comp.context)
    return None
