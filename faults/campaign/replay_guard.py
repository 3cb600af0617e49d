"""A crash bundle is untrusted data: what replay takes from it, and what it never takes.

Bundles travel between people (attached to issues, sent to on-call), so ``hicache inject
--replay`` reads one the way it would read any file from a stranger:

* the manifest is read only if it is a regular file of at most :data:`MAX_MANIFEST_BYTES`, and
  any malformation ends in one line (:class:`DumpFormatError` / :class:`ConfigError`);
* no path, URL or output location comes from the bundle: the trace file, the bundle directory
  and the file store's path are dropped (the replay supplies its own, under its output
  directory), and a bundle that names a Redis server replays against a private file store
  unless the user names a server with ``--storage-url``;
* what the run costs is capped (:data:`CAPS`: ranks, and values for requests, pool
  and model sizes, timeouts; then the memory its pools and weights need against what this
  machine has, as for any run), with a one-line error beyond;
* fault specs are checked strictly: kinds that exist and parameters that fit them (the
  config model), request-id globs of a small character set, bounded lags, at most
  :data:`MAX_FAULTS` specs.

:func:`plan` returns what will run (a :class:`ReplayPlan`), so the command can show it first.
The config a bundle holds cannot name a command: ranks are always ``python -m
hicache_runtime.launch.rank_process`` and unknown config keys are rejected by the config model.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from faults.kinds import KINDS
from faults.spec import FaultSpec
from hicache_runtime.config import (
    LOCATION_KEYS,
    Limits,
    RuntimeConfig,
    check_limits,
    check_run_limits,
    load_config,
)
from hicache_runtime.contracts.bundle import Manifest
from hicache_runtime.contracts.errors import ConfigError, DumpFormatError, first_problem, printable
from hicache_runtime.contracts.run_files import MANIFEST
from hicache_runtime.l3.registry import backend_for_url, takes_url

MAX_MANIFEST_BYTES = 4 << 20
"""A genuine manifest is a few KB (a wrong-output one with many mismatches, a few hundred)."""
MAX_FAULTS = 32
MAX_FAULT_MS = 10_000.0
"""A lag beyond 10 s per opportunity turns a replay into a wait, not a reproduction."""
RID_GLOB_RE = re.compile(r"[A-Za-z0-9_.*?\[\]!-]{1,64}")
"""Request ids are like ``chat3-t1``; a glob needs only these characters (no spaces, quotes,
``$``, ``;`` or newlines: nothing a shell or a terminal would act on)."""

#: Upper bounds on what a bundle may ask a replay to allocate or wait for (validated values):
#: 8 rank processes (every topology the campaigns use fits), and these values.
CAPS = Limits("a replay", 8, {
    "workload.requests": 4096,
    "workload.max_new_tokens": 4096,
    "workload.system_prompt_tokens": 65536,
    "workload.turn_tokens": 65536,
    "workload.long_context_tokens": 65536,
    "cache.device_tokens": 1 << 18,
    "cache.host_tokens": 1 << 20,
    "cache.host_bytes": 8 << 30,
    "model.vocab_size": 1 << 16,
    "model.num_layers": 64,
    "model.hidden_size": 4096,
    "model.num_heads": 64,
    "model.head_dim": 256,
    "model.ffn_size": 16384,
    "observability.ring_size": 1 << 20,
    "observability.watchdog_timeout_s": 600.0,
    "observability.protocol_timeout_s": 600.0,
    "storage.reconnect_backoff_max_s": 60.0,
    "storage.prefetch_timeout_base_s": 600.0,
})


@dataclass(frozen=True)
class GuardedConfig:
    """The config a replay runs, and what was changed from the bundle's and why."""

    cfg: RuntimeConfig
    notes: tuple[str, ...]
    storage: str
    """What the replay's L3 is, in words."""


class ReplayPlan(BaseModel):
    """What a replay is about to run (``--dry-run`` prints it; a replay shows it first)."""

    bundle: str
    outcome: str
    cell: str | None
    tp: int
    pp: int
    world_size: int
    seed: int
    requests: int
    warm: bool
    faults: list[str]
    legacy: list[str]
    storage: str
    output: str | None
    notes: list[str]

    def lines(self) -> list[str]:
        """The plan for a person, one fact per line."""
        out = [f"replaying {self.bundle} ({self.outcome}"
               + (f", campaign cell {self.cell})" if self.cell else ")"),
               f"  topology  tp={self.tp} pp={self.pp} ({self.world_size} rank process"
               f"{'es' if self.world_size > 1 else ''})",
               f"  workload  {self.requests} requests, seed {self.seed}"
               + (", after a fault-free warm-up run" if self.warm else ""),
               f"  faults    {'; '.join(self.faults) or 'none'}",
               f"  legacy    {', '.join(self.legacy) or 'none'}",
               f"  storage   {self.storage}"]
        if self.output is not None:
            out.append(f"  output    {self.output}")
        out += [f"  note      {n}" for n in self.notes]
        return out


# --- reading ------------------------------------------------------------------------------------


def read_manifest(bundle: Path) -> Manifest:
    """``bundle/manifest.json``, read without trusting it: a regular file (not a FIFO or
    device), at most :data:`MAX_MANIFEST_BYTES`, valid against :class:`Manifest`."""
    path = bundle / MANIFEST
    try:
        # O_NONBLOCK: opening a FIFO planted as manifest.json must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DumpFormatError(f"{bundle} holds no manifest.json",
                              hint="replay takes a crash bundle directory") from None
    except OSError as exc:
        raise DumpFormatError(f"cannot read {path}: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise DumpFormatError(f"{path} is not a regular file")
    if info.st_size > MAX_MANIFEST_BYTES:
        os.close(fd)
        raise DumpFormatError(f"{path} is {info.st_size} bytes; a bundle manifest is at "
                              f"most {MAX_MANIFEST_BYTES}")
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise DumpFormatError(f"{path} grew past {MAX_MANIFEST_BYTES} bytes while read")
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as exc:
        where, what = first_problem(exc)
        raise DumpFormatError(f"{path} is not a bundle manifest: {where or 'manifest'}: "
                              f"{what}") from None
    except (ValueError, RecursionError) as exc:
        raise DumpFormatError(f"{path} is not a bundle manifest: "
                              f"{printable(str(exc))}") from None


# --- the config -------------------------------------------------------------------------------


def guard_config(raw: dict[str, Any], *, storage_url: str | None = None) -> GuardedConfig:
    """The bundle's config made safe to run; ``storage_url`` is the user's ``--storage-url``.

    Raises :class:`ConfigError` (one line) when the config does not validate or asks for more
    than the caps allow.
    """
    _check_kinds(raw.get("faults"))
    try:
        cfg = load_config(raw)
    except ConfigError as exc:
        raise ConfigError("bundle", f"its config does not validate: {printable(str(exc))}",
                          hint="it was written by another version of hicache, or edited") \
            from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError("bundle", f"its config does not validate: "
                                    f"{printable(str(exc))}") from None
    _check_caps(cfg)
    try:  # what the pools and weights of every rank need, against this machine's memory
        check_run_limits(cfg)
    except ConfigError as exc:
        raise ConfigError("bundle", printable(str(exc), 400),
                          hint="a replay runs the sizes the bundle records") from None
    for i, spec in enumerate(cfg.faults):
        _check_fault(i, spec)
    notes: list[str] = []
    # every place the bundle names is dropped (storage.url is decided below)
    changes: dict[str, Any] = dict.fromkeys(LOCATION_KEYS - {"storage.url"})
    obs, st = cfg.observability, cfg.storage
    if obs.trace_path is not None:
        notes.append(f"the bundle's trace file {printable(str(obs.trace_path))} is not "
                     "written (the new bundle holds the events)")
    if obs.bundle_dir is not None:
        notes.append(f"the bundle's bundle directory {printable(str(obs.bundle_dir))} is "
                     "not used")
    if st.path is not None:
        notes.append(f"the bundle's store path {printable(str(st.path))} is not used")
    if st.backend == "none":
        if storage_url is not None:
            raise ConfigError("--storage-url", "the bundle's run had no L3 store; a storage "
                                               "URL does not apply")
        storage = "none (no L3)"
    elif storage_url is not None:
        backend = backend_for_url(storage_url)
        if backend is None:
            raise ConfigError("--storage-url", f"{redact(storage_url)} uses no known L3 "
                                               "backend's URL scheme")
        changes.update({"storage.backend": backend, "storage.url": storage_url})
        storage = f"{backend} at {redact(storage_url)} (from --storage-url)"
    else:
        changes.update({"storage.backend": "file", "storage.url": None})
        storage = "a private file store under the output directory"
        if _takes_url(st.backend):
            notes.append(f"the bundle's run used a {st.backend} store at "
                         f"{redact(st.url or '')}; not contacted (pass --storage-url to "
                         "replay against one)")
    return GuardedConfig(cfg=cfg.with_overrides(**changes), notes=tuple(notes),
                         storage=storage)


def _takes_url(backend: str) -> bool:
    try:
        return takes_url(backend)
    except ConfigError:  # a plug-in this machine cannot load: its store is not used anyway
        return False


def _check_caps(cfg: RuntimeConfig) -> None:
    check_limits(cfg, CAPS, field="bundle")
    if len(cfg.faults) > MAX_FAULTS:
        raise ConfigError("bundle", f"{len(cfg.faults)} fault specs; a replay takes at most "
                                    f"{MAX_FAULTS}")


def _check_kinds(faults: Any) -> None:
    """Name an unknown fault kind plainly (the model's message lists every kind)."""
    known = set(KINDS)
    for i, spec in enumerate(faults if isinstance(faults, list | tuple) else ()):
        kind = spec.get("kind") if isinstance(spec, dict) else None
        if isinstance(kind, str) and kind not in known:
            raise ConfigError("bundle", f"faults[{i}]: unknown fault kind {printable(kind)!r}",
                              hint=f"known kinds: {', '.join(sorted(known))}")


def _check_fault(i: int, spec: FaultSpec) -> None:
    where = f"faults[{i}] ({spec.kind})"
    if spec.rid is not None and not RID_GLOB_RE.fullmatch(spec.rid):
        raise ConfigError("bundle", f"{where}: rid glob {printable(spec.rid)!r} may hold only "
                                    "1-64 letters, digits and _ . - * ? [ ] !")
    if spec.ms is not None and spec.ms > MAX_FAULT_MS:
        raise ConfigError("bundle", f"{where}: ms={spec.ms:g}; a replay allows at most "
                                    f"{MAX_FAULT_MS:g}")


# --- showing bundle text ------------------------------------------------------------------------


def redact(url: str) -> str:
    """A URL without its user/password, printable."""
    return printable(re.sub(r"//[^@/]*@", "//***@", url))


# --- where the replay's files go ----------------------------------------------------------------


@contextlib.contextmanager
def temp_files_under(where: Path) -> Iterator[None]:
    """Make this process's temporary files (the launcher's run directories among them) go
    under ``where`` while a replay runs, so every file it writes lies in its output directory.
    """
    where.mkdir(parents=True, exist_ok=True)
    before = tempfile.tempdir
    tempfile.tempdir = str(where)
    try:
        yield
    finally:
        tempfile.tempdir = before
