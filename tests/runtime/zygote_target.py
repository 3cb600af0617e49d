"""A program the zygote tests fork: ``main(argv)`` does what ``argv[0]`` says."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    what = argv[0]
    if what == "exit":
        return int(argv[1])
    if what == "sleep":
        time.sleep(float(argv[1]))
        return 0
    if what == "abort":
        os.kill(os.getpid(), signal.SIGABRT)
    if what == "echo-fd":  # write to an inherited descriptor, by its number
        os.write(int(argv[1]), b"through the passed descriptor\n")
        return 0
    if what == "print":
        print("to stdout", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        return 0
    if what == "gc":  # objects the collector walks here, and those it leaves frozen
        print(len(gc.get_objects()), gc.get_freeze_count(), flush=True)
        return 0
    raise SystemExit(f"unknown: {what}")
