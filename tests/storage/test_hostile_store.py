"""Store contents are untrusted: planted page files and Redis values that are huge, special or
of the wrong type are counted corrupt misses, read only up to the page size the reader expects.

The big inputs are sparse files made at test time and read in a subprocess under a 1.5 GiB
address-space cap, so a reader that reads them whole fails the test (``MemoryError``) instead
of taking the machine down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from hicache_runtime.kv.pools import KVShape
from hicache_runtime.l3 import envelope
from hicache_runtime.l3.backend import StorageBackend
from hicache_runtime.l3.backends.file import FileBackend
from hicache_runtime.l3.backends.redis_server import LocalRedisServer
from hicache_runtime.l3.pages import (
    PageCodec,
    PageLayout,
    SidecarCodec,
    max_payload_bytes,
)
from tests.storage.support import SCHEME, hashes, payload_for

ROOT = Path(__file__).resolve().parents[2]
CAP = 3 << 29  # 1.5 GiB of address space for the reading process
GIB = 1 << 30
MakeBackend = Callable[..., StorageBackend]

# Plants hostile files under the names of valid pages in a real store, then reads them back
# in one batch under the address-space cap. Prints one JSON line with what came back.
_READER = textwrap.dedent("""
    import json, os, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    from pathlib import Path
    from hicache_runtime.l3 import envelope
    from hicache_runtime.l3.backends.file import FileBackend
    from tests.storage.support import SCHEME, hashes, payload_for

    def peak_mb():
        # this process's own peak (VmHWM): ru_maxrss after fork and exec also counts the
        # peak of the test worker that started it, which grows over a long suite
        with open("/proc/self/status") as fh:
            return next(int(ln.split()[1]) for ln in fh if ln.startswith("VmHWM:")) // 1024

    root, limit = Path(sys.argv[1]), sys.argv[2]
    opts = {{}} if limit == "default" else {{"max_payload_bytes": int(limit)}}
    b = FileBackend(root, SCHEME, **opts)
    keys = hashes(8)
    assert all(b.batch_set(keys, [payload_for(k) for k in keys]))
    paths = [b.path_for(k) for k in keys]
    # 0: a valid header, then a sparse hole to 1 GiB (size disagrees with the header)
    os.truncate(paths[0], {gib})
    # 1: a header that claims the whole 1 GiB (consistent size, garbage payload)
    with open(paths[1], "r+b") as f:
        f.write(envelope.seal_parts(SCHEME.object_key(keys[1]), b"")[0][:8]
                + ({gib} - envelope.HEADER_SIZE).to_bytes(8, "little"))
    os.truncate(paths[1], {gib})
    # 2: a FIFO (a blocking open would wait for a writer forever)
    paths[2].unlink(); os.mkfifo(paths[2])
    # 3: a symlink to an endless device
    paths[3].unlink(); os.symlink("/dev/zero", paths[3])
    # 4: a directory
    paths[4].unlink(); paths[4].mkdir()
    # 5: a 1 GiB sparse file with no header at all
    paths[5].unlink(); os.truncate(os.open(paths[5], os.O_CREAT | os.O_WRONLY, 0o600), {gib})
    # 6 and 7 stay valid
    got = b.batch_get(keys)
    s = b.stats()
    print(json.dumps({{
        "served": [g is not None for g in got],
        "intact": [got[i] == payload_for(keys[i]) for i in (6, 7)],
        "corrupt": s.corrupt, "misses": s.misses, "errors": s.errors,
        "left": sorted(p.name for p in root.iterdir() if not p.name.startswith(".")),
        "maxrss_mb": peak_mb(),
    }}))
""").format(cap=CAP, gib=GIB)


def _read_hostile(root: Path, limit: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _READER, str(root), limit], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("limit", ["default", "4096"])
def test_planted_huge_and_special_page_files_are_counted_misses_under_a_memory_cap(
        tmp_path: Path, limit: str) -> None:
    r = _read_hostile(tmp_path / "l3", limit)
    assert r["served"] == [False] * 6 + [True, True]
    assert r["intact"] == [True, True]
    assert (r["corrupt"], r["misses"], r["errors"]) == (6, 6, 0)
    # every hostile entry was dropped so a later backup can rewrite the page
    assert len(r["left"]) == 2
    assert r["maxrss_mb"] < 1024


def test_a_payload_over_the_bound_is_not_stored(tmp_path: Path) -> None:
    b = FileBackend(tmp_path / "l3", SCHEME, max_payload_bytes=256)
    keys = hashes(2)
    assert b.batch_set(keys, [payload_for(keys[0], 256), payload_for(keys[1], 257)]) \
        == [True, False]
    assert not b.path_for(keys[1]).exists()
    assert b.stats().set_failures == 1
    assert b.batch_get(keys) == [payload_for(keys[0], 256), None]


def test_codec_sizes_give_the_read_bound() -> None:
    import torch

    layout = PageLayout.of(KVShape(2, 2, 4, torch.float32), 4)
    kv = PageCodec(layout)
    side = SidecarCodec("all_pages", layout, (3,))
    k = torch.zeros(layout.page_dims)
    assert kv.payload_bytes == len(kv.encode(k, k))
    assert max_payload_bytes(kv, side) == max(kv.payload_bytes, side.payload_bytes)


@pytest.mark.redis
def test_huge_or_wrong_type_redis_values_are_bounded_counted_misses(
        make_redis_backend: MakeBackend, redis_server: LocalRedisServer) -> None:
    b = make_redis_backend(max_payload_bytes=1024)
    keys = hashes(4)
    payloads = [payload_for(k, 1024) for k in keys]
    assert all(b.batch_set(keys, payloads))
    raw = redis.Redis.from_url(redis_server.url)
    big, wrong = keys[1] + SCHEME.suffix, keys[2] + SCHEME.suffix
    # A 64 MiB value (SETRANGE builds it server-side) whose header claims all of it.
    header = envelope.seal_parts(big, b"")[0][:8] + ((64 << 20) - envelope.HEADER_SIZE) \
        .to_bytes(8, "little")
    raw.set(big, header)
    raw.setrange(big, (64 << 20) - 1, b"\0")
    raw.delete(wrong)
    raw.hset(wrong, "f", "v")  # a key of another type under a page's name

    def sent() -> int:
        return int(raw.info("stats")["total_net_output_bytes"])

    before = sent()
    got = b.batch_get(keys)
    moved = sent() - before
    assert got == [payloads[0], None, None, payloads[3]]
    s = b.stats()
    assert (s.corrupt, s.misses, s.errors) == (2, 2, 0)
    assert raw.exists(big, wrong) == 0  # both dropped, so later backups rewrite them
    # the 64 MiB value never crossed the wire: at most a header plus the bound per key
    assert moved < 4 * (envelope.HEADER_SIZE + 1024) + 64 * 1024, moved
    raw.close()
