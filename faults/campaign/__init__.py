"""Campaigns: many runs under faults, judged by the doctor.

This layer sits above the runtime and the doctor: ``plan`` reads campaign specs and expands
them into cells, ``cells`` runs one cell and judges its bundle, ``reports`` writes the results,
``replay`` re-runs a bundle's recipe (``replay_guard`` bounds what an untrusted bundle may ask
for), ``shrink`` reduces a failing recipe to a smaller one.
"""
