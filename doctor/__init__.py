"""Triage of whatever a failed HiCache deployment left behind.

``doctor.diagnose.diagnose(paths)`` is the entry point; it returns a
:class:`doctor.report.model.Diagnosis`. The stages, one subpackage each:

* ``read/``   reading artifacts (files, archives, pasted fragments, foreign log formats, dumps)
  into per-rank evidence;
* ``ranks/``  the rank picture: resolved identities, the rank table, blocked call sites,
  collective alignment, the first divergent decision;
* ``facts/``  structural facts derived from that picture, and the observation the catalog scores;
* ``report/`` the verdicts, their calibration, fingerprints and what the report says.

``evidence.py`` is the record model every stage shares. Nothing here imports torch or rich, or
prints.
"""
