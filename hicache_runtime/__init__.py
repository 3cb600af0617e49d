"""A working HiCache runtime: radix tree, L1/L2/L3 pools, copy engine, controller, scheduler,
a small transformer, and TP x PP ranks on torch.distributed, with tracing and crash bundles.

Import submodules directly (``from hicache_runtime.config import load_config``); this package
imports nothing heavy on its own so that the doctor can read bundles without torch.
"""
