"""The triage install: ``pip install .`` (a checkout) without the ``runtime`` extra.

The doctor, the catalog and runbooks work without torch: their own test modules pass in an
interpreter where importing torch fails; the runtime commands say in one line how to install
the runtime; the base dependencies cover what the torch-free code imports; and CI installs
and tests exactly as the README says.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.readme_blocks import readme_block, readme_line

ROOT = Path(__file__).resolve().parents[1]

#: The import name of each base dependency (distribution name -> module).
IMPORT_NAME = {"pyyaml": "yaml", "markdown-it-py": "markdown_it", "google-re2": "re2",
               "google-crc32c": "google_crc32c"}

#: Code the triage commands run (``faults`` and ``trace`` included): torch-free
#: (tests/test_layers.py holds the layering).
TRIAGE_CODE = ("doctor", "signatures", "hicache_runtime/contracts", "hicache_runtime/config.py",
               "hicache_runtime/config_files.py", "hicache_runtime/telemetry/perfetto.py",
               "faults/kinds", "faults/points.py", "faults/spec.py", "faults/describe.py",
               "hicache_runtime/l3/audit.py", "hicache_runtime/l3/envelope.py",
               "hicache_runtime/l3/keys.py", "hicache_runtime/l3/backend.py",
               "hicache_runtime/l3/backends/file.py", "hicache_runtime/l3/formats.py",
               "cli.py", "render.py")

#: Tests under tests/doctor and tests/signatures that need torch themselves: they make what
#: the doctor reads (bundles from real runs, real gloo Flight Recorder dumps) or run torch's
#: own analyzer. Everything else there must pass without torch.
NEEDS_TORCH_MODULES = ("tests/doctor/test_runtime_bundle.py",)
NEEDS_TORCH_TESTS = (
    "tests/doctor/test_flight_recorder.py::test_torch_analyzer_fails_on_the_same_gloo_dumps",
    "tests/doctor/test_flight_recorder.py::test_fresh_gloo_dumps_of_a_crossed_hang",
    # captures a live `hicache run`, which is the runtime
    "tests/doctor/test_capture.py::test_capture_a_live_hicache_run_finds_its_ranks_not_the_zygote",
)

_BLOCK_TORCH = """\
import importlib.abc, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""

#: A pytest plug-in for the torch-free session: it says at the end whether torch stayed out.
_CHECK_PLUGIN = """\
import sys


def pytest_terminal_summary(terminalreporter):
    try:
        import torch  # noqa: F401
    except ImportError:
        blocked = "torch" not in sys.modules
    else:
        blocked = False
    terminalreporter.write_line(f"torch-free session: {'yes' if blocked else 'NO'}")
"""


def _no_torch_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose interpreters cannot import torch (``sitecustomize`` runs first)."""
    site = tmp_path / "no_torch"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_BLOCK_TORCH)
    (site / "torch_free_check.py").write_text(_CHECK_PLUGIN)
    return {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1",
            "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


#: The torch-free session runs in this many parts, each its own test item: pytest-xdist spreads
#: them over its workers, so no part is a long tail at the end of the suite.
TORCH_FREE_PARTS = 4


#: Seconds the heavier modules take (measured with --durations=0 over tests/doctor and
#: tests/signatures, two workers, one run); the rest take about DEFAULT_MODULE_S. Only the
#: balance of the parts depends on these: with stale figures one part took 400 s and the
#: others 120-160 s.
MODULE_S = {"test_hostile.py": 80, "test_corpus.py": 76, "test_linear_time.py": 65,
            "test_without_torch.py": 24, "test_regression.py": 24, "test_fuzz.py": 24,
            "test_flight_recorder.py": 18, "test_unknowns.py": 15, "test_cli.py": 14,
            "test_real_bundles.py": 14, "test_memory.py": 13, "test_capture.py": 6,
            "test_index.py": 5}
DEFAULT_MODULE_S = 2


def torch_free_modules(part: int) -> list[str]:
    """The test modules of tests/doctor and tests/signatures in ``part``: every module in
    exactly one part (the longest first, each into the part with the least time so far),
    none that needs torch."""
    mods = sorted(p.relative_to(ROOT).as_posix() for d in ("tests/doctor", "tests/signatures")
                  for p in (ROOT / d).glob("test_*.py"))
    mods = [m for m in mods if m not in NEEDS_TORCH_MODULES]
    load = [0.0] * TORCH_FREE_PARTS
    parts: list[list[str]] = [[] for _ in range(TORCH_FREE_PARTS)]
    for m in sorted(mods, key=lambda m: -MODULE_S.get(m.rsplit("/", 1)[-1], DEFAULT_MODULE_S)):
        i = load.index(min(load))
        parts[i].append(m)
        load[i] += MODULE_S.get(m.rsplit("/", 1)[-1], DEFAULT_MODULE_S)
    return sorted(parts[part])


@pytest.mark.slow
@pytest.mark.parametrize("part", range(TORCH_FREE_PARTS))
def test_the_doctor_and_catalog_tests_pass_without_torch(tmp_path: Path, part: int) -> None:
    """tests/doctor and tests/signatures, slow ones included, in a torch-free interpreter
    (about 4 minutes of one core, in four parts). A session that runs these tests
    does not run those modules a second time with torch (tests/conftest.py)."""
    modules = torch_free_modules(part)
    assert modules
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-p", "torch_free_check", *modules,
            *(f"--deselect={t}" for t in NEEDS_TORCH_TESTS if t.split("::")[0] in modules)]
    proc = subprocess.run(args, cwd=ROOT, env=_no_torch_env(tmp_path), capture_output=True,
                          text=True, timeout=1800, check=False)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "torch-free session: yes" in proc.stdout, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed, tail
    assert not re.search(r"\d+ (failed|errors?)\b", proc.stdout), tail


def test_the_torch_free_parts_hold_every_doctor_and_catalog_module() -> None:
    parts = [torch_free_modules(p) for p in range(TORCH_FREE_PARTS)]
    every = [m for part in parts for m in part]
    assert len(every) == len(set(every))
    on_disk = {p.relative_to(ROOT).as_posix() for d in ("tests/doctor", "tests/signatures")
               for p in (ROOT / d).glob("test_*.py")}
    assert set(every) == on_disk - set(NEEDS_TORCH_MODULES)
    assert len(every) >= 25  # the whole suite, not a stray subset


@pytest.mark.parametrize("args", [["run", "--requests", "1"], ["campaign", "--list"],
                                  ["inject", "dma-lag:ms=5"], ["inject", "--replay", "x"]],
                         ids=lambda a: "-".join(a[:2]))
def test_runtime_commands_say_how_to_install_the_runtime(tmp_path: Path,
                                                         args: list[str]) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=tmp_path,
                          env=_no_torch_env(tmp_path), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert f"hicache {args[0]} needs the runtime" in lines[0]
    assert "pip install -e '.[runtime]'" in lines[0]


_LOADED = """\
import atexit, json, sys
atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))
from cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("args", [["signatures", "list"], ["faults", "list", "--json"],
                                  ["trace", "schema"]], ids=lambda a: "-".join(a))
def test_triage_commands_load_no_runtime_package(tmp_path: Path, args: list[str]) -> None:
    """Beyond the torch-free contracts, a triage command loads only the config models (typer
    builds every command's options, and ``run``'s show the config's defaults)."""
    proc = subprocess.run([sys.executable, "-c", _LOADED, *args], cwd=ROOT,
                          env=_no_torch_env(tmp_path), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    runtime = [m for m in loaded if m.startswith("hicache_runtime.")
               and m.split(".")[1] not in ("contracts", "config", "config_files")]
    assert not runtime, runtime
    assert not [m for m in loaded if m == "torch" or m.startswith("torch.")]


def test_the_store_audit_runs_without_torch(tmp_path: Path) -> None:
    """``hicache doctor --store`` is triage: it reads a store with the base install."""
    store = tmp_path / "l3"
    store.mkdir()
    (store / ("a" * 64 + "_m_0_1.bin")).write_bytes(b"\0" * 64)
    proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), "doctor", "--store",
                           str(store), "--json"], cwd=tmp_path, env=_no_torch_env(tmp_path),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["formats"] == {"upstream": 1}


def _third_party_imports(paths: tuple[str, ...]) -> set[str]:
    found: set[str] = set()
    files = [p for name in paths for p in ([ROOT / name] if name.endswith(".py")
                                           else (ROOT / name).rglob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    ours = {"doctor", "signatures", "hicache_runtime", "faults", "cli", "render"}
    return found - ours - set(sys.stdlib_module_names)


def test_base_dependencies_are_what_triage_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}

    base = {IMPORT_NAME.get(n, n) for n in names(project["dependencies"])}
    extras = project["optional-dependencies"]
    # cli.py imports torch only inside the runtime commands, after their install check.
    assert _third_party_imports(TRIAGE_CODE) - {"torch"} == base
    assert {"torch", "redis"} <= names(extras["runtime"])
    assert not {"torch", "redis"} & base
    assert "hicache-doctor" in names(extras["dev"]), "dev installs the runtime extra"
    assert "py-spy" in names(extras["capture"])


def _shell_command(text: str) -> str:
    return " ".join(text.replace("\\\n", " ").split())


@pytest.mark.slow
def test_the_readme_triage_install_runs_as_written(tmp_path: Path) -> None:
    """The triage line in a copy of the checkout (its tracked files) with a fresh virtual
    environment active: ``pip install .`` installs no torch, and the doctor reads a log
    folder."""
    import shutil

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    if not tracked or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    copy = tmp_path / "checkout"
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    shutil.copytree(ROOT / "tests" / "fixtures" / "doctor" / "mixed" / "tp4-rank2-missing" /
                    "logs", copy / "logs")
    line = readme_line("pip install . && hicache doctor logs/")
    venv = tmp_path / "venv"
    probe = "import importlib.util as u; print('torch:', u.find_spec('torch'))"
    script = f'{sys.executable} -m venv {venv} && . {venv}/bin/activate && {line} && ' \
        f'python -c "{probe}"'
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = "/usr/bin:/bin"
    proc = subprocess.run(["bash", "-c", script], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "collective-order-deadlock" in proc.stdout, proc.stdout[-3000:]
    assert "torch: None" in proc.stdout, proc.stdout[-2000:]


def test_ci_runs_the_readme_test_command() -> None:
    install = readme_block("python3 -m venv .venv && . .venv/bin/activate && pip install -c "
                           "constraints/cpu.txt -e '.[runtime,capture]'")[0]
    tests = readme_block("python3 -m venv .venv && . .venv/bin/activate && pip install -c "
                         "constraints/cpu.txt -e '.[dev]'")[0]
    assert "'.[runtime,capture]'" in install
    assert install.endswith("hicache campaign")
    assert "'.[dev]'" in tests
    assert tests.endswith(" && python -m pytest -n 4")
    # CI runs the command's installs, waits for the system packages it installs meanwhile
    # (and nothing else), then the command's tests.
    installs, run_tests = _shell_command(tests).rsplit(" && ", 1)
    ci = _shell_command((ROOT / ".ci" / "run").read_text())
    assert ci.count(installs) == 1
    assert ci.count(run_tests) == 1
    between = ci[ci.index(installs) + len(installs):ci.index(run_tests)]
    assert between.split() == ['if', '[', '-n', '"$apt_pid"', '];', 'then', 'wait',
                               '"$apt_pid"', '||', 'true;', 'cat', '"$apt_log";', 'fi'], between
    assert ci.endswith(run_tests)


def test_a_generic_import_name_taken_by_another_distribution_stops_hicache(
        tmp_path: Path) -> None:
    """Another distribution's ``doctor`` package first on the path: ``hicache`` names the
    shadowed import and where it would come from, and exits 2 before running anything."""
    other = tmp_path / "site"
    (other / "doctor").mkdir(parents=True)
    (other / "doctor" / "__init__.py").write_text("raise SystemExit('the other doctor ran')\n")
    code = (f"import sys; sys.path.insert(0, {str(other)!r}); "
            "from cli import main; main(['--version'])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"doctor from {other}" in proc.stderr
    assert "the other doctor ran" not in proc.stderr
    whole = subprocess.run([sys.executable, "-c", "from cli import main; main(['--version'])"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout.startswith("hicache ")
