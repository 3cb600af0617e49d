"""HiCache itself: the policies over the KV parts and the L3 tier (``hicache``), built from
parts it owns: L2 allocation and eviction (``host_space``), write-backup and load-back
(``transfers``), L1 eviction (``eviction``) and their shared counters and in-flight copies
(``state``); the interface the scheduler uses with the cache-disabled reference
(``interface``), and drain-time leak accounting (``accounting``)."""
