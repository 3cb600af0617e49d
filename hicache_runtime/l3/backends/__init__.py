"""L3 backends shipped with the runtime; others plug in through the registry."""
