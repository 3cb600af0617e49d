"""The step watchdog: notices when a rank stops making progress and reports it once.

The scheduler calls :meth:`StepWatchdog.beat` whenever it makes progress (a batch ran, a
request arrived, or it is idle by design). A daemon thread checks the last beat; after
``timeout_s`` without one it calls ``on_stall`` once, from the watchdog thread, while the
scheduler thread is still stuck. ``on_stall`` dumps evidence and then interrupts the scheduler
(see :func:`interrupt_main_thread`), so a hang ends as a bundle instead of a silent process.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from hicache_runtime.contracts.errors import StepStalled

_POLL_S = 0.1
INTERRUPT_SIGNAL = signal.SIGUSR2


class StepWatchdog:
    """Fires ``on_stall(seconds_since_last_beat)`` once when beats stop for ``timeout_s``."""

    def __init__(self, timeout_s: float, on_stall: Callable[[float], None],
                 name: str = "hicache-watchdog") -> None:
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._last = time.monotonic()
        self._stop = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> StepWatchdog:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.wait(_POLL_S):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s and not self.fired:
                self.fired = True
                self._on_stall(idle)
                return


def install_interrupt_handler() -> bool:
    """Make :data:`INTERRUPT_SIGNAL` raise :class:`StepStalled` in the main thread.

    Returns False when not called from the main thread (signals cannot be handled there)."""
    if threading.current_thread() is not threading.main_thread():
        return False

    def _raise(signum: int, frame: FrameType | None) -> None:
        raise StepStalled("scheduler stalled: interrupted by the step watchdog")

    signal.signal(INTERRUPT_SIGNAL, _raise)
    return True


def interrupt_main_thread() -> None:
    """Deliver :data:`INTERRUPT_SIGNAL` to the main thread, waking it from a blocking wait."""
    signal.pthread_kill(threading.main_thread().ident or 0, INTERRUPT_SIGNAL)
