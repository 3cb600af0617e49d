"""``hicache doctor --markdown``: the diagnosis as a Markdown report (for tickets and wikis).

Drawn only from :class:`~doctor.report.model.Diagnosis`, like the rich report.
"""

from __future__ import annotations

from doctor.report.model import Diagnosis, EvidenceItem, Verdict


def cite(e: EvidenceItem) -> str:
    """``file:line`` of an evidence item (or just the file, or nothing)."""
    if e.file is None:
        return ""
    return f"{e.file}:{e.line}" if e.line is not None else e.file


def md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def diagnosis_markdown(d: Diagnosis) -> str:
    out = [f"# hicache doctor: {d.summary}", "",
           f"Status: **{d.status}** (exit {d.exit_code}); catalog {d.catalog_version}; "
           f"report schema {d.schema_version}.", ""]
    for i, v in enumerate(d.verdicts):
        out += _verdict(v, primary=i == 0)
    for look in d.lookalikes:
        out += [f"## Looks like: {look.title} ({look.score:.2f})", "", look.meaning, "",
                f"What to do: {look.advice}", ""]
        out += [f"- {cite(e) or '-'}: {md_escape(e.text)}" for e in look.evidence] + [""]
    if d.near_misses:
        out += ["## Near misses" if d.verdicts else
                "## Closest candidates (not enough evidence to name one)", ""]
        out += [f"- similar to `{n.signature}`, {n.score:.2f}, because {n.because}"
                for n in d.near_misses]
        out.append("")
    if d.fingerprint is not None:
        fp = d.fingerprint
        out += ["## Fingerprint", "", f"`{fp.id}` — the same id groups the same failure across "
                "ranks, runs, paths and line numbers.", ""]
        if fp.exception:
            out.append(f"- exception: `{md_escape(fp.exception)}`")
        if fp.functions:
            out.append(f"- functions: {', '.join(f'`{f}`' for f in fp.functions)}")
        out += [f"- blocked: {md_escape(b)}" for b in fp.blocked]
        out.append("")
    if d.observations:
        out += ["## What the doctor sees", ""] + [f"- {o}" for o in d.observations] + [""]
    out += _ranks(d)
    if d.first_divergence is not None:
        fd = d.first_divergence
        out += ["## First divergent decision", "",
                f"`{fd.label}` occurrence #{fd.index}, ranks {fd.ranks}:", ""]
        out += [f"- rank {r} (step {fd.steps.get(r)}): `{v}`" for r, v in sorted(fd.values.items())]
        out.append("")
    if d.collectives:
        out += ["## Collectives", ""] + [f"- group {c.group} seq {c.seq} **{c.kind}**: "
                                         f"{c.detail}" for c in d.collectives] + [""]
    if d.missing:
        out += ["## Missing evidence", ""]
        out += [f"- {m.what}: `{m.command}`" for m in d.missing] + [""]
    if d.problems:
        out += ["## Input problems", ""] + [f"- {p}" for p in d.problems] + [""]
    bad = [i for i in d.inputs if i.status != "read"]
    out += ["## Inputs", "", f"{len(d.inputs)} input(s), {len(bad)} not readable.", ""]
    out += [f"- `{i.path}` ({i.kind}): {i.status} {i.message}" for i in bad[:50]]
    return "\n".join(out).rstrip() + "\n"


def _verdict(v: Verdict, primary: bool) -> list[str]:
    head = "## Verdict" if primary else "## Also matches"
    out = [head, "", f"**{v.signature}** — {v.title}", "",
           f"- confidence: {v.confidence:.2f}", f"- severity: {v.severity}",
           f"- runbook: `{v.runbook}`"]
    if v.campaign_cell:
        out.append(f"- reproduced by campaign cell `{v.campaign_cell}`")
    out += ["", "### Evidence", "", "| where | rank | evidence | rule |", "|---|---|---|---|"]
    out += [f"| {md_escape(cite(e)) or '-'} | {e.rank if e.rank is not None else '-'} | "
            f"{md_escape(e.text)} | {md_escape(e.rule)} |" for e in v.evidence]
    out += ["", "### Root cause", "", v.root_cause, "", "### Upstream fix", ""]
    out += [f"- {f}" for f in v.upstream_fix]
    out += ["", "### Mitigations", ""]
    for m in v.mitigations:
        extra = " ".join(f"`{x}`" for x in (*m.flags, *m.env))
        out.append(f"- {m.text}" + (f" {extra}" if extra else ""))
    return [*out, ""]


def _ranks(d: Diagnosis) -> list[str]:
    if not d.ranks:
        return []
    out = ["## Ranks", "", "| rank | role | state | frame | call site | error | last seq |",
           "|---|---|---|---|---|---|---|"]
    for r in d.ranks:
        seq = "; ".join(f"{k}: {v}" for k, v in r.last_seq.items())
        out.append(f"| {r.rank} | {r.role} | {r.state} | {md_escape(r.frame or '')} | "
                   f"{md_escape(r.site or '')} | {md_escape(r.error or '')} | {md_escape(seq)} |")
    if d.missing_ranks:
        out += ["", f"Missing ranks: {d.missing_ranks}."]
    return [*out, ""]
