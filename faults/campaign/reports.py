"""Campaign reports for machines and people: JUnit XML (CI systems), Markdown, and HTML pages
(a matrix of the cells, an incident page with a timeline per cell that left a bundle).

A property campaign's reports carry its properties too: JUnit gets a second suite with one
test case per property (a failure lists the violating cells and their bundles), Markdown a
table per property.
"""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from doctor.report.markdown import md_code, md_escape
from faults.campaign.cells import CampaignResult, CellResult, PropertyResult


def junit_xml(result: CampaignResult) -> str:
    """One ``testsuite``; one ``testcase`` per cell, a ``failure`` when it did not behave. A
    property campaign: ``testsuites`` holding that suite and one of its properties."""
    suite = _cells_suite(result)
    if result.properties:
        props = _properties_suite(result)
        root = ET.Element("testsuites", name=f"hicache-campaign.{result.name}",
                          tests=str(len(result.cells) + len(result.properties)),
                          failures=str(result.failed + int(props.attrib["failures"])),
                          errors="0", time=f"{result.wall_s:.2f}")
        root.extend([suite, props])
        suite = root
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)


def _properties_suite(result: CampaignResult) -> ET.Element:
    bad = sum(not p.holds for p in result.properties)
    suite = ET.Element("testsuite", name=f"hicache-campaign.{result.name}.properties",
                       tests=str(len(result.properties)), failures=str(bad), errors="0",
                       time=f"{result.wall_s:.2f}", timestamp=result.started_at)
    for p in result.properties:
        case = ET.SubElement(suite, "testcase", classname=f"campaign.{result.name}.properties",
                             name=p.property, time="0")
        if not p.holds:
            failure = ET.SubElement(case, "failure", type="property-violated",
                                    message=f"{p.violations} of {p.checked} checked cells "
                                            f"violate {p.property}")
            failure.text = "\n".join(
                f"{v.cell}: {v.detail}" + (f" (bundle: {v.bundle})" if v.bundle else "")
                for v in p.violating)
        out = ET.SubElement(case, "system-out")
        out.text = _property_line(p)
    return suite


def _property_line(p: PropertyResult) -> str:
    return (f"{p.property}: {p.meaning}; {p.checked} cells checked, {p.violations} "
            f"violation(s), {len(p.unchecked)} unchecked")


def _cells_suite(result: CampaignResult) -> ET.Element:
    suite = ET.Element("testsuite", name=f"hicache-campaign.{result.name}",
                       tests=str(len(result.cells)), failures=str(result.failed), errors="0",
                       skipped=str(result.skipped), time=f"{result.wall_s:.2f}",
                       timestamp=result.started_at)
    for cell in result.cells:
        case = ET.SubElement(suite, "testcase", classname=f"campaign.{result.name}",
                             name=cell.id, time=f"{cell.wall_s:.2f}")
        if cell.skipped is not None:
            ET.SubElement(case, "skipped", message=cell.skipped)
        elif not cell.passed:
            failure = ET.SubElement(case, "failure", message=cell.detail, type=cell.observed)
            failure.text = "\n".join(x for x in (
                f"expected: {cell.expect}", f"observed: {cell.observed}",
                f"outcome: {cell.outcome}", f"error: {cell.error}" if cell.error else "",
                f"bundle: {cell.bundle}" if cell.bundle else "") if x)
        out = ET.SubElement(case, "system-out")
        weak = ", ".join(f"{k} ({v})" for k, v in cell.not_a_release.items())
        out.text = "\n".join(x for x in (
            cell.detail, cell.rerun_note, f"bundle: {cell.bundle}" if cell.bundle else "",
            f"not evidence about a release: {weak}" if weak else "") if x)
    return suite


def markdown(result: CampaignResult) -> str:
    """The campaign as a Markdown page. Cell ids, expectations, errors and paths come from the
    spec and the runs, so every one is escaped: ``a|b`` (an expectation of either signature)
    must not split a table cell, nor a newline end the row."""
    lines = [f"# Campaign {md_code(result.name)}", "",
             f"{result.passed} of {len(result.cells)} cells behaved as expected "
             f"({result.failed} did not{_skipped(result.skipped)}), {result.wall_s:.0f} s, "
             "started "
             f"{md_escape(result.started_at)}.",
             "", "| cell | expected | observed | outcome | wall s | bundle |",
             "|---|---|---|---|---|---|"]
    for c in result.cells:
        mark = "skipped" if c.skipped is not None else "pass" if c.passed else "**FAIL**"
        obs = c.observed + (f" ({c.confidence:.2f})" if c.confidence is not None else "")
        bundle = md_code(c.bundle, table=True) if c.bundle else ""
        lines.append(f"| {md_code(c.id, table=True)} | {md_escape(c.expect)} | "
                     f"{md_escape(obs)} {mark} | {md_escape(c.outcome)} | {c.wall_s:.1f} | "
                     f"{bundle} |")
    weak = [c for c in result.cells if c.not_a_release]
    if weak:
        lines += ["", "## Cells that are no evidence about a release", "",
                  "Their switches are grafted (a release's pre-fix piece on this runtime's fixed "
                  "protocols) or synthetic (a trigger or code path no release had): "
                  "`docs/legacy-switches.md`.", ""]
        lines += [f"- {md_code(c.id)}: " + ", ".join(f"{md_code(k)} {v}"
                                                     for k, v in c.not_a_release.items())
                  for c in weak]
    reran = [c for c in result.cells if c.rerun_note]
    if reran:
        lines += ["", "## Cells that ran again", ""]
        lines += [f"- {md_code(c.id)}: {md_escape(c.rerun_note or '')}" for c in reran]
    groups = result.failure_groups()
    if groups:
        lines += ["", "## Cells that did not behave", "",
                  "One line per way of failing (the doctor's fingerprint), its first cell "
                  "standing for the rest.", ""]
        for key, group in groups:
            c = group[0]
            more = (f" (and {len(group) - 1} more: "
                    + ", ".join(md_code(x.id) for x in group[1:6])
                    + (", ..." if len(group) > 6 else "") + f"; {md_code(key)})"
                    if len(group) > 1 else "")
            lines.append(f"- {md_code(c.id)}{more}: {md_escape(c.detail)}"
                         + (f" — {md_escape(c.error)}" if c.error else "")
                         + (f" — bundle {md_code(c.bundle)}" if c.bundle else ""))
    if result.properties:
        lines += _markdown_properties(result)
    return "\n".join(lines) + "\n"


def _skipped(n: int) -> str:
    return f", {n} skipped on this machine" if n else ""


def _markdown_properties(result: CampaignResult) -> list[str]:
    lines = ["", "## Properties", "", "| property | meaning | checked | violations | "
             "unchecked |", "|---|---|---|---|---|"]
    for p in result.properties:
        mark = "" if p.holds else " **VIOLATED**"
        lines.append(f"| {md_code(p.property, table=True)}{mark} | {md_escape(p.meaning)} | "
                     f"{p.checked} | {p.violations} | {len(p.unchecked)} |")
    for p in result.properties:
        if p.holds:
            continue
        lines += ["", f"### {md_code(p.property)}: {p.violations} violation(s)", "",
                  "| cell | faults | outcome | detail | bundle |", "|---|---|---|---|---|"]
        for v in p.violating:
            bundle = md_code(v.bundle, table=True) if v.bundle else ""
            lines.append(f"| {md_code(v.cell, table=True)} | "
                         f"{md_escape('; '.join(v.faults))} | {md_escape(v.outcome)} | "
                         f"{md_escape(v.detail)} | {bundle} |")
    return lines


def html_pages(result: CampaignResult) -> dict[str, str]:
    """The campaign as pages: ``index.html``, a matrix of its cells (rows: topology and fault;
    columns: the fixed protocol and each legacy switch; each cell its expectation, what it
    showed and pass or fail), and one incident page per cell that left a bundle (its verdict,
    the timeline of its ranks' runs, its evidence and playbook), linked from the matrix."""
    from doctor.diagnose import diagnose
    from doctor.report.html import incident_page, page
    from doctor.report.runbook import incident_runbook
    from signatures.loader import load_catalog

    catalog = load_catalog()
    pages: dict[str, str] = {}
    links: dict[str, str] = {}
    for c in result.cells:
        if c.bundle is None or not Path(c.bundle).is_dir():
            continue
        name = "cell-" + re.sub(r"[^A-Za-z0-9._-]+", "-", c.id).strip("-.")[:120] + ".html"
        d = diagnose([c.bundle])
        pages[name] = incident_page(d, incident_runbook(d, catalog), {"index.html"}).replace(
            "<body>\n", f'<body>\n<p><a href="index.html">campaign {html.escape(result.name)}'
                        f"</a> / cell <code>{html.escape(c.id)}</code></p>\n", 1)
        links[c.id] = name
    pages["index.html"] = page(f"Campaign {result.name}", _matrix(result, links))
    return pages


def _matrix(result: CampaignResult, links: dict[str, str]) -> str:
    e = html.escape
    rows: dict[str, dict[str, CellResult]] = {}
    modes: list[str] = []
    for c in result.cells:
        row, mode = c.row or c.id, c.column or "cell"
        rows.setdefault(row, {})[mode] = c
        if mode not in modes:
            modes.append(mode)
    modes.sort(key=lambda m: (m != "fixed", m))
    out = [f"<h1>Campaign {e(result.name)}</h1>",
           f"<p>{result.passed} of {len(result.cells)} cells behaved as expected "
           f"({result.failed} did not{_skipped(result.skipped)}), {result.wall_s:.0f} s, started "
           f"{e(result.started_at)}.</p>",
           '<table class="matrix"><thead><tr><th>topology and fault</th>'
           + "".join(f"<th>{e(m)}</th>" for m in modes) + "</tr></thead><tbody>"]
    for row, cells in rows.items():
        out.append(f"<tr><th>{e(row)}</th>")
        for m in modes:
            cell = cells.get(m)
            if cell is None:
                out.append("<td></td>")
                continue
            state = "skip" if cell.skipped is not None else "pass" if cell.passed else "fail"
            seen = e(cell.observed) + (f" ({cell.confidence:.2f})"
                                       if cell.confidence is not None else "")
            if cell.id in links:
                seen = f'<a href="{e(links[cell.id])}">{seen}</a>'
            out.append(f'<td class="{state}" data-cell="{e(cell.id)}" data-state="{state}">'
                       f"<strong>{state}</strong><br>expected {e(cell.expect)}<br>showed {seen}"
                       f"<br>{cell.wall_s:.1f} s</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)
