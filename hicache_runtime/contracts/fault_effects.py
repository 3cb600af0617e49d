"""What a fired fault did, in the words the doctor reads (the ``effect`` of a ``fault`` event
and of a bundle's ``faults_fired``, from bundle 1.4).

A fault kind states its effect (``faults.kinds``): the doctor recognises a fault by what it did,
never by its kind's name or its spec's text, so a kind added later is read the same way as the
built-ins. Bundles before 1.4 carry no effect; :func:`effect_of_older` derives it from the
built-in kinds of that time.
"""

from __future__ import annotations

from enum import StrEnum


class FaultEffect(StrEnum):
    """What one firing did to the run."""

    LAG = "lag"
    """Something ran slower (a step, a copy, a forward, a storage call)."""
    ALLOC_FAIL = "alloc-fail"
    """An allocation of host (L2) pages was refused."""
    STORAGE_SHORT = "storage-short"
    """An L3 existence answer came back shorter than the store holds."""
    STORAGE_HOLES = "storage-holes"
    """L3 reads failed for pages in the middle of a batch while later pages loaded."""
    STORAGE_ERROR = "storage-error"
    """L3 calls failed (soft, or raised as a client library that throws)."""
    STORAGE_CORRUPT = "storage-corrupt"
    """Bytes of a page read from L3 were flipped (its checksum must reject it)."""
    ABORT = "abort"
    """A client abort of a request, timed by the fault."""
    CRASH = "crash"
    """The rank raised on its scheduler thread: the failure itself."""
    HANG = "hang"
    """The rank's scheduler thread blocked for good: the failure itself."""
    KILL = "kill"
    """The rank's process was killed (SIGKILL): the failure itself."""


_OLDER: dict[str, FaultEffect] = {
    "stage-lag": FaultEffect.LAG, "dma-lag": FaultEffect.LAG, "compute-lag": FaultEffect.LAG,
    "storage-latency": FaultEffect.LAG, "storage-error": FaultEffect.STORAGE_ERROR,
    "storage-corrupt": FaultEffect.STORAGE_CORRUPT, "mid-prefetch-abort": FaultEffect.ABORT,
    "chunked-abort": FaultEffect.ABORT, "host-alloc-fail": FaultEffect.ALLOC_FAIL,
    "rank-kill": FaultEffect.KILL, "crash": FaultEffect.CRASH, "hang": FaultEffect.HANG,
}


def effect_of(attrs: dict[str, object]) -> FaultEffect | None:
    """The effect of one fault event's ``attrs``: its own field, or for a bundle before 1.4
    (no such field) what its built-in kind did then; None when neither says."""
    value = attrs.get("effect")
    if isinstance(value, str):
        try:
            return FaultEffect(value)
        except ValueError:
            return None
    if "effect" in attrs and value is not None:
        return None
    return effect_of_older(str(attrs.get("kind", "")), str(attrs.get("spec", "")))


def effect_of_older(kind: str, spec: str) -> FaultEffect | None:
    """What a fault of a bundle before 1.4 did, from its built-in kind and compact spec (the
    only place a spec's text is read: those bundles say nothing else)."""
    if kind == "storage-shortfall":
        return FaultEffect.STORAGE_HOLES if "mode=holes" in spec else FaultEffect.STORAGE_SHORT
    return _OLDER.get(kind)
