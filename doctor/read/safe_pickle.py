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
float, bool and None. Sizes are bounded before loading and nesting is bounded after.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

from hicache_runtime.errors import DumpFormatError

MAX_PICKLE_BYTES = 256 << 20
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
    try:
        for op, _arg, _pos in pickletools.genops(data):
            if op.name in _FORBIDDEN:
                raise DumpFormatError(f"pickle uses {op.name}: it would import or call code, "
                                      "refused (only plain data is read)")
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
    """Reject absurd nesting (a list nested 10**5 deep breaks recursive consumers)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if depth > _MAX_DEPTH:
            raise DumpFormatError(f"pickle nests deeper than {_MAX_DEPTH} levels")
        if seen > 5_000_000:
            raise DumpFormatError("pickle holds more than 5,000,000 values")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in item)
