"""What the upstream index holds, and its on-disk form.

One file per upstream system (``data/<system>.json.gz``): the versions it was built from (oldest
first, each with where its sources came from), and every message template of those sources with
the file, function and line it is built in, its level, the exception type it raises and the
versions it appears in (a bit mask over the system's versions). Files and functions are string
tables, so the data stays small. Each template's tokens (:mod:`signatures.index.tokens`) are
stored too, as ids into the file's vocabulary in one packed array, so that loading the index
costs a decompression, not a tokenisation of every template.

The files are generated (``python -m signatures.mine``) and committed; they are read back
through :func:`read_system`, which validates the header, the vocabulary and the token arrays
at once and every template row when it is first used: a damaged file is a clear error, never a
wrong answer.
"""

from __future__ import annotations

import base64
import gzip
import json
import zlib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

FORMAT = 2
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


def pack(values: np.ndarray) -> str:
    """An int32 array as base64 of its zlib-compressed little-endian bytes."""
    raw = np.ascontiguousarray(values, dtype="<i4").tobytes()
    return base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def unpack(text: str, limit: int) -> np.ndarray:
    """The int32 array :func:`pack` wrote; at most ``limit`` values."""
    d = zlib.decompressobj()
    raw = d.decompress(base64.b64decode(text, validate=True), limit * 4 + 4)
    if d.unconsumed_tail or len(raw) > limit * 4 or len(raw) % 4:
        raise ValueError("a packed array is larger than its budget or not int32")
    return np.frombuffer(raw, dtype="<i4")


MAX_TOKENS = 64 << 20


class SystemFile(BaseModel):
    """The on-disk form of one system's templates (validated as a boundary; template rows are
    checked one by one when first used, see :meth:`row`)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    format: int
    system: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    versions: list[Provenance] = Field(min_length=1)
    files: list[str]
    functions: list[str]
    vocab: list[str]
    tokens: str = Field(description="packed int32: vocabulary ids, -1 where a wildcard stands")
    offsets: str = Field(description="packed int32: where each template's tokens start")
    templates: list[Any]
    _toks: np.ndarray = PrivateAttr()
    _offs: np.ndarray = PrivateAttr()

    @field_validator("format")
    @classmethod
    def _format(cls, v: int) -> int:
        if v != FORMAT:
            raise ValueError(f"index format {v} is not {FORMAT}: regenerate the index")
        return v

    @model_validator(mode="after")
    def _arrays(self) -> SystemFile:
        toks = unpack(self.tokens, MAX_TOKENS)
        offs = unpack(self.offsets, len(self.templates) + 1)
        if len(offs) != len(self.templates) + 1 or (len(offs) and (
                offs[0] != 0 or offs[-1] != len(toks) or np.any(np.diff(offs) < 0))):
            raise ValueError("token offsets do not fit the templates")
        if len(toks) and (toks.min() < -1 or toks.max() >= len(self.vocab)):
            raise ValueError("a token id is out of the vocabulary")
        self._toks, self._offs = toks, offs
        return self

    @property
    def token_ids(self) -> np.ndarray:
        return self._toks

    @property
    def token_offsets(self) -> np.ndarray:
        return self._offs

    def row(self, i: int, first_id: int = 0,
            masks: dict[int, tuple[str, ...]] | None = None) -> Template:
        """Template ``i`` as a :class:`Template` (id ``first_id + i``), checked."""
        raw = self.templates[i]
        try:
            text, fi, fn, level, exc, line, mask = raw
            ok = (isinstance(text, str) and isinstance(exc, str) and type(fi) is int
                  and type(fn) is int and type(line) is int and type(mask) is int
                  and 0 <= fi < len(self.files) and 0 <= fn < len(self.functions)
                  and mask > 0 and not mask >> len(self.versions))
            lvl = Level(level)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{self.system} template {i}: a malformed row, or a table index "
                             "or version mask out of range")
        vers = masks.get(mask) if masks is not None else None
        if vers is None:
            vers = tuple(p.version for b, p in enumerate(self.versions) if mask >> b & 1)
            if masks is not None:
                masks[mask] = vers
        return Template(first_id + i, self.system, text, self.files[fi], self.functions[fn],
                        lvl, exc, line, vers)

    def rows(self, first_id: int = 0) -> list[Template]:
        """Every template as a :class:`Template` record, ids from ``first_id``."""
        masks: dict[int, tuple[str, ...]] = {}
        return [self.row(i, first_id, masks) for i in range(len(self.templates))]


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
