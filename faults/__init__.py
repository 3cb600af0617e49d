"""Seeded fault injection: the definitions below the runtime, campaigns above it.

At this level: ``kinds`` states every fault kind once (parameters, points, whether a rank
survives it); ``spec`` parses fault specs (pydantic, or the compact ``kind:key=value,...``
form); ``points`` names every fault point the runtime exposes; ``injector`` decides,
deterministically from one seed, whether a point fires for a given rank, request and step;
``rendezvous`` times a fault whose bug needs one interleaving of the ranks' threads;
``describe`` lists kinds and selectors. What a fault *does* when it fires is the runtime's, at
each fault point (a lag, a failed allocation, a raised crash). ``campaign/`` (plans, cells,
reports, replay, shrink) runs the runtime and judges with the doctor; ``campaigns/`` holds the
built-in campaign specs.
"""

from faults.spec import FaultKind, FaultSpec, parse_fault

__all__ = ["FaultKind", "FaultSpec", "parse_fault"]
