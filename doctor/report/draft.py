"""A draft catalog entry from an incident's diagnosis (``hicache signatures new --from``).

When a failure fits no signature and keeps recurring (the same fingerprint in several
incidents), a maintainer turns it into a catalog entry. The draft does the mechanical part from
what the doctor saw: the exception (type and message with its variable parts turned into
regexes), the in-app functions of the failing stack, the collectives the ranks blocked in, the
log patterns and facts that fired, the evidence lines with their files. What only a person can
write (meaning, root cause, fix, mitigations, runbook) is left as ``TODO`` text for them to
finish; the draft validates against the catalog model, so it loads as soon as it is filed.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from doctor.report.model import Diagnosis
from signatures.fact_names import Fact
from signatures.models import Signature

TODO = "TODO (maintainer):"
_PLACEHOLDERS = {"N": r"-?\d+(?:\.\d+)?", "X": r"0x[0-9a-fA-F]+", "ID": r"\S+"}
_STRUCTURAL_FACTS = {f.value for f in Fact} - {"hang", "crash", "wrong-output", "no-failure"}


def _literal(name: str) -> str:
    """A function name as a pattern that matches only it. ``@`` separates a frame pattern's
    function from its file, so it is written ``\x40`` (``re.escape`` leaves it as is)."""
    return re.escape(name).replace("@", r"\x40")


def _failure_kind(d: Diagnosis) -> str:
    """The shape the incident showed: the run's recorded outcome when it has one, else a
    crash when any rank raised (its peers blocked in collectives are the consequence), a hang
    when ranks only blocked."""
    outcome = str(d.topology.get("outcome") or "")
    if outcome in ("crash", "hang", "wrong-output"):
        return outcome
    fp = d.fingerprint
    return "hang" if fp is not None and fp.blocked and not fp.exception else "crash"


def draft_signature(d: Diagnosis, sig_id: str | None = None) -> dict[str, Any]:
    """The draft as plain data (YAML-ready), validated against the catalog model."""
    fp = d.fingerprint
    if fp is None:
        raise ValueError("the diagnosis has no fingerprint (it was written by an older doctor)")
    sig_id = sig_id or f"unknown-{fp.id.removeprefix('fp-')}"
    exc_type, _, exc_msg = (fp.exception or "").partition(": ")
    recognisers: dict[str, Any] = {}
    if fp.exception and exc_type and exc_type != "(cut off)":
        recognisers["exceptions"] = [{"type": _type_regex(exc_type),
                                      "message": _message_regex(exc_msg), "weight": 0.3}]
    if fp.functions:
        recognisers["frames"] = {"where": "any", "weight": 0.3,
                                 "any": [rf"(^|\.){_literal(f)}$" for f in fp.functions]}
    facts = [f for f in fp.facts if f in _STRUCTURAL_FACTS]
    if facts:
        recognisers["facts"] = [{"fact": f, "weight": 0.3} for f in facts]
    recognisers["stack_shape"] = (f"{TODO} describe the cross-rank stack shape. Seen: "
                                  + ("; ".join(fp.blocked) or "no rank blocked in a collective"))
    recognisers["trace_evidence"] = f"{TODO} what the event trace would show."
    title = (f"{exc_type}: {exc_msg}"[:90] if fp.exception else
             ("Hang in " + fp.blocked[0] if fp.blocked else "Unknown failure"))
    evidence = [f"{e.text} ({e.file}:{e.line})" if e.file else e.text
                for v in d.verdicts[:1] for e in v.evidence] or d.observations[:6]
    draft: dict[str, Any] = {
        "id": sig_id,
        "title": f"{TODO} {title}",
        "severity": "high",
        "kind": _failure_kind(d),
        "meaning": f"{TODO} what happened, in a paragraph. Fingerprint {fp.id}; seen: "
                   + " | ".join(evidence[:6]),
        "recognisers": recognisers,
        "threshold": 0.6,
        "root_cause": f"{TODO} the mechanism, in upstream's terms.",
        "upstream_fix": [{"ref": "TODO/owner#0", "summary": f"{TODO} the fix, or 'none yet'."}],
        "mitigations": [{"text": f"{TODO} what an operator can do now."}],
        "runbook": {"confirm": [f"{TODO} how to confirm it is this failure."],
                    "diagnosis_path": [f"{TODO} from the error back to the cause."],
                    "escalation": f"{TODO} who to page, what to attach."},
    }
    if fp.logs:
        draft["recognisers"]["logs"] = [{"pattern": p, "weight": 0.2} for p in fp.logs]
    Signature.model_validate(draft)  # a draft that would not load is no help
    return draft


def draft_yaml(d: Diagnosis, sig_id: str | None = None) -> str:
    header = ("# Draft catalog entry written by `hicache signatures new` from a diagnosis.\n"
              "# Finish every TODO, tune the weights on real evidence, then add the id to\n"
              "# catalog.yaml's order and run the catalog tests.\n")
    return header + yaml.safe_dump(draft_signature(d, sig_id), sort_keys=False,
                                   allow_unicode=True, width=100)


def _type_regex(exc_type: str) -> str:
    short = exc_type.rsplit(".", 1)[-1]
    return rf"(\w+\.)*{re.escape(short)}"


def _message_regex(message: str) -> str:
    """The normalised message as a regex: placeholders become what they stood for."""
    parts = re.split(r"\b(N|X|ID)\b", message[:120])
    out = []
    for i, part in enumerate(parts):
        out.append(_PLACEHOLDERS[part] if i % 2 else re.escape(part).replace("\\ ", " "))
    return "".join(out) or ".*"
