"""The shared Tier conformance suite on the NVMe tier, on both IO backends."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.tiers._nvme_support import nvme_config
from tierkv._platform import io_uring_sqpoll_available
from tierkv.config import NvmeBackend
from tierkv.testing import TierConformance
from tierkv.tiers.base import Tier
from tierkv.tiers.nvme.tier import NvmeTier


@pytest.mark.uring
class TestNvmeUring(TierConformance):
    async def make_tier(self, directory: Path) -> Tier:
        return NvmeTier(nvme_config(directory, backend=NvmeBackend.IO_URING))

    async def test_backend_in_use(self, tier: Tier) -> None:
        assert tier.stats()["backend"] == "io_uring"
        assert tier.describe()["backend"] == "io_uring"


class TestNvmeThreads(TierConformance):
    async def make_tier(self, directory: Path) -> Tier:
        return NvmeTier(nvme_config(directory, backend=NvmeBackend.THREADS))

    async def test_backend_in_use(self, tier: Tier) -> None:
        assert tier.stats()["backend"] == "threads"
        assert tier.describe()["io"].startswith("direct")


@pytest.mark.uring
class TestNvmeUringSqPoll(TierConformance):
    """The same contract with io_uring submission-queue polling (`sq_poll`)."""

    async def make_tier(self, directory: Path) -> Tier:
        reason = io_uring_sqpoll_available()
        if reason is not None:
            pytest.skip(f"sq_poll: {reason}")
        config = nvme_config(directory, backend=NvmeBackend.IO_URING)
        return NvmeTier(dataclasses.replace(config, sq_poll=0.002))

    async def test_backend_in_use(self, tier: Tier) -> None:
        assert tier.stats()["backend"] == "io_uring"
        assert tier.stats()["sq_poll"] == 0.002
        assert "2ms" in tier.describe()["sq_poll"]
