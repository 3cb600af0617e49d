"""A pickle reader that can only build plain data, for PyTorch Flight Recorder dumps.

Pickle is a program: ``GLOBAL``/``STACK_GLOBAL`` fetch any callable, ``REDUCE`` calls it. A
hostile dump could run anything on the machine of whoever triages it. This loader refuses that
by construction, in two independent layers:

1. the opcode stream is checked first (``pickletools.genops``, nothing is executed): any opcode
   that imports, calls or builds an object (``GLOBAL``, ``STACK_GLOBAL``, ``REDUCE``, ``BUILD``,
   ``INST``, ``OBJ``, ``NEWOBJ``, ``NEWOBJ_EX``, ``EXT*``, ``PERSID``, ``BINPERSID``) rejects the
   file;
2. the unpickler's ``find_class`` and ``persistent_load`` raise, so even an opcode missed by the
   scan cannot resolve a callable.

What remains can only produce dict, list, tuple, set, frozenset, str, bytes, bytearray, int,
float, bool and None. Memory is bounded before anything is built: the file size
(``MAX_PICKLE_BYTES``) and, during the same opcode scan, what loading would allocate
(``MAX_BUILD_COST``: a fixed cost per value pushed, more per container, plus the bytes of every
string), so a small pickle of a million empty lists is refused before it is loaded. After
loading, nesting depth and the number of values reachable (counting a shared object once per
reference, which is what a consumer walking it would pay) are bounded.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections.abc import Iterator
from typing import Any

from hicache_runtime.contracts.errors import DumpFormatError

MAX_PICKLE_BYTES = 64 << 20
MAX_BUILD_COST = 256 << 20
"""Accounted bytes loading may allocate (see the module docstring)."""
_CONTAINER_OPS = frozenset({
    "EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE", "EMPTY_SET", "LIST", "DICT", "TUPLE", "TUPLE1",
    "TUPLE2", "TUPLE3", "FROZENSET", "MARK",
})
_OP_COST, _CONTAINER_COST = 16, 72
MAX_VALUES = 5_000_000
_FORBIDDEN = frozenset({
    "GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX",
    "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID", "READONLY_BUFFER", "NEXT_BUFFER",
})
_MAX_DEPTH = 64


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: plain data only")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id: plain data only")


def load_plain(data: bytes) -> Any:
    """Unpickle ``data`` if it holds plain data only; else raise :class:`DumpFormatError`."""
    if len(data) > MAX_PICKLE_BYTES:
        raise DumpFormatError(f"pickle of {len(data)} bytes is larger than the "
                              f"{MAX_PICKLE_BYTES >> 20} MiB limit")
    cost = 0
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name in _FORBIDDEN:
                raise DumpFormatError(f"pickle uses {op.name}: it would import or call code, "
                                      "refused (only plain data is read)")
            cost += _CONTAINER_COST if op.name in _CONTAINER_OPS else _OP_COST
            if isinstance(arg, (str, bytes, bytearray)):
                cost += len(arg)
            if cost > MAX_BUILD_COST:
                raise DumpFormatError(f"pickle would build more than {MAX_BUILD_COST >> 20} MiB "
                                      "of objects; refused")
    except DumpFormatError:
        raise
    except Exception as exc:  # truncated or corrupt opcode stream
        raise DumpFormatError(f"not a readable pickle: {exc}") from None
    try:
        value = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise DumpFormatError(f"not a readable pickle: {exc}") from None
    _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    """Reject absurd nesting (a list nested 10**5 deep breaks recursive consumers) and values
    that reach more than ``MAX_VALUES`` items. Depth-first with one iterator per open
    container, so the walk itself holds at most ``_MAX_DEPTH`` iterators."""
    if not isinstance(value, _CONTAINERS):
        return
    stack: list[Iterator[Any]] = [_children(value)]
    seen = 1
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        seen += 1
        if seen > MAX_VALUES:
            raise DumpFormatError(f"pickle holds more than {MAX_VALUES:,} values (counting "
                                  "each reference to a shared object); refused")
        if isinstance(item, _CONTAINERS):
            if len(stack) >= _MAX_DEPTH:
                raise DumpFormatError(f"pickle nests deeper than {_MAX_DEPTH} levels")
            stack.append(_children(item))


_CONTAINERS = (dict, list, tuple, set, frozenset)
_END = object()


def _children(value: Any) -> Iterator[Any]:
    return iter(value.values()) if isinstance(value, dict) else iter(value)
