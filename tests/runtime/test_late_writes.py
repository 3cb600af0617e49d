"""The late-write gate of ``abort-frees-in-flight`` (kv/late_writes.py), with real threads:
an owner whose copy lands in an armed page waits until the late write is in, so nothing reads
the copy between the two, whatever the threads' timing."""

from __future__ import annotations

import threading
import time

from hicache_runtime.kv.late_writes import LateWrites


def _writer(late: LateWrites, pages: list[int], log: list[str], give_up_s: float = 5.0) -> None:
    """A late writer as StorageWorkers runs one: wait for an owner, write, disarm."""
    deadline = time.monotonic() + give_up_s
    owner = None
    while owner is None and time.monotonic() < deadline:
        late.wait(0.01)
        owner = late.owner(pages)
    time.sleep(0.05)  # a slow write: the owner must still be waiting when it ends
    log.append(f"late write ({owner})")
    late.disarm(pages)


def test_an_owner_reads_its_copy_only_after_the_late_write_landed() -> None:
    late = LateWrites()
    late.arm([3, 4])
    log: list[str] = []
    writer = threading.Thread(target=_writer, args=(late, [3, 4], log))
    writer.start()
    time.sleep(0.05)  # the writer is waiting for an owner
    assert late.copied([4, 9], timeout_s=5.0)
    log.append("owner reads its copy")
    writer.join(5.0)
    assert log == ["late write (copied)", "owner reads its copy"]
    assert not late.armed


def test_a_prefetch_owner_lets_the_late_write_land_first() -> None:
    late = LateWrites()
    late.arm([1])
    log: list[str] = []
    writer = threading.Thread(target=_writer, args=(late, [1], log))
    writer.start()
    late.queued([1, 2])
    writer.join(5.0)
    assert log == ["late write (queued)"]


def test_pages_nobody_armed_never_wait() -> None:
    late = LateWrites()
    t0 = time.monotonic()
    assert late.copied([1, 2, 3], timeout_s=5.0)
    late.arm([7])
    assert late.copied([1, 2, 3], timeout_s=5.0)
    assert time.monotonic() - t0 < 1.0
    assert late.owner([1, 2, 3]) is None


def test_an_owner_goes_on_when_the_late_write_never_comes() -> None:
    late = LateWrites()
    late.arm([5])
    t0 = time.monotonic()
    assert not late.copied([5], timeout_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert late.owner([5]) == "copied"  # a writer arriving late still sees the owner
