"""The shared tier on Redis (standalone or Redis Cluster)."""

from __future__ import annotations

import asyncio

from tierkv.config import RedisTierConfig
from tierkv.errors import TierKVError
from tierkv.tiers.redis.tier import RedisTier

__all__ = ["RedisTier", "probe"]


def probe(config: RedisTierConfig) -> dict[str, str]:
    """What `tierkv info` shows of a redis tier: where it connects (never the credentials),
    the client, and whether the server answers now."""

    async def reach() -> str:
        try:
            await RedisTier(config).ping()
        except TierKVError as exc:
            return f"no: {exc}"
        return "yes"

    described = RedisTier(config).describe()
    described["reachable"] = asyncio.run(reach())
    return described
