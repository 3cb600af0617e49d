"""Contracts: what every layer shares, torch-free.

Errors, the crash-bundle and manifest models, event names, the legacy-switch registry, rank
topology and bounded line reading. The doctor and the signature catalog import only this
package of the runtime (a test enforces it), so triage runs where torch is not installed.
"""
