"""The layers of the code base, checked from the source: no upward import, no file cycle, no
folder a newcomer has to read as one flat room.

The layers form two ordered lists, lowest first, that share their bottom and their top
(:data:`CHAINS`): a module imports only from its own layer or from one before it in a list that
holds both. The runtime and the doctor sit side by side: neither imports the other.

* the runtime's list: ``hicache_runtime.contracts`` (errors, bundle models, event names and
  payloads, registries, topology; torch-free, imports nothing of ours outside itself), the
  fault definitions (``faults``: points, specs, the injector), then the runtime's subpackages
  in the order of :data:`RUNTIME_ORDER`;
* the doctor's list: contracts, ``signatures`` (the catalog), then the doctor's model
  (``doctor.model``: evidence, findings, frame classes) and its stages in the order they run
  (``read``, ``ranks``, ``facts``, ``report``), then the doctor's own root modules
  (``diagnose``, ``capture``); all torch-free;
* both end in ``faults.campaign`` (it runs the runtime and asks the doctor) and the front end
  (``cli``, ``render``).

Imports under ``if TYPE_CHECKING:`` and inside functions count for layering (a dependency is a
dependency, whenever it is paid); only module-level imports outside ``TYPE_CHECKING`` count for
cycles, since those are the ones that break at import time.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hicache_runtime", "faults", "doctor", "signatures")
FRONT = ("cli", "render")
RUNTIME_ORDER = ("config", "telemetry", "dist", "kv", "l3", "cache", "engine", "launch")
DOCTOR_ORDER = ("model", "read", "ranks", "facts", "report")
TOP = ("campaign", "front")
CHAINS = (
    ("contracts", "faults", *(f"runtime.{x}" for x in RUNTIME_ORDER), *TOP),
    ("contracts", "signatures", *(f"doctor.{x}" for x in DOCTOR_ORDER), "doctor", *TOP),
)
#: Runtime modules at the runtime package's root and the layer they belong to.
RUNTIME_ROOT_MODULES = {"config": "config", "config_files": "config"}
TORCH_FREE = ("contracts", "faults", "signatures", "doctor",
              *(f"doctor.{x}" for x in DOCTOR_ORDER))
HEAVY = ("torch",)  # numpy is a dependency of the light install (the log prefilter)
MAX_MODULES_PER_FOLDER = 15


@dataclass
class Module:
    name: str
    path: Path
    imports: set[str] = field(default_factory=set)  # every import, for layering
    eager: set[str] = field(default_factory=set)  # module-level, outside TYPE_CHECKING
    third_party: set[str] = field(default_factory=set)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: Module) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        pkg = module.name.split(".")
        if module.path.name != "__init__.py":
            pkg = pkg[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join([*pkg, base] if base else pkg)
    # ``from pkg import sub`` imports the submodule when there is one; resolved later.
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _scan(module: Module) -> None:
    tree = ast.parse(module.path.read_text(encoding="utf-8"))

    def visit(nodes: list[ast.stmt], eager: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module):
                    module.imports.add(target)
                    if eager:
                        module.eager.add(target)
                    module.third_party.add(target.split(".")[0])
            elif isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.body, False)
                visit(node.orelse, eager)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        for target in _targets(sub, module):
                            module.imports.add(target)
                            module.third_party.add(target.split(".")[0])
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, block, None) or []
                    for item in inner:
                        visit(item.body if isinstance(item, ast.ExceptHandler) else [item],
                              eager)

    visit(tree.body, True)


def load_modules() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    paths = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    paths += [ROOT / f"{name}.py" for name in FRONT]
    for path in paths:
        module = Module(_module_name(path), path)
        _scan(module)
        modules[module.name] = module
    return modules


def resolve(target: str, modules: dict[str, Module]) -> str | None:
    """The module of ours an import target loads, or None for third-party code."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def layer(name: str) -> str:
    parts = name.split(".")
    if parts[0] in FRONT:
        return "front"
    if parts[0] == "faults":
        return "campaign" if len(parts) > 1 and parts[1] == "campaign" else "faults"
    if parts[0] == "signatures":
        return "signatures"
    if parts[0] == "doctor":
        if len(parts) > 1 and parts[1] in DOCTOR_ORDER:
            return "doctor." + parts[1]
        assert len(parts) == 1 or (ROOT / "doctor" / f"{parts[1]}.py").is_file(), \
            f"{name}: doctor subpackage not in DOCTOR_ORDER"
        return "doctor"
    if len(parts) == 1 or parts[1] == "contracts":
        return "contracts"
    if parts[1] in RUNTIME_ROOT_MODULES:
        return "runtime." + RUNTIME_ROOT_MODULES[parts[1]]
    assert parts[1] in RUNTIME_ORDER, f"{name}: runtime subpackage not in RUNTIME_ORDER"
    return "runtime." + parts[1]


def may_import(src: str, dst: str) -> bool:
    """``dst`` is ``src`` or comes before it in a list that holds both."""
    return src == dst or any(src in chain and dst in chain
                             and chain.index(dst) < chain.index(src) for chain in CHAINS)


def test_every_import_points_down() -> None:
    modules = load_modules()
    upward = []
    for module in modules.values():
        src = layer(module.name)
        for target in module.imports:
            dst_name = resolve(target, modules)
            if dst_name is None:
                continue
            dst = layer(dst_name)
            if not may_import(src, dst):
                upward.append(f"{module.name} ({src}) imports {dst_name} ({dst})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(set(upward)))


def test_torch_free_layers_import_no_heavy_package() -> None:
    modules = load_modules()
    heavy = [f"{m.name} imports {pkg}" for m in modules.values()
             if layer(m.name) in TORCH_FREE for pkg in sorted(m.third_party & set(HEAVY))]
    assert not heavy, "\n".join(heavy)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_file_cycles() -> None:
    modules = load_modules()
    graph: dict[str, set[str]] = {}
    for module in modules.values():
        deps = {resolve(t, modules) for t in module.eager}
        # A package's __init__ is loaded by importing any of its modules; only a module's
        # own imports make a cycle, so a package does not depend on its parent here.
        graph[module.name] = {d for d in deps if d and d != module.name
                              and not module.name.startswith(d + ".")}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_folder_is_a_flat_room() -> None:
    crowded = []
    for pkg in PACKAGES:
        for folder in [ROOT / pkg, *[p for p in (ROOT / pkg).rglob("*") if p.is_dir()]]:
            count = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
            if count > MAX_MODULES_PER_FOLDER:
                crowded.append(f"{folder.relative_to(ROOT)}: {count} modules")
    assert not crowded, "\n".join(crowded)


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The rules themselves: a doctor module importing the runtime, contracts importing the
    runtime, and a kv module importing the engine are all refused."""
    assert not may_import(layer("doctor.read.bundle"), layer("hicache_runtime.launch.run"))
    assert not may_import(layer("hicache_runtime.contracts.bundle"),
                          layer("hicache_runtime.kv.pools"))
    assert not may_import(layer("hicache_runtime.kv.pools"), layer("hicache_runtime.engine.rank"))
    assert not may_import(layer("faults.injector"), layer("hicache_runtime.telemetry.tracer"))
    assert may_import(layer("faults.campaign.cells"), layer("doctor.diagnose"))
    assert may_import(layer("hicache_runtime.engine.rank"), layer("faults.injector"))
    assert not may_import(layer("doctor.read.bundle"), layer("doctor.ranks.table"))
    assert not may_import(layer("doctor.ranks.table"), layer("doctor.report.model"))
    assert may_import(layer("doctor.facts.derive"), layer("doctor.model.findings"))
    assert not may_import(layer("hicache_runtime.l3.tier"), layer("doctor.read.bundle"))
    assert not may_import(layer("signatures.loader"), layer("doctor.model.evidence"))
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
