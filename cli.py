"""The ``hicache`` command.

Subcommands land with the feature they expose: ``run`` (a run of the runtime, compared against
its cache-disabled twin) and ``trace`` (export traces, print the bundle schema).

Exit codes: 0 success / healthy run; 1 the run was not healthy; 2 bad usage, bad configuration
or unreadable input (one line on stderr, no traceback).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import tomllib
import typer

from hicache_runtime.errors import ConfigError, HiCacheError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run, break and diagnose a hierarchical KV cache (SGLang HiCache).")
trace_app = typer.Typer(no_args_is_help=True, help="Export traces; print the bundle schema.")
app.add_typer(trace_app, name="trace")

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2
F = TypeVar("F", bound=Callable[..., Any])


def _handles_errors(fn: F) -> F:
    """Turn our errors into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import render

        try:
            return fn(*args, **kwargs)
        except HiCacheError as exc:
            render.error(str(exc), exc.hint)
            raise typer.Exit(EXIT_USAGE) from None
        except OSError as exc:
            render.error(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
            raise typer.Exit(EXIT_USAGE) from None

    return wrapper  # type: ignore[return-value]


# --- run ------------------------------------------------------------------------------------


@app.command()
@_handles_errors
def run(
    requests: Annotated[int | None, typer.Option(help="Requests in the workload.")] = None,
    workload: Annotated[str | None, typer.Option(
        help="multi_turn | shared_prefix | long_context | mixed")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the workload and faults.")] = None,
    device_tokens: Annotated[int | None, typer.Option(help="L1 (device) pool size.")] = None,
    host_tokens: Annotated[int | None, typer.Option(help="L2 (host) pool size.")] = None,
    page_size: Annotated[int | None, typer.Option(help="Tokens per page.")] = None,
    write_policy: Annotated[str | None, typer.Option(
        help="write_through | write_through_selective | write_back")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens generated per request.")]
    = None,
    storage: Annotated[str | None, typer.Option(help="L3 backend: none | file | redis.")]
    = None,
    storage_path: Annotated[Path | None, typer.Option(help="Directory of the file backend.")]
    = None,
    storage_url: Annotated[str | None, typer.Option(
        help="Redis URL for the redis backend, e.g. redis://127.0.0.1:6379/0.")] = None,
    storage_optional: Annotated[bool, typer.Option(
        help="Start even if the L3 backend is unreachable (it reconnects later).")] = False,
    prefetch_policy: Annotated[str | None, typer.Option(
        help="best_effort | wait_complete | timeout")] = None,
    fault: Annotated[list[str] | None, typer.Option(
        help="Fault spec, e.g. 'dma-lag:ms=20' (repeatable).")] = None,
    legacy: Annotated[list[str] | None, typer.Option(
        help="Restore a pre-fix protocol, e.g. 'skip-empty-sync' (repeatable).")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML, TOML or JSON config file.")] = None,
    trace: Annotated[Path | None, typer.Option(help="Write every event to this JSONL file.")]
    = None,
    bundle_dir: Annotated[Path | None, typer.Option(help="Where crash bundles go.")] = None,
    watchdog_timeout: Annotated[float | None, typer.Option(
        help="Seconds without progress before a run counts as hung.")] = None,
    compare: Annotated[bool, typer.Option(
        help="Compare outputs with a cache-disabled run.")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run the runtime on a seeded workload and judge it against a cache-disabled run."""
    from faults.spec import parse_faults
    from hicache_runtime.config import load_config
    from hicache_runtime.legacy import parse_legacy

    data: dict[str, Any] = _read_config(config) if config else {}
    overrides = {
        "workload.requests": requests, "workload.kind": workload, "seed": seed,
        "cache.device_tokens": device_tokens, "cache.host_tokens": host_tokens,
        "cache.page_size": page_size, "cache.write_policy": write_policy,
        "workload.max_new_tokens": max_new_tokens, "observability.trace_path": trace,
        "observability.bundle_dir": bundle_dir,
        "observability.watchdog_timeout_s": watchdog_timeout, "storage.backend": storage,
        "storage.path": storage_path, "storage.url": storage_url,
        "storage.prefetch_policy": prefetch_policy,
        "storage.required": False if storage_optional else None,
    }
    data.update({k: v for k, v in overrides.items() if v is not None})
    if fault:
        data["faults"] = parse_faults(fault)
    if legacy:
        data["legacy"] = parse_legacy(legacy)
    cfg = load_config(data)
    summary = _execute(cfg, compare, progress=not json_out)
    if json_out:
        print(summary.model_dump_json(indent=2))
    else:
        import render

        render.run_summary(summary)
    raise typer.Exit(EXIT_OK if summary.outcome.value == "healthy" else EXIT_UNHEALTHY)


def _execute(cfg: Any, compare: bool, progress: bool) -> Any:
    import render
    from hicache_runtime.run import run_single

    with render.run_progress("running", enabled=progress and sys.stderr.isatty()) as update:
        return run_single(cfg, compare=compare, progress=update)


def _read_config(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        raise ConfigError("config", f"cannot parse {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping at top level")
    return data


# --- trace ----------------------------------------------------------------------------------


@trace_app.command("export")
@_handles_errors
def trace_export(
    traces: Annotated[list[Path], typer.Argument(help="JSONL traces or bundle directories.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output file.")] = Path("trace.json"),
    perfetto: Annotated[bool, typer.Option(
        "--perfetto", help="Chrome/Perfetto trace JSON (the only format so far).")] = True,
) -> None:
    """Convert runtime traces into a Perfetto/Chrome trace: one track per rank and thread."""
    from hicache_runtime.tracing import read_jsonl, to_perfetto

    events: list[dict[str, Any]] = []
    for path in traces:
        files = sorted(path.glob("rank*/events.jsonl")) if path.is_dir() else [path]
        if not files:
            raise ConfigError("traces", f"no events.jsonl under {path}")
        for f in files:
            events.extend(read_jsonl(f))
    out.write_text(json.dumps(to_perfetto(events)), encoding="utf-8")
    print(f"wrote {len(events)} events to {out} (open in https://ui.perfetto.dev)")


@trace_app.command("schema")
@_handles_errors
def trace_schema(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write to a file.")] = None,
) -> None:
    """Print the JSON Schema of crash bundles (manifest, state, events, flight recorder)."""
    from hicache_runtime.bundle import bundle_json_schema

    text = json.dumps(bundle_json_schema(), indent=2)
    if out:
        out.write_text(text, encoding="utf-8")
    else:
        print(text)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
