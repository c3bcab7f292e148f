"""The real Redis servers the redis tier is tested and benchmarked against
(`tierkv.testing.redis_server`): they answer redis-py, come back on the same port after a
crash, form a cluster that spreads keys over its three masters, and leave no process behind."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from tierkv.testing.redis_server import RedisServer

pytestmark = pytest.mark.redis


def gone(pid: int) -> bool:
    """No process has `pid`, not even a zombie (the server was reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_standalone_set_get(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.set("tierkv:key", b"\x00value\xff")
        assert await client.get("tierkv:key") == b"\x00value\xff"
        assert await client.dbsize() == 1
    finally:
        await client.aclose()


async def test_redis_url_starts_empty(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.dbsize() == 0
        await client.set("left:behind", b"1")
    finally:
        await client.aclose()


async def test_kill_and_restart_on_the_same_port(fresh_redis_server: RedisServer) -> None:
    server = fresh_redis_server
    port, first_pid = server.port, server.pid
    client = aioredis.Redis.from_url(server.url)
    try:
        assert await client.set("before", b"1")
        server.kill()
        assert not server.running
        assert gone(first_pid)
        server.restart()
        assert server.port == port
        assert server.pid != first_pid
        # the pooled connection died with the old process: one command may see that
        with contextlib.suppress(RedisConnectionError):
            await client.ping()
        assert await client.set("after", b"2")
        # persistence is off: the crash lost what was written before it
        assert await client.get("before") is None
        assert await client.get("after") == b"2"
    finally:
        await client.aclose()


async def test_cluster_spreads_keys_over_three_masters(redis_cluster_nodes: list[str]) -> None:
    assert len(redis_cluster_nodes) == 3
    startup = [ClusterNode(host, int(port))
               for host, port in (node.rsplit(":", 1) for node in redis_cluster_nodes)]
    client = RedisCluster(startup_nodes=startup)
    try:
        keys = [f"tierkv:{i}" for i in range(100)]
        for key in keys:
            assert await client.set(key, key.encode())
        assert await client.get("tierkv:42") == b"tierkv:42"
        slots = {client.keyslot(key) for key in keys}
        assert len(slots) > 50
        sizes = {}
        for node in client.get_primaries():
            sizes[node.name] = await client.dbsize(target_nodes=node)
        assert sorted(sizes) == sorted(redis_cluster_nodes)
        assert sum(sizes.values()) == 100
        assert all(size > 0 for size in sizes.values()), sizes
    finally:
        await client.aclose()


def test_stop_leaves_no_process_or_directory() -> None:
    with RedisServer(unix_socket=True) as server:
        pid, directory = server.pid, server.log_path.parent
        assert not gone(pid)
        assert server.unix_socket is not None
        assert Path(server.unix_socket).is_socket()
        server.stop()
        assert gone(pid)
        assert not directory.exists()
        assert not server.running
    # leaving the block stopped it once more, which does nothing


def test_password_and_maxmemory() -> None:
    with RedisServer(password="s3cret:/@", maxmemory=64 << 20) as server:
        assert server.url == f"redis://:s3cret%3A%2F%40@127.0.0.1:{server.port}/0"
        assert server.command("CONFIG", "GET", "maxmemory-policy") == [
            b"maxmemory-policy", b"allkeys-lru"]
        assert server.command("CONFIG", "GET", "maxmemory") == [
            b"maxmemory", str(64 << 20).encode()]
    assert gone(server.pid)
