"""What a rank's exit code means, in words.

An exit code alone misleads: in a runtime bundle a rank stuck inside a collective cannot return
on its own, so after its dump is complete the launcher stops it (SIGTERM, exit -15, or SIGKILL
when it ignores that). Such a rank did not *fail* by signal; the signal is the launcher
collecting evidence. A rank that died by signal *without* a dump is another story: SIGKILL
then means a rank kill or the kernel OOM killer, SIGABRT a C++ abort, SIGSEGV a crash.
"""

from __future__ import annotations

from doctor.model.evidence import ExitRecord

#: The runtime's own exit codes (``hicache_runtime.contracts.outcome``).
_HICACHE_CODES = {1: "the rank failed with an exception", 3: "the rank reported a hang "
                  "(a protocol timeout or its step watchdog)"}
_BY_SIGNAL = {"SIGKILL": "killed", "SIGABRT": "aborted", "SIGSEGV": "crashed (segfault)",
              "SIGBUS": "crashed (bus error)", "SIGTERM": "terminated"}


def stopped_after_dump(x: ExitRecord) -> bool:
    """Ended by a signal after its own dump was complete: the launcher stopped it."""
    return bool(x.dumped) and x.signal in ("SIGTERM", "SIGKILL")


def killed_without_dump(x: ExitRecord) -> bool:
    """SIGKILL before the rank could write anything: a rank kill or the OOM killer."""
    return x.signal == "SIGKILL" and x.dumped is not True


def describe(x: ExitRecord) -> str:
    """``exit N`` with what it means (never empty)."""
    code = f"exit {x.exit_code}"
    if stopped_after_dump(x):
        return (f"{code}: stopped by the launcher ({x.signal}) after its dump was complete; "
                "a rank stuck inside a collective cannot exit on its own")
    if killed_without_dump(x):
        return (f"{code}: killed (SIGKILL) before it could dump: a rank kill or the kernel "
                "OOM killer")
    if x.signal is not None:
        what = _BY_SIGNAL.get(x.signal, f"ended by {x.signal}")
        late = " before it could dump" if x.dumped is False else ""
        return f"{code} ({x.signal}): {what}{late}"
    if x.launcher == "hicache" and x.exit_code in _HICACHE_CODES:
        return f"{code}: {_HICACHE_CODES[x.exit_code]}"
    return code
