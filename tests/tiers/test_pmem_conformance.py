"""The shared Tier conformance suite against `PmemTier` (pool file under the test's tmp_path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.config import PmemTierConfig
from tierkv.testing import TierConformance
from tierkv.tiers.base import Tier
from tierkv.tiers.pmem.tier import PmemTier

pytestmark = pytest.mark.pmem

CAPACITY = 8 << 20


class TestPmemConformance(TierConformance):
    async def make_tier(self, directory: Path) -> Tier:
        return PmemTier(PmemTierConfig("pmem", CAPACITY, directory / "tier.pool"))


class TestPmemConformancePythonCopies(TierConformance):
    """The same contract on the Python copy path (what runs where the native library is not
    built)."""

    async def make_tier(self, directory: Path) -> Tier:
        return PmemTier(PmemTierConfig("pmem", CAPACITY, directory / "tier.pool"), native=False)
