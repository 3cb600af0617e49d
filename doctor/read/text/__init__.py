"""Free text, one line at a time: the parsers behind the log scanner's slow path (Python
tracebacks, native backtraces, thread dumps, torchrun summaries, log prefixes, storage-layer
lines, evidence pasted inside issue pages)."""
