"""Bad input to ``hicache run`` / ``inject`` / ``campaign`` ends in one line and exit 2.

Hostile inputs (anchor bombs, /dev/zero, FIFOs, sparse files, absurd sizes) run the real CLI in
a subprocess under an address-space cap, so a regression fails (MemoryError, timeout) instead
of taking the machine down. Everything is generated at test time.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AS_CAP = 1536 << 20
SMALL = ["--requests", "4", "--device-tokens", "256", "--page-size", "4",
         "--max-new-tokens", "2"]


def _cap() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_CAP, AS_CAP))


def hicache(args: list[str], cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """The real command, capped at 1.5 GiB of address space."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "TERMINAL_WIDTH": "100",
           "TMPDIR": str(cwd)}
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=_cap,
                          check=False)


def one_error(res: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Exit 2, nothing on stdout, one ``error:`` line (plus at most a ``hint:`` line) naming
    every ``expected`` text, no traceback."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines, "no error shown"
    assert lines[0].startswith("error: "), lines
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint: ")), lines
    assert len(lines[0]) < 400, lines[0][:400]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def anchor_bomb(levels: int = 9, width: int = 9) -> str:
    """A few hundred bytes that expand to width**levels strings when aliases are followed."""
    lines = ['  l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"  l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * width) + "]")
    return "bomb:\n" + "\n".join(lines) + "\n"


# --- files: bounded, regular, UTF-8, aliases bounded ----------------------------------------


def test_yaml_anchor_bomb_in_config_is_refused_fast(tmp_path: Path) -> None:
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(anchor_bomb() + "seed: *l8\n")
    assert cfg.stat().st_size < 1024
    t0 = time.monotonic()
    res = hicache(["run", "--config", str(cfg)], tmp_path)
    line = one_error(res, "config", "YAML aliases")
    assert time.monotonic() - t0 < 60
    assert "lol" not in line, "the expanded value is never quoted"


def test_yaml_anchor_bomb_in_campaign_is_refused_fast(tmp_path: Path) -> None:
    spec = tmp_path / "bomb.yaml"
    spec.write_text(anchor_bomb() + "name: *l8\n")
    res = hicache(["campaign", str(spec), "--list"], tmp_path)
    assert "lol" not in one_error(res, "campaign", "YAML aliases")


@pytest.mark.parametrize(("name", "content", "says"), [
    ("garbage.bin", bytes(range(256)) * 64, "is not UTF-8 text"),
    ("garbage.yaml", b"\xff\xfe\x00garbage", "is not UTF-8 text"),
    ("bad.yaml", b"a: [1, 2\nb: {", "cannot parse"),
    ("bad.toml", b"a = = 1\n", "cannot parse"),
    ("bad.json", b"{\"a\": ", "cannot parse"),
    ("deep.json", b"[" * 200_000, "cannot parse"),
    ("deep.yaml", b"[" * 200_000, "cannot parse"),
    ("list.yaml", b"- 1\n- 2\n", "must hold a mapping"),
    ("bigint.yaml", b"seed: " + b"9" * 10_000 + b"\n", "cannot parse"),
    ("two.yaml", b"a: 1\n---\nb: 2\n", "cannot parse"),
    ("cycle.yaml", b"a: &a [*a]\n", "refers to a node that contains it"),
], ids=lambda v: v if isinstance(v, str) and "." in v else None)
def test_unreadable_configs_are_one_line(tmp_path: Path, name: str, content: bytes,
                                         says: str) -> None:
    from typer.testing import CliRunner

    from cli import app

    cfg = tmp_path / name
    cfg.write_bytes(content)
    res = CliRunner().invoke(app, ["run", "--config", str(cfg)])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("error: config: "), lines
    assert says in lines[0], lines[0]
    assert len(lines[0]) < 400


def test_dev_zero_fifo_and_sparse_files_are_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    sparse = tmp_path / "big.json"
    with sparse.open("wb") as f:
        f.truncate(2 << 30)
    for args, says in (
        (["run", "--config", "/dev/zero"], "/dev/zero is not a regular file"),
        (["run", "--config", str(fifo)], "is not a regular file"),
        (["campaign", "/dev/zero", "--list"], "/dev/zero is not a regular file"),
        (["campaign", str(fifo), "--list"], "is not a regular file"),
        (["run", "--config", str(sparse)], "the limit is"),
        (["run", "--config", str(tmp_path / "absent.yaml")], "no such file"),
        (["run", "--config", str(tmp_path)], "is a directory"),
    ):
        one_error(hicache(args, tmp_path, timeout=60), says)


def test_values_from_files_are_quoted_short(tmp_path: Path) -> None:
    """A validation error quotes at most a bounded repr of the offending value."""
    from typer.testing import CliRunner

    from cli import app

    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: [" + ", ".join(["x" * 100] * 5000) + "]\n")
    res = CliRunner().invoke(app, ["run", "--config", str(cfg)])
    assert res.exit_code == 2
    line = res.stderr.splitlines()[0]
    assert line.startswith("error: seed: ")
    assert len(line) < 300, line
    cfg = tmp_path / "c.json"
    cfg.write_text('{"' + "k" * 100_000 + '": 1}')
    res = CliRunner().invoke(app, ["run", "--config", str(cfg)])
    assert res.exit_code == 2
    line = res.stderr.splitlines()[0]
    assert line.startswith("error: kkk")
    assert len(line) < 300, line


def test_markup_in_a_file_name_is_shown_as_text(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli import app

    res = CliRunner().invoke(app, ["run", "--config", str(tmp_path / "[/]x[bold].yaml")])
    assert res.exit_code == 2
    assert "[/]x[bold].yaml: no such file" in res.stderr


# --- sizes and URLs --------------------------------------------------------------------------


def test_absurd_request_count_is_refused_before_running(tmp_path: Path) -> None:
    res = hicache(["run", "--requests", "99999999999999999999999"], tmp_path, timeout=60)
    one_error(res, "workload.requests", "at most 100000")


@pytest.mark.parametrize(("flag", "field"), [
    ("--device-tokens", "cache.device_tokens"),
    ("--host-tokens", "cache.host_tokens"),
])
def test_pools_larger_than_memory_are_refused_before_allocating(tmp_path: Path, flag: str,
                                                                field: str) -> None:
    res = hicache(["run", flag, "100000000000000"], tmp_path, timeout=60)
    one_error(res, field, "available")


def test_pools_over_the_address_space_cap_are_refused(tmp_path: Path) -> None:
    """2 GiB of device pool fits this machine's memory but not this process's 1.5 GiB cap."""
    res = hicache(["run", "--device-tokens", str(512 << 10), "--host-tokens", "1024"],
                  tmp_path, timeout=60)
    one_error(res, "cache.device_tokens", "available")


@pytest.mark.parametrize("url", [
    "redis://[::1", "http://127.0.0.1:6379/0", "redis://h:99999/0", "redis://h:x/0",
    "redis://h:6379/abc", "redis://h:6379/0\n", "unix://", "",
])
def test_malformed_storage_urls_are_one_line(url: str) -> None:
    from typer.testing import CliRunner

    from cli import app

    res = CliRunner().invoke(app, ["run", "--storage", "redis", "--storage-url", url])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.stderr.splitlines()[0].startswith("error: --storage-url: "), res.stderr


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://user:pw@h:1/2",
                                 "redis://[::1]:6379", "unix:///tmp/redis.sock", "redis://h"])
def test_well_formed_storage_urls_validate(url: str) -> None:
    from hicache_runtime.config import load_config

    assert load_config({"storage.backend": "redis", "storage.url": url}).storage.url == url


# --- faults that could never fire ------------------------------------------------------------


@pytest.mark.parametrize(("args", "says"), [
    (["run", "--fault", "dma-lag:pp=99"], "pp=99, but the run has 1 pipeline stage"),
    (["run", "--tp", "2", "--fault", "crash:rank=9,point=scheduler.step"],
     "rank=9, but the run has 2 ranks (0-1)"),
    (["run", "--pp", "2", "--fault", "stage-lag:tp=1"], "tp=1, but the run has 1 TP rank"),
    (["inject", "--tp", "2", "--pp", "2", "dma-lag:pp=3"],
     "pp=3, but the run has 2 pipeline stages"),
])
def test_fault_selectors_outside_the_topology_are_refused(tmp_path: Path, args: list[str],
                                                          says: str) -> None:
    from typer.testing import CliRunner

    from cli import app

    res = CliRunner().invoke(app, [*args, "--bundle-dir", str(tmp_path / "b")])
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines()[0].startswith("error: faults: "), res.stderr
    assert says in res.stderr
    assert not (tmp_path / "b").exists(), "nothing ran"


# --- usage errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "says"), [
    (["run", "--tp", "abc"], "Invalid value for '--tp'"),
    (["run", "--no-such-flag"], "No such option: --no-such-flag"),
    (["no-such-command"], "No such command 'no-such-command'"),
    (["trace", "export"], "Missing argument"),
    (["campaign", "--seeds", "0-99999999999999"], "more than 100000 seeds"),
])
def test_usage_errors_are_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    res = hicache(args, tmp_path, timeout=60)
    assert "╭" not in res.stderr, res.stderr
    assert "Usage:" not in res.stderr, res.stderr
    one_error(res, says)


def test_a_small_run_still_works_under_the_cap(tmp_path: Path) -> None:
    """The limits refuse what cannot fit, not ordinary runs."""
    res = hicache(["run", *SMALL, "--no-compare", "--json"], tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


# --- the memory estimate -----------------------------------------------------------------------


def test_the_memory_estimate_matches_the_pools_a_rank_allocates() -> None:
    from hicache_runtime.config import load_config, memory_need
    from hicache_runtime.engine.rank import build_rank

    cfg = load_config({"cache.device_tokens": 512, "cache.host_tokens": 1024,
                       "model.sidecars": ["all_pages", "trailing_pages"]})
    rt = build_rank(cfg)
    try:
        assert rt.host_pool is not None
        pools = [rt.device_pool, rt.host_pool]
        allocated = [sum(t.nbytes for t in (p.k, p.v, *p.aux.values())) for p in pools]
    finally:
        rt.close()
    need = memory_need(cfg)
    assert (need.device_pools, need.host_pools) == tuple(allocated)


def test_device_pools_on_an_accelerator_are_checked_against_its_free_memory() -> None:
    from hicache_runtime.config import check_run_limits, load_config
    from hicache_runtime.contracts.errors import ConfigError

    cfg = load_config({"cache.device_tokens": 1 << 16})
    check_run_limits(cfg, accelerator=True, device_free=64 << 30)
    with pytest.raises(ConfigError, match=r"cache.device_tokens: .* the accelerator has"):
        check_run_limits(cfg, accelerator=True, device_free=16 << 20)
