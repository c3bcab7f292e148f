"""The fleet's invalidation log lost or rolled back on the server (a restart without its data,
or from an older snapshot), and what engines then serve: never what an invalidation that
returned removed, whether the engine was running, crashed before its first flush, or opened
after the loss; and a log position of something else under the prefix is a clear error."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import gpu_tier
from tests.engine.test_refused_deletes import run_child_until_flushed
from tests.engine.test_shared_restart import engine
from tierkv.errors import DeviceError
from tierkv.testing.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.pmem]

#: a write_through put (durable in the pool once it returns), then a `kill -9`: no flush, no
#: close ever saved this engine's position in the fleet's log
_PUT_CHILD = """
import asyncio, json, sys
import tierkv

async def main(cfg):
    kv = await tierkv.open(cfg)
    await kv.put(b"K", b"v1" * 100)
    print("FLUSHED", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1])))
"""


def shared_only(url: str) -> dict[str, object]:
    return {"tiers": [gpu_tier(), {"name": "shared", "kind": "redis", "url": url,
                                   "capacity": "64MiB", "timeout": "1s"}]}


async def test_an_engine_killed_before_its_first_flush_notices_a_lost_log(
        tmp_path: Path, fresh_redis_server: RedisServer) -> None:
    """Its position is saved at open: with none saved, a log lost meanwhile read as one
    where nothing happened, and the invalidated value was served after the restart."""
    server = fresh_redis_server
    a = engine(tmp_path / "a", server.url, timeout="1s")
    a["engine"] = {"write_policy": "write_through"}
    await asyncio.to_thread(run_child_until_flushed, a, _PUT_CHILD)
    async with tierkv.open(shared_only(server.url)) as other:
        assert await other.invalidate(b"K") == 0  # not held there: the fleet is told all the same
    server.kill()
    await asyncio.to_thread(server.restart)  # without its data: the log is gone
    async with tierkv.open(a) as kv:
        assert kv.stats()["engine"]["shared_recovered_dropped"] >= 1
        assert await kv.get(b"K") is None


async def test_invalidations_a_rolled_back_log_lost_are_published_again(
        fresh_redis_server: RedisServer) -> None:
    """The server restarts from a snapshot older than an invalidation: its record of the key
    is back and its log lacks the entry. The running engines find the log rolled back and
    publish the invalidations they hold again, so an engine opened afterwards misses too."""
    server = fresh_redis_server
    config = shared_only(server.url)
    async with tierkv.open(config) as a, tierkv.open(config) as b:
        await a.put(b"K", b"old" * 100)
        await a.settle()
        assert await b.get(b"K") == b"old" * 100
        server.command("SAVE")  # the snapshot the restart goes back to
        assert await a.invalidate(b"K") == 1
        server.kill()
        await asyncio.to_thread(server.restart)
        assert _records(server) == 1  # K's record, back from the snapshot
        deadline = asyncio.get_running_loop().time() + 15.0
        while _records(server):  # until an engine deleted it again, publishing K
            assert asyncio.get_running_loop().time() < deadline, "never published again"
            await asyncio.sleep(0.05)
        assert a.stats()["tiers"]["shared"]["log_history_lost"] >= 1
        assert await a.get(b"K") is None
        assert await b.get(b"K") is None
    async with tierkv.open(config) as c:
        assert await c.get(b"K") is None


def _records(server: RedisServer) -> int:
    """How many objects' records the server holds (keys under the default prefix's ``o:``)."""
    return len(server.command("KEYS", "tierkv:o:*"))  # type: ignore[arg-type]


async def test_a_log_position_of_something_else_under_the_prefix_is_a_clear_error(
        fresh_redis_server: RedisServer) -> None:
    server = fresh_redis_server
    config = shared_only(server.url)
    async with tierkv.open(config) as kv:
        await kv.put(b"K", b"v" * 100)
    server.command("SET", "tierkv:{fleet}:horizon", "not-a-position")  # the default prefix
    with pytest.raises(DeviceError, match="not a tierkv log position"):
        await tierkv.open(config)
