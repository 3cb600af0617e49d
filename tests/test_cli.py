"""The ``hicache`` command as users call it."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cli import app

runner = CliRunner()
SMALL = ["--requests", "12", "--device-tokens", "256", "--page-size", "4",
         "--max-new-tokens", "4"]


def test_run_json_is_healthy_and_compared(tmp_path: Path) -> None:
    res = runner.invoke(app, ["run", *SMALL, "--json", "--bundle-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["outcome"] == "healthy"
    assert out["output_match"] is True
    for key in ("requests", "completed", "aborted", "cached_tokens", "steps", "wall_s"):
        assert key in out
    assert set(out["cached_tokens"]) == {"device", "host", "storage"}


def test_run_human_summary() -> None:
    res = runner.invoke(app, ["run", *SMALL])
    assert res.exit_code == 0, res.output
    assert "healthy" in res.stdout
    assert "identical to the cache-disabled run" in res.stdout


def test_injected_crash_exits_1_with_bundle(tmp_path: Path) -> None:
    res = runner.invoke(app, ["run", *SMALL, "--json", "--bundle-dir", str(tmp_path),
                              "--fault", "crash:point=scheduler.step,step=3"])
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    assert out["outcome"] == "crash"
    assert Path(out["bundle"], "manifest.json").exists()


def test_config_file_and_flags_combine(tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("workload:\n  kind: shared_prefix\ncache:\n  write_policy: write_back\n")
    res = runner.invoke(app, ["run", *SMALL, "--config", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["outcome"] == "healthy"


def _one_line_error(args: list[str], field: str) -> None:
    res = runner.invoke(app, ["run", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("error: ")
    assert field in lines[0]
    assert "Traceback" not in res.output


def test_negative_size_is_one_line_exit_2() -> None:
    _one_line_error(["--device-tokens", "-8"], "--device-tokens")


def test_page_size_must_divide_pools() -> None:
    _one_line_error(["--device-tokens", "100", "--page-size", "8"], "--device-tokens")


def test_unknown_policy() -> None:
    _one_line_error(["--write-policy", "sometimes"], "--write-policy")


def test_every_bad_flag_is_named_as_typed_at_once(tmp_path: Path) -> None:
    """Errors name the flags the user typed, all of them in one go; a value from a config
    file is named by its key in the file."""
    res = runner.invoke(app, ["run", "--tp", "0", "--pp", "0", "--write-policy", "sometimes"])
    assert res.exit_code == 2
    line = res.stderr.splitlines()[0]
    for flag in ("--tp:", "--pp:", "--write-policy:"):
        assert flag in line, line
    assert "topology." not in line
    cfg = tmp_path / "c.yaml"
    cfg.write_text("topology:\n  pp: 0\n")
    res = runner.invoke(app, ["run", "--config", str(cfg), "--tp", "0"])
    line = res.stderr.splitlines()[0]
    assert "--tp:" in line
    assert "topology.pp:" in line, line


def test_fault_switch_and_flag_errors_come_together_with_suggestions() -> None:
    """A bad fault spec, a mistyped switch and bad flags: one error naming each as typed, the
    closest valid word for each typo (a key, a switch, a choice)."""
    res = runner.invoke(app, ["run", "--fault", "dma-lag:msx=5", "--legacy", "skip-empty-synk",
                              "--tp", "0", "--write-policy", "write_thru"])
    assert res.exit_code == 2
    line = res.stderr.splitlines()[0]
    for part in ("--fault: 'dma-lag:msx=5'", "did you mean 'ms'",
                 "--legacy: unknown switch 'skip-empty-synk'; did you mean 'skip-empty-sync'?",
                 "--tp:", "--write-policy:", "did you mean 'write_through'?"):
        assert part in line, line
    campaign = runner.invoke(app, ["campaign", "--only", "zzz*", "--list"])
    assert campaign.stderr.startswith("error: --only: "), campaign.stderr


def test_unknown_fault_and_legacy() -> None:
    _one_line_error(["--fault", "gremlins:ms=3"], "unknown fault kind")
    _one_line_error(["--legacy", "not-a-switch"], "legacy")


def test_trace_export_and_schema(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    res = runner.invoke(app, ["run", *SMALL, "--trace", str(trace), "--json"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "p.json"
    res = runner.invoke(app, ["trace", "export", str(trace), "-o", str(out)])
    assert res.exit_code == 0, res.output
    perfetto = json.loads(out.read_text())
    names = {e["name"] for e in perfetto["traceEvents"]}
    assert {"sched.batch", "thread_name", "process_name"} <= names
    assert any(e["ph"] == "X" for e in perfetto["traceEvents"])
    res = runner.invoke(app, ["trace", "schema"])
    assert res.exit_code == 0
    assert "manifest.json" in json.loads(res.stdout)


def test_trace_export_of_missing_file_is_exit_2(tmp_path: Path) -> None:
    res = runner.invoke(app, ["trace", "export", str(tmp_path / "nope.jsonl")])
    assert res.exit_code == 2
    assert "Traceback" not in res.output
