"""HiCache itself: the policies over the KV parts and the L3 tier (``hicache``), its L1/L2
eviction (``eviction``), write-backup and load-back (``transfers``), the interface the scheduler
uses with the cache-disabled reference (``interface``), and drain-time leak accounting
(``accounting``)."""
