"""Engine fixtures: small L1-only configs on the CPU device."""

from __future__ import annotations

from typing import Any


def l1_config(capacity: str = "64KiB", slot_size: str = "4KiB", ttl: str = "60s",
              write_policy: str = "write_back") -> dict[str, Any]:
    return {
        "engine": {"write_policy": write_policy},
        "tiers": [{"name": "l1", "kind": "gpu", "device": "cpu", "capacity": capacity,
                   "slot_size": slot_size, "ttl": ttl}],
    }
