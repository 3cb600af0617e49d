"""Seeded fault injection: the definitions below the runtime, campaigns above it.

At this level: ``kinds/`` holds every fault kind, each one object (parameters, points, what it
does there through the hooks the runtime's fault points call, whether a rank survives it, the
effect the doctor reads), built-in or registered; ``spec`` parses fault specs (pydantic, or the
compact ``kind:key=value,...`` form); ``points`` names every fault point the runtime exposes;
``injector`` decides, deterministically from one seed, whether a point fires for a given rank,
request and step; ``rendezvous`` times a fault whose bug needs one interleaving of the ranks'
threads; ``describe`` lists kinds and selectors. ``campaign/`` (plans, cells,
reports, replay, shrink) runs the runtime and judges with the doctor; ``campaigns/`` holds the
built-in campaign specs.
"""

from faults.spec import FaultKind, FaultSpec, parse_fault

__all__ = ["FaultKind", "FaultSpec", "parse_fault"]
