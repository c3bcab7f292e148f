"""The shared Tier conformance suite on the GPU slot tier: on the CPU, and on CUDA where present."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.config import GpuTierConfig
from tierkv.testing import TierConformance
from tierkv.tiers.base import Tier
from tierkv.tiers.gpu.tier import GpuTier


class TestGpuTierOnCpu(TierConformance):
    device = "cpu"

    async def make_tier(self, directory: Path) -> Tier:
        return GpuTier(GpuTierConfig("l1", 64 * 4096, self.device, 4096, 5.0))


@pytest.mark.gpu
class TestGpuTierOnCuda(TestGpuTierOnCpu):
    device = "cuda:0"
