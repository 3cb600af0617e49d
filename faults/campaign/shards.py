"""CI shards of a campaign, and the merge of their results into one.

``hicache campaign --shard I/N`` runs the I-th of N deterministic, balanced subsets of the
selected cells: each cell's cost is estimated from what it runs (ranks x requests, twice for a
cell that warms L3 first, plus a fixed start-up cost), and the cells are dealt, costliest first,
to the shard with the least estimated work so far (ties to the lower shard, cells in id order),
so every machine computes the same partition from the spec alone. ``hicache campaign merge
a.json b.json ... -o all.json`` joins the shards' JSON results into one result, cells in the
order an unsharded run would have them, refusing results of different campaigns, a cell that
appears twice, or a set of shards that is incomplete.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from faults.campaign.cells import CampaignResult, CellResult, property_results
from faults.campaign.plan import CampaignSpec, CellSpec, Property, cell_settings
from hicache_runtime.contracts.errors import ConfigError

MAX_SHARDS = 1024
MAX_RESULT_BYTES = 64 << 20
_SHARD = re.compile(r"(\d{1,4})/(\d{1,4})")
START_COST = 40
"""Estimated cost of starting a cell's ranks, in request-rank units: a cell of few requests is
not free."""


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` (1 <= I <= N <= MAX_SHARDS) as (I, N)."""
    m = _SHARD.fullmatch(text.strip())
    if m is None or not 1 <= int(m[1]) <= int(m[2]) <= MAX_SHARDS:
        raise ConfigError("--shard", f"{text[:32]!r} is not I/N with 1 <= I <= N <= {MAX_SHARDS}",
                          hint="e.g. --shard 2/4: the second of four shards")
    return int(m[1]), int(m[2])


def cell_cost(spec: CampaignSpec, cell: CellSpec) -> int:
    """A cell's estimated cost: its ranks times its requests (both runs when it warms L3
    first; the cache-disabled reference once more when it compares outputs), plus start-up."""
    settings = cell_settings(spec, cell)
    ranks = cell.tp * cell.pp * int(settings.get("topology.dp", 1) or 1)
    requests = int(settings.get("workload.requests", 32) or 32)
    runs = 1 + int(cell.warm) + int(cell.compare)
    return ranks * (START_COST + requests * runs)


def shard(spec: CampaignSpec, cells: list[CellSpec], index: int, count: int) -> list[CellSpec]:
    """The cells of shard ``index`` of ``count`` (1-based), in their original order."""
    loads = [0] * count
    owner: dict[str, int] = {}
    for cell in sorted(cells, key=lambda c: (-cell_cost(spec, c), c.id)):
        target = min(range(count), key=lambda i: (loads[i], i))
        loads[target] += cell_cost(spec, cell)
        owner[cell.id] = target
    return [c for c in cells if owner[c.id] == index - 1]


def merge(results: list[CampaignResult]) -> CampaignResult:
    """One result from shards' results: every shard of one run (the same campaign, the same
    selection, shards 1..N each once), cells in the order the whole run has them, wall time
    the slowest shard's, reuse counts summed, properties judged over every cell."""
    if not results:
        raise ConfigError("merge", "no results to merge")
    names = {r.name for r in results}
    if len(names) != 1:
        raise ConfigError("merge", f"results of different campaigns: {sorted(names)[:4]}")
    if any(r.shard is None for r in results):
        raise ConfigError("merge", "a result is a whole run, not a shard (--shard I/N)")
    counts = {r.shard.split("/")[1] for r in results if r.shard}
    seen = sorted(int(r.shard.split("/")[0]) for r in results if r.shard)
    if len(counts) != 1 or seen != list(range(1, int(next(iter(counts))) + 1)):
        raise ConfigError("merge", f"shards {', '.join(r.shard or '' for r in results)}: "
                                   "every shard of one run, each once")
    order = results[0].selection
    if any(r.selection != order for r in results):
        raise ConfigError("merge", "the shards ran different selections of cells")
    cells: dict[str, CellResult] = {}
    for r in results:
        for c in r.cells:
            if c.id in cells:
                raise ConfigError("merge", f"cell {c.id[:120]!r} appears in two shards")
            cells[c.id] = c
    missing = [i for i in order if i not in cells]
    extra = [i for i in cells if i not in set(order)]
    if missing or extra:
        raise ConfigError("merge", f"the shards' cells are not their selection "
                                   f"({len(missing)} missing, {len(extra)} extra)")
    ordered = [cells[i] for i in order]
    props = [Property(p.property) for p in results[0].properties]
    return CampaignResult(
        name=results[0].name, started_at=min(r.started_at for r in results),
        wall_s=max(r.wall_s for r in results), cells=ordered,
        properties=property_results(CampaignSpec(properties=props), ordered),
        references_reused=sum(r.references_reused for r in results),
        warmups_reused=sum(r.warmups_reused for r in results))


def read_result(path: Path) -> CampaignResult:
    """A campaign result JSON (untrusted: bounded, validated)."""
    if not path.is_file() or path.stat().st_size > MAX_RESULT_BYTES:
        raise ConfigError("merge", f"{path}: not a file of at most {MAX_RESULT_BYTES >> 20} MiB")
    try:
        data: Any = path.read_text(encoding="utf-8", errors="replace")
        return CampaignResult.model_validate_json(data)
    except ValueError as exc:
        raise ConfigError("merge", f"{path}: not a campaign result "
                                   f"({str(exc).splitlines()[0][:200]})") from None
