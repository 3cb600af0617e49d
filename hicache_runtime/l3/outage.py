"""The outage state machine of a remote L3 backend (Redis, Mooncake), in one place.

A remote store can go away and come back. While it is away the backend serves nothing from
L3 (calls fail soft: a miss, a refused write) and the run goes on from L1/L2; it must neither
hammer the dead server nor block the prefetch and backup threads. So:

* **up**: every call goes ahead;
* the first call that meets the outage marks it **down**: logged once (a warning), counted,
  traced (``l3.storage`` ``outage``), and the first probe is scheduled after
  ``base_backoff_s``;
* **down**: calls fail soft at once, except one **probe** at a time once the backoff has
  passed; the probe is the caller's own request, so a probe that goes through serves it and
  ends the outage (an info line, ``reconnect`` with how long it lasted); a probe that meets the
  outage again doubles the backoff (capped at ``max_backoff_s``);
* a call that started before the outage was noticed and fails afterwards changes nothing (the
  schedule stands), and one that succeeds while down is not a probe and does not end it.

The backend supplies what differs: how a call is made, what counts as the outage, and what to
drop when it starts (Redis' pooled sockets).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


class Outage:
    """Thread-safe outage state of one backend (see the module docstring)."""

    def __init__(self, system: str, where: str, *, base_backoff_s: float, max_backoff_s: float,
                 count: Callable[..., None], emit: Callable[..., None], url: str,
                 on_down: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.system, self.where, self.url = system, where, url
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max(max_backoff_s, base_backoff_s)
        self._count, self._emit, self._on_down = count, emit, on_down
        self._log = logging.getLogger(f"hicache_runtime.l3.backends.{system}")
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._backoff_s = base_backoff_s
        self._next_probe = 0.0
        self._probing = False
        self.last_error = ""
        """The error that started (or last extended) the current outage."""

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def may_try(self) -> bool:
        """Whether a call may go ahead: while up, always; while down, for one probing caller
        at a time once the backoff has passed (that caller holds the probe slot until it
        calls :meth:`mark_up`, :meth:`mark_down` or :meth:`release`)."""
        with self._lock:
            if self._down_since is None:
                return True
            if self._probing or self._clock() < self._next_probe:
                return False
            self._probing = True
            return True

    def release(self) -> None:
        """Give the probe slot back without a verdict (the call failed for its own reasons,
        or raised): the next caller after the backoff probes again."""
        with self._lock:
            self._probing = False

    def mark_down(self, why: str) -> None:
        now = self._clock()
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = now
                self._backoff_s = self.base_backoff_s
            elif self._probing:
                self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
            else:
                return  # a call that started before the outage was noticed: the schedule stands
            self._next_probe = now + self._backoff_s
            self._probing = False
            self.last_error = why
        if first:
            self._count(outages=1)
            self._log.warning("L3 %s at %s unavailable (%s); serving from L1/L2 and retrying with "
                        "backoff", self.system, self.where, why)
            self._emit("outage", url=self.url, error=why)
            if self._on_down is not None:
                self._on_down()

    def mark_up(self) -> None:
        """A call went through: if it was the probe, the outage is over."""
        if self._down_since is None:  # the common case, without the lock
            return
        with self._lock:
            if self._down_since is None or not self._probing:
                return
            down_s = self._clock() - self._down_since
            self._down_since = None
            self._probing = False
            self._backoff_s = self.base_backoff_s
        self._count(reconnects=1)
        self._log.info("L3 %s at %s is back after %.1f s", self.system, self.where, down_s)
        self._emit("reconnect", url=self.url, down_s=round(down_s, 3))

    def state(self) -> dict[str, Any]:
        """For snapshots and tests: whether down, since when, the current backoff."""
        with self._lock:
            return {"down": self._down_since is not None, "backoff_s": self._backoff_s,
                    "last_error": self.last_error}
