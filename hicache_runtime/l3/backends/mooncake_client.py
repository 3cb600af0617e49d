"""Reaching a Mooncake Store: the ``mooncake://`` URL, the client library, its error codes and
its log.

The URL names the master and the metadata server (the form scripts use)::

    mooncake://HOST:RPC_PORT?metadata=http://HOST:PORT/metadata

and takes optional parameters: ``protocol`` (``tcp``, the default, or ``rdma``), ``device``
(RDMA device names), ``segment`` (memory this client contributes to the store, default 0:
pages live in the store's own segment holders and outlive the run, as upstream advises for
SGLang), ``buffer`` (the client's local transfer buffer, default 16 MiB) and ``host`` (the
address this client is reached at; default ``127.0.0.1`` for a loopback master, else the
address that routes to the master). Sizes take ``KiB``/``MiB``/``GiB`` (or ``KB``/``MB``/``GB``).

The client library (``mooncake-transfer-engine``, the ``[mooncake]`` extra) is imported only
when a client is opened. Its log goes through glog: to stderr, unless ``MC_LOG_DIR`` names a
directory before the library loads; then glog writes one file per process there (and copies
errors to stderr). :func:`open_client` sets a private log directory when the user has not, so
that a rank's bundle can carry its client's own lines (:func:`client_log_tail`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from hicache_runtime.contracts.errors import ConfigError, StorageUnavailable, ToolUnavailable

SCHEME = "mooncake"
URL_HINT = "use mooncake://HOST:RPC_PORT?metadata=http://HOST:PORT/metadata"
INSTALL_HINT = ("pip install -e '.[mooncake]' in the hicache-doctor checkout (the "
                "mooncake-transfer-engine wheel; "
                "it needs the libibverbs1, librdmacm1 and libnuma1 system libraries)")
DEFAULT_BUFFER_BYTES = 16 << 20
_PARAMS = ("metadata", "protocol", "device", "segment", "buffer", "host")
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1 << 10,
          "mib": 1 << 20, "gib": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")
_MAX_SEGMENT = 1 << 40

#: ``mooncake::ErrorCode`` values (mooncake-store/include/types.h) the backend tells apart;
#: the client returns them as negative integers.
ERROR_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE", -300: "INVALID_VERSION",
    -400: "INVALID_KEY", -500: "WRITE_FAIL", -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT",
    -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -710: "REPLICA_NOT_FOUND",
    -712: "REPLICA_IS_GONE", -800: "TRANSFER_FAIL", -900: "RPC_FAIL",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600
#: A read of these is a plain miss: absent, or still being written by another client.
MISS_CODES = frozenset({OBJECT_NOT_FOUND, -703})
#: A write answered with these stored nothing, and needs not: the object exists, or another
#: client is writing it now (the same bytes: a key names its content).
PRESENT_CODES = frozenset({-705, -703})
#: Codes that mean the master (or the client's link to it) is gone: an outage, not a bad key.
OUTAGE_CODES = frozenset({-900, -103, -601, -1010})
HEALTHY = 0
"""``health_check()``: 0 healthy, 1 not initialised or closed, 2 master unreachable."""


def code_name(code: int) -> str:
    """``RPC_FAIL (-900)``: a client return code as Mooncake names it."""
    return f"{ERROR_NAMES.get(code, 'error')} ({code})"


@dataclass(frozen=True, slots=True)
class MooncakeTarget:
    """A parsed ``mooncake://`` URL: where the store is and how this client joins it."""

    master: str
    """``host:port`` of ``mooncake_master``'s RPC service."""
    metadata: str
    """The transfer engine's metadata server (``http://host:port/metadata``)."""
    protocol: str = "tcp"
    device: str = ""
    segment_bytes: int = 0
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    local_host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        """The URL back, in the form scripts use (optional parameters only when set)."""
        extra = "".join(f"&{k}={v}" for k, v in (
            ("protocol", self.protocol if self.protocol != "tcp" else ""),
            ("device", self.device), ("segment", self.segment_bytes or ""),
            ("buffer", self.buffer_bytes if self.buffer_bytes != DEFAULT_BUFFER_BYTES else ""))
            if v)
        return f"{SCHEME}://{self.master}?metadata={self.metadata}{extra}"

    def endpoints(self) -> list[tuple[str, int]]:
        """The TCP endpoints that must answer before a client is worth opening."""
        host, _, port = self.master.rpartition(":")
        out = [(host, int(port))]
        meta = urlsplit(self.metadata)
        if meta.scheme in ("http", "https") and meta.hostname:
            out.append((meta.hostname, meta.port or (443 if meta.scheme == "https" else 80)))
        return out


def parse_url(url: str) -> MooncakeTarget:
    """A ``mooncake://`` URL as a :class:`MooncakeTarget`; raises :class:`ConfigError` (field
    ``storage.url``) saying what is wrong, never an exception from deep in the client."""
    if len(url) > 2048 or not url.isprintable() or any(c.isspace() for c in url):
        raise _bad(url, "the URL is too long or holds spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise _bad(url, f"not a URL ({exc})") from None
    if parts.scheme != SCHEME:
        raise _bad(url, f"scheme {parts.scheme or 'missing'!r} is not {SCHEME!r}")
    if not parts.hostname or not port:
        raise _bad(url, "it needs the master's host and RPC port (mooncake://HOST:RPC_PORT)")
    if parts.path not in ("", "/") or parts.username or parts.password:
        raise _bad(url, "it takes a host and port only (no path, no credentials)")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - set(_PARAMS))
    if unknown:
        raise _bad(url, f"unknown parameter(s) {', '.join(unknown)[:80]} (known: "
                        f"{', '.join(_PARAMS)})")
    metadata = query.get("metadata", "")
    if not (metadata == "P2PHANDSHAKE" or re.match(r"^https?://[^\s/]+(/\S*)?$", metadata)):
        raise _bad(url, "metadata= must name the metadata server (http://HOST:PORT/metadata)")
    protocol = query.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise _bad(url, f"protocol {protocol[:20]!r} is not tcp or rdma")
    segment = _size(url, "segment", query.get("segment", "0"))
    buffer = _size(url, "buffer", query.get("buffer", str(DEFAULT_BUFFER_BYTES)))
    if segment > _MAX_SEGMENT or buffer > _MAX_SEGMENT or buffer < 1 << 20:
        raise _bad(url, "segment is at most 1 TiB and buffer between 1 MiB and 1 TiB")
    host = parts.hostname
    return MooncakeTarget(master=f"{host}:{port}", metadata=metadata, protocol=protocol,
                          device=query.get("device", ""), segment_bytes=segment,
                          buffer_bytes=buffer,
                          local_host=query.get("host") or _local_host(host, port))


def _size(url: str, name: str, text: str) -> int:
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise _bad(url, f"{name}={text[:20]!r} is not a size (bytes, or with KiB/MiB/GiB)")
    return int(m.group(1)) * _UNITS[unit]


def _bad(url: str, problem: str) -> ConfigError:
    shown = url if len(url) <= 120 else url[:117] + "..."
    return ConfigError("storage.url", f"{shown!r}: {problem}", hint=URL_HINT)


def _local_host(master_host: str, master_port: int) -> str:
    """The address peers reach this client at: loopback for a loopback master, else the
    local address of the route to the master (a UDP connect sends nothing)."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(master_host).is_loopback:
            return "127.0.0.1"
    if master_host == "localhost":
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_host, master_port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


# --- the client library -----------------------------------------------------------------------


def reachable(target: MooncakeTarget, timeout_s: float) -> str | None:
    """None when the master and the metadata server accept connections, else why not.

    Checked before ``setup``: the client retries an unreachable master for a long time
    (``MC_STORE_CLIENT_SETUP_RETRIES`` times a few seconds) before it gives up.
    """
    for host, port in target.endpoints():
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                pass
        except OSError as exc:
            return f"{host}:{port} does not answer ({exc.strerror or exc})"
    return None


def open_client(target: MooncakeTarget) -> Any:
    """A set-up ``MooncakeDistributedStore`` joined to ``target``.

    Raises :class:`ToolUnavailable` when the client library is not installed and
    :class:`StorageUnavailable` when ``setup`` fails.
    """
    cls = _store_class()
    client = cls()
    rc = client.setup(target.local_host, target.metadata, target.segment_bytes,
                      target.buffer_bytes, target.protocol, target.device, target.master)
    if rc != 0:
        with contextlib.suppress(Exception):
            client.close()
        raise StorageUnavailable(f"Mooncake client setup against {target.master} failed "
                                 f"({code_name(rc)})",
                                 hint="check the master and metadata addresses in the URL")
    return client


def mooncake_installed() -> bool:
    """Whether the Mooncake client library can be imported (tests skip without it)."""
    try:
        _store_class()
    except ToolUnavailable:
        return False
    return True


def _store_class() -> Any:
    if "mooncake.store" not in sys.modules:
        _prepare_environment()
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ToolUnavailable(f"the mooncake backend needs the Mooncake client library "
                              f"({exc})", hint=INSTALL_HINT) from None
    return MooncakeDistributedStore


def _prepare_environment() -> None:
    """Before the library loads: give glog a private log directory (unless the user chose
    one) and bound the client's setup retries (reachability is checked first, so retries are
    only for its own port clashes)."""
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "5")
    # Unbuffered: glog holds INFO-file lines for up to 30 s, and a bundle taken at a failure
    # must hold the client's last words (it logs little while healthy).
    os.environ.setdefault("GLOG_logbuflevel", "-1")
    if "MC_LOG_DIR" not in os.environ:
        log_dir = default_log_dir()
        if log_dir is not None:
            os.environ["MC_LOG_DIR"] = str(log_dir)


def default_log_dir() -> Path | None:
    """``<tmp>/hicache-mooncake-<uid>``, private to the user; None when it cannot be made so
    (glog then writes to stderr, as without the variable)."""
    path = Path(tempfile.gettempdir()) / f"hicache-mooncake-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(path)
    if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    _prune(path)
    return path


_KEEP_LOG_FILES = 300
"""Newest glog files kept in the default log directory (three per process: INFO, WARNING,
ERROR, so the last hundred processes'); older ones are deleted when a process opens it. Ranks
of runs on one machine share the directory: a live process's file is far newer than these."""


def _prune(path: Path) -> None:
    try:
        files = sorted((p for p in path.iterdir() if p.is_file() and not p.is_symlink()),
                       key=lambda p: p.stat().st_mtime)
    except OSError:
        return
    for old in files[: max(0, len(files) - _KEEP_LOG_FILES)]:
        with contextlib.suppress(OSError):
            old.unlink()


def client_log_file() -> Path | None:
    """This process's glog file holding every line of its Mooncake client (the INFO file
    holds all severities), or None when glog writes to stderr."""
    log_dir = os.environ.get("MC_LOG_DIR")
    if not log_dir or "mooncake.store" not in sys.modules:
        return None
    try:
        found = sorted(Path(log_dir).glob(f"*.log.INFO.*.{os.getpid()}"))
    except OSError:
        return None
    return found[-1] if found else None


def log_offset() -> int:
    """Where this process's client log ends now (a backend's own lines start there)."""
    path = client_log_file()
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def client_log_tail(since: int, limit: int = 256 << 10) -> str | None:
    """The client's log lines written since offset ``since`` (at most the last ``limit``
    bytes, cut at a line start), or None when there is no log file."""
    path = client_log_file()
    if path is None:
        return None
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(since, size - limit)
            f.seek(start)
            data = f.read(size - start)
    except OSError:
        return None
    text = data.decode(errors="replace")
    if start > since:
        text = text.partition("\n")[2]
    return text
