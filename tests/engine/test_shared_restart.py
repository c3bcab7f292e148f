"""Restarting an engine that shares a redis tier: what the fleet invalidated while it was down
is gone when it comes back (its saved cursor in the fleet's log), and if the log no longer
reaches back to that cursor, nothing it recovered is served; an open cancelled while it reads
the fleet's log releases its local tiers."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

import tierkv
from tests.engine._configs import gpu_tier, pmem_tier
from tests.engine.test_refused_deletes import run_child_until_flushed
from tierkv.keys import Key
from tierkv.testing.redis_server import RedisServer
from tierkv.testing.stepping import cancel_at

pytestmark = [pytest.mark.redis, pytest.mark.pmem]


def engine(directory: Path, url: str, **redis: Any) -> dict[str, Any]:
    directory.mkdir(exist_ok=True)
    return {"tiers": [gpu_tier(), pmem_tier(directory),
                      {"name": "shared", "kind": "redis", "url": url, "capacity": "64MiB",
                       **redis}]}


async def test_what_the_fleet_invalidated_while_an_engine_was_down_is_gone_after_it(
        tmp_path: Path, redis_url: str) -> None:
    a, b = engine(tmp_path / "a", redis_url), engine(tmp_path / "b", redis_url)
    async with tierkv.open(a) as kv:
        for key in (b"k1", b"k2", b"k3"):
            await kv.put(key, key * 100)
        await kv.settle()
    async with tierkv.open(b) as other:  # while a is down
        await other.invalidate(b"k1")
        await other.put(b"k3", b"new" * 100)  # b never held k3: a fresh put, not an invalidation
    async with tierkv.open(a) as kv:
        assert await kv.get(b"k1") is None
        assert await kv.get(b"k2") == b"k2" * 100
        assert kv.stats()["engine"]["shared_recovered_dropped"] == 0
        await kv.put(b"k1", b"again" * 100)  # stored after the invalidation: it stays
    async with tierkv.open(a) as kv:
        assert await kv.get(b"k1") == b"again" * 100


@pytest.mark.parametrize("parent", ["model", "deleted"])
async def test_what_derives_from_a_key_not_held_goes_if_the_fleet_invalidated_it_meanwhile(
        tmp_path: Path, redis_url: str, parent: str) -> None:
    """The parent the fleet invalidated while this engine was down is one it does not hold (a
    model version, a key it deleted): what it recovered deriving from it goes at the open,
    as it would have gone had the engine been running (the log's entries were applied only
    to keys the engine held)."""
    a, b = engine(tmp_path / "a", redis_url), engine(tmp_path / "b", redis_url)
    async with tierkv.open(a) as kv:
        if parent == "model":
            child: Key = tierkv.block_keys(list(range(16)), block_size=16, model="m@1",
                                                  rope_theta=10000.0)[0]
            await kv.put(child, b"block" * 100)
        else:
            child = b"c"
            await kv.put(b"p", b"parent" * 100)
            await kv.put(child, b"child" * 100, parents=[b"p"])
            await kv.delete(b"p")
        await kv.settle()
    async with tierkv.open(b) as other:  # while a is down
        if parent == "model":
            await other.invalidate_model("m@1")
        else:
            await other.invalidate(b"p")
    async with tierkv.open(a) as kv:
        assert await kv.get(child) is None


async def test_an_edge_added_to_a_shared_copy_survives_a_restart(redis_url: str) -> None:
    """`add_dependency` to a key held in volatile tiers and the shared tier: the shared copy's
    record names the new parent, so the object adopted again after a restart is known to
    derive from it (the record kept its old parents, and an invalidation of the parent after
    the restart left the child served)."""
    config = {"tiers": [gpu_tier(), {"name": "shared", "kind": "redis", "url": redis_url,
                                     "capacity": "64MiB"}]}
    async with tierkv.open(config) as kv:
        await kv.put(b"p", b"parent" * 100)
        await kv.put(b"c", b"child" * 100)
        await kv.settle()  # both shared
        await kv.add_dependency(b"p", b"c")
    async with tierkv.open(config) as kv:  # nothing local: the shared copies are adopted
        assert await kv.invalidate(b"p") >= 0
        assert await kv.get(b"c") is None


async def test_an_engine_the_log_no_longer_reaches_back_to_drops_what_it_recovered(
        tmp_path: Path, redis_url: str) -> None:
    retention = {"retention": "50ms"}
    a, b = engine(tmp_path / "a", redis_url, **retention), engine(tmp_path / "b", redis_url,
                                                                  **retention)
    async with tierkv.open(a) as kv:
        await kv.put(b"k1", b"v1" * 100)
        await kv.put(b"k2", b"v2" * 100)
    async with tierkv.open(b) as other:
        await other.invalidate(b"k1")
        await asyncio.sleep(0.2)
        await other.invalidate(b"unrelated")  # its append trims the first entry
        assert other.stats()["tiers"]["shared"]["log_horizon"] == 0  # b read both: no gap
    async with tierkv.open(a) as kv:
        # a cannot know what the trimmed entry said: it serves nothing it recovered
        assert kv.stats()["engine"]["shared_recovered_dropped"] == 2
        assert kv.stats()["tiers"]["shared"]["log_horizon"] > 0
        assert await kv.get(b"k2") in (None, b"v2" * 100)  # None locally; the shared copy may
        assert await kv.get(b"k1") is None  # the invalidated one never comes back


async def test_an_invalidation_the_server_never_took_is_published_after_a_restart(
        tmp_path: Path, fresh_redis_server: RedisServer) -> None:
    """A invalidates a key B holds while the server does not answer (frozen: its data kept),
    then closes: the invalidation is kept in A's pool; once the server answers and A reopens,
    it is published, and B drops the key (through the log: B's log is intact)."""
    server = fresh_redis_server
    # 1 s, not less: a server killed refuses at once, and a loaded CI machine once took longer
    # than 300 ms to answer the first open's first read of the fleet's log
    a = engine(tmp_path / "a", server.url, timeout="1s")
    b = {"tiers": [gpu_tier(), {"name": "shared", "kind": "redis", "url": server.url,
                                "capacity": "64MiB", "timeout": "1s"}]}
    async with tierkv.open(b) as other:
        kv = await tierkv.open(a)
        try:
            await kv.put(b"K", b"old" * 100)
            await kv.settle()
            assert await other.get(b"K") == b"old" * 100
            await other.settle()
            os.kill(server.pid, signal.SIGSTOP)
            try:
                assert await kv.invalidate(b"K") == 1
                await kv.close()  # the server still down: the invalidation is saved, not published
            finally:
                os.kill(server.pid, signal.SIGCONT)
        finally:
            await kv.close()
        assert await other.get(b"K") == b"old" * 100
        async with tierkv.open(a) as kv:
            deadline = asyncio.get_running_loop().time() + 10.0
            while await other.contains(b"K"):
                assert asyncio.get_running_loop().time() < deadline, "never published"
                await asyncio.sleep(0.05)
            assert kv.stats()["engine"]["shared_republished"] >= 1
        assert await other.get(b"K") is None


#: an invalidation the frozen server does not take, saved as kept by a flush; a second flush
#: while the health watch sends it again (the server still frozen), then a `kill -9`
_REPUBLISH_CHILD = """
import asyncio, json, os, signal, sys
import tierkv

async def main(cfg, server):
    kv = await tierkv.open(cfg)
    os.kill(server, signal.SIGSTOP)
    assert await kv.invalidate(b"K") == 0  # not held here: the fleet is told all the same
    await kv.flush()
    for _ in range(1000):  # the health watch's next look, within a second or two
        if kv.stats()["engine"]["shared_republished"]:
            break
        await asyncio.sleep(0.01)
    assert kv.stats()["engine"]["shared_republished"]
    await kv.flush()  # while that send waits for the server
    print("FLUSHED", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1]), int(sys.argv[2])))
"""


#: two flushes at once: the first one's save of the fleet cursor is held up on its way into the
#: pool (a slow device, under `slow_operation`); an invalidation the frozen server does not take,
#: then the second flush, which saves it as kept; then the first's save, from before it, lands
_CURSOR_RACE_CHILD = """
import asyncio, json, os, signal, sys
from tierkv.testing.faults import FaultPlan, open_with_faults

async def main(cfg, server):
    plan = FaultPlan()
    kv = await open_with_faults(cfg, plan)
    plan.add("pmem", "latency", schedule=[1], ops=["put"], arg=4.0)
    earlier = asyncio.create_task(kv.flush())
    for _ in range(1000):  # until its save of the cursor is on its way into the pool
        if plan.fired["pmem:latency"]:
            break
        await asyncio.sleep(0.01)
    assert plan.fired["pmem:latency"] == 1
    os.kill(server, signal.SIGSTOP)
    assert await kv.invalidate(b"K") == 0
    await kv.flush()
    await earlier
    print("FLUSHED", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1]), int(sys.argv[2])))
"""


async def published_after_kill_9(tmp_path: Path, server: RedisServer, child: str) -> None:
    """`child` (a script run on engine A's config with the server's pid) invalidates K, which
    another engine holds, while the server is frozen, and is killed -9 once its flushes
    returned: A's restart must still publish the invalidation, and the other engine drop K."""
    a = engine(tmp_path / "a", server.url, timeout="1s")
    a["health"] = {"slow_operation": "10s"}  # a slow put of A's records is not cut off
    b = {"tiers": [gpu_tier(), {"name": "shared", "kind": "redis", "url": server.url,
                                "capacity": "64MiB", "timeout": "1s"}]}
    async with tierkv.open(b) as other:
        await other.put(b"K", b"old" * 100)
        await other.settle()
        try:
            await asyncio.to_thread(run_child_until_flushed, a, child, [str(server.pid)])
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert await other.get(b"K") == b"old" * 100  # not published yet
        async with tierkv.open(a):
            deadline = asyncio.get_running_loop().time() + 10.0
            while await other.contains(b"K"):
                assert asyncio.get_running_loop().time() < deadline, "never published"
                await asyncio.sleep(0.05)
        assert await other.get(b"K") is None


async def test_an_invalidation_sent_again_while_a_flush_saves_survives_a_kill_9(
        tmp_path: Path, fresh_redis_server: RedisServer) -> None:
    """An invalidation the server did not take stays in the record a flush saves until the
    server has taken it: taken out while the health watch sent it again, a flush then saved a
    record without it, and after a `kill -9` it was never published: the fleet kept serving
    the invalidated value."""
    await published_after_kill_9(tmp_path, fresh_redis_server, _REPUBLISH_CHILD)


async def test_concurrent_flushes_never_leave_an_older_fleet_cursor_record(
        tmp_path: Path, fresh_redis_server: RedisServer) -> None:
    """The fleet cursor is saved one flush at a time: two at once wrote its records side by
    side, and the earlier flush's, from before an invalidation the server did not take, landed
    last and deleted the record of it the later flush had saved; after a `kill -9` it was
    never published."""
    await published_after_kill_9(tmp_path, fresh_redis_server, _CURSOR_RACE_CHILD)


async def test_an_engine_away_while_the_server_lost_its_log_drops_what_it_recovered(
        tmp_path: Path, fresh_redis_server: RedisServer) -> None:
    """The server restarted without its data while this engine was closed: the log that said
    what was invalidated meanwhile is gone (no horizon says so), so the engine cannot trust
    what it recovered."""
    server = fresh_redis_server
    writer = {"tiers": [gpu_tier(), {"name": "shared", "kind": "redis", "url": server.url,
                                     "capacity": "64MiB", "timeout": "1s"}]}
    reader = engine(tmp_path / "b", server.url, timeout="1s")
    async with tierkv.open(writer) as kv:
        await kv.put(b"K", b"v1" * 100)
        await kv.put(b"L", b"kept" * 100)
        await kv.settle()
        async with tierkv.open(reader) as other:
            assert await other.get_many([b"K", b"L"]) == [b"v1" * 100, b"kept" * 100]
            await other.settle()
        assert await kv.invalidate(b"K") == 1  # the reader is away
    server.kill()
    await asyncio.to_thread(server.restart)
    async with tierkv.open(reader) as other:
        assert other.stats()["engine"]["shared_recovered_dropped"] >= 1
        assert await other.get(b"K") is None
    # its own log, read to the end and saved at close, is trusted at the next open
    async with tierkv.open(reader) as other:
        await other.put(b"M", b"mine" * 100)
    async with tierkv.open(reader) as other:
        assert other.stats()["engine"]["shared_recovered_dropped"] == 0
        assert await other.get(b"M") == b"mine" * 100


async def test_an_open_cancelled_at_any_await_leaves_its_tiers_closed(
        tmp_path: Path, redis_url: str) -> None:
    config = engine(tmp_path, redis_url)
    async with tierkv.open(config) as kv:
        await kv.put(b"k", b"v" * 100)

    async def opening(_k: int) -> tierkv.Engine:
        return await tierkv.open(config)

    async def reopen(_k: int) -> None:
        # the pool was released, whichever await the cancelled open was at: the tiers' opens
        # or, with them open, the reading of the fleet's log
        async with tierkv.open(config) as kv:
            assert await kv.get(b"k") == b"v" * 100

    cancelled, kv = await cancel_at(opening, after=reopen)
    await kv.close()
    assert cancelled
