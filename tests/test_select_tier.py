"""`select_tier`: the slowest tier that meets a latency SLO at an access frequency, table-driven;
and puts with a `latency_slo` placed by it through the engine, on configured profiles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tierkv
from tierkv.scheduler.select import MAX_UTILISATION, TierProfile, select_tier

NS, US, MS = 1e-9, 1e-6, 1e-3
GiB = 1 << 30
#: a dram-like, a persistent-memory-like and an nvme-like tier
DRAM = TierProfile(100 * NS, 20 * GiB, queue_depth=8)
PMEM = TierProfile(300 * NS, 6 * GiB, queue_depth=8)
NVME = TierProfile(80 * US, 3 * GiB, queue_depth=32)
TIERS = (DRAM, PMEM, NVME)
ROOM = (True, True, True)


@pytest.mark.parametrize(
    ("nbytes", "slo", "frequency", "room", "expected"),
    [
        # the rule generalised: a hot object (> 1000/s) under a 500 ns SLO -> persistent memory
        (64, 500 * NS, 5000.0, ROOM, 1),
        # a relaxed SLO -> nvme, the slowest tier that meets it
        (64, 1 * MS, 5000.0, ROOM, 2),
        (64, 1 * MS, 0.0, ROOM, 2),
        # only dram meets 200 ns
        (64, 200 * NS, 10.0, ROOM, 0),
        # nothing meets 50 ns: the fastest tier with room
        (64, 50 * NS, 10.0, ROOM, 0),
        (64, 50 * NS, 10.0, (False, True, True), 1),
        # pmem full: the slowest that meets it with room is dram
        (64, 500 * NS, 10.0, (True, False, True), 0),
        # bandwidth counts: 16 MiB from nvme takes ~5.3 ms, misses a 2 ms SLO; pmem ~2.6 ms too
        (16 << 20, 2 * MS, 0.0, ROOM, 0),
        (16 << 20, 10 * MS, 0.0, ROOM, 2),
        # frequency counts: at 300k reads/s one object would keep more than half of nvme's 32
        # slots busy (300k * 80 us = 24 > 16), so pmem it is
        (64, 1 * MS, 300_000.0, ROOM, 1),
        # no room anywhere
        (64, 1 * MS, 1.0, (False, False, False), None),
    ],
)
def test_select_tier_table(nbytes: int, slo: float, frequency: float,
                           room: tuple[bool, ...], expected: int | None) -> None:
    assert select_tier(TIERS, nbytes, slo, frequency, room) == expected


def test_utilisation_bound_is_what_the_table_says() -> None:
    assert 300_000.0 * NVME.access_time(64) > MAX_UTILISATION * NVME.queue_depth
    assert 5000.0 * NVME.access_time(64) <= MAX_UTILISATION * NVME.queue_depth


def _config(tmp: Path) -> dict[str, object]:
    return {
        "tiers": [
            {"name": "gpu", "kind": "gpu", "device": "cpu", "capacity": "1MiB",
             "slot_size": "64KiB", "latency": "200ns", "bandwidth": "20GiB"},
            {"name": "pmem", "kind": "pmem", "path": str(tmp / "p.pool"), "capacity": "16MiB",
             "latency": "400ns", "bandwidth": "6GiB"},
            {"name": "nvme", "kind": "nvme", "path": str(tmp / "n.log"), "capacity": "9MiB",
             "region_size": "1MiB", "latency": "80us", "bandwidth": "3GiB"},
        ],
    }


async def test_puts_with_a_latency_slo_land_where_select_tier_says(tmp_path: Path) -> None:
    async with tierkv.open(_config(tmp_path)) as kv:
        await kv.put(b"relaxed", b"x" * 4096, latency_slo=10 * MS)
        await kv.put(b"pmem-fast", b"x" * 4096, latency_slo=2 * US)
        await kv.put(b"dram-fast", b"x" * 64, latency_slo=250 * NS)
        await kv.put(b"no-slo", b"x" * 4096)
        assert await kv.locate(b"relaxed") == "nvme"
        assert await kv.locate(b"pmem-fast") == "pmem"
        assert await kv.locate(b"dram-fast") == "gpu"
        assert await kv.locate(b"no-slo") == "gpu"
        assert await kv.get(b"relaxed") == b"x" * 4096
        with pytest.raises(ValueError, match="latency_slo"):
            await kv.put(b"bad", b"x", latency_slo=0.0)


async def test_profiles_are_probed_when_not_configured(tmp_path: Path) -> None:
    config = _config(tmp_path)
    for tier in config["tiers"]:  # type: ignore[attr-defined]
        del tier["latency"], tier["bandwidth"]
    async with tierkv.open(config) as kv:
        # measured, nvme is slower than the gpu tier on the CPU: a generous SLO goes down
        await kv.put(b"relaxed", b"y" * 4096, latency_slo=1.0)
        assert await kv.locate(b"relaxed") == "nvme"
        # and nothing of the probe is left behind
        assert kv.stats()["engine"]["objects"] == 1


@pytest.mark.parametrize(("key", "value", "message"), [
    ("latency", "fast", "tiers[0].latency: 'fast' is not a duration"),
    ("latency", -1, "tiers[0].latency: must be positive"),
    ("bandwidth", "lots", "tiers[0].bandwidth: 'lots' is not a size"),
    ("bandwidth", 0, "tiers[0].bandwidth: must be positive"),
])
def test_bad_profiles_name_the_key(tmp_path: Path, key: str, value: object,
                                   message: str) -> None:
    config = _config(tmp_path)
    config["tiers"][0][key] = value  # type: ignore[index]
    with pytest.raises(tierkv.ConfigError, match=re.escape(message)):
        tierkv.load_config(config)


def test_scheduler_keys_are_checked(tmp_path: Path) -> None:
    config = _config(tmp_path)
    config["scheduler"] = {"policy": "lfu"}
    with pytest.raises(tierkv.ConfigError, match=re.escape("scheduler.policy: 'lfu' is not one")):
        tierkv.load_config(config)
    config["scheduler"] = {"alpha": 1.5}
    with pytest.raises(tierkv.ConfigError, match=re.escape("scheduler.alpha: 1.5 is outside")):
        tierkv.load_config(config)
