"""Hardware markers: `gpu`, `pmem`, `uring`, `direct`, `native` and `redis` tests skip with a
printed reason where what they need is absent."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

from tierkv._platform import (
    cuda_available,
    io_uring_available,
    libpmemobj_available,
    o_direct_supported,
)
from tierkv.testing.redis_server import redis_missing

pytest_plugins = ["tests.redis_fixtures"]


@functools.cache
def native_pmem_missing() -> str | None:
    """``None`` when the pmem tier's native copy library is built and current, else why not."""
    if reason := libpmemobj_available():
        return reason
    from tierkv.errors import DeviceError
    from tierkv.tiers.pmem._native import load

    try:
        loaded = load()
    except DeviceError as exc:
        return str(exc)
    if loaded is None:
        return "the native pmem copy library is not built or is stale (scripts/setup builds it)"
    return None


@functools.cache
def o_direct_missing(directory: Path) -> str | None:
    if o_direct_supported(directory):
        return None
    return f"the filesystem of {directory} refuses O_DIRECT"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") and not cuda_available():
        pytest.skip("gpu: no CUDA device on this machine")
    if item.get_closest_marker("pmem") and (reason := libpmemobj_available()):
        pytest.skip(f"pmem: {reason}")
    if item.get_closest_marker("uring") and (reason := io_uring_available()):
        pytest.skip(f"uring: {reason}")
    if item.get_closest_marker("native") and (reason := native_pmem_missing()):
        pytest.skip(f"native: {reason}")
    if item.get_closest_marker("redis") and (reason := redis_missing()):
        pytest.skip(f"redis: {reason}")
    if item.get_closest_marker("direct"):
        # tmp_path lies under the base temporary directory
        base = item.config.getoption("basetemp") or tempfile.gettempdir()
        if reason := o_direct_missing(Path(base)):
            pytest.skip(f"direct: {reason}")
