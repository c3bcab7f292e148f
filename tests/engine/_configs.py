"""Config builders for engine tests over tier hierarchies (plain mappings for `tierkv.open`).

`hierarchy_config(directory, ("gpu", "pmem", "nvme"), ...)` builds the hierarchy in the order
given, each tier named after its kind; the pmem pool and the nvme log live under `directory`.
Only documented configuration keys are used (README, "Configuration").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: tier kinds in the order a hierarchy lists them
KINDS = ("gpu", "pmem", "nvme")
#: every tier combination a hierarchy may have (a gpu tier, if any, comes first)
COMBINATIONS: tuple[tuple[str, ...], ...] = (
    ("gpu",),
    ("pmem",),
    ("nvme",),
    ("gpu", "pmem"),
    ("gpu", "nvme"),
    ("pmem", "nvme"),
    ("gpu", "pmem", "nvme"),
)

KiB = 1 << 10
MiB = 1 << 20


def gpu_tier(capacity: int = 256 * KiB, slot_size: int = 64 * KiB, ttl: str = "60s"
             ) -> dict[str, Any]:
    """The L1 slot pool, on the CPU (so the tests run without CUDA)."""
    return {"name": "gpu", "kind": "gpu", "device": "cpu", "capacity": capacity,
            "slot_size": slot_size, "ttl": ttl}


def pmem_tier(directory: Path, capacity: int = 8 * MiB) -> dict[str, Any]:
    """A libpmemobj pool on a file (emulated persistent memory); 8 MiB is PMDK's minimum."""
    return {"name": "pmem", "kind": "pmem", "path": str(directory / "tierkv.pool"),
            "capacity": capacity}


def nvme_tier(directory: Path, capacity: int = 32 * MiB, region_size: int = MiB,
              queue_depth: int = 8) -> dict[str, Any]:
    """The log of regions on a file."""
    return {"name": "nvme", "kind": "nvme", "path": str(directory / "tierkv.log"),
            "capacity": capacity, "region_size": region_size, "queue_depth": queue_depth}


def hierarchy_config(
    directory: Path,
    kinds: Sequence[str],
    *,
    write_policy: str = "write_back",
    gpu: dict[str, Any] | None = None,
    pmem: dict[str, Any] | None = None,
    nvme: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A config of the tiers `kinds` (in that order); `gpu`/`pmem`/`nvme` override tier keys."""
    overrides = {"gpu": gpu or {}, "pmem": pmem or {}, "nvme": nvme or {}}
    tiers: list[dict[str, Any]] = []
    for kind in kinds:
        if kind == "gpu":
            tier = gpu_tier()
        elif kind == "pmem":
            tier = pmem_tier(directory)
        elif kind == "nvme":
            tier = nvme_tier(directory)
        else:
            raise ValueError(f"unknown tier kind {kind!r}")
        tier.update(overrides[kind])
        tiers.append(tier)
    return {"engine": {"write_policy": write_policy}, "tiers": tiers}


def crash_hierarchy(directory: Path, write_policy: str) -> dict[str, Any]:
    """The issue's crash hierarchy: gpu 4 MiB of 64 KiB slots → pmem 8 MiB → nvme 256 MiB of
    1 MiB regions. 200 objects of 64 KiB overflow L1 and the pool, so demotion L1 → pmem → nvme
    runs; the log holds far more than any crash test writes, so it never drops anything."""
    return hierarchy_config(
        directory, ("gpu", "pmem", "nvme"), write_policy=write_policy,
        gpu={"capacity": 4 * MiB, "slot_size": 64 * KiB, "ttl": "60s"},
        nvme={"capacity": 256 * MiB, "region_size": MiB},
    )
