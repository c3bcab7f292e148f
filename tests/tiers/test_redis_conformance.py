"""The shared Tier conformance suite against `RedisTier`: on a standalone server and on a
cluster of three masters (the session's servers, emptied before each test). The tier keeps
nothing on media of its own, so the persistence cases skip themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.config import RedisTierConfig
from tierkv.testing import TierConformance
from tierkv.tiers.base import Tier
from tierkv.tiers.redis import RedisTier

pytestmark = pytest.mark.redis

CAPACITY = 256 << 10


class TestRedisStandaloneConformance(TierConformance):
    url = ""

    @pytest.fixture(autouse=True)
    def _server(self, redis_url: str) -> None:
        self.url = redis_url

    async def make_tier(self, directory: Path) -> Tier:
        return RedisTier(RedisTierConfig("shared", CAPACITY, url=self.url))


class TestRedisClusterConformance(TierConformance):
    nodes: tuple[str, ...] = ()

    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster_nodes: list[str]) -> None:
        self.nodes = tuple(redis_cluster_nodes)

    async def make_tier(self, directory: Path) -> Tier:
        return RedisTier(RedisTierConfig("shared", CAPACITY, cluster=self.nodes))
