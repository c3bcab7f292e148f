"""`NvmeTier.time_read` reads the device, never a region buffer: the engine's profile probe
(`select_tier`) must time the log's media, not the memory its newest entries are read from."""

from __future__ import annotations

from pathlib import Path

from tests.tiers._nvme_support import REGION, key, meta_of, nvme_config, payload_for
from tierkv.tiers.nvme.tier import NvmeTier


async def test_time_read_reads_the_device_where_a_get_reads_the_head(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path))
    await tier.open()
    try:
        data = payload_for(1, 8000)
        await tier.put(key(1), meta_of(data), data)
        before = tier.stats()["bytes_read"]
        got = await tier.get(key(1))
        assert got is not None and bytes(got[1]) == data
        assert tier.stats()["bytes_read"] == before  # the head's buffer served it
        seconds = await tier.time_read(4096)
        assert seconds is not None and seconds > 0
        assert tier.stats()["bytes_read"] == before + 4096
    finally:
        await tier.close()


async def test_a_large_read_is_timed_once_the_log_has_written_that_much(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=4))
    await tier.open()
    try:
        # a new log has written only its superblock: a longer read would time the file system
        # answering for a part of the file never written, not the device
        assert await tier.time_read(256 << 10) is None
        for i in range(2 * REGION // 100_000):  # fills the first region, seals it
            data = payload_for(i, 100_000)
            await tier.put(key(i), meta_of(data), data)
        await tier.flush()
        before = tier.stats()["bytes_read"]
        assert await tier.time_read(256 << 10) is not None
        assert tier.stats()["bytes_read"] == before + (256 << 10)
        for i in range(2 * REGION // 100_000):  # and it left every object as it was
            got = await tier.get(key(i))
            assert got is not None and bytes(got[1]) == payload_for(i, 100_000)
    finally:
        await tier.close()
