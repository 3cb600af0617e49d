"""``hicache doctor --store``: the audit of an L3 file store (``hicache_runtime/l3/audit.py``).

Stores come from the real file backend: a one-rank run's (both formats), and pages written
through ``FileBackend.batch_set`` under each TP rank's key scheme, so that a rank can be made
to lack pages the way a rank whose writes failed does. Store contents are untrusted: FIFOs,
symlinks, sparse files and hostile names in the directory are counted, never followed, read
or echoed raw.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.l3.audit import audit_store, parse_name
from hicache_runtime.l3.backends.file import FileBackend
from hicache_runtime.l3.keys import KeyScheme

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-test"


def _hashes(n: int) -> list[str]:
    return [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]


def _write(root: Path, tp_rank: int, tp_size: int, hashes: list[str], size: int = 512) -> None:
    scheme = KeyScheme.for_rank(MODEL, RankInfo(tp_rank=tp_rank, tp_size=tp_size))
    backend = FileBackend(root, scheme)
    assert all(backend.batch_set(hashes, [bytes([tp_rank]) * size] * len(hashes)))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), "doctor", *args],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "COLUMNS": "80", "NO_COLOR": "1"})


def test_a_one_rank_run_leaves_a_clean_store_in_either_format(tmp_path: Path) -> None:
    from hicache_runtime.config import load_config
    from hicache_runtime.launch.run import run

    for fmt in ("envelope", "upstream"):
        store = tmp_path / fmt
        cfg = load_config({"workload.requests": 16, "cache.device_tokens": 256,
                           "cache.host_tokens": 512, "storage.backend": "file",
                           "storage.path": store, "storage.format": fmt})
        assert run(cfg, bundle_root=tmp_path / "b").outcome.value == "healthy"
        audit = audit_store(store)
        assert audit.pages > 0
        assert audit.formats == {fmt: audit.pages}
        assert audit.problems == []
        assert list(audit.stages) == [f"{parse_name(next(os.scandir(store)).name).model} "
                                      "tp=1 pp=1 stage=0"]  # type: ignore[union-attr]
    proc = _cli("--store", str(tmp_path / "envelope"))
    assert proc.returncode == 0, proc.stderr
    assert "no problem found" in proc.stdout


def test_pages_one_tp_rank_lacks_are_named(tmp_path: Path) -> None:
    hashes = _hashes(12)
    _write(tmp_path, 0, 2, hashes)
    _write(tmp_path, 1, 2, hashes[3:])  # rank 1's first three writes failed
    audit = audit_store(tmp_path)
    assert audit.pages == 21
    assert audit.rank_gaps == {f"{MODEL} tp=2 pp=1 stage=0": {"1": 3}}
    assert len(audit.rank_gap_examples) == 3
    assert all(e.endswith("lacks TP rank 1 of 2") for e in audit.rank_gap_examples)
    assert any("held by some TP ranks" in p for p in audit.problems)

    proc = _cli("--store", str(tmp_path), "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["rank_gaps"] == {f"{MODEL} tp=2 pp=1 stage=0": {"1": 3}}
    assert report["problems"] == audit.problems


def test_corrupt_pages_sizes_and_formats(tmp_path: Path) -> None:
    hashes = _hashes(6)
    _write(tmp_path, 0, 1, hashes)
    pages = sorted(tmp_path.glob("*.bin"))
    with pages[0].open("r+b") as f:  # one flipped byte in a payload
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pages[1].open("r+b") as f:  # a torn write
        f.truncate(200)
    audit = audit_store(tmp_path)
    assert audit.corrupt_count == 2
    assert sorted(audit.corrupt) == sorted(p.name for p in pages[:2])
    assert audit.pages == 4

    # raw upstream pages of two sizes beside the envelopes: another writer, another layout
    scheme = KeyScheme.for_rank("org-m", RankInfo())
    for h, size in zip(_hashes(3), (4096, 4096, 2048)):
        (tmp_path / f"{scheme.object_key(h)}.bin").write_bytes(b"\0" * size)
    audit = audit_store(tmp_path)
    assert audit.formats == {"envelope": 4, "upstream": 3}
    assert audit.size_mismatches == {"org-m tp=1 pp=1 stage=0 (upstream)": {2048: 1, 4096: 2}}
    problems = " | ".join(audit.problems)
    assert "fail their envelope check" in problems
    assert "several sizes" in problems
    assert "mixed in one store" in problems


def test_hostile_entries_are_counted_not_followed(tmp_path: Path) -> None:
    h = _hashes(4)
    os.mkfifo(tmp_path / f"{h[0]}_{MODEL}_0_1.bin")  # opening it for reading would block
    (tmp_path / f"{h[1]}_{MODEL}_0_1.bin").symlink_to("/etc/passwd")
    sparse = tmp_path / f"{h[2]}_{MODEL}_0_1.bin"
    with sparse.open("wb") as f:  # an envelope header, then a 4 GiB hole
        f.write(b"HCL3" + b"\0" * 20)
        f.truncate(4 << 30)
    (tmp_path / "\x1b]8;;https:x\x07[bold]evil\x1b[2J.txt").write_text("x")
    audit = audit_store(tmp_path)
    assert audit.unreadable_count == 2
    assert audit.corrupt_count == 1  # too big for any page: rejected from its size
    assert audit.not_pages_count == 1
    proc = _cli("--store", str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert "\x1b" not in proc.stdout
    assert "[bold]evil" in proc.stdout  # shown as text, not taken for markup


def test_a_store_too_large_is_audited_in_part(tmp_path: Path) -> None:
    _write(tmp_path, 0, 1, _hashes(5))
    audit = audit_store(tmp_path, max_files=3)
    assert audit.stopped_at == 3
    assert audit.pages == 3


@pytest.mark.parametrize(("name", "parts"), [
    ("a" * 64 + "_m_0_2.bin", ("m", 0, 2, 1, 0)),
    ("a" * 64 + "_m_1_2_2_1.bin", ("m", 1, 2, 2, 1)),
    ("a" * 64 + "_m.bin", ("m", None, None, 1, 0)),  # shared by the TP ranks (MLA-style)
    ("a" * 64 + "_m_2_1.bin", ("m", None, None, 2, 1)),  # shared, stage 1 of 2
    ("a" * 64 + "_llama_3_0_2.bin", ("llama_3", 0, 2, 1, 0)),  # a model name ending in digits
    ("a" * 64 + "_m_0_2.tmp", None),
    ("b" * 63 + "_m_0_2.bin", None),
])
def test_page_names(name: str, parts: tuple[object, ...] | None) -> None:
    page = parse_name(name)
    got = None if page is None else (page.model, page.tp_rank, page.tp_size, page.pp_size,
                                     page.pp_rank)
    assert got == parts
