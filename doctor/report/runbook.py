"""Runbooks in Markdown (pages of them: :mod:`doctor.report.html`).

* ``signature_runbook(sig)``: the playbook of one catalog signature — overview, severity, how
  to confirm, diagnosis path from the error back to the cause, mitigation commands, upstream
  fix, the campaign cell that reproduces it and its fixed twin that verifies the fix,
  escalation;
* ``incident_runbook(diagnosis)``: the same for one incident, filled with that incident's
  verdict, evidence (file:line), rank table, missing evidence and collect commands.

A stored diagnosis (``--from diag.json``) is untrusted: it may have been crafted, and its
evidence is artifact text anyway. Everything taken from it is escaped Markdown or a code span
(:mod:`doctor.report.markdown`); the HTML pages escape all text again and make links only to
``http(s)://`` addresses and to sibling pages that exist, so no ``javascript:`` or ``data:``
URL, tag or attribute from a diagnosis reaches the HTML.
"""

from __future__ import annotations

from doctor.report.markdown import cite, md_code, md_escape
from doctor.report.model import Diagnosis
from hicache_runtime.contracts.profiles import PROFILES
from signatures.models import Catalog, Signature


def signature_runbook(sig: Signature) -> str:
    return "\n".join(_sections(sig)).rstrip() + "\n"


def catalog_index(catalog: Catalog) -> str:
    out = [f"# HiCache crash signature runbooks (catalog {catalog.version})", "",
           "| signature | severity | kind | title |", "|---|---|---|---|"]
    out += [f"| [{s.id}]({s.id}.md) | {s.severity.value} | {s.kind.value} | {md_escape(s.title)} |"
            for s in catalog.signatures]
    return "\n".join(out) + "\n"


def _sections(sig: Signature, level: int = 1) -> list[str]:
    h = "#" * level
    rec = sig.recognisers
    out = [f"{h} {sig.id}: {sig.title}", "", f"{h}# Overview", "", _para(sig.meaning), "",
           f"{h}# Severity", "", f"**{sig.severity.value}** ({sig.kind.value}): "
           + _severity_note(sig.severity.value), "", f"{h}# How to confirm", ""]
    out += [f"{i}. {c}" for i, c in enumerate(sig.runbook.confirm, 1)]
    out += ["", "Run the doctor on everything you have (logs, py-spy dumps, Flight Recorder "
            "dumps, crash bundles) and check that it names this signature:", "", "```bash",
            "hicache doctor logs/ dumps/ --markdown > diagnosis.md", "```", ""]
    if rec.stack_shape:
        out += [f"Stack shape: {_para(rec.stack_shape)}", ""]
    if rec.trace_evidence:
        out += [f"Trace evidence: {_para(rec.trace_evidence)}", ""]
    out += [f"{h}# Diagnosis path", ""]
    out += [f"{i}. {c}" for i, c in enumerate(sig.runbook.diagnosis_path, 1)]
    out += ["", f"Root cause: {_para(sig.root_cause)}", "", f"{h}# Mitigation", ""]
    for m in sig.mitigations:
        out.append(f"- {m.text}")
        cmds = [*m.flags, *(f"export {e}" if "=" in e else e for e in m.env)]
        if cmds:
            out += ["", "  ```bash", *(f"  {c}" for c in cmds), "  ```"]
    out += ["", f"{h}# Upstream fix", ""] + [f"- {f.ref}: {f.summary}" for f in sig.upstream_fix]
    out += _releases(sig, h)
    out += ["", f"{h}# Verify with a campaign cell", "", *_campaign(sig)]
    out += ["", f"{h}# Escalation", "", _para(sig.runbook.escalation), ""]
    if sig.related:
        out += [f"Related: {', '.join(f'[{r}]({r}.md)' for r in sig.related)}", ""]
    return out


def _releases(sig: Signature, h: str) -> list[str]:
    """Which releases the release matrix saw it on (``catalog/affected.yaml``), and the first
    release on which its fault no longer exposes it."""
    a = sig.affected
    if a is None:
        return []
    releases = [n for n, p in PROFILES.items() if p.release is not None]
    seen = ", ".join(f"`{p}`" for p in a.reproduces) or "none of them"
    out = ["", f"{h}# Releases", "",
           f"The release matrix (`{a.command}`, {a.run_at}) reproduced it on {seen}, of "
           f"{', '.join(f'`{p}`' for p in a.profiles)}."]
    if a.row is not None:
        out[-1] += (f" Its fault (`{a.row}`) ran clean on "
                    f"{', '.join(f'`{p}`' for p in a.clean) or 'none of them'}.")
    first = a.no_longer_from([r for r in releases if r in a.profiles])
    if first is not None:
        out[-1] += f" It no longer reproduces from `{first}` on."
    out[-1] += (" A profile is this runtime's rendering of a release's protocols "
                "(`hicache profiles show`), not a run of the release.")
    return out


def _campaign(sig: Signature) -> list[str]:
    if sig.campaign is None:
        return ["No campaign cell reproduces this signature yet; reproduce it from the incident's "
                "evidence and add one."]
    fixed = sig.campaign.fixed_twin
    out = [f"Campaign cell `{sig.campaign.cell}` of the built-in campaign reproduces it "
           f"(expects `{sig.campaign.expect}`); its twin `{fixed}` verifies the fix (expects "
           "`healthy`). A cell passes only when the doctor names the expected signature for "
           "the bundle the run leaves.",
           "", "```bash", f"# reproduce: {sig.campaign.cell}", sig.campaign.run_command(),
           f"# verify the fix: {fixed}", sig.campaign.run_command(fixed=True), "```"]
    for switch, why in sig.campaign.not_a_release.items():
        out += ["", f"Not evidence about a release: `{switch}` is {why.rstrip('.')}. The "
                    "cell reproduces the hazard; which releases it reaches is `hicache "
                    "profiles show`'s question."]
    if sig.campaign.note:
        out += ["", sig.campaign.note]
    return out


def _severity_note(severity: str) -> str:
    return {"critical": "the server dies or hangs; page the on-call now.",
            "high": "wrong output or a failure within hours; fix today.",
            "medium": "degraded service; schedule the fix.",
            "low": "informational."}.get(severity, "")


def _para(text: str) -> str:
    return " ".join(text.split())


def incident_runbook(d: Diagnosis, catalog: Catalog) -> str:
    """The runbook of one incident from a stored diagnosis (``hicache doctor --json``)."""
    e_ = md_escape
    out = [f"# Incident runbook: {e_(d.summary)}", "", f"Diagnosis status **{e_(d.status)}**, "
           f"catalog {e_(d.catalog_version)}.", ""]
    out += _incident_evidence(d)
    if not d.verdicts:
        out += ["## No known signature", "", "The doctor named no signature. What it sees:", ""]
        out += [f"- {e_(o)}" for o in d.observations] or ["- nothing specific"]
        if d.near_misses:
            out += ["", "Closest signatures (not named: too little evidence):", ""]
            out += [f"- similar to {md_code(n.signature)} ({n.score:.2f}): {e_(n.because)}"
                    for n in d.near_misses]
        return "\n".join(out).rstrip() + "\n"
    try:
        sig = catalog.get(d.verdicts[0].signature)
    except KeyError:
        return "\n".join([*out, f"Signature {md_code(d.verdicts[0].signature)} is not in "
                                 f"catalog {catalog.version}."]) + "\n"
    out += ["## Playbook", "", *_sections(sig, level=2)[2:]]
    return "\n".join(out).rstrip() + "\n"


def _incident_evidence(d: Diagnosis) -> list[str]:
    e_ = md_escape
    out: list[str] = []
    if d.verdicts:
        v = d.verdicts[0]
        out += [f"## Verdict: {e_(v.signature)} (confidence {v.confidence:.2f})", "",
                e_(v.title), "", "### Evidence in this incident", ""]
        out += [f"- {md_code(cite(e))}: {e_(e.text)}" if cite(e) else f"- {e_(e.text)}"
                for e in v.evidence]
        out.append("")
    if d.ranks:
        out += ["### Ranks", ""] + [f"- rank {r.rank} ({e_(r.role)}): {e_(r.state)}"
                                    + (f" at {md_code(r.frame)}" if r.frame else "")
                                    + (f", {e_(r.error)}" if r.error else "") for r in d.ranks]
        out.append("")
    if d.first_divergence is not None:
        fd = d.first_divergence
        steps = ", ".join(f"rank {r} at step {s}" for r, s in sorted(fd.steps.items()))
        out += ["### First divergent decision", "",
                f"{md_code(fd.label)}, occurrence #{fd.index} ({steps}): "
                + ", ".join(f"rank {r}: {md_code(str(v))}" for r, v in sorted(fd.values.items()))
                + ".", "",
                "The earliest decision on which ranks that must agree did not; later "
                "differences (and the failure itself) are usually its consequences."]
        out += [f"- {md_code(cite(e))}" for e in fd.evidence if cite(e)] + [""]
    if d.missing:
        out += ["### Collect what is missing", ""] + [f"- {e_(m.what)}: {md_code(m.command)}"
                                                      for m in d.missing] + [""]
    return out
