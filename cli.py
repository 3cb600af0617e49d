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
import os
import re
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from hicache_runtime.contracts.errors import (
    ConfigError,
    HiCacheError,
    ToolUnavailable,
    first_problem,
)


class _HelpFormatter(typer._click.HelpFormatter):
    """Help text wrapped at word boundaries: a hyphenated value (``write_through_selective``,
    ``round-robin``) or a URL is never cut inside, a description gets the room left of the
    terminal (``COLUMNS``) after the option names, and a long option name puts its
    description on the next line. Paragraphs of a docstring are re-flowed; a paragraph that
    starts with a ``\\b`` line is kept as written."""

    def write_text(self, text: str) -> None:
        self.write(_wrap(text, self.width, " " * self.current_indent) + "\n")

    def write_dl(self, rows: Any, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        names = max((len(first) for first, _ in rows), default=0)
        first_col = min(names, col_max) + col_spacing
        width = max(self.width, first_col + self.current_indent + 24)
        for first, second in rows:
            # click shows a default given as text in parentheses: "[default: (1)]"
            second = re.sub(r"\[default: \((.*)\)\]", r"[default: \1]", second)
            pad = " " * self.current_indent
            if not second:
                self.write(f"{pad}{first}\n")
                continue
            body = _wrap(second, width, " " * (first_col + self.current_indent)).lstrip()
            if len(first) <= first_col - col_spacing:
                self.write(f"{pad}{first:<{first_col}}{body}\n")
            else:
                self.write(f"{pad}{first}\n{' ' * (first_col + self.current_indent)}{body}\n")


def _wrap(text: str, width: int, indent: str) -> str:
    """Paragraphs of ``text`` filled to ``width`` (counting ``indent``) at word boundaries."""
    import textwrap

    out = []
    for par in re.split(r"\n\s*\n", text.strip("\n")):
        lines = par.splitlines()
        if lines and lines[0].strip() == "\b":
            out.append("\n".join(indent + ln for ln in lines[1:]))
            continue
        out.append(textwrap.fill(" ".join(ln.strip() for ln in lines), width=width,
                                 initial_indent=indent, subsequent_indent=indent,
                                 break_on_hyphens=False, break_long_words=False))
    return "\n\n".join(out)


# Plain help, not rich's panels: at 80 columns the panels left a description ~19 characters
# and cut option names; the formatter above wraps at words and honours COLUMNS.
typer._click.Context.formatter_class = _HelpFormatter
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, context_settings={"max_content_width": 200},
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
        except BrokenPipeError:
            _closed_pipe()
        except HiCacheError as exc:
            render.error(_one_line(str(exc)), _one_line(exc.hint))
            raise typer.Exit(EXIT_USAGE) from None
        except OSError as exc:
            render.error(_one_line(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")))
            raise typer.Exit(EXIT_USAGE) from None
        except KeyboardInterrupt as exc:
            # Ctrl-C, or SIGTERM/SIGHUP turned into an interrupt by the launcher (which has
            # already stopped the ranks and said where any bundle was kept): the shell's
            # convention, 128 + the signal's number, so a supervisor sees why the run ended.
            import signal

            signum = int(getattr(exc, "signum", signal.SIGINT))
            render.error(f"interrupted by {signal.Signals(signum).name}")
            raise typer.Exit(128 + signum) from None

    return wrapper  # type: ignore[return-value]


def _closed_pipe() -> None:
    """The reader went away (``hicache ... | head``): end quietly, with the status a process
    killed by SIGPIPE has (128 + 13), whatever the command would have returned; nothing more
    is written, not even at exit when Python flushes stdout."""
    import os
    import signal

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass
    raise typer.Exit(128 + signal.SIGPIPE)


def _one_line(text: str) -> str:
    """An error message as shown: one line (``render.error`` escapes it: it may quote file
    names and values from files, which may hold brackets)."""
    return " ".join(text.split())


def _require_runtime(command: str) -> None:
    """The runtime commands need torch, which the base (triage) install leaves out: without
    it, say in one line how to install it, before anything imports it (exit 2)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torch") is not None
    except ImportError:  # a finder that refuses it, as a broken or blocked install does
        found = False
    if not found:
        raise ToolUnavailable(f"hicache {command} needs the runtime (torch, redis), which is "
                              "not installed: pip install -e '.[runtime]' in the "
                              "hicache-doctor checkout")


def _version() -> str:
    """The installed distribution's version; from ``pyproject.toml`` in a plain checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hicache-doctor")
    except PackageNotFoundError:
        import tomllib

        meta = tomllib.loads((Path(__file__).parent / "pyproject.toml").read_text("utf-8"))
        return str(meta["project"]["version"])


@functools.cache
def _config_defaults() -> Any:
    from hicache_runtime.config import load_config

    return load_config({})


def _dflt(dotted: str) -> str:
    """The runtime config's default of a field, shown by ``--help`` for the options that
    leave the field to the config (their own default is None, which says nothing)."""
    value: Any = _config_defaults()
    for part in dotted.split("."):
        value = getattr(value, part)
    return str(getattr(value, "value", value))


def _print_version(value: bool) -> None:
    if value:
        print(f"hicache {_version()}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _options(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print the version and exit.")] = False,
) -> None:
    """Run, break and diagnose a hierarchical KV cache (SGLang HiCache)."""


# --- run ------------------------------------------------------------------------------------


@app.command(short_help="Run the runtime and judge it against a cache-disabled run.")
@_handles_errors
def run(
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel ranks.",
                                           show_default=_dflt("topology.tp"))] = None,
    pp: Annotated[int | None, typer.Option(help="Pipeline stages.",
                                           show_default=_dflt("topology.pp"))] = None,
    dp: Annotated[int | None, typer.Option(
        help="Data-parallel groups, each a tp x pp grid; a DP controller routes the requests.",
        show_default=_dflt("topology.dp"))] = None,
    dp_policy: Annotated[str | None, typer.Option(
        help="round-robin | shortest-queue: how the DP controller picks a group.",
        show_default=_dflt("topology.dp_policy"))] = None,
    requests: Annotated[int | None, typer.Option(
        help="Requests in the workload.", show_default=_dflt("workload.requests"))] = None,
    workload: Annotated[str | None, typer.Option(
        help="multi_turn | shared_prefix | long_context (or long-context) | mixed",
        show_default=_dflt("workload.kind"))] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the workload and faults.",
                                             show_default=_dflt("seed"))] = None,
    device_tokens: Annotated[int | None, typer.Option(
        help="L1 (device) pool size.", show_default=_dflt("cache.device_tokens"))] = None,
    host_tokens: Annotated[int | None, typer.Option(
        help="L2 (host) pool size.",
        show_default=f"{_dflt('cache.host_ratio')} x device tokens")] = None,
    page_size: Annotated[int | None, typer.Option(
        help="Tokens per page.", show_default=_dflt("cache.page_size"))] = None,
    write_policy: Annotated[str | None, typer.Option(
        help="write_through | write_through_selective | write_back",
        show_default=_dflt("cache.write_policy"))] = None,
    eviction_policy: Annotated[str | None, typer.Option(
        help="Which leaf L1 and L2 eviction take first: lru | lfu | fifo | mru | filo | "
             "priority | slru | tlru (as the profile's release offers; settings in a config "
             "file's cache.eviction_policy_config).",
        show_default=_dflt("cache.eviction_policy"))] = None,
    mem_layout: Annotated[str | None, typer.Option(
        help="Host pool layout: layer_first | page_first | page_first_direct",
        show_default=_dflt("cache.mem_layout"))] = None,
    max_new_tokens: Annotated[int | None, typer.Option(
        help="Tokens generated per request.", show_default=_dflt("workload.max_new_tokens"))]
    = None,
    storage: Annotated[str | None, typer.Option(
        help="L3 backend: none, or a backend's name (an unknown name lists the known "
             "ones, installed plug-ins included).",
        show_default=_dflt("storage.backend"))]
    = None,
    storage_path: Annotated[Path | None, typer.Option(
        help="Directory of the file backend.",
        show_default="a private per-user directory under $TMPDIR")] = None,
    storage_url: Annotated[str | None, typer.Option(
        help="The server of a backend that keeps its store in one: redis://HOST:PORT/DB, "
             "or mooncake://HOST:RPC_PORT ?metadata=http://HOST:PORT/metadata (one word). "
             "Without it, a backend that can start a private store for the run does "
             "(mooncake).")] = None,
    storage_optional: Annotated[bool, typer.Option(
        help="Start even if the L3 backend is unreachable (it reconnects later).")] = False,
    storage_format: Annotated[str | None, typer.Option(
        help="envelope (checksummed; the default) or upstream: the raw page files SGLang's "
             "file backend reads and writes, to share a store with a deployment (name its "
             "model with --storage-model).")] = None,
    storage_model: Annotated[str | None, typer.Option(
        help="The model name in object keys: SGLang's served model name (default: an id of "
             "this run's model).")] = None,
    prefetch_policy: Annotated[str | None, typer.Option(
        help="best_effort | wait_complete | timeout",
        show_default=_dflt("storage.prefetch_policy"))] = None,
    sidecar_pools: Annotated[str | None, typer.Option(
        help="Hybrid-model sidecar pools: all_pages, trailing_pages or both (comma-separated).")]
    = None,
    fault: Annotated[list[str] | None, typer.Option(
        help="Fault spec, e.g. 'dma-lag:ms=20' (repeatable).")] = None,
    legacy: Annotated[list[str] | None, typer.Option(
        help="Restore a pre-fix protocol, e.g. 'skip-empty-sync' (repeatable).")] = None,
    profile: Annotated[str | None, typer.Option(
        help="The release to stand for: sglang-0.5.5, -0.5.13, -0.5.16, -0.5.20, -0.5.23 "
             "or proposed (hicache profiles list).",
        show_default=_dflt("profile"))] = None,
    config: Annotated[Path | None, typer.Option(help="YAML, TOML or JSON config file.")] = None,
    trace: Annotated[Path | None, typer.Option(help="Write every event to this JSONL file.")]
    = None,
    bundle_dir: Annotated[Path | None, typer.Option(
        help="Where crash bundles go.", show_default="hicache-bundles")] = None,
    watchdog_timeout: Annotated[float | None, typer.Option(
        help="Seconds without progress before a run counts as hung.",
        show_default=_dflt("observability.watchdog_timeout_s"))] = None,
    protocol_timeout: Annotated[float | None, typer.Option(
        help="Timeout of protocol collectives between ranks (seconds).",
        show_default=_dflt("observability.protocol_timeout_s"))] = None,
    consensus_check: Annotated[bool, typer.Option(
        help="Hash decisions that must agree and compare them across ranks.")] = False,
    enable_dynamic_chunking: Annotated[bool, typer.Option(
        help="PP only: size continuation chunks of long prefills for equal forward latency, "
             "from a latency profile PP0 takes at start-up.")] = False,
    compare: Annotated[bool, typer.Option(
        help="Compare outputs with a cache-disabled run.")] = True,
    torchrun_dir: Annotated[Path | None, typer.Option(
        help="Do not run: write DIR/config.json and print the torchrun command that runs "
             "the same ranks (env:// rendezvous, e.g. across nodes).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run the runtime on a seeded workload and judge it against a cache-disabled run."""
    _require_runtime("run")

    data: dict[str, Any] = _read_config(config) if config else {}
    given = {  # config key -> (the flag that sets it, its value); errors name the flag
        "topology.tp": ("--tp", tp), "topology.pp": ("--pp", pp), "topology.dp": ("--dp", dp),
        "topology.dp_policy": ("--dp-policy", dp_policy),
        "workload.requests": ("--requests", requests), "workload.kind": ("--workload", workload),
        "seed": ("--seed", seed), "profile": ("--profile", profile),
        "cache.device_tokens": ("--device-tokens", device_tokens),
        "cache.host_tokens": ("--host-tokens", host_tokens),
        "cache.page_size": ("--page-size", page_size),
        "cache.write_policy": ("--write-policy", write_policy),
        "cache.eviction_policy": ("--eviction-policy", eviction_policy),
        "cache.mem_layout": ("--mem-layout", mem_layout),
        "workload.max_new_tokens": ("--max-new-tokens", max_new_tokens),
        "observability.trace_path": ("--trace", trace),
        "observability.bundle_dir": ("--bundle-dir", bundle_dir),
        "observability.watchdog_timeout_s": ("--watchdog-timeout", watchdog_timeout),
        "storage.backend": ("--storage", storage), "storage.path": ("--storage-path", storage_path),
        "storage.url": ("--storage-url", storage_url),
        "storage.format": ("--storage-format", storage_format),
        "storage.model_name": ("--storage-model", storage_model),
        "storage.prefetch_policy": ("--prefetch-policy", prefetch_policy),
        "model.sidecars": ("--sidecar-pools", tuple(
            p.strip() for p in sidecar_pools.split(",") if p.strip()) if sidecar_pools else None),
        "storage.required": ("--storage-optional", False if storage_optional else None),
        "observability.protocol_timeout_s": ("--protocol-timeout", protocol_timeout),
        "observability.consensus_check": ("--consensus-check",
                                          True if consensus_check else None),
        "scheduler.enable_dynamic_chunking": ("--enable-dynamic-chunking",
                                              True if enable_dynamic_chunking else None),
    }
    data.update({k: v for k, (_, v) in given.items() if v is not None})
    cfg = _config_from_flags(data, given, fault, legacy)
    if torchrun_dir is not None:
        # The ranks run on other machines: only their sizes are checked, not this machine.
        from hicache_runtime.config import check_run_limits

        check_run_limits(cfg, memory=False)
        if cfg.topology.dp > 1:
            raise ConfigError("topology.dp", "DP groups are started by the DP controller of "
                              "'hicache run'; torchrun starts one group's ranks")
        torchrun_dir.mkdir(parents=True, exist_ok=True)
        (torchrun_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
        print(f"torchrun --nproc-per-node {cfg.topology.world_size} "
              f"-m hicache_runtime.launch.rank_process --run-dir {torchrun_dir}")
        raise typer.Exit(EXIT_OK)
    _check_machine(cfg)
    summary = _execute(cfg, compare, progress=not json_out)
    if json_out:
        print(summary.model_dump_json(indent=2))
    else:
        import render

        render.run_summary(summary)
    raise typer.Exit(EXIT_OK if summary.outcome.value == "healthy" else EXIT_UNHEALTHY)


def _check_machine(cfg: Any) -> None:
    """Refuse, in one line, a run this machine cannot hold: before any pool is allocated or
    rank started (a typo in --device-tokens must not end in an allocator traceback)."""
    from hicache_runtime.config import check_run_limits

    check_run_limits(cfg, memory=False)  # sizes first: no need to wait for torch to load
    accelerator, device_free = False, None
    import torch

    if torch.cuda.is_available():
        accelerator = True
        if cfg.topology.grid_size == 1:  # the rank runs in this process: ask the device
            device_free = int(torch.cuda.mem_get_info()[0])
    check_run_limits(cfg, accelerator=accelerator, device_free=device_free)


def _execute(cfg: Any, compare: bool, progress: bool) -> Any:
    import render
    from hicache_runtime.l3.registry import private_store
    from hicache_runtime.launch.run import run

    with private_store(cfg) as (cfg, store):
        if store is not None:  # on stderr: with --json, stdout stays one JSON object
            print(f"L3: started a private {cfg.storage.backend} store for this run at "
                  f"{store.url} (stopped when the run ends; --storage-url uses your own)",
                  file=sys.stderr)
        with render.run_progress("running", enabled=progress and sys.stderr.isatty()) as update:
            return run(cfg, compare=compare, progress=update)


def _config_from_flags(data: dict[str, Any], given: dict[str, tuple[str, Any]],
                       faults: list[str] | None, legacy: list[str] | None) -> Any:
    """The run's config from its flags (``given``: config key -> the flag and its value) over
    ``data``. Every problem at once, the fault specs', the switches' and the other flags',
    each named by the flag typed: fixing one typo per try costs a run start each."""
    from faults.spec import parse_faults
    from hicache_runtime.config import load_config
    from hicache_runtime.contracts.errors import InvalidFaultSpec
    from hicache_runtime.contracts.legacy import parse_legacy

    problems: list[tuple[str, str, str]] = []  # (flag, what, hint); flag "" names its own
    if faults:
        try:
            data["faults"] = parse_faults(faults)
        except InvalidFaultSpec as exc:
            problems.append(("--fault", str(exc), exc.hint))
    if legacy:
        try:
            data["legacy"] = parse_legacy(legacy)
        except ConfigError as exc:
            problems.append(("--legacy", str(exc).removeprefix(f"{exc.field}: "), exc.hint))
    try:
        cfg = load_config(data, names={k: f for k, (f, v) in given.items() if v is not None})
    except ConfigError as exc:
        if not problems:
            raise
        problems.append(("", str(exc), exc.hint))
    if problems:
        (flag, what, _), rest = problems[0], problems[1:]
        raise ConfigError(flag, what + "".join(f"; {f + ': ' if f else ''}{w}"
                                               for f, w, _ in rest),
                          hint="; ".join(h.rstrip(".") for *_, h in problems if h))
    return cfg


def _read_config(path: Path) -> dict[str, Any]:
    """A ``--config`` file: bounded read, aliases bounded (``config_files``), one-line errors."""
    from hicache_runtime.config_files import load_file

    data = load_file(path, "config", default="json")
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping at top level")
    return data


# --- campaign, inject -----------------------------------------------------------------------


@app.command(short_help="Run a fault campaign: every cell judged by its expectation.")
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
    html_dir: Annotated[Path | None, typer.Option(
        "--html", help="Write HTML pages into this directory: the matrix of cells "
                       "(index.html) and an incident page per cell that left a bundle.")]
    = None,
    bundle_dir: Annotated[Path, typer.Option(help="Where the cells' crash bundles go.")]
    = Path("hicache-bundles"),
    storage_url: Annotated[str | None, typer.Option(
        help="The store of cells whose backend keeps it in a server (redis, mooncake); a "
             "spec may not name one.")] = None,
    resume: Annotated[Path | None, typer.Option(
        help="Append each cell's result to this file as it ends; run again with the same "
             "file to finish an interrupted run (done cells are not run again).")] = None,
    shard: Annotated[str | None, typer.Option(
        help="Run only shard I of N (e.g. 2/4): a deterministic subset balanced by each "
             "cell's estimated cost; 'hicache campaign merge' joins the shards' --json "
             "results.")] = None,
    profile: Annotated[str | None, typer.Option(
        help="Run every cell on this release profile instead of the spec's (the built-in "
             "campaigns run proposed).")] = None,
    executor: Annotated[str, typer.Option(
        help="local (one cell after the other, here) or ray: each cell a Ray task reserving "
             "a CPU per rank and busy helper (pip install -e '.[ray]' in the checkout)."
    )] = "local",
    address: Annotated[str | None, typer.Option(
        help="With --executor ray: the cluster's address (HOST:PORT of 'ray start --head', "
             "or auto); without it, a Ray instance of this command's own.")] = None,
    keep_bundles_on_nodes: Annotated[bool, typer.Option(
        help="With --executor ray: leave each bundle on the node that ran the cell (the "
             "result names node and path) instead of copying it here.")] = False,
    profiles: Annotated[str | None, typer.Option(
        help="The release matrix: run the cells without legacy switches once per profile "
             "(comma-separated, e.g. sglang-0.5.13,sglang-0.5.23) and print what each "
             "release does under each fault.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")]
    = False,
) -> None:
    """Run a fault campaign: each cell runs topology x legacy switches x faults x seed and must
    end as expected (healthy with outputs identical to a cache-disabled run, or failed with
    the doctor naming the expected signature). Exit 1 when any cell did not.

    hicache campaign merge A.json B.json ... -o ALL.json joins the --json results of every
    --shard I/N of one run into the result of the whole run (with --junit and --markdown).

    With --profiles, the release matrix: each cell that runs no legacy switch, once per
    profile, judged by the doctor; nothing is expected of a release, so it exits 0 once every
    run has its verdict."""
    _require_runtime("campaign")
    import render
    from faults.campaign.cells import RayOptions, run_campaign, seed_bases, select
    from faults.campaign.plan import MAX_RUNS, load_campaign, needs_store
    from faults.campaign.reports import junit_xml
    from faults.campaign.reports import markdown as markdown_report

    camp = load_campaign(spec)
    if executor not in ("local", "ray"):
        raise ConfigError("--executor", f"{executor[:40]!r} is not local or ray")
    if executor == "local" and (address is not None or keep_bundles_on_nodes):
        raise ConfigError("--address", "--address and --keep-bundles-on-nodes go with "
                                       "--executor ray")
    ray_options = RayOptions(address, keep_bundles_on_nodes) if executor == "ray" else None
    if profile is not None and profiles is not None:
        raise ConfigError("--profile", "give --profile (one profile for every cell) or "
                                       "--profiles (the release matrix), not both")
    if profile is not None:
        from hicache_runtime.contracts.profiles import unknown

        problem = unknown(profile)
        if problem is not None:
            raise ConfigError("--profile", problem)
        camp = camp.model_copy(update={"defaults": {**camp.defaults, "profile": profile}})
    shard_of = None
    if shard is not None:
        from faults.campaign.shards import parse_shard

        shard_of = parse_shard(shard)
        if profiles is not None:
            raise ConfigError("--shard", "shard a campaign, not the release matrix")
    if profiles is not None:
        if ray_options is not None:
            raise ConfigError("--executor", "the release matrix runs locally; --executor ray "
                                            "runs a campaign's cells")
        _release_matrix(camp, profiles, only=only, seeds=seeds, list_cells=list_cells,
                        junit=junit, markdown=markdown, html_dir=html_dir,
                        bundle_dir=bundle_dir, storage_url=storage_url, json_out=json_out)
    seed_list = _seeds(seeds) if seeds else None
    if seed_list is not None:  # counted before select() multiplies the cells
        n = len(seed_bases(select(camp, only))) * len(seed_list)
        if n > MAX_RUNS:
            raise ConfigError("--seeds", f"{n} cell runs ({len(seed_list)} seeds); at most "
                                       f"{MAX_RUNS}")
    cells = select(camp, only, seed_list)
    if not cells:
        raise ConfigError("--only", f"no cell of campaign {camp.name!r} matches {only!r}",
                          hint="hicache campaign --list shows the cell ids")
    if shard_of is not None:
        from faults.campaign.shards import shard as shard_cells

        cells = shard_cells(camp, cells, *shard_of)
    store_cells = needs_store(camp, cells)
    if store_cells and storage_url is None and not list_cells:
        (backend, example), first = store_cells[0]
        raise ConfigError("--storage-url", f"{len(store_cells)} cell(s) use a {backend} "
                          f"store ({first}, ...), which only the command line names",
                          hint=f"hicache campaign SPEC --storage-url {example}")
    if list_cells:
        if json_out:  # each cell with the settings it runs with (campaign defaults + its own)
            print(json.dumps([{**c.model_dump(), "settings": {**camp.defaults, **c.config}}
                              for c in cells], indent=2, default=str))
        else:
            render.campaign_cells(cells, camp.defaults)
        raise typer.Exit(EXIT_OK)
    with render.campaign_progress(len(cells), enabled=not json_out) as hook:
        result = run_campaign(camp, bundle_root=bundle_dir, only=only, seeds=seed_list,
                              hook=hook, storage_url=storage_url, shard=shard_of,
                              resume=resume, ray=ray_options)
    if junit is not None:
        junit.write_text(junit_xml(result), encoding="utf-8")
    if markdown is not None:
        markdown.write_text(markdown_report(result), encoding="utf-8")
    if html_dir is not None:
        from faults.campaign.reports import html_pages

        html_dir.mkdir(parents=True, exist_ok=True)
        for name, text in html_pages(result).items():
            (html_dir / name).write_text(text, encoding="utf-8")
    if json_out:
        print(result.model_dump_json(indent=2))
    else:
        render.campaign_summary(result)
    raise typer.Exit(EXIT_OK if result.failed == 0 else EXIT_UNHEALTHY)


@app.command("campaign-merge", hidden=True)
@_handles_errors
def campaign_merge(
    results: Annotated[list[Path], typer.Argument(help="The --json results of every shard.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="The merged result (JSON).")],
    junit: Annotated[Path | None, typer.Option(help="Write JUnit XML here.")] = None,
    markdown: Annotated[Path | None, typer.Option(help="Write a Markdown report here.")]
    = None,
) -> None:
    """hicache campaign merge A.json B.json ... -o ALL.json: the shards of one run (--shard
    1/N .. N/N, each once) joined into the whole run's result, cells in its order. Exit 1 when
    any cell did not behave, as the whole run would."""
    from faults.campaign.reports import junit_xml
    from faults.campaign.reports import markdown as markdown_report
    from faults.campaign.shards import merge, read_result

    merged = merge([read_result(p) for p in results])
    out.write_text(merged.model_dump_json(indent=2), encoding="utf-8")
    if junit is not None:
        junit.write_text(junit_xml(merged), encoding="utf-8")
    if markdown is not None:
        markdown.write_text(markdown_report(merged), encoding="utf-8")
    print(f"{out}: {len(merged.cells)} cells from {len(results)} shards, {merged.passed} "
          f"behaved as expected, {merged.failed} did not")
    raise typer.Exit(EXIT_OK if merged.failed == 0 else EXIT_UNHEALTHY)


def _release_matrix(camp: Any, profiles: str, *, only: str | None, seeds: str | None,
                    list_cells: bool, junit: Path | None, markdown: Path | None,
                    html_dir: Path | None, bundle_dir: Path, storage_url: str | None,
                    json_out: bool) -> None:
    """``hicache campaign --profiles``: the release matrix (``faults/campaign/releases.py``)."""
    import render
    from faults.campaign.cells import select
    from faults.campaign.releases import markdown as matrix_markdown
    from faults.campaign.releases import parse_profiles, release_spec, run_release_matrix
    from faults.campaign.reports import junit_xml

    if seeds is not None or html_dir is not None:
        raise ConfigError("--profiles", "the release matrix runs each cell once per profile; "
                                        "--seeds and --html do not apply")
    names = parse_profiles(profiles)
    cells = select(release_spec(camp, names[0]), only)
    if not cells:
        raise ConfigError("--only", f"no cell without legacy switches matches {only!r}",
                          hint="hicache campaign --list shows the cell ids")
    if list_cells:  # each cell runs once per profile
        render.campaign_cells(cells, {**camp.defaults, "profile": ",".join(names)})
        raise typer.Exit(EXIT_OK)
    with render.campaign_progress(len(cells) * len(names), enabled=not json_out) as hook:
        result = run_release_matrix(camp, names, bundle_root=bundle_dir, only=only, hook=hook,
                                    storage_url=storage_url)
    if junit is not None:
        junit.write_text(junit_xml(result.as_campaign()), encoding="utf-8")
    if markdown is not None:
        markdown.write_text(matrix_markdown(result), encoding="utf-8")
    if json_out:
        print(json.dumps({**result.model_dump(mode="json"), "reproduces": result.reproduces()},
                         indent=2))
    else:
        render.release_matrix(result)
    raise typer.Exit(EXIT_OK)


def _seeds(text: str) -> list[int]:
    from faults.campaign.plan import MAX_RUNS

    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)) \
                or len(lo) > 18 or len(hi) > 18:
            raise ConfigError("--seeds", f"{text[:60]!r}: expected seeds like 0-4 or 0,3,7")
        count = int(hi) - int(lo) + 1 if sep else 1
        if len(out) + count > MAX_RUNS:  # counted before the range is materialised
            raise ConfigError("--seeds", f"more than {MAX_RUNS} seeds")
        out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    if not out:
        raise ConfigError("--seeds", "no seeds given")
    return out


@app.command(short_help="Inject faults and name what they caused; replay, shrink.")
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
    max_runs: Annotated[int, typer.Option(
        min=1, help="Run budget of --shrink's search (a step is kept after 2 runs that both "
                    "fail the same way).")] = 16,
    confirm: Annotated[int, typer.Option(
        min=0, max=100, help="With --shrink: rerun the final case N more times and report how "
                             "often it reproduced (k/N); a case short of N/N is marked flaky."
                             )] = 3,
    out: Annotated[Path | None, typer.Option(
        help="Output directory: of --shrink (default: shrunk-<bundle name>); of --replay, "
             "where its bundle and scratch files go (default: --bundle-dir, else "
             "hicache-bundles).")] = None,
    storage_url: Annotated[str | None, typer.Option(
        help="With --replay: run the bundle's L3 on this Redis server (by default a replay "
             "uses a private file store and never contacts a server the bundle names).")]
    = None,
    dry_run: Annotated[bool, typer.Option(
        help="With --replay: show what would run (topology, requests, faults, storage, "
             "output) and run nothing.")] = False,
    warm: Annotated[bool | None, typer.Option(
        help="Warm L3 with a fault-free run first (default: as the bundle's cell did).")]
    = None,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel ranks.",
                                           show_default=_dflt("topology.tp"))] = None,
    pp: Annotated[int | None, typer.Option(help="Pipeline stages.",
                                           show_default=_dflt("topology.pp"))] = None,
    legacy: Annotated[list[str] | None, typer.Option(
        help="Restore a pre-fix protocol (repeatable).")] = None,
    profile: Annotated[str | None, typer.Option(
        help="The release to stand for: sglang-0.5.5, -0.5.13, -0.5.16, -0.5.20, -0.5.23 "
             "or proposed (hicache profiles list).",
        show_default=_dflt("profile"))] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the workload and faults.",
                                             show_default=_dflt("seed"))] = None,
    requests: Annotated[int | None, typer.Option(
        help="Requests in the workload.", show_default=_dflt("workload.requests"))] = None,
    config: Annotated[Path | None, typer.Option(help="YAML, TOML or JSON config file.")] = None,
    bundle_dir: Annotated[Path | None, typer.Option(
        help="Where crash bundles go.", show_default="hicache-bundles")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Inject faults into a run and name what they caused; or replay (and shrink) a bundle.

    Exit codes: 0 the run stayed healthy / the replay failed the same way; 1 it did not.
    """
    _require_runtime("inject")
    if replay is None:
        if shrink or not faults:
            raise ConfigError("inject", "give fault specs, or --replay BUNDLE [--shrink]")
        _inject_faults(faults, tp, pp, legacy, profile, seed, requests, config, bundle_dir,
                       warm, json_out)
        return
    if faults:
        raise ConfigError("inject", "--replay reruns the bundle's own faults; drop the specs")
    given = [name for name, v in (("--tp", tp), ("--pp", pp), ("--legacy", legacy),
                                  ("--profile", profile),
                                  ("--seed", seed), ("--requests", requests),
                                  ("--config", config)) if v is not None]
    if given:
        raise ConfigError("inject", f"--replay reruns the bundle's own run; {', '.join(given)} "
                                    "do not apply")
    _replay(replay, shrink=shrink, max_runs=max_runs, confirm=confirm, out=out,
            bundle_dir=bundle_dir, storage_url=storage_url, dry_run=dry_run, warm=warm,
            json_out=json_out)


def _replay(bundle: Path, *, shrink: bool, max_runs: int, confirm: int, out: Path | None,
            bundle_dir: Path | None, storage_url: str | None, dry_run: bool,
            warm: bool | None, json_out: bool) -> None:
    """Replay (or shrink) a bundle. The bundle is untrusted (docs/threat-model.md): what runs
    is shown first, and paths, servers and sizes come from this command line, not from it."""
    import tempfile

    import render
    from faults.campaign.replay import plan
    from faults.campaign.replay import replay as replay_bundle
    from hicache_runtime.launch.run import DEFAULT_BUNDLE_ROOT

    if shrink and storage_url is not None:
        raise ConfigError("--storage-url", "--shrink always uses private file stores")
    output = (out or Path(f"shrunk-{bundle.resolve().name}")) if shrink \
        else (out or bundle_dir or DEFAULT_BUNDLE_ROOT)
    the_plan, _, _ = plan(bundle, output=output, warm=warm, storage_url=storage_url)
    if dry_run:
        print(the_plan.model_dump_json(indent=2) if json_out else "\n".join(the_plan.lines()))
        raise typer.Exit(EXIT_OK)
    # What is about to run goes to stderr (stdout stays the result); with --json only for a
    # person watching, since the JSON result carries the plan too.
    if not json_out or sys.stderr.isatty():
        print("\n".join(the_plan.lines()), file=sys.stderr)
    if shrink:
        from faults.campaign.shrink import shrink_bundle

        shown = not json_out or sys.stderr.isatty()
        result = shrink_bundle(bundle, output, max_runs=max_runs, confirm=confirm, warm=warm,
                               on_trial=render.shrink_step if shown else None)
        if json_out:
            print(result.model_dump_json(indent=2))
        else:
            render.shrink_summary(result)
        raise typer.Exit(EXIT_OK if result.reproduced else EXIT_UNHEALTHY)
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".replay-", dir=output) as work:
        res = replay_bundle(bundle, work=Path(work), bundle_root=bundle_dir or output,
                            warm=warm, storage_url=storage_url)
    if json_out:
        print(res.model_dump_json(indent=2))
    else:
        render.replay_summary(res)
    raise typer.Exit(EXIT_OK if res.reproduced else EXIT_UNHEALTHY)


def _inject_faults(faults: list[str], tp: int | None, pp: int | None,
                   legacy: list[str] | None, profile: str | None, seed: int | None,
                   requests: int | None,
                   config: Path | None, bundle_dir: Path | None, warm: bool | None,
                   json_out: bool) -> None:
    import render
    from faults.campaign.cells import run_and_diagnose
    from hicache_runtime.launch.run import DEFAULT_BUNDLE_ROOT

    data: dict[str, Any] = _read_config(config) if config else {}
    given = {"topology.tp": ("--tp", tp), "topology.pp": ("--pp", pp), "seed": ("--seed", seed),
             "workload.requests": ("--requests", requests), "profile": ("--profile", profile)}
    data.update({k: v for k, (_, v) in given.items() if v is not None})
    cfg = _config_from_flags(data, given, faults, legacy)
    _check_machine(cfg)
    done = run_and_diagnose(cfg, warm=bool(warm), compare=True,
                            bundle_root=bundle_dir or cfg.observability.bundle_dir
                            or DEFAULT_BUNDLE_ROOT)
    if json_out:
        print(done.model_dump_json(indent=2))
    else:
        render.inject_summary(done)
    raise typer.Exit(EXIT_OK if done.observed == "healthy" else EXIT_UNHEALTHY)


# --- trace ----------------------------------------------------------------------------------


@trace_app.command("export", short_help="Runtime traces as one Perfetto/Chrome trace.")
@_handles_errors
def trace_export(
    traces: Annotated[list[Path], typer.Argument(help="JSONL traces or bundle directories.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output file.")] = Path("trace.json"),
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print what was written and skipped as JSON.")] = False,
) -> None:
    """Convert runtime traces into a Perfetto/Chrome trace: one track per rank and thread.

    Lines that are not events are skipped and counted; an input without any event is an error
    (exit 2).
    """
    import render
    from hicache_runtime.telemetry.perfetto import export_perfetto

    stats = export_perfetto(list(traces), out)
    for problem in stats.problems:
        render.warn(problem)
    if json_out:
        import dataclasses

        print(json.dumps({"out": str(out), **dataclasses.asdict(stats)}, indent=2))
        return
    skipped = f"; skipped {stats.skipped_text}" if stats.skipped_text else ""
    print(f"wrote {stats.events} events to {out}{skipped} (open in https://ui.perfetto.dev)")


@trace_app.command("schema", short_help="The JSON Schema of crash bundles.")
@_handles_errors
def trace_schema(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write to a file.")] = None,
) -> None:
    """Print the JSON Schema of crash bundles (manifest, state, events, flight recorder)."""
    from hicache_runtime.contracts.bundle import bundle_json_schema

    text = json.dumps(bundle_json_schema(), indent=2)
    if out:
        out.write_text(text, encoding="utf-8")
    else:
        print(text)


# --- doctor, signatures, runbook, capture ------------------------------------------------------

signatures_app = typer.Typer(no_args_is_help=True,
                             help="The catalog of known crash signatures.")
app.add_typer(signatures_app, name="signatures")


@app.command(short_help="Name the crash signature behind a dead or hung job.")
@_handles_errors
def doctor(
    inputs: Annotated[list[str] | None, typer.Argument(
        help="Files, directories, .tar.gz archives, or - for stdin.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the diagnosis as JSON.")]
    = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a Markdown report.")]
    = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the report here.")]
    = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the rule log.")]
    = False,
    html_out: Annotated[Path | None, typer.Option(
        "--html", help="Also write the incident page here: verdict, a timeline of every "
                       "rank's run, evidence and playbook (several incidents: a directory "
                       "with an index).")] = None,
    store: Annotated[Path | None, typer.Option(
        "--store", help="Audit an L3 file store instead (a deployment's HiCacheFile directory "
                        "or this runtime's): formats, corrupt pages, pages some TP ranks lack, "
                        "page sizes that do not fit.")] = None,
) -> None:
    """Name the crash signature of a dead or hung deployment from its artifacts.

    Reads crash bundles, tracebacks, SGLang/torchrun logs, py-spy and faulthandler dumps and
    PyTorch Flight Recorder dumps. Exit codes: 0 a known signature was named, 1 no known
    signature fits (also: the inputs are empty), 2 bad usage or no readable input (a path not
    found, a device). With --store: 0 no problem found, 1 problems found, 2 no readable store.
    """
    if json_out and markdown:
        raise ConfigError("doctor", "choose one of --json and --markdown")
    if store is not None:
        if inputs:
            raise ConfigError("doctor", "give either inputs or --store, not both")
        _store_audit(store, json_out)
    if not inputs:
        raise ConfigError("doctor", "name what to read: files, directories, archives or - "
                          "(or --store DIR for an L3 file store)")

    from doctor.diagnose import diagnose
    from doctor.read.incidents import split_incidents
    from doctor.report.markdown import diagnosis_markdown

    incidents = split_incidents(inputs)
    if len(incidents) > 1:
        _several_incidents(incidents, json_out, markdown, out, html_out)
    diag = diagnose(inputs)
    if html_out is not None:
        _incident_pages([(None, "", diag)], html_out)
    text = diag.model_dump_json(indent=2) if json_out else (
        diagnosis_markdown(diag) if markdown else None)
    if out is not None:
        out.write_text(text if text is not None else diag.model_dump_json(indent=2),
                       encoding="utf-8")
    if text is not None and out is None:
        print(text)
    elif text is None and diag.status == "unreadable":
        import render

        render.error(diag.summary)  # nothing was read: one line, not an empty report
    elif text is None:
        import render

        render.doctor_report(diag, verbose=verbose)
    raise typer.Exit(diag.exit_code)


def _store_audit(root: Path, json_out: bool) -> None:
    """``doctor --store``: the audit of an L3 file store, then the exit."""
    from hicache_runtime.l3.audit import audit_store

    try:
        audit = audit_store(root)
    except OSError as exc:
        raise ConfigError("--store", f"{root}: {exc.strerror or exc}") from None
    if json_out:
        print(json.dumps(audit.to_json(), indent=2))
    else:
        import render

        render.store_audit(audit)
    raise typer.Exit(EXIT_UNHEALTHY if audit.problems else EXIT_OK)


def _incident_pages(incidents: list[tuple[str | None, str, Any]], path: Path) -> None:
    """The incident page of one diagnosis at ``path``; of several, ``path`` is a directory
    with an index page and one page per incident (``incident-<n>.html``)."""
    from doctor.report.html import incident_page, incidents_index
    from doctor.report.runbook import incident_runbook
    from signatures.loader import load_catalog

    catalog = load_catalog()
    if len(incidents) == 1:
        diag = incidents[0][2]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(incident_page(diag, incident_runbook(diag, catalog)), encoding="utf-8")
        return
    path.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, (bundle, created, diag) in enumerate(incidents, 1):
        name = f"incident-{n}.html"
        (path / name).write_text(incident_page(diag, incident_runbook(diag, catalog)),
                                 encoding="utf-8")
        rows.append((name, bundle or "(the other inputs)", created, diag))
    (path / "index.html").write_text(incidents_index(rows), encoding="utf-8")


def _several_incidents(incidents: list[Any], json_out: bool, markdown: bool,
                       out: Path | None, html_out: Path | None = None) -> None:
    """Inputs that hold several bundles: one diagnosis per incident, newest first."""
    from doctor.diagnose import diagnose
    from doctor.report.markdown import diagnosis_markdown
    from doctor.report.model import Incident, Incidents

    result = Incidents(incidents=[Incident(bundle=i.bundle, created_at=i.created_at,
                                           diagnosis=diagnose(i.paths)) for i in incidents])
    if html_out is not None:
        _incident_pages([(i.bundle, i.created_at, i.diagnosis) for i in result.incidents],
                        html_out)
    if json_out or (out is not None and not markdown):
        text: str | None = result.model_dump_json(indent=2)
    elif markdown:
        text = "\n\n".join(
            f"# Incident {n}: {i.bundle or 'other inputs'}\n\n" + diagnosis_markdown(i.diagnosis)
            for n, i in enumerate(result.incidents, 1))
    else:
        text = None
    if out is not None and text is not None:
        out.write_text(text, encoding="utf-8")
    elif text is not None:
        print(text)
    else:
        import render

        render.incident_list(result)
    raise typer.Exit(result.exit_code)


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
                 "campaign_cell": s.campaign.cell if s.campaign else None,
                 "campaign_cell_not_a_release": s.campaign.not_a_release if s.campaign else {}}
                for s in catalog.signatures]
        print(json.dumps({"catalog_version": catalog.version, "signatures": rows}, indent=2))
        return
    import render

    render.signature_table(catalog)


@signatures_app.command("show", short_help="One signature: meaning, recognisers, root cause, fix.")
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


@signatures_app.command("affected",
                        short_help="Write a release matrix's findings into the catalog.")
@_handles_errors
def signatures_affected(
    matrix: Annotated[Path, typer.Argument(
        help="The JSON of 'hicache campaign --profiles ... --json'.")],
    out: Annotated[Path | None, typer.Option(
        help="Where to write (default: the packaged catalog's affected.yaml).")] = None,
) -> None:
    """Record, per signature, the release profiles on which the matrix reproduced it and those
    on which its own fault ran clean (catalog/affected.yaml; hicache signatures show prints it,
    runbooks and the doctor use it)."""
    from faults.campaign.affected import write_affected

    path, count = write_affected(matrix, out)
    print(f"{path}: {count} signatures")


@signatures_app.command("new", short_help="Draft a catalog entry from an incident's evidence.")
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

    diag = _read_diagnosis(source)
    try:
        text = draft_yaml(diag, sig_id)
    except (ValueError, ValidationError) as exc:
        raise ConfigError("--from", f"cannot draft an entry: {exc}") from None
    if out is not None:
        out.write_text(text, encoding="utf-8")
        print(f"draft written to {out}")
    else:
        print(text, end="")


@signatures_app.command("sources", short_help="What the upstream index was built from.")
@_handles_errors
def signatures_sources(
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """What the upstream index was built from: systems, versions, templates per system."""
    from signatures.index import load_index

    rows = [{"system": s.system, "templates": s.templates, "files": s.files,
             "versions": s.versions} for s in load_index().sources()]
    if json_out:
        print(json.dumps({"systems": rows, "templates": sum(r["templates"] for r in rows)},
                         indent=2))
        return
    import render

    render.index_sources(rows)


@signatures_app.command("schema", short_help="JSON Schemas: catalog, diagnosis, capture, campaign.")
@_handles_errors
def signatures_schema(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write to a file.")] = None,
) -> None:
    """JSON Schemas: the catalog, the doctor's diagnosis, capture manifests, crash bundles."""
    from doctor.read.bundle import CaptureManifest
    from doctor.report.model import Diagnosis
    from hicache_runtime.contracts.bundle import bundle_json_schema
    from signatures.models import Catalog

    text = json.dumps({"catalog": Catalog.model_json_schema(),
                       "diagnosis": Diagnosis.model_json_schema(),
                       "capture": CaptureManifest.model_json_schema(),
                       "bundle": bundle_json_schema()}, indent=2)
    if out:
        out.write_text(text, encoding="utf-8")
    else:
        print(text)


faults_app = typer.Typer(no_args_is_help=True,
                         help="The faults --fault injects: kinds, parameters, selectors, points.",
                         short_help="Fault kinds, parameters, selectors and points.")
app.add_typer(faults_app, name="faults")


@faults_app.command("list", short_help="Every fault kind: parameters, selectors, points.")
@_handles_errors
def faults_list(
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List every fault kind with its parameters, the selectors all kinds take, and the fault
    points of the runtime."""
    from faults.describe import describe_faults

    listing = describe_faults()
    if json_out:
        print(listing.model_dump_json(indent=2))
        return
    import render

    render.fault_listing(listing)


profiles_app = typer.Typer(no_args_is_help=True,
                           help="Release profiles: what the runtime runs to stand for one SGLang "
                                "release (--profile on run, inject and campaign).",
                           short_help="Release profiles: each release's protocols by name.")
app.add_typer(profiles_app, name="profiles")


@profiles_app.command("list", short_help="Every profile: its switches and host allocation.")
@_handles_errors
def profiles_list(
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the release profiles: the switches each turns on and how it allocates host pages
    (docs/legacy-switches.md, "Profiles")."""
    from hicache_runtime.contracts.profiles import PROFILES, describe

    rows = [describe(p) for p in PROFILES.values()]
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    import render

    render.profile_table(rows)


@profiles_app.command("show", short_help="One profile: what it runs, leaves off and lacks.")
@_handles_errors
def profiles_show(
    name: Annotated[str, typer.Argument(help="A profile, e.g. sglang-0.5.13.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show one profile: its switches (with the upstream fixes), the pre-fix code its release
    ran that the profile leaves off (grafted or synthetic switches) and what it does not model."""
    from hicache_runtime.contracts.profiles import describe, profile

    try:
        row = describe(profile(name))
    except KeyError as exc:
        raise ConfigError("profile", str(exc.args[0])) from None
    if json_out:
        print(json.dumps(row, indent=2))
        return
    import render

    render.profile_detail(row)


def _signature(sig_id: str) -> Any:
    from signatures.loader import load_catalog

    try:
        return load_catalog().get(sig_id)
    except KeyError as exc:
        raise ConfigError("signature", str(exc.args[0])) from None


@app.command(short_help="Write runbooks: one per signature, or one for an incident.")
@_handles_errors
def runbook(
    signature: Annotated[list[str] | None, typer.Option(
        "--signature", "-s", help="Only this signature (repeatable).")] = None,
    from_diagnosis: Annotated[Path | None, typer.Option(
        "--from", help="An incident's diagnosis (hicache doctor --json output).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Directory (catalog runbooks) or file (incident runbook).")] = None,
    html_out: Annotated[bool, typer.Option("--html", help="Also write HTML.")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the runbooks (and the files written) as JSON.")] = False,
) -> None:
    """Write runbooks: one per signature, or one for an incident (--from DIAGNOSIS.json).

    A diagnosis is read as untrusted data: its text is escaped in the Markdown and the HTML,
    and the HTML links only to http(s) addresses and the sibling runbooks.
    """
    from doctor.report.runbook import catalog_index, incident_runbook, signature_runbook
    from signatures.loader import load_catalog

    catalog = load_catalog()
    if from_diagnosis is not None:
        diag = _read_diagnosis(from_diagnosis)
        _emit_docs({"incident": incident_runbook(diag, catalog)}, out, html_out, single=True,
                   json_out=json_out, incident=diag)
        return
    sigs = [_signature(s) for s in signature] if signature else catalog.signatures
    docs = {s.id: signature_runbook(s) for s in sigs}
    if out is not None and not signature:
        docs["index"] = catalog_index(catalog)
    _emit_docs(docs, out, html_out, single=False, json_out=json_out)


#: A diagnosis the doctor writes is far smaller; a bigger file is not one.
MAX_DIAGNOSIS_BYTES = 64 << 20


def _read_diagnosis(path: Path) -> Any:
    """A diagnosis written by ``hicache doctor --json``, read as untrusted data: a regular file
    of bounded size (a FIFO or /dev/zero is refused, never read on), validated whole."""
    from pydantic import ValidationError

    from doctor.report.model import Diagnosis
    from hicache_runtime.config_files import read_text

    text = read_text(path, "--from", MAX_DIAGNOSIS_BYTES)
    try:
        return Diagnosis.model_validate_json(text)
    except ValidationError as exc:
        raise ConfigError("--from", f"{path} is not a diagnosis from `hicache doctor --json` "
                                    f"({exc.error_count()} problem(s), first: "
                                    f"{first_problem(exc)[1]})") from None


def _emit_docs(docs: dict[str, str], out: Path | None, html_out: bool, single: bool,
               json_out: bool = False, incident: Any = None) -> None:
    """Write (or print) runbooks; with ``--html`` each also as a page, whose links go only to
    pages that exist beside it (those written now, and those already there)."""
    from doctor.report.html import incident_page, runbook_page

    written: dict[str, dict[str, str]] = {name: {} for name in docs}
    if out is not None and single:
        out.parent.mkdir(parents=True, exist_ok=True)
        name, text = next(iter(docs.items()))
        out.write_text(text, encoding="utf-8")
        written[name]["markdown"] = str(out)
        if html_out:
            html_path = out.with_suffix(".html")
            pages = {p.name for p in out.parent.glob("*.html")} - {html_path.name}
            html_path.write_text(incident_page(incident, text, pages) if incident is not None
                                 else runbook_page(text, out.stem, pages), encoding="utf-8")
            written[name]["html"] = str(html_path)
    elif out is not None:
        out.mkdir(parents=True, exist_ok=True)
        pages = {f"{n}.html" for n in docs} | {p.name for p in out.glob("*.html")}
        for name, text in docs.items():
            (out / f"{name}.md").write_text(text, encoding="utf-8")
            written[name]["markdown"] = str(out / f"{name}.md")
            if html_out:
                (out / f"{name}.html").write_text(runbook_page(text, name, pages),
                                                  encoding="utf-8")
                written[name]["html"] = str(out / f"{name}.html")
    if json_out:
        print(json.dumps({"runbooks": [{"name": name, "markdown": text,
                                        "files": written[name]}
                                       for name, text in docs.items()]}, indent=2))
    elif out is None:
        print("\n\n".join(docs.values()).rstrip())
    elif single:
        print(f"wrote {out}" + (f" and {out.with_suffix('.html')}" if html_out else ""))
    else:
        print(f"wrote {len(docs)} runbook(s) to {out}")


@app.command(short_help="py-spy dumps of every rank of a live job, taken at once.")
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
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the capture manifest (ranks, pids, dumps, errors) as JSON.")]
    = False,
    wait: Annotated[float, typer.Option(
        "--wait", help="With --tree or --torchrun: wait up to this many seconds for the job's "
                       "ranks to start (a job just launched has none yet).", min=0)] = 0.0,
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
    targets = find_targets(list(pid or []), tree, torchrun, wait_s=wait)
    dest = out or Path(f"capture-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    result = do_capture(targets, dest, logs=list(log or []), timeout_s=timeout, native=native,
                        locals_=locals_)
    if json_out:
        print(json.dumps({"out": str(result.out), "failures": result.failures,
                          "hint": result.hint,
                          "manifest": result.manifest.model_dump(mode="json")}, indent=2))
    else:
        render.capture_summary(result)
    captured = sum(1 for t in result.manifest.targets if not t.error)
    raise typer.Exit(EXIT_OK if not result.failures else
                     (EXIT_UNHEALTHY if captured else EXIT_USAGE))


def main(argv: list[str] | None = None) -> None:
    """The ``hicache`` entry point. Usage errors (an unknown option, ``--tp abc``) are one line
    on stderr and exit 2, like every other user error; not click's usage box. A Ctrl-C while
    the modules still load (seconds on a busy machine), before a command's own handling is in
    place, ends as one line and 128 + SIGINT too, not a KeyboardInterrupt traceback."""
    try:
        _main(argv)
    except KeyboardInterrupt as exc:
        import signal

        signum = int(getattr(exc, "signum", signal.SIGINT))
        print(f"error: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        sys.exit(128 + signum)


def entry() -> None:
    """The ``hicache`` console script: :func:`main`, then an exit that skips the interpreter's
    teardown. With torch loaded that teardown (clearing every module, a last collection over
    torch's objects) cost 0.3-0.4 s of CPU per command, after its output, measured on two
    cores; the suite runs hundreds of commands. What an exit owes is kept: the ``atexit``
    handlers (weakref finalizers included: temporary directories, shared memory, logging's
    flush) run, and the standard streams are flushed. Where a non-daemon thread is still
    running, or the exit status is no plain code, the ordinary exit takes over."""
    code: str | int | None = EXIT_OK
    try:
        main()
    except SystemExit as done:
        code = done.code
    import threading

    if (not isinstance(code, int) or not 0 <= code <= 255
            or any(t.is_alive() and not t.daemon for t in threading.enumerate()
                   if t is not threading.main_thread())):
        sys.exit(code)
    import atexit
    import contextlib

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # a closed pipe: the command has chosen its exit status already
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> None:
    from hicache_runtime.contracts.install import shadowed

    elsewhere = shadowed()
    if elsewhere:  # a generic import name of ours taken by another distribution
        where = "; ".join(f"{name} from {path}" for name, path in elsewhere.items())
        print(f"error: this hicache ({Path(__file__).resolve().parent}) would import {where}: "
              "another distribution installs the same import name (or it is missing); "
              "uninstall that one or use a separate virtual environment", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    import render  # noqa: F401 - its consoles, the help's included, end quietly on a closed pipe

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["campaign", "merge"]:  # a sub-command of a command with an argument
        args[:2] = ["campaign-merge"]
    try:
        code = app(args=args, standalone_mode=False)
    except BrokenPipeError:  # while click itself wrote (help, usage)
        try:
            _closed_pipe()
        except typer.Exit as done:
            sys.exit(done.exit_code)
    except SystemExit as done:
        # click's own answer to a closed pipe while it printed help or usage: it wraps the
        # streams so nothing more is written and exits 1, which would read as "unhealthy"
        if type(sys.stdout).__name__ == "PacifyFlushWrapper":
            sys.exit(128 + 13)  # 128 + SIGPIPE, as _closed_pipe
        raise done from None
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        sys.exit(EXIT_UNHEALTHY)
    except typer.TyperException as exc:  # click's ClickException: usage errors and kin
        if type(exc).__name__ == "NoArgsIsHelpError":  # the help was shown; nothing to add
            sys.exit(EXIT_USAGE)
        message = " ".join(str(exc.format_message()).split())
        ctx = getattr(exc, "ctx", None)
        where = f"{ctx.command_path}: " if ctx is not None else ""
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        print(f"error: {where}{message}{hint}", file=sys.stderr)
        sys.exit(int(getattr(exc, "exit_code", EXIT_USAGE)))
    sys.exit(code if isinstance(code, int) else EXIT_OK)


if __name__ == "__main__":
    entry()
