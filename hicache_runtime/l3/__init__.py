"""The L3 tier: storage beyond host memory, shared by every rank and every run.

* ``tier``     the scheduler-side half: backups after L2 writes, prefetch submission and
               settlement (:class:`L3Tier`);
* ``workers``  the prefetch query / IO / vote and backup threads;
* ``ops``      the records the two halves hand each other;
* ``keys``     prefix-chained SHA-256 page hashes and per-rank key suffixes;
* ``pages``    one host page of K/V as bytes (layout header) and back into a host pool;
* ``envelope`` the checksummed wrapper every backend stores around a payload;
* ``backend``  :class:`StorageBackend` (the interface a backend implements), its stats;
* ``registry`` backends by name (built-ins and entry-point plug-ins), :func:`make_backend`;
* ``faulty``   the fault-injection wrapper for the ``storage.*`` fault points;
* ``outage``   the outage state machine of the remote backends (calls fail soft, one probe
               after a doubling backoff);
* ``backends/`` the backends themselves (``file``, the embedded default; ``redis``;
               ``mooncake``, a client of a Mooncake Store, with ``mooncake_client`` and the
               throwaway store of ``mooncake_master``; ``redis_server``, a throwaway Redis).

Nothing is imported here: import the module you need.
"""
