"""Seeded fault injection: named fault points in the runtime, fault specs, and campaigns.

``kinds`` states every fault kind once (parameters, points, behaviour); ``spec`` parses fault
specs (pydantic, or the compact ``kind:key=value,...`` form); ``points``
names every fault point the runtime exposes; ``injector`` decides, deterministically from one
seed, whether a point fires for a given rank, request and step.
"""

from faults.spec import FaultKind, FaultSpec, parse_fault

__all__ = ["FaultKind", "FaultSpec", "parse_fault"]
