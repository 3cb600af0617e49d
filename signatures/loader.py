"""Loading and validating the catalog shipped in ``signatures/catalog/``.

``load_catalog()`` reads ``catalog.yaml`` (version, order, frame rules), ``patterns.yaml``, one
``<id>.yaml`` per signature and ``lookalikes.yaml`` (failure classes that are not signatures),
validates them against :mod:`signatures.models`, and checks the cross-references (log pattern
ids, legacy switch names, the order list, the signatures a look-alike excludes). It is cached:
the catalog is immutable data.

Raises :class:`~hicache_runtime.contracts.errors.ConfigError`
naming the file and field when the catalog is
broken (a packaging or editing mistake, never user input).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hicache_runtime.contracts.errors import ConfigError, first_problem
from hicache_runtime.contracts.legacy import LegacySwitch
from signatures.models import Catalog, Signature

_INDEX = "catalog.yaml"
_PATTERNS = "patterns.yaml"
_LOOKALIKES = "lookalikes.yaml"
_AFFECTED = "affected.yaml"
"""Generated from a release matrix run (``hicache signatures affected``)."""


@functools.lru_cache(maxsize=4)
def load_catalog(directory: Path | None = None) -> Catalog:
    """The validated catalog from ``directory`` (default: the packaged one)."""
    root = directory or Path(__file__).resolve().parent / "catalog"
    index = _read(root / _INDEX)
    patterns = _read(root / _PATTERNS).get("patterns", [])
    order = index.get("order") or []
    sigs = [_read(root / f"{sig_id}.yaml") for sig_id in order]
    lookalikes = (_read(root / _LOOKALIKES).get("lookalikes", [])
                  if (root / _LOOKALIKES).exists() else [])
    extra = sorted({p.stem for p in root.glob("*.yaml")} - set(order)
                   - {"catalog", "patterns", "lookalikes", _AFFECTED.removesuffix(".yaml")})
    if any("affected" in s for s in sigs):
        raise ConfigError("catalog.affected", "a signature file may not set affected: it is "
                                              f"generated into {_AFFECTED}")
    affected = _read(root / _AFFECTED) if (root / _AFFECTED).exists() else {}
    for s in sigs:
        found = (affected.get("signatures") or {}).get(s.get("id"))
        if found is not None:
            s["affected"] = {k: affected.get(k) for k in ("campaign", "command", "run_at",
                                                           "profiles")} | found
    if extra:
        raise ConfigError("catalog.order", f"signature files not listed in order: {extra}")
    try:
        catalog = Catalog(version=str(index.get("version", "")), frames=index.get("frames", {}),
                          patterns=patterns, signatures=sigs, lookalikes=lookalikes)
    except ValidationError as exc:
        where, what = first_problem(exc)
        raise ConfigError(f"catalog.{where}", what) from None
    _check_references(catalog)
    return catalog


#: libyaml's safe loader where PyYAML was built with it: the same documents, about ten times
#: faster than the pure-Python one (the catalog took 1.3 s of every ``hicache doctor``). For
#: the project's own files only: untrusted YAML goes through ``config_files.load_yaml``, whose
#: pure-Python composer is what bounds its aliases and its depth.
_OWN_YAML = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_own_yaml(path: Path) -> Any:
    """A YAML file of this project's (the catalog, the component map), parsed."""
    return yaml.load(path.read_text(encoding="utf-8"), Loader=_OWN_YAML)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = read_own_yaml(path)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"catalog:{path.name}", f"cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"catalog:{path.name}", "must hold a mapping")
    return data


def _check_references(catalog: Catalog) -> None:
    pattern_ids = [p.id for p in catalog.patterns]
    if len(set(pattern_ids)) != len(pattern_ids):
        raise ConfigError("catalog.patterns", "duplicate pattern id")
    known_switches = {s.value for s in LegacySwitch}
    ids = [s.id for s in catalog.signatures]
    if len(set(ids)) != len(ids):
        raise ConfigError("catalog.signatures", "duplicate signature id")
    for sig in catalog.signatures:
        _check_signature(sig, set(pattern_ids), known_switches, set(ids))
    looks = [x.id for x in catalog.lookalikes]
    if len(set(looks)) != len(looks) or set(looks) & set(ids):
        raise ConfigError("catalog.lookalikes", "duplicate look-alike id (or a signature's)")
    for look in catalog.lookalikes:
        unknown = set(look.excludes) - set(ids) - {"*"}
        if unknown:
            raise ConfigError(f"lookalikes.{look.id}.excludes", f"unknown {sorted(unknown)}")


def _check_signature(sig: Signature, patterns: set[str], switches: set[str],
                     ids: set[str]) -> None:
    for log in sig.recognisers.logs:
        if log.pattern not in patterns:
            raise ConfigError(f"{sig.id}.recognisers.logs", f"unknown pattern {log.pattern!r}")
    for leg in sig.recognisers.legacy:
        if leg.switch not in switches:
            raise ConfigError(f"{sig.id}.recognisers.legacy", f"unknown switch {leg.switch!r}")
    for rel in sig.related:
        if rel not in ids:
            raise ConfigError(f"{sig.id}.related", f"unknown signature {rel!r}")
    if sig.campaign is not None:
        _, legacy, _ = sig.campaign.parts
        if legacy not in switches | {"fixed"}:
            raise ConfigError(f"{sig.id}.campaign", f"unknown legacy switch {legacy!r}")
        if sig.campaign.expect not in ids | {"healthy"}:
            raise ConfigError(f"{sig.id}.campaign.expect", f"unknown {sig.campaign.expect!r}")
