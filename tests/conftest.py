"""Hardware markers: `gpu`, `pmem` and `uring` tests skip with a printed reason where absent."""

from __future__ import annotations

import pytest

from tierkv._platform import cuda_available, io_uring_available, libpmemobj_available


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") and not cuda_available():
        pytest.skip("gpu: no CUDA device on this machine")
    if item.get_closest_marker("pmem") and (reason := libpmemobj_available()):
        pytest.skip(f"pmem: {reason}")
    if item.get_closest_marker("uring") and (reason := io_uring_available()):
        pytest.skip(f"uring: {reason}")
