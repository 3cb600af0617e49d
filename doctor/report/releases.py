"""A verdict weighed against the release the input states.

When a report states the SGLang release it ran (``sglang==0.5.23``, a version banner, a
server-argument echo: ``doctor/read/text/versions.py``) and the catalog's verified release data
(``Signature.affected``, from a release matrix) says the fault that exposes a signature ran
clean on that release's profile, the signature loses some confidence, and the verdict says
why. The release matrix covers one fault per signature on this runtime's rendering of each
release, so it weakens a verdict and never removes one.

A stated version that is no profile's release is read as the nearest profile release below
it, if the matrix ran one (0.5.21 as 0.5.20), and the note says so.
"""

from __future__ import annotations

import re

from doctor.model.builder import Evidence
from doctor.report.model import Verdict
from hicache_runtime.contracts.profiles import PROFILES
from signatures.models import Catalog

CLEAN_FACTOR = 0.85
"""A verdict's confidence times this when its fault ran clean on the stated release."""
_VERSION = re.compile(r"^v?(\d{1,6})\.(\d{1,6})(?:\.(\d{1,6}))?")


def _key(version: str) -> tuple[int, int, int] | None:
    m = _VERSION.match(version)
    if m is None:
        return None
    return int(m[1]), int(m[2]), int(m[3] or 0)


def profile_for(version: str, checked: list[str]) -> tuple[str, bool] | None:
    """The release profile of ``checked`` that stands for ``version``: its own (exact) or the
    nearest release below it inside the checked range (not exact); None outside it."""
    stated = _key(version)
    if stated is None:
        return None
    releases = sorted((k, n) for n in checked if (p := PROFILES.get(n)) is not None
                       and p.release is not None and (k := _key(p.release)) is not None)
    if not releases or stated < releases[0][0]:
        return None
    below = [(k, n) for k, n in releases if k <= stated]
    key, name = below[-1]
    if key != stated and stated > releases[-1][0]:
        return None  # newer than every release the matrix ran: nothing is known of it
    return name, key == stated


def weigh_by_release(verdicts: list[Verdict], ev: Evidence, catalog: Catalog) -> list[Verdict]:
    """``verdicts`` with those whose fault ran clean on the stated release weakened and
    annotated, re-sorted by confidence (stable)."""
    stated = ev.versions.get("sglang")
    if stated is None or not verdicts:
        return verdicts
    version, source = stated
    known = {s.id: s for s in catalog.signatures}
    for v in verdicts:
        sig = known.get(v.signature)
        a = sig.affected if sig is not None else None
        if a is None or a.row is None:
            continue
        found = profile_for(version, a.profiles)
        if found is None:
            continue
        name, exact = found
        if name in a.clean and name not in a.reproduces:
            v.confidence = round(v.confidence * CLEAN_FACTOR, 2)
            where = f"{source.file}:{source.line}" if source.line else source.file
            v.release_note = (
                f"the input states sglang {version} ({where}); the release matrix ran this "
                f"signature's fault ({a.row}) clean on {name}"
                + ("" if exact else f", the nearest release below {version} it ran")
                + f" ({a.run_at}): confidence x{CLEAN_FACTOR}")
    return sorted(verdicts, key=lambda v: -v.confidence)
