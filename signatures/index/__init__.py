"""The upstream index: what upstream's own sources say, generated from them.

Every exception message and every logged error or warning format of the systems a HiCache
deployment runs (SGLang's releases from 0.4.6, LMCache, Mooncake, NIXL, 3FS, PyTorch's
collectives, gloo, NCCL) as a template with its system, versions, file, function and level
(``data/``, built by ``python -m signatures.mine``), and a map from module paths to the
components of the serving stack (``components.yaml``). The doctor asks it which upstream line a
report's line was printed by, which component a frame or a log site belongs to, and which
releases have a template.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

from signatures.index.components import Component, Resolver, load_rules
from signatures.index.failures import FailureKind, classify
from signatures.index.matcher import Match, TemplateMatcher
from signatures.index.model import Level, SystemFile, Template, read_system

DATA = Path(__file__).with_name("data")

__all__ = ["Component", "FailureKind", "Level", "Match", "Template", "UpstreamIndex",
           "load_index"]


@dataclass(frozen=True)
class SystemInfo:
    """What one system's part of the index was built from."""

    system: str
    versions: list[dict[str, str]]
    templates: int
    files: int


class UpstreamIndex:
    """The loaded index: templates, their matcher, and the component resolver."""

    def __init__(self, systems: list[SystemFile]) -> None:
        self._systems = systems
        templates: list[Template] = []
        for s in systems:
            templates += s.rows(first_id=len(templates))
        self.templates = templates
        self._versions = {s.system: [p.version for p in s.versions] for s in systems}

    @cached_property
    def matcher(self) -> TemplateMatcher:
        return TemplateMatcher(self.templates)

    @cached_property
    def resolver(self) -> Resolver:
        return Resolver(list(load_rules()),
                        [(s.system, f) for s in self._systems for f in s.files])

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


@lru_cache(maxsize=1)
def load_index(data: Path = DATA) -> UpstreamIndex:
    """The committed index (every ``data/*.json.gz``), loaded once per process."""
    files = sorted(data.glob("*.json.gz"))
    return UpstreamIndex([read_system(p) for p in files])
