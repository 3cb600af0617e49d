"""Campaign specs: matrices of topology x legacy switches x faults x seeds, each cell with an
expectation (``healthy``, or the signature id(s) the doctor must name).

A spec is YAML or TOML::

    name: my-campaign
    defaults: {workload.requests: 48, observability.protocol_timeout_s: 5}
    cells:
      - id: tp2/skip-empty-sync/host-alloc-fail:tp=1
        tp: 2
        legacy: [skip-empty-sync]
        faults: [host-alloc-fail:tp=1]
        expect: collective-order-deadlock
    matrix:
      - topologies: [{tp: 2}, {pp: 2}]
        legacy: [[], [local-ack-drain]]
        faults: [[dma-lag:pp=1,ms=30]]
        seeds: [0, 1]
        expect: {fixed: healthy, local-ack-drain: prefix-length-mismatch|write-ack-pop-empty}

Cell ids read ``<topology>/<legacy switches or fixed>/<faults or none>``, the same ids the
signature catalog cites as the cell that reproduces each signature.
"""

from __future__ import annotations

import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from faults.spec import parse_faults
from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.errors import ConfigError
from hicache_runtime.legacy import parse_legacy

HEALTHY = "healthy"
DEFAULT_CAMPAIGN = "default.yaml"


class CellSpec(BaseModel):
    """One run and what must come of it."""

    model_config = ConfigDict(extra="forbid")
    id: str = ""
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    legacy: list[str] = []
    faults: list[str] = []
    seed: int = 0
    config: dict[str, Any] = {}
    """Dotted config overrides on top of the campaign's defaults."""
    warm: bool = False
    """Run the cell once without faults and switches first (fills L3 for later runs)."""
    compare: bool = True
    """Judge outputs against a cache-disabled run (needed for a ``healthy`` verdict)."""
    expect: str = HEALTHY
    """``healthy``, or signature ids separated by ``|`` (any of them passes)."""

    @model_validator(mode="after")
    def _named_and_valid(self) -> CellSpec:
        parse_legacy(self.legacy)
        parse_faults(self.faults)
        if not self.id:
            self.id = cell_id(self.tp, self.pp, self.legacy, self.faults)
        return self

    @property
    def expected(self) -> set[str]:
        return {e.strip() for e in self.expect.split("|") if e.strip()}


class MatrixSpec(BaseModel):
    """A cross product of cells; ``expect`` maps a legacy-switch set (``fixed`` for none, or
    the switch names joined by ``+``) to what its cells must show."""

    model_config = ConfigDict(extra="forbid")
    topologies: list[dict[str, int]] = [{"tp": 1, "pp": 1}]
    legacy: list[list[str]] = [[]]
    faults: list[list[str]] = [[]]
    seeds: list[int] = [0]
    config: dict[str, Any] = {}
    warm: bool = False
    expect: dict[str, str] = {}

    def cells(self) -> list[CellSpec]:
        out = []
        for topo in self.topologies:
            for switches in self.legacy:
                key = "+".join(sorted(switches)) or "fixed"
                for faults in self.faults:
                    for seed in self.seeds:
                        out.append(CellSpec(
                            tp=topo.get("tp", 1), pp=topo.get("pp", 1), legacy=switches,
                            faults=faults, seed=seed, config=self.config, warm=self.warm,
                            expect=self.expect.get(key, HEALTHY),
                            id=cell_id(topo.get("tp", 1), topo.get("pp", 1), switches, faults,
                                       seed if len(self.seeds) > 1 else None)))
        return out


class CampaignSpec(BaseModel):
    """A whole campaign: defaults, explicit cells and matrices."""

    model_config = ConfigDict(extra="forbid")
    name: str = "campaign"
    description: str = ""
    defaults: dict[str, Any] = {}
    cells: list[CellSpec] = []
    matrix: list[MatrixSpec] = []

    def expand(self) -> list[CellSpec]:
        """Every cell, explicit ones first; ids are unique."""
        out = list(self.cells) + [c for m in self.matrix for c in m.cells()]
        seen: set[str] = set()
        for cell in out:
            if cell.id in seen:
                raise ConfigError("cells", f"cell id {cell.id!r} appears twice")
            seen.add(cell.id)
        return out


#: Config fields a cell sets through its own keys, or that belong to the machine it runs on.
_NOT_CELL_CONFIG = ("topology.", "seed", "faults", "legacy", "observability.bundle_dir",
                    "observability.trace_path", "storage.path")


def cell_from_config(cfg: RuntimeConfig, *, expect: str, warm: bool,
                     cell: str | None = None) -> CellSpec:
    """The campaign cell that reruns ``cfg``: every field that differs from the defaults."""
    ours = _flatten(cfg.model_dump(mode="json"))
    defaults = _flatten(load_config({}).model_dump(mode="json"))
    config = {k: v for k, v in ours.items()
              if v != defaults.get(k) and not k.startswith(_NOT_CELL_CONFIG)}
    return CellSpec(id=cell or "", tp=cfg.topology.tp, pp=cfg.topology.pp,
                    legacy=sorted(s.value for s in cfg.legacy),
                    faults=[f.compact() for f in cfg.faults], seed=cfg.seed, config=config,
                    warm=warm, expect=expect)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("faults", "legacy"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def cell_id(tp: int, pp: int, legacy: list[str], faults: list[str],
            seed: int | None = None) -> str:
    topo = "".join(p for p in (f"tp{tp}" if tp > 1 else "", f"pp{pp}" if pp > 1 else "")
                    if p) or "tp1"
    canonical = [f.compact() for f in parse_faults(faults)]  # ids do not depend on key order
    text = f"{topo}/{'+'.join(sorted(legacy)) or 'fixed'}/{';'.join(canonical) or 'none'}"
    return text if seed is None else f"{text}/seed{seed}"


def load_campaign(path: Path | None = None) -> CampaignSpec:
    """Read a campaign spec (YAML, TOML or JSON); ``None`` gives the built-in default."""
    if path is None:
        text = resources.files("faults.campaigns").joinpath(DEFAULT_CAMPAIGN).read_text()
        return _validate(yaml.safe_load(text), DEFAULT_CAMPAIGN)
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError("campaign", f"cannot parse {path}: {exc}") from None
    return _validate(data, str(path))


def _validate(data: Any, where: str) -> CampaignSpec:
    if not isinstance(data, dict):
        raise ConfigError("campaign", f"{where} must hold a mapping")
    try:
        return CampaignSpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "campaign"
        raise ConfigError(f"campaign.{field}", f"{err['msg']} ({where})") from None
