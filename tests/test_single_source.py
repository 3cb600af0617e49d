"""Each legacy switch is stated once, in ``hicache_runtime.contracts.legacy.REGISTRY``: its upstream
fix, the versions it restores and the default-campaign recipe that exposes it. Every other place
that repeats part of it is held to the registry here: the default campaign's legacy cells, the
signature catalog's campaign cells, the README table, ``docs/legacy-switches.md`` and the
recipes that regenerate the doctor's runtime bundle fixtures.

Each fault kind is stated once, in ``faults.kinds.KINDS``: its parameters, the points where it
acts and what it does. The spec model's fields and the README's fault table are held to it
here."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from faults.campaign.plan import cell_id, load_campaign
from faults.describe import SELECTORS, markdown_table
from faults.injector import points_of
from faults.kinds import KINDS, FaultKind
from faults.points import FaultPoint
from faults.spec import PARAM_FIELDS, FaultSpec, parse_fault, parse_faults
from hicache_runtime.config import load_config
from hicache_runtime.contracts.legacy import REGISTRY, Exposure, Fidelity, LegacySwitch, SwitchEntry
from signatures.loader import load_catalog

ROOT = Path(__file__).resolve().parents[1]

#: ``hicache run`` flags of the config keys a recipe sets; keys without one are written
#: ``key: value`` in the README's setup column.
FLAGS = {"topology.tp": "--tp", "topology.pp": "--pp", "workload.requests": "--requests",
         "cache.device_tokens": "--device-tokens", "cache.host_tokens": "--host-tokens",
         "storage.backend": "--storage", "model.sidecars": "--sidecar-pools",
         "observability.consensus_check": "--consensus-check"}


def _canonical(faults: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return tuple(f.compact() for f in parse_faults(list(faults)))


def _exposures() -> list[tuple[SwitchEntry, Exposure]]:
    return [(e, x) for e in REGISTRY.values() for x in e.exposures]


def _id(entry: SwitchEntry, x: Exposure) -> str:
    return cell_id(x.tp, x.pp, [entry.switch.value], list(x.faults))


def _find(switch: str, tp: int, pp: int, faults: tuple[str, ...]) -> Exposure:
    matches = [x for x in REGISTRY[LegacySwitch(switch)].exposures
               if (x.tp, x.pp, _canonical(x.faults)) == (tp, pp, faults)]
    assert matches, f"{switch} at tp={tp} pp={pp} under {faults}: not in the registry"
    return matches[0]


def test_registry_is_well_formed() -> None:
    assert set(REGISTRY) == set(LegacySwitch)
    for entry, x in _exposures():
        assert all(re.fullmatch(r"#\d+", f) for f in entry.fixes), entry.fixes
        # a switch no release ran is synthetic, and says why
        assert entry.broken_in or entry.fidelity is Fidelity.SYNTHETIC, entry.switch
        assert (entry.fidelity is Fidelity.RELEASE) == (not entry.fidelity_note), entry.switch
        assert all(re.fullmatch(r"0\.5\.\d+", v) for v in entry.broken_in)
        assert _canonical(x.faults) == x.faults, "faults are written in their compact form"
        assert x.expect
    ids = [_id(e, x) for e, x in _exposures()]
    assert len(ids) == len(set(ids))


def test_default_campaign_runs_each_registry_recipe_beside_its_fixed_twin() -> None:
    spec = load_campaign()
    cells = spec.expand()
    legacy_cells = {c.id: c for c in cells if c.legacy}
    assert set(legacy_cells) == {_id(e, x) for e, x in _exposures()}
    by_id = {c.id: c for c in cells}
    for cell in legacy_cells.values():
        assert len(cell.legacy) == 1, f"{cell.id}: one switch per cell"
        x = _find(cell.legacy[0], cell.tp, cell.pp, _canonical(cell.faults))
        assert cell.config == dict(x.config), cell.id
        assert cell.warm == x.warm, cell.id
        assert cell.expected == set(x.expect), cell.id
        twin = by_id[cell_id(cell.tp, cell.pp, [], cell.faults)]
        assert (twin.expect, twin.config, twin.warm) == ("healthy", cell.config, cell.warm)


def test_catalog_cites_the_registry_cells() -> None:
    cited = {s.campaign.cell: s for s in load_catalog().signatures
             if s.campaign and s.campaign.parts[1] != "fixed"}
    recipes = {_id(e, x): (e, x) for e, x in _exposures()}
    for cell, sig in cited.items():
        assert cell in recipes, f"{sig.id} cites {cell}, which no registry recipe is"
        _entry, x = recipes[cell]
        assert sig.campaign.expect == sig.id, cell
        assert sig.id in x.expect, cell
    for cell, (_entry, x) in recipes.items():
        if len(x.expect) == 1:  # a recipe that shows one signature is the one it cites
            assert cell in cited, cell
            assert cited[cell].id == x.expect[0], cell
    fixes = {f.ref.removeprefix("sgl-project/sglang") for s in cited.values()
             for f in s.upstream_fix}
    for entry in REGISTRY.values():
        assert entry.fixes[0] in fixes, f"{entry.switch.value}: no cited signature names it"


def _readme_rows() -> dict[str, list[str]]:
    """Rows of the README's legacy table by their ``--only`` cell pattern."""
    rows: dict[str, list[str]] = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.search(r"hicache campaign --only '([^']+)'", line)
        if line.startswith("| `") and m:
            rows[m.group(1)] = [c.strip() for c in line.strip("|").split(" | ")]
    return rows


def _setup_tokens(x: Exposure) -> list[str]:
    """What the setup column must say for a recipe (flags, config keys, warm-up, faults)."""
    out = [f"--tp {x.tp}"] if x.tp > 1 else []
    out += [f"--pp {x.pp}"] if x.pp > 1 else []
    for key, value in x.config.items():
        flag = FLAGS.get(key)
        if flag is None or value is None:  # a null has no flag: it goes in a config file
            out.append(f"`{key}: {yaml.safe_dump(value).splitlines()[0]}`")
        elif value is True:
            out.append(flag)
        else:
            out.append(f"{flag} {','.join(value) if isinstance(value, list) else value}")
    out += ["warm L3"] if x.warm else []
    out += [f"fault `{f}`" for f in x.faults] or ["no fault"]
    return out


def test_readme_legacy_table_matches_the_registry() -> None:
    rows = _readme_rows()
    want = {f"{_id(e, x).rsplit('/', 1)[0]}/*": (e, x) for e, x in _exposures()}
    assert set(rows) == set(want)
    for pattern, (entry, x) in want.items():
        switch, _run, setup, _fails, names, fixed_by = rows[pattern]
        assert switch == f"`{entry.switch.value}`", pattern
        missing = [t for t in _setup_tokens(x) if t not in setup]
        assert not missing, f"{pattern}: the setup column lacks {missing}"
        assert re.findall(r"`([a-z0-9-]+)`", names) == list(x.expect), pattern
        assert re.findall(r"#\d+", fixed_by) == list(entry.fixes), pattern


def test_legacy_switches_doc_matches_the_registry() -> None:
    text = (ROOT / "docs" / "legacy-switches.md").read_text()
    sections = dict(re.findall(r"^## `([a-z-]+)` (.*?)(?=^## |\Z)", text, re.M | re.S))
    assert set(sections) == {s.value for s in LegacySwitch}
    for entry in REGISTRY.values():
        body = sections[entry.switch.value]
        flat = " ".join(body.split())
        heading, _, rest = body.partition("\n")
        assert re.findall(r"#\d+", heading) == list(entry.fixes), heading
        before = rest.split("**Upstream before the fix.**", 1)[1].split("\n- **", 1)[0]
        for version in entry.broken_in:
            assert version in before, f"{entry.switch.value}: {version} not named"
        for x in entry.exposures:
            assert f"cell `{_id(entry, x).rsplit('/', 1)[0]}/" in flat, entry.switch.value


def _fixture_cases() -> list[Any]:
    path = ROOT / "tests" / "fixtures" / "doctor" / "tools" / "runtime_bundles.py"
    spec = importlib.util.spec_from_file_location("runtime_bundles", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return [c for c in module.CASES if "--legacy" in c.args]


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("case", _fixture_cases(), ids=lambda c: c.name)
def test_fixture_recipe_is_a_registry_recipe(case: Any, tmp_path: Path) -> None:
    """The fixture's ``hicache run`` arguments, resolved by the CLI itself (``--torchrun-dir``
    writes the config without running), hold the registry recipe of its switch."""
    from cli import app

    cfg_file = tmp_path / "case.json"
    cfg_file.write_text(json.dumps(case.config))
    args = ["run", "--config", str(cfg_file), "--torchrun-dir", str(tmp_path / "run"),
            *case.args]
    if case.storage:
        args += ["--storage", "file", "--storage-path", str(tmp_path / "l3")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    cfg = load_config(json.loads((tmp_path / "run" / "config.json").read_text()))
    (switch,) = cfg.legacy
    x = _find(switch.value, cfg.topology.tp, cfg.topology.pp,
              tuple(f.compact() for f in cfg.faults))
    assert case.group in x.expect
    flat = _flat(cfg.model_dump(mode="json"))
    for key, value in x.config.items():
        assert flat[key] == value, f"{case.name}: {key} is {flat[key]!r}, not {value!r}"


# --- fault kinds ------------------------------------------------------------------------------


def test_every_kind_parameter_is_a_spec_field_of_its_type() -> None:
    fields = FaultSpec.model_fields
    assert set(fields) == {"kind", *SELECTORS, *PARAM_FIELDS}
    for entry in KINDS.values():
        for param in entry.params:
            assert param.type in typing.get_args(fields[param.name].annotation), param
            for choice in param.choices:  # every accepted value parses
                parse_fault(f"{entry.name}:{param.name}={choice}")


@pytest.mark.parametrize("kind", list(FaultKind), ids=lambda k: k.value)
def test_a_spec_acts_where_its_entry_says(kind: FaultKind) -> None:
    entry = KINDS[kind]
    assert entry.points, "a kind acts somewhere"
    if entry.point_param:
        assert entry.param("point").choices == tuple(p.value for p in entry.points)
        for point in entry.points:
            assert points_of(parse_fault(f"{kind.value}:point={point.value}")) == {point}
        return
    if entry.by_mode:
        assert tuple(entry.by_mode) == entry.param("mode").choices
        for mode, pts in entry.by_mode.items():
            assert points_of(parse_fault(f"{kind.value}:mode={mode}")) == set(pts)
        assert set().union(*entry.by_mode.values()) == set(entry.points)
    default = points_of(parse_fault(kind.value))
    assert default == (set(entry.points) if not entry.by_mode
                       else set(entry.by_mode[entry.param("mode").default or ""]))
    assert default <= set(FaultPoint)


def _readme_fault_table() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| kind | parameters | acts at | what it does |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return "\n".join(lines[start:end])


def test_readme_fault_table_is_the_registry() -> None:
    """The table is generated: paste ``python -c "from faults.describe import markdown_table;
    print(markdown_table())"`` over it after changing ``KINDS``."""
    assert _readme_fault_table() == markdown_table()
    text = (ROOT / "README.md").read_text()
    paragraph = text[text.index("**Fault kinds.**"):text.index("| kind | parameters |")]
    assert all(f"`{s}" in paragraph for s in SELECTORS), "every selector is named"


def test_the_profile_table_matches_the_profile_registry() -> None:
    """docs/legacy-switches.md, "Profiles": one row per profile, its switches, its host
    allocation and the switches it leaves off, as ``contracts/profiles.py`` derives them."""
    from hicache_runtime.contracts.profiles import DEFAULT_PROFILE, PROFILES

    text = (ROOT / "docs" / "legacy-switches.md").read_text()
    rows = {m[0]: m[1:] for m in re.findall(
        r"^\| `([a-z0-9.-]+)` \| (.*?) \| (per-rank|agreed) \| (.*?) \|$", text, re.M)}
    assert set(rows) == set(PROFILES)
    for name, p in PROFILES.items():
        on, alloc, left = rows[name]
        assert sorted(re.findall(r"`([a-z-]+)`", on)) == sorted(s.value for s in p.switches)
        assert alloc == p.host_alloc.value
        assert sorted(re.findall(r"`([a-z-]+)`", left)) == sorted(s.value for s in p.left_out)
        for switch in p.switches:  # a profile turns on only what its release ran
            assert REGISTRY[switch].fidelity is Fidelity.RELEASE
            assert p.release in REGISTRY[switch].broken_in
    assert f"default is `{DEFAULT_PROFILE}`" in " ".join(text.split())
