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

A *property campaign* names ``properties`` at the top level (Antithesis-style "always"
properties, see :class:`Property`): every cell runs the fixed protocols (no legacy switch),
expects healthy, and is judged on each property as well; the report adds a table per property
(cells checked, violations, the violating cells and their bundles)::

    name: properties
    properties: [no-crash, no-hang, no-wrong-token, no-leaked-page]
    matrix:
      - topologies: [{tp: 2}, {pp: 2}]
        faults: [["dma-lag:rank=1,ms=30"]]
        seeds: [0, 1, 2, 3, 4]
"""

from __future__ import annotations

from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from faults.kinds import KINDS
from faults.spec import check_topology, parse_faults
from hicache_runtime.config import (
    LOCATION_KEYS,
    RuntimeConfig,
    check_run_limits,
    load_config,
    location_keys,
)
from hicache_runtime.config_files import load_file, parse_text, short_repr
from hicache_runtime.contracts import l3_backends
from hicache_runtime.contracts.errors import (
    ConfigError,
    InvalidFaultSpec,
    first_problem,
    nearest,
)
from hicache_runtime.contracts.legacy import (
    NO_FAULTS,
    LegacySwitch,
    format_cell_id,
    mode_label,
    parse_legacy,
    topology_label,
)

HEALTHY = "healthy"
#: A cell that fails with evidence the doctor names no signature for (a shrunk unknown crash).
NO_SIGNATURE = "no-signature"
DEFAULT_CAMPAIGN = "default.yaml"
MAX_CELLS = 1000
"""Cells one campaign spec may hold (its own seeds included): a spec is untrusted input and
each cell is a real run of seconds, so more is a mistake; a matrix is counted before it is
expanded, never materialised past this."""
MAX_RUNS = 100_000
"""Cell runs one command may ask for with ``--seeds`` (the user's own multiplier, counted
before anything is materialised): a nightly run of the default campaign under a thousand
seeds is 24 000, meant to be sharded (``--shard``) and resumed (``--resume``)."""


class Property(str, Enum):
    """What must hold in every cell of a property campaign, whatever the fault and seed."""

    NO_CRASH = "no-crash"
    NO_HANG = "no-hang"
    NO_WRONG_TOKEN = "no-wrong-token"
    NO_LEAKED_PAGE = "no-leaked-page"

    @property
    def meaning(self) -> str:
        return _PROPERTY_MEANING[self]


_PROPERTY_MEANING = {
    Property.NO_CRASH: "no rank crashed (the warm-up and the reference runs included)",
    Property.NO_HANG: "no rank hung (watchdog or protocol timeout)",
    Property.NO_WRONG_TOKEN: "every output identical to the cache-disabled run",
    Property.NO_LEAKED_PAGE: "at drain no page is held outside the tree, locked, pinned or "
                             "reserved, on any rank",
}



class CellSpec(BaseModel):
    """One run and what must come of it."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field("", max_length=200)
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
        problem = check_topology(parse_faults(self.faults), self.tp, self.pp)
        if problem:
            raise ValueError(problem)
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

    @model_validator(mode="after")
    def _well_formed(self) -> MatrixSpec:
        for topo in self.topologies:
            unknown = sorted(set(topo) - {"tp", "pp"})
            if unknown:
                raise ValueError(f"a topology takes tp and pp, not {', '.join(unknown)[:80]}")
            if any(v < 1 for v in topo.values()):
                raise ValueError(f"tp and pp are at least 1, got {topo}")
        known = {s.value for s in LegacySwitch}
        for key in self.expect:
            names = [] if key == "fixed" else key.split("+")
            bad = [n for n in names if n not in known]
            if bad:
                raise ValueError(f"expect key {key[:80]!r} is not 'fixed' or legacy switches "
                                 "joined by '+'")
        return self

    @property
    def size(self) -> int:
        """How many cells the matrix expands to (counted, not expanded)."""
        return len(self.topologies) * len(self.legacy) * len(self.faults) * len(self.seeds)

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
    properties: list[Property] = []
    """Non-empty: a property campaign (fixed protocols only, every cell expects healthy and is
    judged on each of these properties too)."""
    defaults: dict[str, Any] = {}
    cells: list[CellSpec] = []
    matrix: list[MatrixSpec] = []

    @model_validator(mode="after")
    def _bounded(self) -> CampaignSpec:
        for where, config in [("defaults", self.defaults),
                              *((f"cell {c.id[:80]}", c.config) for c in self.cells),
                              *((f"matrix {i}", m.config) for i, m in enumerate(self.matrix))]:
            named = location_keys(config)
            if named:
                raise ValueError(
                    f"{where} sets {', '.join(named)}: a campaign spec may not name a path, "
                    "URL or server (a spec is untrusted: it could overwrite a file or write to "
                    "someone's store); the campaign picks its own directories, and a store is "
                    "given on the command line (hicache campaign --storage-url URL)")
        total = self.size
        if total > MAX_CELLS:
            raise ValueError(f"the campaign expands to {total} cells; at most {MAX_CELLS} "
                             "(each is a real run)")
        if len(set(self.properties)) != len(self.properties):
            raise ValueError("a property is named twice")
        if self.properties:
            for i, m in enumerate(self.matrix):
                problem = _not_fixed(m.legacy, list(m.expect.values()), m.faults)
                if problem:
                    raise ValueError(f"matrix {i}: {problem}")
            for c in self.cells:
                problem = _not_fixed([c.legacy], [c.expect], [c.faults]) or (
                    "" if c.compare else "compare: false (no-wrong-token needs the reference)")
                if problem:
                    raise ValueError(f"cell {c.id[:80]}: {problem}")
        return self

    @property
    def size(self) -> int:
        """How many cells :meth:`expand` returns (counted, not expanded)."""
        return len(self.cells) + sum(m.size for m in self.matrix)

    def expand(self) -> list[CellSpec]:
        """Every cell, explicit ones first; ids are unique."""
        if self.size > MAX_CELLS:
            raise ConfigError("campaign", f"expands to {self.size} cells; at most {MAX_CELLS}")
        out = list(self.cells) + [c for m in self.matrix for c in m.cells()]
        seen: set[str] = set()
        for cell in out:
            if cell.id in seen:
                raise ConfigError("cells", f"cell id {cell.id!r} appears twice")
            seen.add(cell.id)
        return out


def _not_fixed(legacy: list[list[str]], expects: list[str], faults: list[list[str]]) -> str:
    """Why cells cannot belong to a property campaign (which runs the fixed protocols, each
    cell expecting healthy), or ``""``."""
    if any(legacy):
        return "a property campaign runs the fixed protocols: no legacy switch"
    if any(e.strip() != HEALTHY for e in expects):
        return "every cell of a property campaign expects healthy"
    for specs in faults:
        for spec in parse_faults(specs):
            if not KINDS[spec.kind].survivable:
                return (f"{spec.kind} is the failure itself: no cell survives it "
                        "(a property campaign holds cells to no crash and no hang)")
    return ""


#: Config fields a cell sets through its own keys, or that belong to the machine it runs on
#: (the places a run writes or contacts: never in a spec).
_NOT_CELL_CONFIG = ("topology.", "seed", "faults", "legacy", *sorted(LOCATION_KEYS))


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


# The cell-id grammar, in one place: ``<topology>/<mode>/<faults>[/seed<n>]``, e.g.
# ``tp2pp2/skip-empty-sync+local-ack-drain/host-alloc-fail:pp=1``. Reports place a cell by its
# parts (``matrix_place``), never by splitting an id: a spec may name its cells freely.


def faults_label(faults: list[str]) -> str:
    """Canonical fault specs (ids do not depend on key order), or ``none``."""
    return ";".join(f.compact() for f in parse_faults(faults)) or NO_FAULTS


def cell_id(tp: int, pp: int, legacy: list[str], faults: list[str],
            seed: int | None = None) -> str:
    """The cell's id (``hicache_runtime.contracts.legacy.py`` holds the grammar)."""
    return format_cell_id(tp, pp, legacy, faults_label(faults), seed)


def matrix_place(cell: CellSpec) -> tuple[str, str]:
    """Where a cell sits in a campaign's matrix: its row (topology, faults, seed) and column
    (the mode: its switches, or ``fixed``)."""
    row = f"{topology_label(cell.tp, cell.pp)} {faults_label(cell.faults)}"
    return (row + (f" seed{cell.seed}" if cell.seed else ""), mode_label(cell.legacy))


def load_campaign(path: Path | None = None) -> CampaignSpec:
    """Read a campaign spec (YAML, TOML or JSON); ``None`` gives the built-in default."""
    if path is None:
        text = resources.files("faults.campaigns").joinpath(DEFAULT_CAMPAIGN).read_text()
        return _validate(parse_text(text, "yaml", DEFAULT_CAMPAIGN, "campaign"),
                         DEFAULT_CAMPAIGN)
    # A spec is untrusted: bounded read, YAML aliases bounded, one-line errors.
    return _validate(load_file(path, "campaign", default="yaml"), str(path))


def _validate(data: Any, where: str) -> CampaignSpec:
    """The spec, with every cell checked before any runs: the cell count (before expanding),
    each cell's faults, switches and config, and every expectation against the catalog."""
    if not isinstance(data, dict):
        raise ConfigError("campaign", f"{where} must hold a mapping")
    try:
        spec = CampaignSpec.model_validate(data)
    except ValidationError as exc:
        raise _spec_error(exc, where, "") from None
    for i, matrix in enumerate(spec.matrix):
        try:
            matrix.cells()
        except ValidationError as exc:
            raise _spec_error(exc, where, f"matrix.{i}") from None
        except InvalidFaultSpec as exc:
            raise ConfigError(f"campaign.matrix.{i}", f"{exc} ({where})") from None
    cells = spec.expand()
    known = _known_outcomes()
    for cell in spec.cells:  # a matrix cell's expectation is one of its matrix's, below
        check_expectation(cell.expect, known, f"{where}: cell {cell.id}")
    for i, matrix in enumerate(spec.matrix):
        for key, expect in matrix.expect.items():
            check_expectation(expect, known, f"{where}: matrix {i}, expect.{key}")
    for cell in cells:
        settings = cell_settings(spec, cell)
        example = _url_from_command_line(settings.get("storage.backend"))
        if example:  # its server comes from --storage-url; any good URL stands in for it
            settings["storage.url"] = example
        try:
            check_run_limits(load_config(settings))
        except ConfigError as exc:
            raise ConfigError(f"campaign cell {cell.id}", f"{exc} ({where})") from None
    return spec


def _url_from_command_line(backend: object) -> str:
    """A URL of ``backend`` (``url_example``) when only the command line may name its server
    (``url_required``), else ""."""
    if not isinstance(backend, str) or backend == "none":
        return ""
    try:
        cls = l3_backends.load(backend)
    except ConfigError:  # an unknown name is the config check's to report
        return ""
    return str(cls.url_example) if cls.url_required else ""


def needs_store(spec: CampaignSpec, cells: list[CellSpec]) -> list[tuple[tuple[str, str], str]]:
    """``((backend, example URL), cell id)`` of each of ``cells`` whose backend's server only
    the command line may name (``url_required``: Redis); a backend that can start a private
    store (Mooncake) gets one when none is named."""
    out = []
    for c in cells:
        backend = cell_settings(spec, c).get("storage.backend")
        example = _url_from_command_line(backend)
        if example:
            out.append(((str(backend), example), c.id))
    return out


def cell_settings(spec: CampaignSpec, cell: CellSpec) -> dict[str, Any]:
    """A cell's config values (campaign defaults, then the cell's own), without the paths
    of the machine it runs on."""
    data: dict[str, Any] = {**spec.defaults, **cell.config}
    data.update({"topology.tp": cell.tp, "topology.pp": cell.pp, "seed": cell.seed,
                 "faults": tuple(parse_faults(cell.faults)),
                 "legacy": parse_legacy(cell.legacy)})
    return data


def check_expectation(expect: str, known: set[str], where: str) -> None:
    """Each ``|``-separated id must be ``healthy``, ``no-signature`` or a catalog signature: a
    typo would only show after the cell ran, as a failure that is the spec's, not the
    runtime's."""
    names = [n for n in (e.strip() for e in expect.split("|")) if n]
    if not names:
        raise ConfigError("campaign", f"{where}: empty expectation")
    for name in names:
        if name not in known:
            close = nearest(name, sorted(known))
            raise ConfigError("campaign", f"{where}: expects {short_repr(name)}, which is "
                                          "neither healthy, no-signature nor a known signature"
                              + (f" (did you mean {close}?)" if close else ""),
                              hint="hicache signatures list shows the signature ids")


def _known_outcomes() -> set[str]:
    from signatures.loader import load_catalog

    return {HEALTHY, NO_SIGNATURE} | {s.id for s in load_catalog().signatures}


def _spec_error(exc: ValidationError, where: str, prefix: str) -> ConfigError:
    field, msg = first_problem(exc, prefix)
    return ConfigError(f"campaign.{field or 'campaign'}", f"{msg} ({where})")
