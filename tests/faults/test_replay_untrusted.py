"""``hicache inject --replay`` treats a crash bundle as untrusted input.

A genuine bundle is made once (a real run with an injected crash); each test edits a copy of
its manifest the way an attacker would and replays it with the real CLI, in a subprocess under
an address-space cap, with its own working directory, ``TMPDIR`` and ``HOME``, so that "writes
nothing outside its output directory" is checked on every file the replay could reach.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli import app
from faults.campaign.cells import run_and_diagnose
from faults.campaign.replay_guard import MAX_MANIFEST_BYTES
from faults.spec import parse_faults
from hicache_runtime.config import load_config

ROOT = Path(__file__).resolve().parents[2]
AS_CAP = 1536 << 20
CRASH = "crash:point=scheduler.step,step=3"


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real crash bundle of a small single-rank run."""
    root = tmp_path_factory.mktemp("genuine")
    cfg = load_config({"workload.requests": 6, "faults": parse_faults([CRASH])})
    obs = run_and_diagnose(cfg, warm=False, compare=False, bundle_root=root)
    assert obs.bundle is not None
    return Path(obs.bundle)


@pytest.fixture
def craft(genuine: Path, tmp_path: Path) -> Callable[[Callable[[dict[str, Any]], None]], Path]:
    """A copy of the genuine bundle whose manifest ``edit`` has changed."""

    def make(edit: Callable[[dict[str, Any]], None]) -> Path:
        bundle = tmp_path / "incoming" / "bundle"
        shutil.copytree(genuine, bundle)
        manifest = json.loads((bundle / "manifest.json").read_text())
        edit(manifest)
        (bundle / "manifest.json").write_text(json.dumps(manifest))
        return bundle

    return make


@pytest.fixture
def listener() -> Iterator[tuple[int, list[object]]]:
    """A TCP port that records every connection made to it (a stand-in for a remote store)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(0.2)
    accepted: list[object] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(2)
        sock.close()


def hicache(args: list[str], *, cwd: Path, tmp: Path,
            timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess: address space capped, private TMPDIR and HOME."""
    code = ("import resource, sys\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({AS_CAP}, {AS_CAP}))\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            f"sys.argv = ['hicache', *{args!r}]\n"
            "from cli import main\n"
            "main()\n")
    env = {**os.environ, "TMPDIR": str(tmp / "tmpdir"), "HOME": str(tmp / "home"),
           "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "NO_COLOR": "1",
           "TERMINAL_WIDTH": "200"}
    for d in (cwd, tmp / "tmpdir", tmp / "home"):
        d.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


def files_under(root: Path) -> set[Path]:
    """Every path under ``root``, after making the sandbox directories :func:`hicache` uses."""
    for d in ("tmpdir", "home", "cwd"):
        (root / d).mkdir(exist_ok=True)
    return set(root.rglob("*"))


def one_error(text: str) -> str:
    """The one ``error:`` line of ``text`` (a ``hint:`` line may follow), no traceback."""
    lines = text.strip().splitlines()
    assert "Traceback" not in text, text
    assert lines[0].startswith("error:"), text
    assert all(ln.startswith("hint:") for ln in lines[1:]), text
    assert len(lines) <= 2, text
    return lines[0]


def one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    return one_error(res.stderr)


# --- what a crafted bundle asks for, and what the replay does -------------------------------------


def test_crafted_bundle_writes_only_under_the_output_dir_and_contacts_nothing(
        craft: Callable[..., Path], tmp_path: Path, listener: tuple[int, list[object]]) -> None:
    port, accepted = listener
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir(parents=True)
    victim.write_text("precious\n")
    elsewhere = tmp_path / "elsewhere"

    def edit(m: dict[str, Any]) -> None:
        obs, st = m["config"]["observability"], m["config"]["storage"]
        obs["trace_path"] = str(victim)
        obs["bundle_dir"] = str(elsewhere / "bundles")
        st.update(backend="redis", url=f"redis://user:secret@127.0.0.1:{port}/0",
                  path=str(elsewhere / "store"))
        m["config"]["faults"].append({"kind": "stage-lag", "rid": "chat*", "ms": 1})

    bundle = craft(edit)
    cwd = tmp_path / "cwd"
    before = files_under(tmp_path)
    res = hicache(["inject", "--replay", str(bundle)], cwd=cwd, tmp=tmp_path)
    assert res.returncode == 0, res.stderr  # and it still reproduces the crash
    assert victim.read_text() == "precious\n"
    assert not elsewhere.exists()
    assert accepted == []
    out = cwd / "hicache-bundles"
    new = files_under(tmp_path) - before
    assert new
    assert all(p == out or out in p.parents for p in new), sorted(new)
    assert not list(out.glob(".replay-*")), "scratch files are removed"
    assert list(out.glob("*/manifest.json")), "the replay's bundle stays"
    # what ran was shown first, with what the bundle asked for and did not get
    for shown in ("topology  tp=1 pp=1", "workload  6 requests", "; stage-lag:rid=chat*,ms=1",
                  "storage   a private file store", f"output    {Path('hicache-bundles')}",
                  f"trace file {victim} is not written", "a redis store at redis://***@127.0.0.1",
                  "not contacted"):
        assert shown in res.stderr, res.stderr
    assert "secret" not in res.stderr + res.stdout


@pytest.mark.slow
@pytest.mark.multiproc
def test_crafted_multirank_bundle_keeps_rank_files_under_the_output_dir(
        craft: Callable[..., Path], tmp_path: Path) -> None:
    """Rank processes and the launcher's run directory are covered too (tp=2)."""
    victim = tmp_path / "home" / ".profile"
    victim.parent.mkdir(parents=True)
    victim.write_text("precious\n")

    def edit(m: dict[str, Any]) -> None:
        m["config"]["topology"] = {"tp": 2, "pp": 1}
        m["config"]["observability"]["trace_path"] = str(victim)

    bundle = craft(edit)
    cwd = tmp_path / "cwd"
    before = files_under(tmp_path)
    res = hicache(["inject", "--replay", str(bundle), "--out", "replay-out"], cwd=cwd,
                  tmp=tmp_path)
    assert res.returncode in (0, 1), res.stderr
    assert "topology  tp=2 pp=1 (2 rank processes)" in res.stderr
    assert victim.read_text() == "precious\n"
    out = cwd / "replay-out"
    new = files_under(tmp_path) - before
    assert new
    assert all(p == out or out in p.parents for p in new), sorted(new)
    assert list(out.glob("*/rank1")), "a two-rank bundle was written under --out"


@pytest.mark.parametrize(("edit", "says"), [
    (lambda m: m["config"].update(topology={"tp": 4, "pp": 4}),
     "tp=4 pp=4 dp=1 is 16 rank processes; a replay starts at most 8"),
    (lambda m: m["config"]["workload"].update(requests=99999999999999999999999),
     "workload.requests is 99999999999999999999999; a replay allows at most 4096"),
    (lambda m: m["config"]["cache"].update(device_tokens=1 << 40),
     "cache.device_tokens is"),
    (lambda m: m["config"]["observability"].update(watchdog_timeout_s=1e9),
     "observability.watchdog_timeout_s is"),
    (lambda m: m["config"].update(faults=[{"kind": "stage-lag", "ms": 5}] * 33),
     "33 fault specs"),
    (lambda m: m["config"].update(
        model={"num_layers": 64, "num_heads": 64, "head_dim": 256, "hidden_size": 4096},
        cache={"device_tokens": 1 << 18}), "of memory"),
], ids=["topology", "requests", "pool", "watchdog", "fault-count", "memory"])
def test_costs_beyond_the_caps_are_refused_before_anything_runs(
        craft: Callable[..., Path], tmp_path: Path, edit: Callable[[dict[str, Any]], None],
        says: str) -> None:
    bundle = craft(edit)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["inject", "--replay", str(bundle), "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert says in one_error(res.output)
    assert not out.exists(), "nothing ran"


@pytest.mark.parametrize(("fault", "says"), [
    ({"kind": "stage-lag", "rid": "*;touch /tmp/pwned;#", "ms": 1}, "rid glob"),
    ({"kind": "stage-lag", "rid": "a\n$(id)", "ms": 1}, "rid glob"),
    ({"kind": "stage-lag", "rid": "x" * 65, "ms": 1}, "rid glob"),
    ({"kind": "rm-rf"}, "unknown fault kind 'rm-rf'"),
    ({"kind": "stage-lag", "ms": 1e9}, "ms=1e+09"),
    ({"kind": "stage-lag", "point": "scheduler.step"}, "stage-lag takes no point"),
    ({"kind": "stage-lag", "command": "sh"}, "faults.0.command"),
], ids=["shell", "newline", "long", "kind", "lag", "param", "extra"])
def test_fault_specs_from_a_bundle_are_checked_strictly(
        craft: Callable[..., Path], tmp_path: Path, fault: dict[str, Any], says: str) -> None:
    bundle = craft(lambda m: m["config"].update(faults=[fault]))
    res = CliRunner().invoke(app, ["inject", "--replay", str(bundle), "--dry-run"])
    assert res.exit_code == 2, res.output
    assert one_error(res.output).startswith("error: bundle:")
    assert says in res.output


# --- malformed manifests: one line, never a traceback, a hang or a memory blow-up ----------------


def _sparse(path: Path) -> None:
    with path.open("wb") as fh:
        fh.truncate(1 << 30)


def _deep(path: Path) -> None:
    path.write_text("[" * 200_000 + "]" * 200_000)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize(("make", "says"), [
    (lambda p: p.write_bytes(b"\xff\xfe garbage"), "is not a bundle manifest"),
    (lambda p: p.write_text("[]"), "is not a bundle manifest"),
    (lambda p: p.write_text(""), "is not a bundle manifest"),
    (lambda p: p.mkdir(), "is not a regular file"),
    (_fifo, "is not a regular file"),
    (_sparse, f"a bundle manifest is at most {MAX_MANIFEST_BYTES}"),
    (_deep, "is not a bundle manifest"),
], ids=["binary", "list", "empty", "directory", "fifo", "sparse-1gib", "deep"])
def test_malformed_manifests_end_in_one_line(tmp_path: Path, make: Callable[[Path], None],
                                             says: str) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    make(bundle / "manifest.json")
    res = hicache(["inject", "--replay", str(bundle), "--dry-run"], cwd=tmp_path / "cwd",
                  tmp=tmp_path, timeout=120)
    assert says in one_line_error(res)


@pytest.mark.parametrize(("edit", "says"), [
    (lambda m: m.update(config="not a mapping"), "config"),
    (lambda m: m.update(outcome="healthy"), "records a healthy run"),
    (lambda m: m["config"].update(cache={"page_size": "eight"}), "cache.page_size"),
    (lambda m: m["config"].update(launcher="sh -c id"), "launcher"),
], ids=["config-type", "healthy", "bad-value", "unknown-key"])
def test_manifests_that_do_not_validate_end_in_one_line(
        craft: Callable[..., Path], edit: Callable[[dict[str, Any]], None], says: str) -> None:
    res = CliRunner().invoke(app, ["inject", "--replay", str(craft(edit)), "--dry-run"])
    assert res.exit_code == 2, res.output
    assert says in one_error(res.output)


# --- what the user says on the command line is what runs ------------------------------------------


def test_dry_run_shows_the_plan_and_runs_nothing(craft: Callable[..., Path],
                                                 tmp_path: Path) -> None:
    bundle = craft(lambda m: m["config"]["storage"].update(backend="file", path="/etc"))
    out = tmp_path / "out"
    runner = CliRunner()
    res = runner.invoke(app, ["inject", "--replay", str(bundle), "--out", str(out),
                              "--dry-run"])
    assert res.exit_code == 0, res.output
    assert f"output    {out}" in res.output
    assert "the bundle's store path /etc is not used" in res.output
    res = runner.invoke(app, ["inject", "--replay", str(bundle), "--out", str(out),
                              "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert (plan["world_size"], plan["requests"], plan["faults"]) == \
        (1, 6, ["crash:steps=3-3,point=scheduler.step"])
    assert plan["storage"].startswith("a private file store")
    assert not out.exists()


def test_run_options_do_not_apply_to_a_replay(genuine: Path) -> None:
    res = CliRunner().invoke(app, ["inject", "--replay", str(genuine), "--tp", "4",
                                   "--requests", "9", "--dry-run"])
    assert res.exit_code == 2
    assert "--tp, --requests do not apply" in res.output


def test_storage_url_from_the_command_line_is_what_replay_uses(
        craft: Callable[..., Path], tmp_path: Path, redis_server: Any,
        listener: tuple[int, list[object]]) -> None:
    import redis

    port, accepted = listener
    bundle = craft(lambda m: m["config"]["storage"].update(
        backend="redis", url=f"redis://127.0.0.1:{port}/0"))
    client = redis.Redis.from_url(redis_server.url)
    seen = client.info("stats")["total_connections_received"]
    res = CliRunner().invoke(app, ["inject", "--replay", str(bundle), "--storage-url",
                                   redis_server.url, "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.output)
    assert result["reproduced"]
    assert result["plan"]["storage"].startswith("redis at redis://127.0.0.1")
    assert client.info("stats")["total_connections_received"] > seen
    assert accepted == [], "the server the bundle named was never contacted"
    # a run without L3 has nothing to point at a server
    res = CliRunner().invoke(app, ["inject", "--replay", str(craft_none(bundle)),
                                   "--storage-url", redis_server.url, "--dry-run"])
    assert res.exit_code == 2
    assert "had no L3 store" in res.output


def craft_none(bundle: Path) -> Path:
    """``bundle`` edited in place to a run without L3."""
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"]["storage"].update(backend="none", url=None)
    path.write_text(json.dumps(manifest))
    return bundle
