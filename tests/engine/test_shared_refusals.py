"""Writes the shared tier's server refused, through the public API on a real redis-server: a
delete or an invalidation whose server-side delete failed (the server stalled its writes, as
it does during a failover: ``CLIENT PAUSE ... WRITE``) is never adopted back by the engine that
made it, and is carried out once the server answers; and a server that refuses every write (full,
``noeviction``) costs the engine no local space.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.engine._configs import KiB
from tests.engine.test_shared_engine import (
    engine_stats,
    engines,
    eventually,
    server_key,
    shared_config,
)
from tierkv.testing.redis_server import RedisServer

pytestmark = pytest.mark.redis

#: how long the server stalls writes, beside the tier's timeout (300 ms)
PAUSE_MS = 1200


async def server_has(server: RedisServer, key: bytes) -> bool:
    return bool(server.command("EXISTS", server_key(key)))


async def test_a_delete_the_server_refused_is_never_served_again(
        fresh_redis_server: RedisServer) -> None:
    """A's delete returns while the server stalls writes (its own delete there timed out): A
    never adopts the server's record of the deleted value, even once the server answers, and
    the record is deleted then, so B stops finding it too."""
    server = fresh_redis_server
    configs = [shared_config(url=server.url, timeout="300ms") for _ in range(2)]
    async with engines(*configs) as (a, b):
        await a.put(b"K", b"old")
        await a.settle()
        assert await server_has(server, b"K")
        server.command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        assert await a.delete(b"K")
        assert await a.get(b"K") is None  # reads go on during a write pause
        await asyncio.sleep(PAUSE_MS / 1000 + 0.2)
        assert await a.get(b"K") is None
        await eventually(lambda: server_has_not(server, b"K"), within=10.0)
        assert await a.get(b"K") is None and await b.get(b"K") is None
        assert engine_stats(a)["shared_deletes_refused"] >= 1


async def test_an_invalidation_the_server_refused_is_not_adopted_back(
        fresh_redis_server: RedisServer) -> None:
    """A invalidates a key while the server stalls writes: the server keeps its record until
    A's kept invalidation is published, and A adopts none of it meanwhile (it did, at once,
    and kept serving it after the republish, which A's follower skips as its own)."""
    server = fresh_redis_server
    config = shared_config(url=server.url, timeout="300ms", scheduler={"policy": "lru"})
    async with engines(config) as (a,):
        await a.put(b"K", b"old")
        await a.put(b"child", b"derived", parents=[b"K"])
        await a.settle()
        server.command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        assert await a.invalidate(b"K") == 2
        assert await a.get_many([b"K", b"child"]) == [None, None]
        await asyncio.sleep(PAUSE_MS / 1000 + 0.2)
        assert await a.get_many([b"K", b"child"]) == [None, None]
        await eventually(lambda: server_has_not(server, b"K"), within=10.0)
        await a.settle()
        assert await a.get_many([b"K", b"child"]) == [None, None]


async def server_has_not(server: RedisServer, key: bytes) -> bool:
    return not await server_has(server, key)


async def test_a_server_that_refuses_every_write_costs_no_local_space(
        fresh_redis_server: RedisServer) -> None:
    """A full server (``noeviction`` at its memory limit) fails each share of a put: the puts
    still land in the gpu tier, which frees its slots as objects leave it. Each failed share
    used to keep the slots it copied from taken until a full garbage collection, and after a
    few dozen puts every put raised `TierFullError`."""
    server = fresh_redis_server
    config = shared_config(url=server.url, timeout="300ms")
    config["tiers"][0].update(capacity=64 * KiB, slot_size=4 * KiB)
    async with engines(config) as (kv,):
        server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        server.command("CONFIG", "SET", "maxmemory", "1")
        try:
            for i in range(40):
                await kv.put(b"k%d" % i, b"%d|" % i * 2000)
            await kv.settle()
            gpu = kv.stats()["tiers"]["gpu"]
            assert gpu["used"] <= gpu["objects"] * 8 * KiB  # slots held only by objects
            await kv.put(b"after", b"x" * 6000)
            assert await kv.get(b"after") == b"x" * 6000
        finally:
            server.command("CONFIG", "SET", "maxmemory", "0")


async def test_a_shared_copy_the_server_evicted_is_a_miss_not_a_corrupt_read(
        fresh_redis_server: RedisServer) -> None:
    """The server drops shared copies on its own (its maxmemory policy): a read that finds the
    engine's copy gone forgets it and counts it in `shared_lost`; `corrupt_reads` (damage on
    media) stays 0. It counted each such eviction as corrupt."""
    server = fresh_redis_server
    async with engines(shared_config(url=server.url)) as (a,):
        await a.put(b"K", b"k" * 4 * KiB)
        await a.settle()
        assert await server_has(server, b"K")
        for i in range(600):  # more than the first tier's 256 slots: K's local copy leaves
            await a.put(b"filler%d" % i, b"f" * 4 * KiB)
        await a.settle()
        assert await a.locate(b"K") == "shared"
        server.command("DEL", server_key(b"K"))  # as an eviction by the server does
        assert await a.get(b"K") is None
        stats = engine_stats(a)
        assert stats["corrupt_reads"] == 0
        assert stats["shared_lost"] == 1


@pytest.mark.parametrize("refusal", ["killed", "full"])
async def test_a_server_that_stops_taking_demotions_never_fails_a_put(
        fresh_redis_server: RedisServer, refusal: str) -> None:
    """The gpu tier full, its victims demoted into the shared tier, then the server dies (or
    is full: ``noeviction``, reads still served) after a window of successes, so its breaker
    stays closed: each victim the server refuses leaves the cache, as the last local tier's do,
    and every put lands locally. The victims stayed, the evictor retried them, and every put
    waited `space_timeout` and raised `TierFullError` for as long as the server refused."""
    server = fresh_redis_server
    config = shared_config(url=server.url, timeout="300ms")
    config["tiers"][0].update(capacity=64 * KiB, slot_size=4 * KiB)
    config["engine"] = {"space_timeout": "3s"}
    async with engines(config) as (kv,):
        for i in range(200):  # warm: victims demoted, the breaker's window full of successes
            await kv.put(b"warm%d" % i, b"w" * 2000)
            await kv.get_many([b"warm%d" % i, b"absent%d" % i])
        await kv.settle()
        if refusal == "killed":
            server.kill()
        else:
            server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
            server.command("CONFIG", "SET", "maxmemory", "1")
        for i in range(60):  # several times the tier's 16 slots
            async with asyncio.timeout(10):
                await kv.put(b"k%d" % i, b"%d|" % i * 1000)
            if refusal == "full":
                await kv.get(b"absent%d" % i)  # a lookup the server answers
        assert await kv.get(b"k59") == b"59|" * 1000
        await kv.settle()
        assert kv.stats()["engine"]["space_timeouts"] == 0
