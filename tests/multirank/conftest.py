"""Multi-rank tests spawn real rank processes on gloo: slow, but they are the point."""

from __future__ import annotations

import pytest

from hicache_runtime.config import RuntimeConfig, load_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def mr_config(**overrides: object) -> RuntimeConfig:
    """Small pools and short protocol timeouts, so failures surface in seconds."""
    base: dict[str, object] = {
        "workload.requests": 24, "cache.device_tokens": 512, "cache.host_tokens": 1024,
        "observability.protocol_timeout_s": 4.0, "observability.watchdog_timeout_s": 15.0,
    }
    base.update(overrides)
    return load_config(base)
