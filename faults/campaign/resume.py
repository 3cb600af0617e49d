"""A campaign's results appended cell by cell, so that an interrupted run resumes.

``hicache campaign --resume results.jsonl``: the first line names the run (the campaign and
the ids of every selected cell, in order); each cell's result is appended as one JSON line,
flushed and synced, the moment the cell ends. A run started again with the same file checks
that it is the same run, takes the results already there and runs only the cells that have
none: a cell cut off mid-run (its line never written, or only partly) runs again, and no cell
that finished runs twice. The file is the run's own record, but it is read as untrusted input
all the same: bounded, every line validated, a torn last line dropped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ValidationError

from faults.campaign.cells import CellResult
from hicache_runtime.contracts.errors import ConfigError

MAX_LOG_BYTES = 256 << 20
RESUME_KIND = "hicache-campaign-log"


class LogHeader(BaseModel):
    kind: str = RESUME_KIND
    campaign: str
    selection: list[str]


class ResumeLog:
    """The results of one run on disk (see the module docstring). ``done`` holds the results
    found when it was opened, by cell id."""

    def __init__(self, path: Path, campaign: str, selection: list[str]) -> None:
        self.path = path
        self.done: dict[str, CellResult] = {}
        header = LogHeader(campaign=campaign, selection=selection)
        fresh = not path.exists() or (path.is_file() and path.stat().st_size == 0)
        if not fresh:
            self._read(header)
        self._file: IO[str] = path.open("a", encoding="utf-8")
        if fresh:  # a new log (or one cut off before its first line)
            self._write(header.model_dump_json())

    def _read(self, header: LogHeader) -> None:
        if not self.path.is_file() or self.path.stat().st_size > MAX_LOG_BYTES:  # bounded
            raise ConfigError("--resume", f"{self.path}: not a file of at most "
                                          f"{MAX_LOG_BYTES >> 20} MiB")
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # what follows the last newline is a torn write
        lines = data[:end].decode("utf-8", errors="replace").split("\n")[:-1]
        try:
            found = LogHeader.model_validate_json(lines[0]) if lines else None
        except ValidationError:
            found = None
        if found is None or found.kind != RESUME_KIND:
            raise ConfigError("--resume", f"{self.path}: not a campaign results log")
        if found.campaign != header.campaign or found.selection != header.selection:
            raise ConfigError("--resume", f"{self.path} is the log of another run (campaign "
                                          f"{found.campaign[:80]!r}, {len(found.selection)} "
                                          "cells): resume with the same spec and selection, "
                                          "or give a new file")
        wanted = set(header.selection)
        for n, line in enumerate(lines[1:], 2):
            if not line.strip():
                continue
            try:
                result = CellResult.model_validate_json(line)
            except ValidationError:
                raise ConfigError("--resume", f"{self.path}:{n}: not a cell result") from None
            if result.id not in wanted:
                raise ConfigError("--resume", f"{self.path}:{n}: cell {result.id[:120]!r} "
                                              "is not in this run")
            self.done[result.id] = result
        if end < len(data):  # drop the torn write, so the next line starts on its own
            with self.path.open("r+b") as f:
                f.truncate(end)

    def append(self, result: CellResult) -> None:
        self._write(result.model_dump_json())
        self.done[result.id] = result

    def _write(self, line: str) -> None:
        self._file.write(json.dumps(json.loads(line), separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()
