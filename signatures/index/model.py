"""What the upstream index holds, and its on-disk form.

One file per upstream system (``data/<system>.json.gz``): the versions it was built from (oldest
first, each with where its sources came from), and every message template of those sources with
the file, function and line it is built in, its level, the exception type it raises and the
versions it appears in (a bit mask over the system's versions). Files and functions are string
tables, so the data stays small.

The files are generated (``python -m signatures.mine``) and committed; they are read back
through :func:`read_system`, which validates every row: a damaged file is a clear error, never a
half-loaded index.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

FORMAT = 1
MAX_FILE_BYTES = 16 << 20
"""A data file larger than this (compressed) is refused: the budget is far below it."""


class Level(StrEnum):
    """How upstream emits the message."""

    EXCEPTION = "exception"
    """Raised (``raise X(msg)``, ``throw X(msg)``, a checking macro that throws)."""
    ASSERT = "assert"
    """An assertion's message (Python ``assert c, msg``), or its condition when it has none."""
    CHECK = "check"
    """A C++ ``CHECK``/``ENFORCE`` that kills or throws: ``Check failed: <condition>``."""
    FATAL = "fatal"
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"
    """Logged below warning (info, debug) but stating a failure: LMCache logs allocation
    failures at debug level, for one."""
    CODE = "code"
    """An error or status code's name, printed as it is (``RPC_FAIL``, ``ncclSystemError``)."""

    @property
    def failing(self) -> bool:
        """The message says that something failed (not a warning)."""
        return self not in (Level.WARNING, Level.INFO)


@dataclass(frozen=True, slots=True)
class Template:
    """One message template of one upstream system."""

    id: int
    system: str
    text: str
    file: str
    function: str
    level: Level
    exception: str
    """The exception type it raises (short name), or ``""``."""
    line: int
    """The line in the newest version it appears in."""
    versions: tuple[str, ...]

    def where(self) -> str:
        """``sglang 0.5.23 sglang/srt/x.py Class.func (L12)``: a citation a reader can check."""
        newest = self.versions[-1] if self.versions else "?"
        func = f" {self.function}" if self.function else ""
        return f"{self.system} {newest} {self.file}{func} (L{self.line})"


class Provenance(BaseModel):
    """Where one version's sources came from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str
    source: str = Field(description="pypi:<dist>==<version>, git:<repo>@<rev>, dir:<name>")
    digest: str = Field("", description="sha256 of the wheel, or the git commit")


class SystemFile(BaseModel):
    """The on-disk form of one system's templates (validated as a boundary)."""

    model_config = ConfigDict(extra="forbid")

    format: int
    system: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    versions: list[Provenance] = Field(min_length=1)
    files: list[str]
    functions: list[str]
    templates: list[tuple[str, int, int, Level, str, int, int]]

    @field_validator("format")
    @classmethod
    def _format(cls, v: int) -> int:
        if v != FORMAT:
            raise ValueError(f"index format {v} is not {FORMAT}: regenerate the index")
        return v

    def rows(self, first_id: int = 0) -> list[Template]:
        """The templates as :class:`Template` records, ids from ``first_id``."""
        names = [p.version for p in self.versions]
        nf, nfn = len(self.files), len(self.functions)
        out = []
        for i, (text, fi, fn, level, exc, line, mask) in enumerate(self.templates):
            if not (0 <= fi < nf and 0 <= fn < nfn) or mask <= 0 or mask >> len(names):
                raise ValueError(f"{self.system} template {i}: a table index or version mask "
                                 "is out of range")
            vers = tuple(v for b, v in enumerate(names) if mask >> b & 1)
            out.append(Template(first_id + i, self.system, text, self.files[fi],
                                self.functions[fn], level, exc, line, vers))
        return out


def write_system(path: Path, data: SystemFile) -> None:
    """Write ``data`` deterministically (sorted tables, fixed gzip header: same bytes from the
    same sources)."""
    raw = json.dumps(data.model_dump(mode="json"), separators=(",", ":"), ensure_ascii=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0,
                                              compresslevel=9) as gz:
        gz.write(raw.encode("utf-8"))
    tmp.replace(path)


def read_system(path: Path) -> SystemFile:
    """Read and validate one data file; ``ValueError`` naming the file when it is damaged."""
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        with gzip.open(path, "rb") as gz:
            raw = gz.read(MAX_FILE_BYTES * 8 + 1)
        if len(raw) > MAX_FILE_BYTES * 8:
            raise ValueError("expands beyond its budget")
        return SystemFile.model_validate(json.loads(raw))
    except (OSError, EOFError, json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not a valid index file ({exc})") from None
