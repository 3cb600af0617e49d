"""The default file store is private to the user: ``<tmp>/hicache-<uid>``, created 0700, and
refused when it is not a directory this user owns that nobody else may write (pages another
user planted there, checksums and all, must never be served)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hicache_runtime.config import StorageConfig
from hicache_runtime.contracts.errors import StorageUnavailable
from hicache_runtime.l3.backends.file import FileBackend, default_dir
from tests.storage.support import SCHEME, hashes, payload_for

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_created_per_user_and_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        root = default_dir(tmp_path)
    finally:
        os.umask(old)
    assert root == tmp_path / f"hicache-{os.getuid()}"
    assert _mode(root) == 0o700
    assert default_dir(tmp_path) == root  # an existing private directory is reused


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o702])
def test_an_existing_store_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / f"hicache-{os.getuid()}"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(StorageUnavailable, match="writable by others") as info:
        default_dir(tmp_path)
    assert "\n" not in str(info.value)
    assert _mode(root) == mode  # left as found: what is in it cannot be trusted


def test_an_existing_store_others_may_only_read_is_tightened(tmp_path: Path) -> None:
    root = tmp_path / f"hicache-{os.getuid()}"
    root.mkdir()
    os.chmod(root, 0o755)
    assert default_dir(tmp_path) == root
    assert _mode(root) == 0o700


def test_a_symlink_or_file_in_its_place_is_refused(tmp_path: Path) -> None:
    mine = tmp_path / "elsewhere"
    mine.mkdir(mode=0o700)
    root = tmp_path / f"hicache-{os.getuid()}"
    root.symlink_to(mine)
    with pytest.raises(StorageUnavailable, match="not a directory"):
        default_dir(tmp_path)
    root.unlink()
    root.write_bytes(b"")
    with pytest.raises(StorageUnavailable, match="not a directory"):
        default_dir(tmp_path)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create another user's directory")
def test_pages_planted_by_another_user_are_never_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another user got there first: their directory, holding a page with a valid checksum.
    root = tmp_path / f"hicache-{os.getuid()}"
    planter = FileBackend(root, SCHEME)
    key = hashes(1)[0]
    assert planter.batch_set([key], [payload_for(key)]) == [True]
    os.chmod(root, 0o700)
    os.chown(root, NOBODY, NOBODY)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(StorageUnavailable, match=f"belongs to uid {NOBODY}"):
        FileBackend.from_config(StorageConfig(backend="file"), SCHEME)


def test_the_cli_refuses_a_default_store_others_may_write(tmp_path: Path) -> None:
    root = tmp_path / f"hicache-{os.getuid()}"
    root.mkdir()
    os.chmod(root, 0o777)
    proc = subprocess.run(
        [sys.executable, "cli.py", "run", "--storage", "file", "--requests", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "writable by others" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(root.iterdir()) == []
