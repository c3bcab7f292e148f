"""Fixtures of real Redis servers (a plugin of tests/conftest.py): one standalone server and one
three-master cluster for the whole session, each emptied before every test that asks for it,
and a server of a test's own for tests that kill or restart it. Mark such tests `redis`: they
skip where redis-server is not installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierkv.testing.redis_server import RedisClusterServers, RedisServer, redis_missing


def _skip_without_redis() -> None:
    if reason := redis_missing():
        pytest.skip(f"redis: {reason}")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A standalone server shared by the session; stopped at its end."""
    _skip_without_redis()
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's standalone server, emptied (``FLUSHALL``), as ``redis://127.0.0.1:PORT/0``."""
    redis_server.command("FLUSHALL")
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A cluster of three masters shared by the session; stopped at its end."""
    _skip_without_redis()
    with RedisClusterServers() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_nodes(redis_cluster: RedisClusterServers) -> list[str]:
    """The session's cluster with every master emptied, as ``["127.0.0.1:PORT", ...]``."""
    for server in redis_cluster.servers:
        server.command("FLUSHALL")
    return redis_cluster.nodes


@pytest.fixture
def fresh_redis_server() -> Iterator[RedisServer]:
    """A standalone server of this test's own, free to kill and restart; stopped after it."""
    _skip_without_redis()
    with RedisServer() as server:
        yield server
