"""Where the miner reads upstream sources from: wheels from the package registry, tags of git
repositories, and plain directories.

Each source yields ``(path, bytes)`` for the files a system's plan selects, and says where it
came from (a :class:`~signatures.index.model.Provenance`): the wheel's sha256, the git commit.
Nothing is imported, built or run; wheels are read as zip archives, git objects with
``git cat-file``.
"""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from signatures.index.model import Provenance

MAX_SOURCE_FILE = 4 << 20
"""A source file larger than this is generated code or data, not messages: skipped."""


class SourceError(RuntimeError):
    """A source could not be had (no wheel of that version, no such tag, no mirror)."""


@dataclass(frozen=True)
class Selection:
    """Which files of a source count: path prefixes to include, substrings to exclude, and
    file name endings."""

    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    suffixes: tuple[str, ...] = (".py",)

    def wants(self, path: str) -> bool:
        return (path.endswith(self.suffixes) and any(path.startswith(p) for p in self.include)
                and not any(x in path for x in self.exclude))


def wheel(dist: str, version: str, cache: Path) -> tuple[Path, Provenance]:
    """The wheel of ``dist==version`` (downloaded into ``cache`` once, without dependencies)."""
    cache.mkdir(parents=True, exist_ok=True)
    norm = dist.replace("-", "_").lower()
    found = _cached_wheel(cache, norm, version)
    if found is None:
        cmd = ["pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(cache),
               f"{dist}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        found = _cached_wheel(cache, norm, version)
        if found is None:
            errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
            raise SourceError(f"no wheel of {dist}=={version}: "
                              f"{errors[-1] if errors else proc.returncode}")
    digest = hashlib.sha256(found.read_bytes()).hexdigest()
    return found, Provenance(version=version, source=f"pypi:{dist}=={version}", digest=digest)


def _cached_wheel(cache: Path, norm: str, version: str) -> Path | None:
    for p in sorted(cache.glob("*.whl")):
        name, _, rest = p.name.partition("-")
        # a local version label (``2.13.0+cpu``) is the same release
        if name.lower() == norm and rest.split("-", 1)[0].split("+", 1)[0] == version:
            return p
    return None


def wheel_files(path: Path, sel: Selection) -> Iterator[tuple[str, bytes]]:
    """The selected members of a wheel (a zip archive), read without extracting."""
    with zipfile.ZipFile(path) as zf:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            if not info.is_dir() and sel.wants(info.filename) \
                    and info.file_size <= MAX_SOURCE_FILE:
                yield info.filename, zf.read(info)


def git_dir(repo: str, roots: list[Path]) -> Path:
    """The local git directory of ``owner/name``: ``<root>/<owner>+<name>/repo``,
    ``<root>/<owner>+<name>`` or ``<root>/<name>`` (a bare mirror or a clone's ``.git``)."""
    owner, _, name = repo.partition("/")
    for root in roots:
        for cand in (root / f"{owner}+{name}" / "repo", root / f"{owner}+{name}", root / name,
                     root / name / ".git"):
            if (cand / "HEAD").is_file() or (cand / ".git" / "HEAD").is_file():
                return cand
    raise SourceError(f"no local git copy of {repo} under {', '.join(map(str, roots)) or '-'} "
                      f"(give --git-root DIR holding {owner}+{name}/ or a clone named {name}/)")


def _git(gd: Path, *args: str, data: bytes | None = None) -> bytes:
    proc = subprocess.run(["git", "--git-dir", str(gd), *args], input=data,
                          capture_output=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise SourceError(f"git {' '.join(args[:2])} in {gd}: "
                          f"{proc.stderr.decode(errors='replace').strip()[:300]}")
    return proc.stdout


def git_revision(gd: Path, rev: str, repo: str, version: str) -> Provenance:
    commit = _git(gd, "rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    return Provenance(version=version, source=f"git:{repo}@{rev}", digest=commit)


def git_files(gd: Path, rev: str, sel: Selection) -> Iterator[tuple[str, bytes]]:
    """The selected files of ``rev``, read with one ``git cat-file --batch``; a blob the copy
    lacks (large files may be left out of a snapshot) is skipped."""
    listing = _git(gd, "ls-tree", "-r", "-l", rev).decode("utf-8", errors="replace")
    wanted: list[tuple[str, str]] = []
    for row in listing.splitlines():
        meta, _, path = row.partition("\t")
        parts = meta.split()
        if len(parts) != 4 or parts[1] != "blob" or not sel.wants(path):
            continue
        if parts[3].isdigit() and int(parts[3]) > MAX_SOURCE_FILE:
            continue
        wanted.append((parts[2], path))
    if not wanted:
        return
    out = _git(gd, "cat-file", "--batch", data="".join(f"{sha}\n" for sha, _ in wanted).encode())
    pos = 0
    for sha, path in wanted:
        nl = out.index(b"\n", pos)
        header = out[pos:nl].split()
        pos = nl + 1
        if len(header) < 3 or header[1] == b"missing":
            continue
        size = int(header[2])
        body = out[pos:pos + size]
        pos += size + 1
        if header[0].decode() == sha:
            yield path, body


def dir_files(root: Path, sel: Selection) -> Iterator[tuple[str, bytes]]:
    """The selected files under a plain directory (paths relative to it)."""
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not p.is_symlink() and sel.wants(rel) \
                and p.stat().st_size <= MAX_SOURCE_FILE:
            yield rel, p.read_bytes()


def dir_provenance(root: Path, name: str, version: str) -> Provenance:
    """A directory's provenance: its ``PROVENANCE.txt`` first line if it has one."""
    note = root / "PROVENANCE.txt"
    digest = ""
    if note.is_file():
        h = hashlib.sha256(note.read_bytes()).hexdigest()
        digest = f"sha256:{h}"
    return Provenance(version=version, source=f"dir:{name}", digest=digest)
