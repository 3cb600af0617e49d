"""Reading what a dead deployment left: files, directories, archives and stdin (``ingest``),
told apart by their first bytes (``sniff``); crash-bundle manifests (``bundle``), structured
dumps (``dumps``, read through ``safe_pickle``), the runtime's traces (``trace``); logs streamed
through a vectorised prefilter (``logscan``, ``prefilter``) into the line parsers in ``text/``."""
