"""The late-write gate of ``abort-frees-in-flight`` (kv/late_writes.py), with real threads:
a posted late write lands when a load-back is about to read one of its pages, before that
read, whatever the threads' timing; a load-back of pages a writer is still reading waits for
it to post."""

from __future__ import annotations

import threading
import time

from hicache_runtime.kv.late_writes import LateWrites


def test_a_load_back_reads_only_after_the_late_write_landed() -> None:
    late = LateWrites()
    log: list[str] = []
    late.arm([3, 4])
    late.post([3, 4], lambda: log.append("late write"))
    late.disarm([3, 4])  # the IO thread goes on: the posted write stays
    assert late.armed
    assert late.pending == 1
    assert late.reading([9], timeout_s=5.0)  # other pages: nothing lands
    assert log == []
    assert late.reading([4, 9], timeout_s=5.0)
    log.append("load-back reads the copy")
    assert log == ["late write", "load-back reads the copy"]
    assert not late.armed
    assert late.reading([3, 4], timeout_s=5.0)  # landed once
    assert log == ["late write", "load-back reads the copy"]


def test_writes_on_one_page_land_in_the_order_they_were_posted() -> None:
    late = LateWrites()
    log: list[str] = []
    late.post([1, 2], lambda: log.append("first"))
    late.post([2], lambda: log.append("second"))
    late.post([7], lambda: log.append("elsewhere"))
    assert late.reading([2], timeout_s=1.0)
    assert log == ["first", "second"]
    assert late.pending == 1


def test_a_load_back_waits_for_a_writer_still_reading_its_batch() -> None:
    late = LateWrites()
    log: list[str] = []
    late.arm([5, 6])

    def writer() -> None:
        time.sleep(0.1)  # still reading the batch from storage
        late.post([5, 6], lambda: log.append("late write"))

    t = threading.Thread(target=writer)
    t.start()
    assert late.reading([6], timeout_s=5.0)
    log.append("load-back reads the copy")
    t.join(5.0)
    assert log == ["late write", "load-back reads the copy"]


def test_pages_nobody_armed_never_wait() -> None:
    late = LateWrites()
    t0 = time.monotonic()
    assert late.reading([1, 2, 3], timeout_s=5.0)
    late.arm([7])
    assert late.reading([1, 2, 3], timeout_s=5.0)
    late.disarm([7])  # the abort freed nothing: no write comes
    assert late.reading([7], timeout_s=5.0)
    assert time.monotonic() - t0 < 1.0
    assert not late.armed


def test_a_load_back_goes_on_when_the_writer_never_posts() -> None:
    late = LateWrites()
    late.arm([5])
    t0 = time.monotonic()
    assert not late.reading([5], timeout_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0
