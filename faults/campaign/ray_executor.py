"""Campaign cells as Ray tasks: ``hicache campaign --executor ray [--address ADDR]``.

Each cell is one task that reserves as many CPUs as the cell has rank processes and helpers
working beside them (``_cpus``; capped at the largest node's CPUs, so a cell bigger than any
node still runs), runs the cell as the local executor does (``cells.run_cell``: warm-up, judged
run, doctor) in a working directory of its own on the node, and sends back its result with
the crash bundle packed (a tar of at most
:data:`MAX_BUNDLE_BYTES`), which the driver unpacks under ``--bundle-dir``. With
``keep_bundles`` the bundle stays on the node's disk instead and the result says where (its
node and path).

A task whose worker or node died (the process killed, the node lost: Ray's
``WorkerCrashedError``, ``NodeDiedError`` and friends) is submitted once more and its result
says so (``reruns``); a second loss is a failed cell (``error``). A cell counts as passed only
when its run reached its verdict. Cells on different nodes share no warm-up store and no
reference run (the local executor's memo): each task makes its own.

Ray is an optional dependency (``pip install -e '.[ray]'`` in the
checkout), imported only here.
"""

from __future__ import annotations

import io
import os
import socket
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache_runtime.contracts.errors import ConfigError, DumpFormatError, ToolUnavailable

if TYPE_CHECKING:
    from faults.campaign.cells import CellResult
    from faults.campaign.plan import CampaignSpec, CellSpec

MAX_BUNDLE_BYTES = 256 << 20
"""The largest packed bundle a task sends back (a real one is a few MB): a bigger one stays on
the node, and the result says where."""
KEEP_ROOT = Path(tempfile.gettempdir()) / "hicache-ray-bundles"
"""Where a node keeps bundles the driver asked it to keep (``keep_bundles``)."""
RERUNS = 1
"""How many times a cell whose worker died is submitted again."""

ResultHook = Callable[["CellSpec", "CellResult"], None]


def ray_module() -> Any:
    """The ``ray`` package; :class:`ToolUnavailable` with the install hint when it is absent."""
    try:
        import ray
    except ImportError:
        raise ToolUnavailable("the Ray executor needs ray, which is not installed",
                              hint="pip install -e '.[ray]' in the checkout (or pip install ray)")\
            from None
    return ray


def run_on_ray(spec: CampaignSpec, cells: list[CellSpec], *, bundle_root: Path,
               address: str | None, storage_url: str | None = None,
               keep_bundles: bool = False) -> Iterator[tuple[CellSpec, CellResult]]:
    """Run ``cells`` as Ray tasks on the cluster at ``address`` (None: a Ray instance of this
    process's own); yield each cell with its result as it finishes."""
    from faults.campaign.cells import CellResult

    ray = ray_module()
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False, include_dashboard=False,
                     configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError("--address", f"no Ray cluster at {address}: {exc}".splitlines()[0],
                              hint="ray start --head, then pass its address (host:port)") \
                from None
    biggest = max((int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]),
                  default=1)
    task = ray.remote(_cell_task)
    spec_data = spec.model_dump(mode="json")
    pending: dict[Any, tuple[CellSpec, int]] = {}

    def submit(cell: CellSpec, attempt: int) -> None:
        cpus = max(1, min(_cpus(spec, cell), biggest))
        ref = task.options(num_cpus=cpus, max_retries=0, name=f"hicache-cell {cell.id}"[:100]) \
            .remote(spec_data, cell.model_dump(mode="json"), storage_url, keep_bundles)
        pending[ref] = (cell, attempt)

    for cell in cells:
        submit(cell, 0)
    while pending:
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        cell, attempt = pending.pop(ref)
        try:
            out = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # the task itself raised: not a lost node
            yield cell, _failed(cell, spec, f"the cell's task raised: {_first_line(exc)}",
                                attempt)
            continue
        except ray.exceptions.RayError as exc:  # the worker or its node is gone
            if attempt < RERUNS:
                submit(cell, attempt + 1)
                continue
            yield cell, _failed(cell, spec, f"its worker died {attempt + 1} times "
                                            f"({type(exc).__name__})", attempt)
            continue
        result = CellResult.model_validate(out["result"])
        result.node = out["node"]
        result.reruns = attempt
        if out["bundle_tar"] is not None:
            result.bundle = str(_unpack(out["bundle_tar"], bundle_root))
        yield cell, result


def _cell_task(spec_data: dict[str, Any], cell_data: dict[str, Any], storage_url: str | None,
               keep_bundles: bool) -> dict[str, Any]:
    """On a node: run one cell in a working directory of its own."""
    from faults.campaign.cells import run_cell
    from faults.campaign.plan import CampaignSpec, CellSpec

    spec = CampaignSpec.model_validate(spec_data)
    cell = CellSpec.model_validate(cell_data)
    node = socket.gethostname()
    with tempfile.TemporaryDirectory(prefix="hicache-ray-cell-") as work:
        bundles = KEEP_ROOT / spec.name if keep_bundles else Path(work) / "bundles"
        bundles.mkdir(parents=True, exist_ok=True)
        result = run_cell(spec, cell, Path(work) / "cell", bundles, storage_url=storage_url)
        packed = None
        if result.bundle is not None and not keep_bundles:
            packed = _pack(Path(result.bundle))
            if packed is None:  # too big to send: it stays here, and the result says where
                kept = KEEP_ROOT / spec.name / Path(result.bundle).name
                kept.parent.mkdir(parents=True, exist_ok=True)
                os.replace(result.bundle, kept)
                result.bundle = str(kept)
        return {"result": result.model_dump(mode="json"), "bundle_tar": packed,
                "node": node}


def _cpus(spec: CampaignSpec, cell: CellSpec) -> int:
    """CPUs a cell's task reserves: one per rank, plus its helpers that work while the ranks
    do: the launcher (it drives the ranks' start, the dumps, the bundle; a single rank runs
    in it instead), and the DP controller that routes requests when there are DP groups.
    The zygote only forks and waits. Capped by the caller at the largest node."""
    from faults.campaign.plan import cell_settings

    dp = cell_settings(spec, cell).get("topology.dp", 1)
    groups = dp if isinstance(dp, int) and dp > 0 else 1
    ranks = cell.tp * cell.pp * groups
    return ranks + (1 if ranks > 1 else 0) + (1 if groups > 1 else 0)


def _pack(bundle: Path) -> bytes | None:
    """The bundle as a gzipped tar (its folder name at the top), or None when bigger than
    :data:`MAX_BUNDLE_BYTES`."""
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    if size > MAX_BUNDLE_BYTES:
        return None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(bundle, arcname=bundle.name)
    return buf.getvalue()


def _unpack(data: bytes, root: Path) -> Path:
    """Unpack a task's bundle under ``root``: one top folder, regular files and folders only,
    nothing outside it (tarfile's ``data`` filter), at most :data:`MAX_BUNDLE_BYTES`."""
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        tops = {Path(m.name).parts[0] for m in members if m.name}
        if len(tops) != 1 or sum(m.size for m in members) > MAX_BUNDLE_BYTES:
            raise DumpFormatError("a cell's bundle from a Ray task is not one folder of "
                                  "bounded size; not unpacked")
        top = tops.pop()
        if (root / top).exists():
            raise DumpFormatError(f"bundle {top} is already under {root}; not overwritten")
        tar.extractall(root, filter="data")
    return root / top


def _failed(cell: CellSpec, spec: CampaignSpec, why: str, attempt: int) -> CellResult:
    from faults.campaign.cells import CellResult, identity

    return CellResult(**identity(cell), observed="error", passed=False, outcome="error",
                      wall_s=0.0, error=why, detail="the cell did not reach its verdict",
                      properties={p.value: None for p in spec.properties}, reruns=attempt)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1][:300] if text else type(exc).__name__
