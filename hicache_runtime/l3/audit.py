"""What an L3 file store holds, read without a run: the doctor's look at a store a deployment
(or this runtime) wrote (``hicache doctor --store DIR``).

A file store is one file per page, ``<page hash><suffix>.bin`` (``backends/file.py``; SGLang's
``HiCacheFile`` names them the same way, ``keys.py``). From the names and the bytes alone the
audit tells:

* the **formats**: checksummed envelopes (this runtime's default) or raw upstream pages
  (``formats.py``), and a store that mixes them;
* **corrupt pages**: envelopes that fail their checksum, length or header check (a reader treats
  each as a miss; upstream's raw pages carry no checksum, so the same damage there is served);
* **pages some TP ranks lack**: a page hash stored by some TP ranks of a stage and not the
  others. Every rank of a stage must load the same prefix, so a release that takes a prefetch's
  hit from one rank's own lookup loads different prefixes on different ranks (0.5.5-0.5.13,
  ``local-prefetch-progress``: ``prefix-length-mismatch``); releases that agree on the hit with
  a MIN over TP (#27010, 0.5.16 and later) load the shorter one everywhere. A gap comes from a
  write that failed on one rank, a rank that died during its backups, or ranks that run at
  different speeds and were stopped;
* **sizes that do not fit**: pages of one model, topology and format whose size differs from
  the rest: written by a run with another layout, dtype, head count or page size. Upstream
  refuses a raw page of the wrong size (``HiCacheFile.get``) but reads one of the right size
  in whatever layout its own pool has.

Store contents are untrusted: only regular files are opened (no symlink is followed, a FIFO is
never opened for reading), at most :data:`MAX_FILES` names are looked at, and no page over the
reader's limit is read (the size is checked on the open descriptor first). Torch-free.
"""

from __future__ import annotations

import os
import stat
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hicache_runtime.contracts.errors import CorruptPage
from hicache_runtime.l3 import envelope
from hicache_runtime.l3.backends.file import open_page, read_parts
from hicache_runtime.l3.keys import is_page_hash

MAX_FILES = 200_000
"""Names looked at in one store; a larger store is audited in part, and the report says so."""
_EXAMPLES = 5


@dataclass(frozen=True)
class PageName:
    """A page file's name, parsed: ``<page hash>_<model>[_<tp rank>_<tp size>]
    [_<pp size>_<pp rank>]`` (``keys.key_suffix``). ``tp_size`` is None for pages every TP
    rank shares (MLA-style, ``single_writer``)."""

    page_hash: str
    model: str
    tp_rank: int | None
    tp_size: int | None
    pp_size: int
    pp_rank: int


def parse_name(name: str) -> PageName | None:
    """The parts of a page file name, or None for a file that is not a page. A model name may
    end in digits itself (``llama_3``): the longest reading of the trailing numbers as rank
    parts that is consistent wins."""
    if not name.endswith(".bin"):
        return None
    head, sep, rest = name[:-4].partition("_")
    if not sep or not is_page_hash(head) or not rest:
        return None
    parts = rest.split("_")
    trailing = 0
    while trailing < min(4, len(parts) - 1) and _small_int(parts[-1 - trailing]):
        trailing += 1
    for k in (4, 2, 0):
        if k > trailing:
            continue
        nums = [int(p) for p in parts[len(parts) - k:]]
        model = "_".join(parts[:len(parts) - k])
        page = _reading(head, model, nums)
        if page is not None:
            return page
    return None


def _small_int(text: str) -> bool:
    return text.isdigit() and text.isascii() and len(text) <= 6


def _reading(page_hash: str, model: str, nums: list[int]) -> PageName | None:
    """The page these trailing numbers make, or None when they cannot be rank parts."""
    tp: tuple[int | None, int | None] = (None, None)
    pp = (1, 0)
    if len(nums) == 4:
        tp, pp = (nums[0], nums[1]), (nums[2], nums[3])
    elif len(nums) == 2:
        # TP alone (rank < size) or, for a page the TP ranks share, PP alone (size > rank)
        if nums[0] < nums[1]:
            tp = (nums[0], nums[1])
        else:
            pp = (nums[0], nums[1])
    if tp[0] is not None and tp[1] is not None and not 0 <= tp[0] < tp[1]:
        return None
    if not 0 <= pp[1] < pp[0] or not model:
        return None
    return PageName(page_hash, model, tp[0], tp[1], pp[0], pp[1])


@dataclass
class StoreAudit:
    """What :func:`audit_store` found. Examples are file names, at most a few per finding."""

    root: str
    files: int = 0
    stopped_at: int | None = None
    """Set when the store had more than :data:`MAX_FILES` names: the audit read this many."""
    pages: int = 0
    bytes: int = 0
    formats: dict[str, int] = field(default_factory=dict)
    stages: dict[str, int] = field(default_factory=dict)
    """Pages per ``model tp=N pp=M stage=K`` (tp=shared for MLA-style pages)."""
    not_pages: list[str] = field(default_factory=list)
    not_pages_count: int = 0
    unreadable: list[str] = field(default_factory=list)
    unreadable_count: int = 0
    """Page names that are no regular file, or could not be read."""
    corrupt: list[str] = field(default_factory=list)
    corrupt_count: int = 0
    rank_gaps: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per stage: TP rank -> page hashes the stage's other ranks hold and it lacks."""
    rank_gap_examples: list[str] = field(default_factory=list)
    size_mismatches: dict[str, dict[int, int]] = field(default_factory=dict)
    """Per stage and format: page size -> pages, for groups with more than one size."""

    def to_json(self) -> dict[str, object]:
        """The audit as ``hicache doctor --store --json`` prints it."""
        out: dict[str, object] = asdict(self)
        out["problems"] = self.problems
        return out

    @property
    def problems(self) -> list[str]:
        """One line per finding, worst first; empty for a clean store."""
        out = []
        if self.corrupt_count:
            out.append(f"{self.corrupt_count} page(s) fail their envelope check (checksum, "
                       "length or header): each reads as a miss")
        if self.unreadable_count:
            out.append(f"{self.unreadable_count} page name(s) are no regular file or could "
                       "not be read")
        gaps = sum(n for per in self.rank_gaps.values() for n in per.values())
        if gaps:
            out.append(f"{gaps} page(s) are held by some TP ranks of their stage and not the "
                       "others: ranks that each count their own L3 hits load different "
                       "prefixes (prefix-length-mismatch before #27010); a MIN vote over TP "
                       "takes the shorter one")
        if self.size_mismatches:
            out.append("pages of one stage come in several sizes: another layout, dtype, head "
                       "count or page size wrote some of them")
        if len(self.formats) > 1:
            out.append("envelope and upstream pages are mixed in one store: two kinds of "
                       "writer share it")
        return out


def audit_store(root: Path, *, max_payload_bytes: int = envelope.DEFAULT_MAX_PAYLOAD_BYTES,
                max_files: int = MAX_FILES) -> StoreAudit:
    """Read the file store at ``root``. Raises ``NotADirectoryError`` or ``OSError`` when
    ``root`` is no readable directory."""
    st = os.stat(root)  # follows a symlink the user named; nothing inside is followed
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{root} is not a directory")
    audit = StoreAudit(str(root))
    # per stage (its label and TP size): page hash -> the TP ranks holding it
    ranks: dict[tuple[str, int], dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    sizes: dict[tuple[str, str], Counter[int]] = defaultdict(Counter)  # per stage and format
    with os.scandir(root) as entries:
        for entry in entries:
            if audit.files >= max_files:
                audit.stopped_at = audit.files
                break
            audit.files += 1
            page = parse_name(entry.name)
            if page is None:
                audit.not_pages_count += 1
                _note(audit.not_pages, entry.name)
                continue
            kind, size = _read_page(Path(entry.path), entry.name, max_payload_bytes, audit)
            if kind is None:
                continue
            audit.pages += 1
            audit.bytes += size
            audit.formats[kind] = audit.formats.get(kind, 0) + 1
            label = _stage_label(page)
            audit.stages[label] = audit.stages.get(label, 0) + 1
            sizes[(label, kind)][size] += 1
            if page.tp_size is not None and page.tp_rank is not None:
                ranks[(label, page.tp_size)][page.page_hash].add(page.tp_rank)
    _find_rank_gaps(audit, ranks)
    for (label, kind), seen in sorted(sizes.items()):
        if len(seen) > 1:
            audit.size_mismatches[f"{label} ({kind})"] = dict(sorted(seen.items()))
    return audit


def _read_page(path: Path, name: str, limit: int,
               audit: StoreAudit) -> tuple[str | None, int]:
    """``(format, payload bytes)`` of one page file, read as the file backend reads it;
    ``(None, 0)`` for one that is unreadable or corrupt (recorded in ``audit``)."""
    key = name[:-4]
    try:
        fd, size = open_page(path, key)  # regular files only: no symlink, no FIFO
        try:
            head = os.pread(fd, envelope.HEADER_SIZE, 0)
        finally:
            os.close(fd)
    except (CorruptPage, OSError):
        _note(audit.unreadable, name)
        audit.unreadable_count += 1
        return None, 0
    if not head.startswith(envelope.MAGIC):
        return "upstream", size
    try:
        header, payload = read_parts(path, key, limit)
        envelope.open_parts(key, header, payload)
    except CorruptPage:
        _note(audit.corrupt, name)
        audit.corrupt_count += 1
        return None, 0
    except OSError:  # removed or changed under us
        _note(audit.unreadable, name)
        audit.unreadable_count += 1
        return None, 0
    return "envelope", len(payload)


def _note(examples: list[str], name: str) -> None:
    if len(examples) < _EXAMPLES:
        examples.append(name)


def _stage_label(page: PageName) -> str:
    tp = "shared" if page.tp_size is None else str(page.tp_size)
    return f"{page.model} tp={tp} pp={page.pp_size} stage={page.pp_rank}"


def _find_rank_gaps(audit: StoreAudit,
                    ranks: dict[tuple[str, int], dict[str, set[int]]]) -> None:
    for (label, size), hashes in sorted(ranks.items()):
        missing: Counter[int] = Counter()
        for page_hash, held in hashes.items():
            for rank in range(size):
                if rank not in held:
                    missing[rank] += 1
                    if len(audit.rank_gap_examples) < _EXAMPLES:
                        audit.rank_gap_examples.append(f"{page_hash[:16]}... lacks TP rank "
                                                       f"{rank} of {size}")
        if missing:
            audit.rank_gaps[label] = {str(r): n for r, n in sorted(missing.items())}
