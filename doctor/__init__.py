"""Triage of a dead or hung HiCache deployment: read its artifacts, name the signature.

``doctor.diagnose.diagnose(paths)`` is the entry point; it returns a
:class:`doctor.report.Diagnosis`. The pipeline (reading, rank resolution, analysis, scoring) is
described in ``docs/architecture.md``. Nothing here imports torch or rich, or prints.
"""
