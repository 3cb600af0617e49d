"""The vocabulary between the doctor and the catalog: structural facts.

The doctor reads artifacts and derives *facts*: conclusions about the shape of a failure across
ranks (ranks blocked at different collective sites, drain counts that diverge, a peer that exited
before the others saw ``Connection closed by peer``...). Catalog entries refer to facts by their
string value; the loader rejects unknown names, so a typo in a YAML file fails the catalog tests
instead of silently never matching.

Every member carries one line saying what it means; ``describe()`` returns it.
"""

from __future__ import annotations

from enum import Enum


class Fact(str, Enum):
    """A structural conclusion about a failure. The docstring of each member is its contract."""

    # --- outcome ---------------------------------------------------------------------------
    HANG = "hang"
    """Some rank stopped making progress (watchdog, collective timeout, hang bundle)."""
    CRASH = "crash"
    """Some rank raised or died (exception, fatal signal, non-zero exit)."""
    WRONG_OUTPUT = "wrong-output"
    """The run finished but produced output that differs from a cache-disabled run."""

    # --- collectives and stacks --------------------------------------------------------------
    BLOCKED_SITES_DIVERGE = "blocked-sites-diverge"
    """Ranks are blocked in collectives entered from at least two different call sites."""
    RANK_MISSING_FROM_COLLECTIVE = "rank-missing-from-collective"
    """A collective (group, seq) was entered by some ranks and never by others."""
    COLLECTIVE_OP_MISMATCH = "collective-op-mismatch"
    """At the same (group, seq) ranks ran different operations or came from different sites."""
    COLLECTIVE_SIZE_MISMATCH = "collective-size-mismatch"
    """At the same (group, seq) ranks fed tensors of different sizes."""
    ALL_RANKS_IDLE = "all-ranks-idle"
    """A hang in which no rank is inside a collective or busy: every thread waits for work."""
    SAME_COLLECTIVE_EVERYWHERE = "same-collective-everywhere"
    """Two or more ranks wait in the same collective (same sequence number and operation, or
    the same call site) and none is seen anywhere else."""
    BLOCKED_IN_PREFETCH_VOTE = "blocked-in-prefetch-vote"
    """A prefetch hit/progress vote thread is blocked inside its collective, or its flight
    recorder shows ranks that entered a prefetch vote some rank never entered."""
    PEER_EXITED_FIRST = "peer-exited-first"
    """One rank died (signal, abort, exception) and its peers then lost their connection to it."""
    PROCESS_SEGFAULT = "process-segfault"
    """A rank died of SIGSEGV/SIGBUS/SIGABRT (``Fatal Python error``, exit code -11/-6); not
    an abort that an uncaught C++ exception the log names explains (``terminate called after
    throwing ...``: gloo's size check, a c10 error)."""
    EXCEPTION_ON_DOWNSTREAM_STAGE = "exception-on-downstream-stage"
    """The failing exception was raised on a pipeline stage other than PP0."""

    # --- traces and state --------------------------------------------------------------------
    DRAIN_COUNT_DIVERGENCE = "drain-count-divergence"
    """Ranks consumed different numbers of write/load acks at the same drain."""
    PREFIX_LENGTH_DIVERGENCE = "prefix-length-divergence"
    """Ranks disagree on the prefix, hit or settled length of the same request or batch."""
    MESSAGE_SKIPPED = "message-skipped"
    """A rank never received a point-to-point message its peer sent, and went on to wait for
    that peer in another exchange: the two ran different sequences of steps (a pipeline stage
    ran no micro-batch where its upstream stage sent one)."""
    PREFETCH_ACKS_STOPPED = "prefetch-acks-stopped"
    """For the same prefetch op, one rank emitted fewer progress acks than its peers (or its
    IO thread recorded that it stopped acking an op it had not finished)."""
    PREFETCH_ACKS_MISPAIRED = "prefetch-acks-mispaired"
    """The agreed progress of one prefetch op went down between two of its acks: the per-ack
    MIN vote paired acks of different ops, so ranks settle different prefetched lengths."""
    ABORT_DURING_PREFETCH = "abort-during-prefetch"
    """A request was aborted while its L3 prefetch IO was still in flight."""
    PREFETCH_HOLE_COMMITTED = "prefetch-hole-committed"
    """A prefetch with a failed middle page was settled past the failure (a hole committed)."""
    HOST_POOL_DOUBLE_USE = "host-pool-double-use"
    """The host pool reported a double allocation or a double free."""
    PENDING_SENDS_GROW = "pending-sends-grow"
    """PP0's pending point-to-point sends (isend + cloned tensor) keep accumulating."""
    MEMORY_GROWS = "memory-grows"
    """A rank's memory grows at a steady slope across samples."""
    OOM_KILLED = "oom-killed"
    """A rank was killed by SIGKILL (exit code -9), typically the kernel OOM killer."""
    INJECTED_FAILURE = "injected-failure"
    """A fault injector made a rank crash, hang or die on purpose (a fatal fault fired)."""
    HOST_CAPACITY_DIFFERS = "host-capacity-differs"
    """Ranks (pipeline stages) run with different host-pool token capacities."""
    EVICTION_DIVERGENCE = "eviction-divergence"
    """Ranks evicted different victims (or different amounts) at the same eviction."""
    RESERVATION_LEAKED = "reservation-leaked"
    """Prefetch host tokens stay reserved while no prefetch is in flight."""
    HOST_ALLOC_FAILING = "host-alloc-failing"
    """Host (L2) allocations fail repeatedly: backups or prefetches are dropped."""
    STORAGE_ERRORS = "storage-errors"
    """The L3 backend (a KV storage layer) reported errors, timeouts or failed reads/writes."""
    PD_TRANSFER_ERRORS = "pd-transfer-errors"
    """The prefill/decode disaggregation transfer reported failures."""
    CONSENSUS_FIRED = "consensus-fired"
    """A rank consensus check (ours, or SGLang's) found ranks that decided differently."""
    INVARIANT_BROKEN = "invariant-broken"
    """A tree or pool bookkeeping invariant check failed."""

    # --- things that explain a report that fits no signature ---------------------------------
    DEVICE_FAULT = "device-fault"
    """A device-side fault (CUDA illegal address, device-side assert, Xid)."""
    STARTUP_CONFIG_ERROR = "startup-config-error"
    """The job failed at start-up on its configuration, before serving anything."""
    NO_FAILURE = "no-failure"
    """The inputs record no failure at all: no exception, stack, hang, crash or error line."""
    STORE_WITHOUT_KV_CACHE = "store-without-kv-cache"
    """A storage system failed, but nothing in the inputs shows a KV cache or a serving engine
    using it: the store may serve anything (training data, an object queue)."""

    def describe(self) -> str:
        """The one-line meaning of this fact."""
        return _DESCRIPTIONS.get(self, self.value)


def _descriptions() -> dict[Fact, str]:
    import ast
    import inspect

    # Read the member docstrings from the source once, so the meaning lives in one place.
    out: dict[Fact, str] = {}
    try:
        body = ast.parse(inspect.getsource(Fact)).body[0]
    except (OSError, TypeError, SyntaxError):  # no source shipped: fall back to the names
        return out
    if not isinstance(body, ast.ClassDef):
        return out
    last: str | None = None
    for node in body.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            last = node.targets[0].id
        elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str) and last is not None):
            out[Fact[last]] = " ".join(node.value.value.split())
            last = None
    return out


_DESCRIPTIONS = _descriptions()
