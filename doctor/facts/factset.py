"""The container of derived facts and how a witness is made (shared by the fact analyzers)."""

from __future__ import annotations

from doctor.model.evidence import SourceRef
from signatures.fact_names import Fact
from signatures.matching import Witness

MAX_WITNESSES = 6


class FactSet(dict[Fact, list[Witness]]):
    """Facts with their witnesses (at most ``MAX_WITNESSES`` each, duplicates dropped)."""

    def add(self, fact: Fact, witness: Witness) -> None:
        wits = self.setdefault(fact, [])
        if len(wits) < MAX_WITNESSES and witness not in wits:
            wits.append(witness)


def witness(text: str, src: SourceRef | None, rank: int) -> Witness:
    """A witness citing ``src`` (file and line), its text cut to one readable line."""
    return Witness(text[:300], src.file if src else None, src.line if src else None, rank)
