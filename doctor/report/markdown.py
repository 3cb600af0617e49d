"""``hicache doctor --markdown``: the diagnosis as a Markdown report (for tickets and wikis).

Drawn only from :class:`~doctor.report.model.Diagnosis`, like the rich report. Text that comes
from the artifacts (evidence, frames, errors, paths, rank roles) is data: it goes through
:func:`md_escape` or :func:`md_code`, so it can neither break a table or list nor become a
link, an image, emphasis or HTML. Catalog text (root causes, fixes) is the project's own
Markdown and is kept as written.
"""

from __future__ import annotations

import re

from doctor.model.evidence import InputStatus
from doctor.model.findings import EvidenceItem
from doctor.report.model import Diagnosis, Verdict

#: Characters with a meaning in (GitHub-flavoured) Markdown inline text or tables.
_SPECIAL = re.compile(r"([\\`*_\[\]<>|~#!&])")
#: Every line boundary ``str.splitlines`` knows (FS, GS and RS included), and tabs, plus the
#: other C0/C1 controls, which no report text should carry: all become one space.
_BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def cite(e: EvidenceItem) -> str:
    """``file:line`` of an evidence item (or just the file, or nothing)."""
    if e.file is None:
        return ""
    return f"{e.file}:{e.line}" if e.line is not None else e.file


def md_escape(text: str) -> str:
    """``text`` as inert inline Markdown, safe in a table cell: one line, every character
    with a Markdown meaning backslash-escaped (pipes too, which would end the cell)."""
    return _SPECIAL.sub(r"\\\1", _BREAKS.sub(" ", text))


def md_code(text: str, table: bool = False) -> str:
    """``text`` as one inline code span (shown verbatim, no links or HTML): one line, fenced
    with more backticks than it contains. In a table cell pipes are escaped as GFM asks (the
    renderer removes the backslash, even inside code)."""
    text = _BREAKS.sub(" ", text)
    if table:
        text = text.replace("|", "\\|")
    run = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (run + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def diagnosis_markdown(d: Diagnosis) -> str:
    e_ = md_escape
    out = [f"# hicache doctor: {e_(d.summary)}", "",
           f"Status: **{e_(d.status)}** (exit {d.exit_code}); catalog "
           f"{e_(d.catalog_version)}; report schema {e_(d.schema_version)}.", ""]
    for i, v in enumerate(d.verdicts):
        out += _verdict(v, primary=i == 0)
    for look in d.lookalikes:
        out += [f"## Looks like: {e_(look.title)} ({look.score:.2f})", "", look.meaning, "",
                f"What to do: {look.advice}", ""]
        out += [f"- {_where(e)}: {e_(e.text)}" for e in look.evidence] + [""]
    if d.near_misses:
        out += ["## Near misses" if d.verdicts else
                "## Closest candidates (not enough evidence to name one)", ""]
        out += [f"- similar to {md_code(n.signature)}, {n.score:.2f}, because {e_(n.because)}"
                for n in d.near_misses]
        out.append("")
    if d.fingerprint is not None:
        fp = d.fingerprint
        out += ["## Fingerprint", "", f"{md_code(fp.id)} — the same id groups the same failure "
                "across ranks, runs, paths and line numbers.", ""]
        if fp.exception:
            out.append(f"- exception: {md_code(fp.exception)}")
        if fp.functions:
            out.append(f"- functions: {', '.join(md_code(f) for f in fp.functions)}")
        out += [f"- blocked: {e_(b)}" for b in fp.blocked]
        out.append("")
    if d.observations:
        out += ["## What the doctor sees", ""] + [f"- {e_(o)}" for o in d.observations] + [""]
    out += _ranks(d)
    if d.first_divergence is not None:
        fd = d.first_divergence
        out += ["## First divergent decision", "",
                f"{md_code(fd.label)} occurrence #{fd.index}, ranks {fd.ranks}:", ""]
        out += [f"- rank {r} (step {fd.steps.get(r)}): {md_code(str(v))}"
                for r, v in sorted(fd.values.items())]
        out.append("")
    if d.collectives:
        out += ["## Collectives", ""] + [f"- group {e_(str(c.group))} seq {c.seq} "
                                         f"**{e_(c.kind)}**: {e_(c.detail)}"
                                         for c in d.collectives] + [""]
    if d.missing:
        out += ["## Missing evidence", ""]
        out += [f"- {e_(m.what)}: {md_code(m.command)}" for m in d.missing] + [""]
    if d.problems:
        out += ["## Input problems", ""] + [f"- {e_(p)}" for p in d.problems] + [""]
    bad = [i for i in d.inputs if i.status != InputStatus.READ]
    out += ["## Inputs", "", f"{len(d.inputs)} input(s), {len(bad)} not readable.", ""]
    out += [f"- {md_code(i.path)} ({e_(i.kind)}): {e_(i.status)} {e_(i.message)}"
            for i in bad[:50]]
    return "\n".join(out).rstrip() + "\n"


def _where(e: EvidenceItem, table: bool = False) -> str:
    """Where an evidence item was found, as code (paths come from the artifacts), or ``-``."""
    where = cite(e)
    return md_code(where, table=table) if where else "-"


def _verdict(v: Verdict, primary: bool) -> list[str]:
    head = "## Verdict" if primary else "## Also matches"
    out = [head, "", f"**{md_escape(v.signature)}** — {v.title}", "",
           f"- confidence: {v.confidence:.2f}", f"- severity: {md_escape(v.severity)}",
           f"- runbook: {md_code(v.runbook)}"]
    if v.campaign_cell:
        out.append(f"- reproduced by campaign cell {md_code(v.campaign_cell)}")
    if v.release_note:
        out.append(f"- release: {md_escape(v.release_note)}")
    if v.tie_note:
        out.append(f"- tied: {md_escape(v.tie_note)}")
    out += ["", "### Evidence", "", "| where | rank | evidence | rule |", "|---|---|---|---|"]
    out += [f"| {_where(e, table=True)} | {e.rank if e.rank is not None else '-'} | "
            f"{md_escape(e.text)} | {md_escape(e.rule)} |" for e in v.evidence]
    out += ["", "### Root cause", "", v.root_cause, "", "### Upstream fix", ""]
    out += [f"- {f}" for f in v.upstream_fix]
    out += ["", "### Mitigations", ""]
    for m in v.mitigations:
        extra = " ".join(md_code(x) for x in (*m.flags, *m.env))
        out.append(f"- {m.text}" + (f" {extra}" if extra else ""))
    return [*out, ""]


def _ranks(d: Diagnosis) -> list[str]:
    if not d.ranks:
        return []
    e_ = md_escape
    out = ["## Ranks", "", "| rank | role | state | frame | call site | error | last seq |",
           "|---|---|---|---|---|---|---|"]
    for r in d.ranks:
        seq = "; ".join(f"{k}: {v}" for k, v in r.last_seq.items())
        out.append(f"| {r.rank} | {e_(r.role)} | {e_(r.state)} | {e_(r.frame or '')} | "
                   f"{e_(r.site or '')} | {e_(r.error or '')} | {e_(seq)} |")
    if d.missing_ranks:
        out += ["", f"Missing ranks: {d.missing_rank_ranges or d.missing_ranks}."]
    return [*out, ""]
