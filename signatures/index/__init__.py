"""The upstream index: what upstream's own sources say, generated from them.

Every exception message and every logged error or warning format of the systems a HiCache
deployment runs (SGLang's releases from 0.4.6, vLLM, LMCache, Mooncake, NIXL, 3FS, PyTorch's
collectives, gloo, NCCL) as a template with its system, versions, file, function and level
(``data/``, built by ``python -m signatures.mine``), and a map from module paths to the
components of the serving stack (``components.yaml``). The doctor asks it which upstream line a
report's line was printed by, which component a frame or a log site belongs to, and which
releases have a template.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import overload

import numpy as np

from signatures.index.components import Component, Resolver, load_rules
from signatures.index.failures import FailureKind, classify
from signatures.index.matcher import Match, TemplateMatcher
from signatures.index.model import Level, SystemFile, Template, read_system

DATA = Path(__file__).with_name("data")

__all__ = ["Component", "FailureKind", "Level", "Match", "Template", "UpstreamIndex",
           "load_index", "warm_up"]


@dataclass(frozen=True)
class SystemInfo:
    """What one system's part of the index was built from."""

    system: str
    versions: list[dict[str, str]]
    templates: int
    files: int


class Templates(Sequence[Template]):
    """Every template of the index by id, each built (and its row checked) when first used."""

    def __init__(self, systems: list[SystemFile]) -> None:
        self._systems = systems
        self._starts = np.cumsum([0, *(len(s.templates) for s in systems)])
        self._made: dict[int, Template] = {}
        self._masks: list[dict[int, tuple[str, ...]]] = [{} for _ in systems]

    def __len__(self) -> int:
        return int(self._starts[-1])

    @overload
    def __getitem__(self, i: int) -> Template: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Template]: ...

    def __getitem__(self, i: int | slice) -> Template | Sequence[Template]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        t = self._made.get(i)
        if t is None:
            k = int(np.searchsorted(self._starts, i, side="right")) - 1
            t = self._systems[k].row(i - int(self._starts[k]), int(self._starts[k]),
                                     self._masks[k])
            self._made[i] = t
        return t

    def __iter__(self) -> Iterator[Template]:
        for i in range(len(self)):
            yield self[i]

    def texts(self) -> Iterator[str]:
        """Each template's text in id order, read from its row without building (or checking)
        the template: a pass over all 68k that builds them took most of the matcher's
        build. A row that is not well formed yields ``""`` here and fails when it is used."""
        for s in self._systems:
            for raw in s.templates:
                text = raw[0] if isinstance(raw, (list, tuple)) and raw else None
                yield text if isinstance(text, str) else ""


class UpstreamIndex:
    """The loaded index: templates, their matcher, and the component resolver."""

    def __init__(self, systems: list[SystemFile]) -> None:
        self._systems = systems
        self.templates = Templates(systems)
        self._versions = {s.system: [p.version for p in s.versions] for s in systems}
        self._lock = threading.Lock()
        self._matcher: TemplateMatcher | None = None
        self._resolver: Resolver | None = None

    @property
    def matcher(self) -> TemplateMatcher:
        """Built once, by whichever thread asks first (see :func:`warm_up`)."""
        with self._lock:
            if self._matcher is None:
                self._matcher = self._build_matcher()
            return self._matcher

    def _build_matcher(self) -> TemplateMatcher:
        """One vocabulary over every system's, and their token arrays renumbered into it."""
        vocab: dict[str, int] = {}
        parts, offs, base = [], [np.zeros(1, dtype=np.int64)], 0
        for s in self._systems:
            remap = np.array([vocab.setdefault(w, len(vocab)) for w in s.vocab] + [-1],
                             dtype=np.int32)
            toks = s.token_ids
            parts.append(remap[np.where(toks < 0, len(s.vocab), toks)])
            offs.append(s.token_offsets[1:].astype(np.int64) + base)
            base += len(toks)
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return TemplateMatcher(self.templates, list(vocab), tokens, np.concatenate(offs))

    @property
    def resolver(self) -> Resolver:
        with self._lock:
            if self._resolver is None:
                self._resolver = Resolver(list(load_rules()),
                                          [(s.system, f) for s in self._systems
                                           for f in s.files])
            return self._resolver

    def match(self, text: str, limit: int = 3) -> list[Match]:
        return self.matcher.match(text, limit)

    def component(self, path: str) -> Component | None:
        return self.resolver.component(path)

    def template_component(self, t: Template) -> Component | None:
        return self.resolver.component(f"{t.system}:{t.file}")

    def failure(self, t: Template) -> FailureKind | None:
        return classify(t.text, t.level, t.exception)

    def versions(self, system: str) -> list[str]:
        """The versions of ``system`` the index was built from, oldest first."""
        return list(self._versions.get(system, []))

    def sources(self) -> list[SystemInfo]:
        return [SystemInfo(s.system, [p.model_dump() for p in s.versions], len(s.templates),
                           len(s.files)) for s in self._systems]


_LOADING = threading.Lock()
_WARMING = False
"""Whether :func:`warm_up` has started its thread in this process."""


@lru_cache(maxsize=1)
def _load(data: Path) -> UpstreamIndex:
    return UpstreamIndex([read_system(p) for p in sorted(data.glob("*.json.gz"))])


def load_index(data: Path = DATA) -> UpstreamIndex:
    """The committed index (every ``data/*.json.gz``), loaded once per process."""
    with _LOADING:
        return _load(data)


def warm_up() -> None:
    """Load the index and build its matcher on a background thread: the doctor reads its
    inputs meanwhile and needs the index only afterwards."""
    # Not a daemon: an input that never needs the index ends the process while the thread is
    # still inside numpy, and tearing the interpreter down under it aborted the process
    # ("terminate called without an active exception", seen under a memory cap). Exit waits
    # for the load (a fraction of a second) instead.
    global _WARMING
    with _LOADING:
        if _WARMING:  # once per process: a thread per diagnosis was 5% of a small one's time
            return
        _WARMING = True
    threading.Thread(target=lambda: load_index().matcher, name="index-warm-up",
                     daemon=False).start()
