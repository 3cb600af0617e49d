"""The KV cache's parts: the radix tree, the device (L1) and host (L2) pools and their
allocators, host page pins, the asynchronous copy engine, the transfer queues, and a request's
view of its KV."""
