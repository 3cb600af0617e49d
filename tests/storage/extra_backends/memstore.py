"""``mem``: an L3 backend whose stores are dictionaries in this process, named by URL
(``mem://NAME``), complete in this one file.

It is what adding a backend costs: the class (the storage hooks, its URL scheme and check, a
throwaway store), and one ``register_backend`` line. The config, ``--storage-url`` of runs and
campaigns, replays, private stores and the contract tests then know it without another file
changing. Its stores live in this process only, so a run on it is a single-rank run (rank
processes would each see an empty store of the same name).
"""

from __future__ import annotations

import itertools
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from hicache_runtime.l3 import envelope
from hicache_runtime.l3.backend import RawPage, StorageBackend
from hicache_runtime.l3.keys import KeyScheme
from hicache_runtime.l3.registry import register_backend

if TYPE_CHECKING:
    from hicache_runtime.config import StorageConfig
    from hicache_runtime.telemetry.tracer import Tracer

STORES: dict[str, dict[str, RawPage]] = {}
"""Every store of this process by name; a store is created by its first backend."""
_LOCK = threading.Lock()
_NAME = re.compile(r"mem://([a-z0-9-]{1,40})")
_THROWAWAYS = itertools.count()


class MemStore:
    """A throwaway store: a fresh name whose dictionary is dropped on exit."""

    def __init__(self) -> None:
        self.name = f"throwaway-{next(_THROWAWAYS)}"

    @property
    def url(self) -> str:
        return f"mem://{self.name}"

    def __enter__(self) -> MemStore:
        with _LOCK:
            STORES.setdefault(self.name, {})
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            STORES.pop(self.name, None)


class MemBackend(StorageBackend):
    name = "mem"
    url_schemes = ("mem",)
    url_example = "mem://shared"

    def __init__(self, url: str, scheme: KeyScheme, *, tracer: Tracer | None = None) -> None:
        super().__init__(scheme, tracer=tracer)
        self.url = url
        with _LOCK:
            self.store = STORES.setdefault(url.removeprefix("mem://"), {})

    @classmethod
    def url_problem(cls, url: str) -> str | None:
        problem = super().url_problem(url)
        if problem is None and not _NAME.fullmatch(url):
            problem = "a mem URL is mem://NAME (lowercase letters, digits, '-')"
        return problem

    @classmethod
    def throwaway(cls, workdir: Path | None = None) -> MemStore:
        return MemStore()

    @classmethod
    def from_config(cls, cfg: StorageConfig, scheme: KeyScheme, *, required: bool = True,
                    tracer: Tracer | None = None,
                    max_payload_bytes: int = envelope.DEFAULT_MAX_PAYLOAD_BYTES) -> MemBackend:
        return cls(cfg.url or cls.url_example, scheme, tracer=tracer)

    def _exists_leading(self, object_keys: list[str]) -> int:
        with _LOCK:
            n = 0
            while n < len(object_keys) and object_keys[n] in self.store:
                n += 1
            return n

    def read_raw(self, object_keys: list[str]) -> list[RawPage | None]:
        with _LOCK:
            return [self.store.get(k) for k in object_keys]

    def write_sealed(self, object_keys: list[str], pages: list[RawPage]) -> list[bool]:
        with _LOCK:
            present = sum(key in self.store for key in object_keys)
            for key, page in zip(object_keys, pages):
                self.store.setdefault(key, page)
        self._count(set_skipped=present)
        return [True] * len(object_keys)

    def _clear(self) -> None:
        with _LOCK:
            for key in [k for k in self.store if k.endswith(self.scheme.suffix)
                        and k[: -len(self.scheme.suffix)].isalnum()]:
                del self.store[key]

    def _discard(self, object_key: str) -> bool:
        with _LOCK:
            return self.store.pop(object_key, None) is not None


register_backend("mem", f"{__name__}:MemBackend")
