"""Campaign reports for machines and people: JUnit XML (CI systems) and Markdown."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from doctor.report.markdown import md_code, md_escape
from faults.runner import CampaignResult


def junit_xml(result: CampaignResult) -> str:
    """One ``testsuite``; one ``testcase`` per cell, a ``failure`` when it did not behave."""
    suite = ET.Element("testsuite", name=f"hicache-campaign.{result.name}",
                       tests=str(len(result.cells)), failures=str(result.failed), errors="0",
                       time=f"{result.wall_s:.2f}", timestamp=result.started_at)
    for cell in result.cells:
        case = ET.SubElement(suite, "testcase", classname=f"campaign.{result.name}",
                             name=cell.id, time=f"{cell.wall_s:.2f}")
        if not cell.passed:
            failure = ET.SubElement(case, "failure", message=cell.detail, type=cell.observed)
            failure.text = "\n".join(x for x in (
                f"expected: {cell.expect}", f"observed: {cell.observed}",
                f"outcome: {cell.outcome}", f"error: {cell.error}" if cell.error else "",
                f"bundle: {cell.bundle}" if cell.bundle else "") if x)
        out = ET.SubElement(case, "system-out")
        out.text = cell.detail + (f"\nbundle: {cell.bundle}" if cell.bundle else "")
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)


def markdown(result: CampaignResult) -> str:
    """The campaign as a Markdown page. Cell ids, expectations, errors and paths come from the
    spec and the runs, so every one is escaped: ``a|b`` (an expectation of either signature)
    must not split a table cell, nor a newline end the row."""
    lines = [f"# Campaign {md_code(result.name)}", "",
             f"{result.passed} of {len(result.cells)} cells behaved as expected "
             f"({result.failed} did not), {result.wall_s:.0f} s, started "
             f"{md_escape(result.started_at)}.",
             "", "| cell | expected | observed | outcome | wall s | bundle |",
             "|---|---|---|---|---|---|"]
    for c in result.cells:
        mark = "pass" if c.passed else "**FAIL**"
        obs = c.observed + (f" ({c.confidence:.2f})" if c.confidence is not None else "")
        bundle = md_code(c.bundle, table=True) if c.bundle else ""
        lines.append(f"| {md_code(c.id, table=True)} | {md_escape(c.expect)} | "
                     f"{md_escape(obs)} {mark} | {md_escape(c.outcome)} | {c.wall_s:.1f} | "
                     f"{bundle} |")
    failures = [c for c in result.cells if not c.passed]
    if failures:
        lines += ["", "## Cells that did not behave", ""]
        for c in failures:
            lines.append(f"- {md_code(c.id)}: {md_escape(c.detail)}"
                         + (f" — {md_escape(c.error)}" if c.error else ""))
    return "\n".join(lines) + "\n"
