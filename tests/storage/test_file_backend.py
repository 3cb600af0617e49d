"""The file backend: on-disk layout, atomic writes, damaged page files."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import pytest

from hicache_runtime.contracts.errors import StorageUnavailable
from hicache_runtime.l3 import envelope
from hicache_runtime.l3.backends.file import FileBackend
from hicache_runtime.l3.keys import KeyScheme
from tests.storage.support import SCHEME, hashes, payload_for


def test_one_file_per_page_named_hash_plus_suffix(file_backend: FileBackend) -> None:
    keys = hashes(3)
    file_backend.batch_set(keys, [payload_for(k) for k in keys])
    names = sorted(p.name for p in file_backend.root.iterdir())
    assert names == sorted(f"{k}{SCHEME.suffix}.bin" for k in keys)
    blob = file_backend.path_for(keys[0]).read_bytes()
    assert blob[:4] == envelope.MAGIC
    assert envelope.unseal(keys[0] + SCHEME.suffix, blob) == payload_for(keys[0])


def _damage(path: Path, how: str, donor: Path) -> None:
    data = path.read_bytes()
    if how == "flip":
        pos = envelope.HEADER_SIZE + len(data[envelope.HEADER_SIZE :]) // 2
        path.write_bytes(data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1 :])
    elif how == "truncate":
        path.write_bytes(data[: len(data) - 7])
    elif how == "truncate-header":
        path.write_bytes(data[:10])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "append":
        path.write_bytes(data + b"\0\0")
    elif how == "header":
        path.write_bytes(b"XXXX" + data[4:])
    elif how == "swap":  # another page's (valid) file under this name
        shutil.copyfile(donor, path)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["flip", "truncate", "truncate-header", "empty", "append",
                                 "header", "swap"])
def test_damaged_page_file_is_a_counted_miss_never_served(file_backend: FileBackend,
                                                          how: str) -> None:
    keys = hashes(4)
    payloads = [payload_for(k) for k in keys]
    file_backend.batch_set(keys, payloads)
    victim = file_backend.path_for(keys[1])
    _damage(victim, how, donor=file_backend.path_for(keys[2]))

    # Existence does not read contents: the damaged page still "exists".
    assert file_backend.batch_exists(keys) == 4
    got = file_backend.batch_get(keys)
    assert got == [payloads[0], None, payloads[2], payloads[3]]
    s = file_backend.stats()
    assert (s.hits, s.misses, s.corrupt, s.discarded) == (3, 1, 1, 1)
    # The bad file is gone, so the next backup rewrites it and the page is served again.
    assert not victim.exists()
    assert file_backend.batch_exists(keys) == 1
    assert file_backend.batch_set([keys[1]], [payloads[1]]) == [True]
    assert file_backend.batch_get(keys) == payloads


def test_deleted_page_file_is_a_plain_miss(file_backend: FileBackend) -> None:
    keys = hashes(3)
    file_backend.batch_set(keys, [payload_for(k) for k in keys])
    file_backend.path_for(keys[0]).unlink()
    assert file_backend.batch_exists(keys) == 0
    assert file_backend.batch_get(keys)[0] is None
    s = file_backend.stats()
    assert s.misses == 1
    assert s.corrupt == 0


def test_corrupt_page_logged_once(file_backend: FileBackend,
                                  caplog: pytest.LogCaptureFixture) -> None:
    keys = hashes(3)
    file_backend.batch_set(keys, [payload_for(k) for k in keys])
    for k in keys:
        _damage(file_backend.path_for(k), "flip", donor=Path())
    with caplog.at_level(logging.WARNING, logger="hicache_runtime.l3"):
        assert file_backend.batch_get(keys) == [None, None, None]
    assert len([r for r in caplog.records if "corrupt" in r.getMessage()]) == 1
    assert file_backend.stats().corrupt == 3


def test_write_is_atomic_when_the_rename_fails(file_backend: FileBackend,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    keys = hashes(2)

    def broken_replace(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    assert file_backend.batch_set(keys, [b"a", b"b"]) == [False, False]
    monkeypatch.undo()
    assert list(file_backend.root.iterdir()) == []  # no page, no temp file left
    s = file_backend.stats()
    assert s.set_failures == 2
    assert s.errors == 2
    assert s.stored == 0
    assert file_backend.batch_set(keys, [b"a", b"b"]) == [True, True]


def test_readers_never_see_a_partial_write(file_backend: FileBackend) -> None:
    """Big pages written while another thread reads the same keys: hit or miss, never torn."""
    keys = hashes(24, seed=11)
    big = {k: payload_for(k, 1 << 20) for k in keys}
    seen_torn: list[str] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            for k, p in zip(keys, file_backend.batch_get(keys)):
                if p is not None and p != big[k]:
                    seen_torn.append(k)

    t = threading.Thread(target=reader)
    t.start()
    for k in keys:
        file_backend.batch_set([k], [big[k]])
    done.set()
    t.join(timeout=60)
    assert not seen_torn
    assert file_backend.stats().corrupt == 0


def test_leftover_temp_files_are_not_pages_and_clear_removes_them(
        file_backend: FileBackend) -> None:
    keys = hashes(2)
    # A writer that crashed between write and rename leaves a hidden temp file.
    tmp = file_backend.root / f".{keys[0]}{SCHEME.suffix}.123.1.0.tmp"
    tmp.write_bytes(b"half a page")
    assert file_backend.batch_exists(keys) == 0
    file_backend.batch_set(keys, [b"x", b"y"])
    file_backend.clear()
    assert list(file_backend.root.iterdir()) == []


def test_ranks_with_different_suffixes_do_not_share_files(tmp_path: Path) -> None:
    a = FileBackend(tmp_path, KeyScheme("_m_0_2"))
    b = FileBackend(tmp_path, KeyScheme("_m_1_2"))
    keys = hashes(2)
    a.batch_set(keys, [b"tp0", b"tp0"])
    assert b.batch_exists(keys) == 0
    assert b.batch_get(keys) == [None, None]


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    with pytest.raises(StorageUnavailable, match="not usable"):
        FileBackend(blocker / "l3", SCHEME)


def test_read_errors_fail_soft(file_backend: FileBackend) -> None:
    keys = hashes(2)
    file_backend.batch_set(keys, [b"a", b"b"])
    path = file_backend.path_for(keys[0])
    path.unlink()
    path.mkdir()  # not a page file: refused before reading, a counted corrupt miss
    assert file_backend.batch_get(keys) == [None, b"b"]
    assert (file_backend.stats().corrupt, file_backend.stats().errors) == (1, 0)
    assert not path.exists()  # an empty directory is removed so a backup can rewrite it
