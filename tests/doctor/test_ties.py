"""Two signatures that fit equally well: neither is stated with high confidence.

A real report (gpustack#3047: LMCache's remote receives fail to allocate host memory, in a
storage connector, then the engine dies on the missing chunk) fits storage-backend-failure
and host-pool-exhausted at 1.00 each; the catalog's order alone picked the first, a wrong
answer at 1.00. Tied verdicts are capped and say why."""

from __future__ import annotations

from doctor.diagnose import TIE_MARGIN, TIED_CAP
from tests.corpus import diagnose_bytes, load_cases


def _case(case_id: str) -> bytes:
    return next(c.text for c in load_cases() if c.id == case_id)


def test_tied_verdicts_are_capped_and_say_what_else_fits() -> None:
    d = diagnose_bytes("x.log", _case(
        "other-gpustack-3047-lmcache-redis-remote-receive-alloc-fail-crash"))
    top, second = d.verdicts[0], d.verdicts[1]
    assert {top.signature, second.signature} == {"storage-backend-failure",
                                                  "host-pool-exhausted"}
    assert top.confidence == second.confidence == TIED_CAP
    assert second.signature in top.tie_note
    assert "from 1.00" in top.tie_note
    assert top.signature in second.tie_note


def test_a_verdict_well_ahead_of_the_next_keeps_its_confidence() -> None:
    for case in load_cases():
        d = diagnose_bytes(f"{case.id}.log", case.text)
        if len(d.verdicts) >= 2 and d.verdicts[0].confidence > TIED_CAP and \
                d.verdicts[1].confidence < d.verdicts[0].confidence - TIE_MARGIN:
            assert d.verdicts[0].tie_note == ""
            return
    raise AssertionError("no case with a clear first verdict above the cap")
