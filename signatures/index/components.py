"""The component map: which part of the serving stack a module path belongs to.

A path as a report gives it (an absolute traceback path in a container, a site-packages path, a
bare ``client_service.cpp`` from a glog line, a relative ``python/sglang/srt/...``) is first
*qualified*: the install prefix is cut at the package root, and the path is looked up among the
upstream index's files by its trailing segments, so ``client_service.cpp`` becomes
``mooncake:mooncake-store/src/client_service.cpp``. The map's patterns (``components.yaml``)
then name the component and its role. Patterns anchor on the folder names that carry meaning,
so a module that moved (``mem_cache/allocator.py`` became ``mem_cache/allocator/paged.py``) or a
vendored copy still maps.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from signatures.linear import linear
from signatures.loader import read_own_yaml
from signatures.models import check_regex

MAP_FILE = Path(__file__).with_name("components.yaml")
ROLES = ("storage", "transfer", "pd", "host-pool", "tree", "pool", "controller", "comm",
         "scheduler", "model", "startup")
#: Package roots a path is cut at (the last occurrence wins: a vendored copy's own root).
_ROOTS = re.compile(r"(?:^|/)(?=(?:sglang|vllm|vllm_ascend|lmcache|lmcache_vllm|mooncake|"
                    r"mooncake-\w+|nixl|torch|gloo|deepspeed|megatron|tensorrt_llm|dynamo|"
                    r"kvbm|aibrix\w*|infinistore|flexkv|transformers|accelerate|lightning|"
                    r"hf3fs_fuse|sgl_kernel)/)")
_INSTALL = re.compile(r"^.*?(?:site-packages|dist-packages)/")


class PathPattern(BaseModel):
    """A path pattern with exceptions: a path ``match`` finds and ``unless`` does not. (Linear
    -time matching has no lookahead, so "storage_backend/ but not pd_backend" is two patterns.)"""

    model_config = ConfigDict(extra="forbid", frozen=True)

    match: str
    unless: str

    @field_validator("match", "unless")
    @classmethod
    def _regex(cls, v: str) -> str:
        return check_regex(v)


class ComponentRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z][a-z0-9.-]*$")
    role: str
    paths: list[str | PathPattern] = Field(min_length=1)
    context: str = ""
    catch_all: bool = False
    """The rest of a package, placed by its root alone: too loose to overrule a signature's
    own pattern for a file (``signatures.matching.elsewhere``)."""

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r} (one of {', '.join(ROLES)})")
        return v

    @field_validator("paths")
    @classmethod
    def _regexes(cls, v: list[str | PathPattern]) -> list[str | PathPattern]:
        return [check_regex(rx) if isinstance(rx, str) else rx for rx in v]


class ComponentMap(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    components: list[ComponentRule]


@dataclass(frozen=True)
class Component:
    """A component of the serving stack: ``storage.mooncake`` with role ``storage``."""

    id: str
    role: str
    context: str = ""
    catch_all: bool = False


def normalise(path: str) -> str:
    """A report's path without its install prefix: ``sglang/srt/x.py`` from
    ``/opt/venv/lib/python3.12/site-packages/sglang/srt/x.py`` or
    ``/sgl-workspace/sglang/python/sglang/srt/x.py``; backslashes become slashes."""
    p = path.strip().strip("\"'").replace("\\", "/")
    cut = None
    for m in _ROOTS.finditer(p):
        cut = m.start() + (1 if p[m.start():m.start() + 1] == "/" else 0)
    if cut is not None:
        return p[cut:]
    return _INSTALL.sub("", p).lstrip("./")


class Resolver:
    """Qualifies paths against the index's files and maps them to components."""

    def __init__(self, rules: list[ComponentRule], files: Iterable[tuple[str, str]] = ()):
        self._rules = [(Component(r.id, r.role, r.context, r.catch_all),
                        [_matcher(p) for p in r.paths]) for r in rules]
        by_base: dict[str, list[str]] = {}
        for system, path in files:
            base = path.rsplit("/", 1)[-1]
            by_base.setdefault(base, []).append(f"{system}:{path}")
        self._by_base = by_base

    def qualify(self, path: str) -> str:
        """``<system>:<path>`` of the index file whose trailing segments match most of
        ``path``, or ``?:<normalised path>``."""
        norm = normalise(path)
        cands = self._by_base.get(norm.rsplit("/", 1)[-1])
        if not cands:
            return f"?:{norm}"
        segs = norm.split("/")
        best, best_n, tie = "", 0, False
        for c in cands:
            csegs = c.partition(":")[2].split("/")
            n = 0
            while n < min(len(segs), len(csegs)) and segs[-1 - n] == csegs[-1 - n]:
                n += 1
            if n > best_n:
                best, best_n, tie = c, n, False
            elif n == best_n:
                tie = True
        # a bare file name shared by several systems' files says nothing more than itself
        if tie and best_n <= 1:
            return f"?:{norm}"
        return best

    @lru_cache(maxsize=8192)  # noqa: B019 - one resolver per process; paths repeat heavily
    def component(self, path: str) -> Component | None:
        """The component of ``path`` (qualified here), or None when no pattern fits."""
        if not path:
            return None
        qualified = re.match(r"^[\w?-]+:", path) and not re.match(r"^[A-Za-z]:[/\\]", path)
        q = path if qualified else self.qualify(path)
        for candidate in (q, None if qualified else "?:" + path.replace("\\", "/")):
            # the path as cut at its package root first; then whole, for a package whose
            # own name is a root's (vua/vllm/kv_connector_v1.py is VUA's, not vLLM's)
            if candidate is None:
                break
            for comp, matchers in self._rules:
                if any(m(candidate) for m in matchers):
                    return comp
        return None


def _matcher(p: str | PathPattern) -> Callable[[str], bool]:
    """Whether a path fits a pattern (and not its exception), in linear time."""
    if isinstance(p, str):
        rx = linear(p)
        return lambda path: rx.search(path) is not None
    match, unless = linear(p.match), linear(p.unless)
    return lambda path: match.search(path) is not None and unless.search(path) is None


@lru_cache(maxsize=1)
def load_rules(path: Path = MAP_FILE) -> tuple[ComponentRule, ...]:
    raw = read_own_yaml(path)
    return tuple(ComponentMap.model_validate(raw).components)
