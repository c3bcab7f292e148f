"""A failing device under the engine: a read error is a miss, nothing else is lost.

The nvme tier's file is truncated under the open engine, so reads of what it held fail in the
kernel's read path (past the end of the file); objects in the other tiers stay served.
"""

from __future__ import annotations

import os
from pathlib import Path

import tierkv
from tests.engine.test_hierarchy import hierarchy


async def test_nvme_read_failure_is_a_counted_miss(tmp_path: Path) -> None:
    config = hierarchy(tmp_path, pmem=False)
    # large objects fill sealed regions on media; small ones stay in L1
    values = {f"big{i}": os.urandom(60_000) for i in range(40)}
    values.update({f"small{i}": os.urandom(3000) for i in range(4)})
    async with tierkv.open(config) as kv:
        for key, value in values.items():
            await kv.put(key, value)
        await kv.flush()
        below = [k for k in values if await kv.locate(k) == "nvme"]
        above = [k for k in values if await kv.locate(k) == "gpu"]
        # L1 keeps free space between its watermarks, so a small object may be below too
        assert below[:40] == [f"big{i}" for i in range(40)] and above
        os.truncate(tmp_path / "tierkv.log", 4096)
        below = below[:20]  # the first regions written are sealed, read from the device
        for key in below:
            assert await kv.get(key) is None
        for key in above:
            assert await kv.get(key) == values[key]
        stats = kv.stats()["engine"]
        assert stats["device_errors"] >= len(below)
        assert stats["misses"] >= len(below)
        await kv.put("after", b"still works")
        assert await kv.get("after") == b"still works"


async def test_corrupt_payload_below_is_a_miss_not_wrong_bytes(tmp_path: Path) -> None:
    config = hierarchy(tmp_path, pmem=False)
    marker = b"\xab\xcd" * 1500
    async with tierkv.open(config) as kv:
        await kv.put("victim", marker)
        for i in range(8):
            await kv.put(f"filler{i}", os.urandom(3000))
        await kv.flush()
        assert await kv.locate("victim") == "nvme"
    raw = bytearray((tmp_path / "tierkv.log").read_bytes())
    at = raw.find(marker)
    assert at > 0
    raw[at + 100] ^= 0xFF
    (tmp_path / "tierkv.log").write_bytes(bytes(raw))
    async with tierkv.open(config) as kv:
        assert await kv.get("victim") is None
        assert await kv.get("filler7") is not None
