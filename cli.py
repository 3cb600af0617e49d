"""The ``hicache`` command.

Subcommands: ``run`` (a run of the runtime, compared against its cache-disabled twin),
``inject`` (a run under faults, named by the doctor; ``--replay``/``--shrink`` a bundle),
``campaign`` (matrices of cells, each judged against its expectation), ``trace`` (export
traces, print the bundle schema), ``doctor`` (name the crash signature of artifacts),
``signatures`` (the catalog), ``runbook`` and ``capture`` (py-spy dumps of a live job).

Exit codes: 0 success / healthy run / every cell as expected; 1 the run was not healthy, a
cell was not as expected, a replay did not reproduce; 2 bad usage, bad configuration or
unreadable input (one line on stderr, no traceback).
"""

from __future__ import annotations

import functools
import json
import sys
import tomllib
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

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
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel ranks.")] = None,
    pp: Annotated[int | None, typer.Option(help="Pipeline stages.")] = None,
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
    sidecar_pools: Annotated[str | None, typer.Option(
        help="Hybrid-model sidecar pools: all_pages, trailing_pages or both (comma-separated).")]
    = None,
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
    protocol_timeout: Annotated[float | None, typer.Option(
        help="Timeout of protocol collectives between ranks (seconds).")] = None,
    consensus_check: Annotated[bool, typer.Option(
        help="Hash decisions that must agree and compare them across ranks.")] = False,
    compare: Annotated[bool, typer.Option(
        help="Compare outputs with a cache-disabled run.")] = True,
    torchrun_dir: Annotated[Path | None, typer.Option(
        help="Do not run: write DIR/config.json and print the torchrun command that runs "
             "the same ranks (env:// rendezvous, e.g. across nodes).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run the runtime on a seeded workload and judge it against a cache-disabled run."""
    from faults.spec import parse_faults
    from hicache_runtime.config import load_config
    from hicache_runtime.legacy import parse_legacy

    data: dict[str, Any] = _read_config(config) if config else {}
    overrides = {
        "topology.tp": tp, "topology.pp": pp, "workload.requests": requests,
        "workload.kind": workload, "seed": seed,
        "cache.device_tokens": device_tokens, "cache.host_tokens": host_tokens,
        "cache.page_size": page_size, "cache.write_policy": write_policy,
        "workload.max_new_tokens": max_new_tokens, "observability.trace_path": trace,
        "observability.bundle_dir": bundle_dir,
        "observability.watchdog_timeout_s": watchdog_timeout, "storage.backend": storage,
        "storage.path": storage_path, "storage.url": storage_url,
        "storage.prefetch_policy": prefetch_policy,
        "model.sidecars": tuple(p.strip() for p in sidecar_pools.split(",") if p.strip())
        if sidecar_pools else None,
        "storage.required": False if storage_optional else None,
        "observability.protocol_timeout_s": protocol_timeout,
        "observability.consensus_check": True if consensus_check else None,
    }
    data.update({k: v for k, v in overrides.items() if v is not None})
    if fault:
        data["faults"] = parse_faults(fault)
    if legacy:
        data["legacy"] = parse_legacy(legacy)
    cfg = load_config(data)
    if torchrun_dir is not None:
        torchrun_dir.mkdir(parents=True, exist_ok=True)
        (torchrun_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
        print(f"torchrun --nproc-per-node {cfg.topology.world_size} "
              f"-m hicache_runtime.rank_main --run-dir {torchrun_dir}")
        raise typer.Exit(EXIT_OK)
    summary = _execute(cfg, compare, progress=not json_out)
    if json_out:
        print(summary.model_dump_json(indent=2))
    else:
        import render

        render.run_summary(summary)
    raise typer.Exit(EXIT_OK if summary.outcome.value == "healthy" else EXIT_UNHEALTHY)


def _execute(cfg: Any, compare: bool, progress: bool) -> Any:
    import render
    from hicache_runtime.run import run

    with render.run_progress("running", enabled=progress and sys.stderr.isatty()) as update:
        return run(cfg, compare=compare, progress=update)


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


# --- campaign, inject -----------------------------------------------------------------------


@app.command()
@_handles_errors
def campaign(
    spec: Annotated[Path | None, typer.Argument(
        help="Campaign spec (YAML, TOML or JSON); the built-in default when omitted.")] = None,
    only: Annotated[str | None, typer.Option(
        help="Run only the cells whose id matches this glob, e.g. 'pp2/*'.")] = None,
    seeds: Annotated[str | None, typer.Option(
        help="Run every selected cell once per seed, e.g. '0-4' or '0,3,7' (flake hunting).")]
    = None,
    list_cells: Annotated[bool, typer.Option("--list", help="List the cells; run nothing.")]
    = False,
    junit: Annotated[Path | None, typer.Option(help="Write JUnit XML here.")] = None,
    markdown: Annotated[Path | None, typer.Option(help="Write a Markdown report here.")]
    = None,
    bundle_dir: Annotated[Path, typer.Option(help="Where the cells' crash bundles go.")]
    = Path("hicache-bundles"),
    json_out: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")]
    = False,
) -> None:
    """Run a fault campaign: each cell runs topology x legacy switches x faults x seed and must
    end as expected (healthy with outputs identical to a cache-disabled run, or failed with
    the doctor naming the expected signature). Exit 1 when any cell did not."""
    import render
    from faults.campaign import load_campaign
    from faults.reports import junit_xml
    from faults.reports import markdown as markdown_report
    from faults.runner import run_campaign, select

    camp = load_campaign(spec)
    seed_list = _seeds(seeds) if seeds else None
    cells = select(camp, only, seed_list)
    if not cells:
        raise ConfigError("only", f"no cell of campaign {camp.name!r} matches {only!r}",
                          hint="hicache campaign --list shows the cell ids")
    if list_cells:
        if json_out:
            print(json.dumps([c.model_dump() for c in cells], indent=2))
        else:
            render.campaign_cells(cells)
        raise typer.Exit(EXIT_OK)
    with render.campaign_progress(len(cells), enabled=not json_out) as hook:
        result = run_campaign(camp, bundle_root=bundle_dir, only=only, seeds=seed_list,
                              hook=hook)
    if junit is not None:
        junit.write_text(junit_xml(result), encoding="utf-8")
    if markdown is not None:
        markdown.write_text(markdown_report(result), encoding="utf-8")
    if json_out:
        print(result.model_dump_json(indent=2))
    else:
        render.campaign_summary(result)
    raise typer.Exit(EXIT_OK if result.failed == 0 else EXIT_UNHEALTHY)


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ConfigError("seeds", f"{text!r}: expected seeds like 0-4 or 0,3,7")
        out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    if not out:
        raise ConfigError("seeds", "no seeds given")
    return out


@app.command()
@_handles_errors
def inject(
    faults: Annotated[list[str] | None, typer.Argument(
        help="Fault specs to inject, e.g. 'stage-lag:pp=1,ms=30'.")] = None,
    replay: Annotated[Path | None, typer.Option(
        help="Rerun the run a crash bundle came from and check it fails the same way.")]
    = None,
    shrink: Annotated[bool, typer.Option(
        help="With --replay: shrink to the fewest requests and the narrowest fault schedule "
             "that still show the same signature.")] = False,
    max_runs: Annotated[int, typer.Option(min=1, help="Run budget of --shrink.")] = 16,
    out: Annotated[Path | None, typer.Option(
        help="--shrink output directory (default: shrunk-<bundle name>).")] = None,
    warm: Annotated[bool | None, typer.Option(
        help="Warm L3 with a fault-free run first (default: as the bundle's cell did).")]
    = None,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel ranks.")] = None,
    pp: Annotated[int | None, typer.Option(help="Pipeline stages.")] = None,
    legacy: Annotated[list[str] | None, typer.Option(
        help="Restore a pre-fix protocol (repeatable).")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the workload and faults.")] = None,
    requests: Annotated[int | None, typer.Option(help="Requests in the workload.")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML, TOML or JSON config file.")] = None,
    bundle_dir: Annotated[Path | None, typer.Option(help="Where crash bundles go.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Inject faults into a run and name what they caused; or replay (and shrink) a bundle.

    Exit codes: 0 the run stayed healthy / the replay failed the same way; 1 it did not.
    """
    import render

    if replay is None:
        if shrink or not faults:
            raise ConfigError("inject", "give fault specs, or --replay BUNDLE [--shrink]")
        _inject_faults(faults, tp, pp, legacy, seed, requests, config, bundle_dir, warm,
                       json_out)
    if faults:
        raise ConfigError("inject", "--replay reruns the bundle's own faults; drop the specs")
    if shrink:
        from faults.shrink import shrink_bundle

        result = shrink_bundle(replay, out or Path(f"shrunk-{replay.resolve().name}"),
                               max_runs=max_runs, warm=warm)
        if json_out:
            print(result.model_dump_json(indent=2))
        else:
            render.shrink_summary(result)
        raise typer.Exit(EXIT_OK if result.reproduced else EXIT_UNHEALTHY)
    import tempfile

    from faults.replay import replay as replay_bundle
    from hicache_runtime.run import DEFAULT_BUNDLE_ROOT

    with tempfile.TemporaryDirectory(prefix="hicache-replay-") as work:
        res = replay_bundle(replay, work=Path(work), bundle_root=bundle_dir or DEFAULT_BUNDLE_ROOT,
                            warm=warm)
    if json_out:
        print(res.model_dump_json(indent=2))
    else:
        render.replay_summary(res)
    raise typer.Exit(EXIT_OK if res.reproduced else EXIT_UNHEALTHY)


def _inject_faults(faults: list[str], tp: int | None, pp: int | None,
                   legacy: list[str] | None, seed: int | None, requests: int | None,
                   config: Path | None, bundle_dir: Path | None, warm: bool | None,
                   json_out: bool) -> None:
    import render
    from faults.runner import observe
    from faults.spec import parse_faults
    from hicache_runtime.config import load_config
    from hicache_runtime.legacy import parse_legacy
    from hicache_runtime.run import DEFAULT_BUNDLE_ROOT

    data: dict[str, Any] = _read_config(config) if config else {}
    data.update({k: v for k, v in {"topology.tp": tp, "topology.pp": pp, "seed": seed,
                                   "workload.requests": requests}.items() if v is not None})
    data["faults"] = parse_faults(faults)
    if legacy:
        data["legacy"] = parse_legacy(legacy)
    cfg = load_config(data)
    obs = observe(cfg, warm=bool(warm), compare=True,
                  bundle_root=bundle_dir or cfg.observability.bundle_dir or DEFAULT_BUNDLE_ROOT)
    if json_out:
        print(obs.model_dump_json(indent=2))
    else:
        render.inject_summary(obs)
    raise typer.Exit(EXIT_OK if obs.observed == "healthy" else EXIT_UNHEALTHY)


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


# --- doctor, signatures, runbook, capture ------------------------------------------------------

signatures_app = typer.Typer(no_args_is_help=True,
                             help="The catalog of known crash signatures.")
app.add_typer(signatures_app, name="signatures")


@app.command()
@_handles_errors
def doctor(
    inputs: Annotated[list[str], typer.Argument(
        help="Files, directories, .tar.gz archives, or - for stdin.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the diagnosis as JSON.")]
    = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a Markdown report.")]
    = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the report here.")]
    = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the rule log.")]
    = False,
) -> None:
    """Name the crash signature of a dead or hung deployment from its artifacts.

    Reads crash bundles, tracebacks, SGLang/torchrun logs, py-spy and faulthandler dumps and
    PyTorch Flight Recorder dumps. Exit codes: 0 a known signature was named, 1 no known
    signature fits, 2 bad usage or no readable input.
    """
    from doctor.diagnose import diagnose
    from doctor.report.markdown import diagnosis_markdown

    if json_out and markdown:
        raise ConfigError("doctor", "choose one of --json and --markdown")
    diag = diagnose(inputs)
    text = diag.model_dump_json(indent=2) if json_out else (
        diagnosis_markdown(diag) if markdown else None)
    if out is not None:
        out.write_text(text if text is not None else diag.model_dump_json(indent=2),
                       encoding="utf-8")
    if text is not None and out is None:
        print(text)
    elif text is None:
        import render

        render.doctor_report(diag, verbose=verbose)
    raise typer.Exit(diag.exit_code)


@signatures_app.command("list")
@_handles_errors
def signatures_list(
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List every signature id with its severity and title."""
    from signatures.loader import load_catalog

    catalog = load_catalog()
    if json_out:
        rows = [{"id": s.id, "title": s.title, "severity": s.severity.value, "kind": s.kind.value,
                 "campaign_cell": s.campaign.cell if s.campaign else None}
                for s in catalog.signatures]
        print(json.dumps({"catalog_version": catalog.version, "signatures": rows}, indent=2))
        return
    import render

    render.signature_table(catalog)


@signatures_app.command("show")
@_handles_errors
def signatures_show(
    signature: Annotated[str, typer.Argument(help="Signature id, e.g. write-ack-pop-empty.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show one signature: meaning, recognisers, root cause, fix, mitigations, campaign cell."""
    sig = _signature(signature)
    if json_out:
        print(sig.model_dump_json(indent=2))
        return
    import render

    render.signature_detail(sig)


@signatures_app.command("new")
@_handles_errors
def signatures_new(
    source: Annotated[Path, typer.Option("--from", help="A diagnosis written by "
                                          "`hicache doctor --json` (the incident).")],
    sig_id: Annotated[str | None, typer.Option("--id", help="Id of the new signature "
                                                "(default: unknown-<fingerprint>).")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the draft here.")]
    = None,
) -> None:
    """Write a draft catalog entry from an incident's evidence, for a maintainer to finish."""
    from pydantic import ValidationError

    from doctor.report.draft import draft_yaml
    from doctor.report.model import Diagnosis

    try:
        raw = source.read_bytes()[: 64 << 20]
        diag = Diagnosis.model_validate_json(raw)
    except OSError as exc:
        raise ConfigError("--from", f"cannot read {source}: {exc.strerror or exc}") from None
    except ValidationError as exc:
        raise ConfigError("--from", f"{source} is not a diagnosis from `hicache doctor --json` "
                                    f"({exc.error_count()} problem(s), first: "
                                    f"{exc.errors()[0]['msg']})") from None
    try:
        text = draft_yaml(diag, sig_id)
    except (ValueError, ValidationError) as exc:
        raise ConfigError("--from", f"cannot draft an entry: {exc}") from None
    if out is not None:
        out.write_text(text, encoding="utf-8")
        print(f"draft written to {out}")
    else:
        print(text, end="")


@signatures_app.command("schema")
@_handles_errors
def signatures_schema(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write to a file.")] = None,
) -> None:
    """JSON Schemas: the catalog, the doctor's diagnosis, capture manifests, crash bundles."""
    from doctor.read.bundle import CaptureManifest
    from doctor.report.model import Diagnosis
    from hicache_runtime.bundle import bundle_json_schema
    from signatures.models import Catalog

    text = json.dumps({"catalog": Catalog.model_json_schema(),
                       "diagnosis": Diagnosis.model_json_schema(),
                       "capture": CaptureManifest.model_json_schema(),
                       "bundle": bundle_json_schema()}, indent=2)
    if out:
        out.write_text(text, encoding="utf-8")
    else:
        print(text)


def _signature(sig_id: str) -> Any:
    from signatures.loader import load_catalog

    try:
        return load_catalog().get(sig_id)
    except KeyError as exc:
        raise ConfigError("signature", str(exc.args[0])) from None


@app.command()
@_handles_errors
def runbook(
    signature: Annotated[list[str] | None, typer.Option(
        "--signature", "-s", help="Only this signature (repeatable).")] = None,
    from_diagnosis: Annotated[Path | None, typer.Option(
        "--from", help="An incident's diagnosis (hicache doctor --json output).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Directory (catalog runbooks) or file (incident runbook).")] = None,
    html_out: Annotated[bool, typer.Option("--html", help="Also write HTML.")] = False,
) -> None:
    """Write runbooks: one per signature, or one for an incident (--from DIAGNOSIS.json)."""
    from doctor.report.model import Diagnosis
    from doctor.report.runbook import catalog_index, incident_runbook, signature_runbook
    from signatures.loader import load_catalog

    catalog = load_catalog()
    if from_diagnosis is not None:
        try:
            diag = Diagnosis.model_validate_json(from_diagnosis.read_bytes())
        except ValueError as exc:
            raise ConfigError("--from", f"{from_diagnosis} is not a diagnosis: "
                                        f"{str(exc).splitlines()[0]}") from None
        _emit_docs({"incident": incident_runbook(diag, catalog)}, out, html_out, single=True)
        return
    sigs = [_signature(s) for s in signature] if signature else catalog.signatures
    docs = {s.id: signature_runbook(s) for s in sigs}
    if out is not None and not signature:
        docs["index"] = catalog_index(catalog)
    _emit_docs(docs, out, html_out, single=False)


def _emit_docs(docs: dict[str, str], out: Path | None, html_out: bool, single: bool) -> None:
    from doctor.report.runbook import to_html

    if out is None:
        print("\n\n".join(docs.values()).rstrip())
        return
    if single:
        out.parent.mkdir(parents=True, exist_ok=True)
        text = next(iter(docs.values()))
        out.write_text(text, encoding="utf-8")
        if html_out:
            out.with_suffix(".html").write_text(to_html(text, out.stem), encoding="utf-8")
        print(f"wrote {out}")
        return
    out.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (out / f"{name}.md").write_text(text, encoding="utf-8")
        if html_out:
            (out / f"{name}.html").write_text(to_html(text, name), encoding="utf-8")
    print(f"wrote {len(docs)} runbook(s) to {out}")


@app.command()
@_handles_errors
def capture(
    pid: Annotated[list[int] | None, typer.Option("--pid", help="A rank's pid (repeatable).")]
    = None,
    tree: Annotated[int | None, typer.Option(
        "--tree", help="Every Python process below this pid (a launcher or server).")] = None,
    torchrun: Annotated[int | None, typer.Option(
        "--torchrun", help="The workers of this torchrun agent (ranks from RANK).")] = None,
    log: Annotated[list[Path] | None, typer.Option(
        "--log", help="A log file to include (repeatable).")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Capture directory.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per py-spy dump.")] = 10.0,
    native: Annotated[bool, typer.Option(help="Include native frames.")] = False,
    locals_: Annotated[bool, typer.Option("--locals", help="Include local variables.")]
    = False,
) -> None:
    """Take py-spy dumps of every rank of a live job at about the same time, plus logs.

    Exit codes: 0 every rank captured, 1 some dumps failed, 2 bad usage or nothing captured.
    """
    import render
    from doctor.capture import capture as do_capture
    from doctor.capture import find_targets

    for path in log or []:
        if not path.is_file():
            raise ConfigError("--log", f"{path} is not a file")
    targets = find_targets(list(pid or []), tree, torchrun)
    dest = out or Path(f"capture-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    result = do_capture(targets, dest, logs=list(log or []), timeout_s=timeout, native=native,
                        locals_=locals_)
    render.capture_summary(result)
    captured = sum(1 for t in result.manifest.targets if not t.error)
    raise typer.Exit(EXIT_OK if not result.failures else
                     (EXIT_UNHEALTHY if captured else EXIT_USAGE))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
