"""Reading the structured files a user points a command at: ``--config`` and campaign specs.

Such a file is untrusted input (campaign specs travel with issues and pull requests), so reading
one is bounded before anything expands it:

* only a regular file is opened for reading, without blocking (a FIFO would block forever,
  ``/dev/zero`` never ends); at most :data:`MAX_BYTES` are read;
* the text must be UTF-8;
* YAML is composed first, and the node graph is measured *as it would expand*: aliases share
  nodes, so a few hundred bytes of anchors can stand for billions of values (an anchor bomb).
  More than :data:`MAX_NODES` expanded nodes, or an alias that contains itself, is refused
  before anything is constructed, and so before pydantic or an error message walks it.

Every failure is a :class:`ConfigError` of one line that never quotes the expanded value.
"""

from __future__ import annotations

import json
import os
import reprlib
import stat
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml

from hicache_runtime.contracts.errors import ConfigError

MAX_BYTES = 1 << 20
"""Largest config or campaign file read (the built-in campaign is about 4 KB)."""
MAX_NODES = 100_000
"""Largest YAML document, counted with every alias expanded."""

Format = Literal["yaml", "toml", "json"]

_SHORT = reprlib.Repr()
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4
_SHORT.maxlevel = 2


def short_repr(value: Any) -> str:
    """``repr`` of at most about 100 characters, whatever the value's size or depth: what an
    error message may quote of a value read from a file."""
    try:
        text = _SHORT.repr(value)
    except (RecursionError, ValueError):  # ValueError: an int past the str() digit limit
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 100 else text[:97] + "..."


def format_of(path: Path, default: Format) -> Format:
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return "yaml"
    if suffix in (".toml", ".json"):
        return "toml" if suffix == ".toml" else "json"
    return default


def read_text(path: Path, what: str, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of ``path``, a regular file of at most ``max_bytes``."""
    try:
        # O_NONBLOCK: opening a FIFO for reading must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(what, f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(what, f"cannot open {path}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(what, f"{path} is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(what, f"{path} is not a regular file")
        raise ConfigError(what, f"{path} is {st.st_size} bytes; the limit is {max_bytes}")
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read(max_bytes + 1)
        except OSError as exc:
            raise ConfigError(what, f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:  # grew while we read it
        raise ConfigError(what, f"{path} is larger than {max_bytes} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(what, f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                                f"offset {exc.start})") from None


def parse_text(text: str, fmt: Format, where: str, what: str) -> Any:
    """Parse ``text`` as ``fmt``; ``where`` names it in errors."""
    try:
        if fmt == "yaml":
            return load_yaml(text, where, what)
        if fmt == "toml":
            return tomllib.loads(text)
        return json.loads(text)
    except ConfigError:
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(what, f"cannot parse {where}: {_one_line(exc.problem or exc)}{at}") \
            from None
    except RecursionError:
        raise ConfigError(what, f"cannot parse {where}: nested too deeply") from None
    except (yaml.YAMLError, ValueError) as exc:  # JSON/TOML decode errors are ValueErrors
        raise ConfigError(what, f"cannot parse {where}: {_one_line(exc)}") from None


def load_file(path: Path, what: str, default: Format) -> Any:
    """Read and parse ``path`` (format from its suffix, else ``default``)."""
    return parse_text(read_text(path, what), format_of(path, default), str(path), what)


class _Loader(yaml.SafeLoader):
    """The pure-Python safe loader: its composer recurses in Python, so a deeply nested
    document ends in RecursionError rather than in a C stack overflow."""


def load_yaml(text: str, where: str, what: str, max_nodes: int = MAX_NODES) -> Any:
    """``yaml.safe_load`` with aliases bounded: the document is composed, measured as it
    would expand, and only then constructed."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, where, what, max_nodes)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node, where: str, what: str, max_nodes: int) -> None:
    """Count the nodes of ``root`` with every alias expanded, without expanding anything:
    each distinct node is visited once and its expanded size memoised (iterative post-order,
    so depth costs no Python stack)."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        kids = _children(node)
        if done:
            on_path.discard(key)
            total = 1 + sum(size[id(k)] for k in kids)
            if total > max_nodes:
                raise ConfigError(what, f"{where}: the document expands to more than "
                                        f"{max_nodes} values (YAML aliases); refusing it")
            size[key] = total
            continue
        if key in size:
            continue
        if key in on_path:
            raise ConfigError(what, f"{where}: a YAML alias refers to a node that contains it")
        on_path.add(key)
        stack.append((node, True))
        for kid in kids:
            kid_key = id(kid)
            if kid_key in on_path:
                raise ConfigError(what, f"{where}: a YAML alias refers to a node that "
                                        "contains it")
            if kid_key not in size:
                stack.append((kid, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _one_line(exc: object) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."
