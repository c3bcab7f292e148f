"""The redis tier beyond the conformance suite: what it refuses to serve (values planted,
truncated or copied by hand on the server, another deployment's key prefix, a record another
writer replaced), pipelined batches, server-side expiry, its timeout against a frozen server,
a server killed and restarted, passwords (which never show in a message, a repr or `tierkv
info`) and a server that is not there.

Values are planted and read back with a plain redis-py client under `RedisTier.server_key`,
bypassing the tier under test."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis

from tierkv.config import RedisTierConfig, load_config
from tierkv.config._redis import MAX_SERVER_MS
from tierkv.errors import DeviceError
from tierkv.formats.value import ObjectMeta, ValueKind, payload_view
from tierkv.testing import payload_bytes
from tierkv.testing.redis_server import RedisClusterServers, RedisServer
from tierkv.tiers.redis import RedisTier

pytestmark = pytest.mark.redis

T = TypeVar("T")
CAPACITY = 1 << 20
PASSWORD = "pw-7c1e9a4f0b"
PASSWORD_ENV = "TIERKV_TEST_REDIS_PASSWORD"


def meta(data: bytes, generation: int = 1) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), len(data), generation)


def key_of(i: int) -> bytes:
    return b"\x02redis-tier-" + str(i).encode()


def shared(url: str, **options: Any) -> RedisTierConfig:
    return RedisTierConfig("shared", CAPACITY, url=url, **options)


async def put(tier: RedisTier, key: bytes, data: bytes, generation: int = 1) -> None:
    await tier.put(key, meta(data, generation), memoryview(data))


async def value_of(tier: RedisTier, key: bytes) -> bytes | None:
    got = await tier.get(key)
    return None if got is None else payload_bytes(got[1])


async def after_one_failure(call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, once more if it fails: the first call after the server came back may still
    find the connection that broke (redis-py reconnects on the next)."""
    try:
        return await call()
    except DeviceError:
        return await call()


async def eventually(condition: Callable[[], bool], within: float = 3.0) -> None:
    """Wait until `condition()` holds: it follows a server process, which signals nothing."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client of the session's server, beside the tier."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def tier(redis_url: str) -> AsyncIterator[RedisTier]:
    tier = RedisTier(shared(redis_url))
    await tier.open()
    try:
        yield tier
    finally:
        await tier.close()


@pytest.fixture
def password_server() -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD) as server:
        yield server


# -- what is never served ----------------------------------------------------------------------
async def test_a_planted_value_is_a_counted_miss(tier: RedisTier, raw: aioredis.Redis) -> None:
    await put(tier, key_of(0), b"genuine")
    await raw.set(tier.server_key(key_of(0)), b"planted by hand, no record at all")
    assert await tier.get(key_of(0)) is None
    assert tier.stats()["corrupt"] == 1
    assert key_of(0) not in set(tier.keys())  # the miss let it go
    # a key it never held: a lookup decodes it, and refuses it the same way
    await raw.set(tier.server_key(key_of(1)), b"\x00" * 64)
    assert await tier.fetch_many([key_of(1)]) == [None]
    assert tier.stats()["corrupt"] == 2
    assert tier.stats()["lookup_hits"] == 0


async def test_a_value_of_another_type_is_a_miss_of_that_key_only(tier: RedisTier,
                                                                  raw: aioredis.Redis) -> None:
    """A list or a hash under one key (written by something else) is that key's counted miss:
    not a failure of the server, of a whole pipelined batch, or of the tier's breaker."""
    for i in range(4):
        await put(tier, key_of(i), b"value %d" % i)
    await raw.delete(tier.server_key(key_of(1)))
    await raw.rpush(tier.server_key(key_of(1)), b"a list")
    await raw.hset(tier.server_key(key_of(7)), b"field", b"a hash")
    got = await tier.get_many([key_of(i) for i in range(4)])
    assert [None if g is None else bytes(payload_view(g[1])) for g in got] == [
        b"value 0", None, b"value 2", b"value 3"]
    records = await tier.fetch_many([key_of(7), key_of(2)])
    assert records[0] is None and records[1] is not None
    await put(tier, key_of(5), b"five")
    await raw.delete(tier.server_key(key_of(5)))
    await raw.sadd(tier.server_key(key_of(5)), b"a set")
    assert await tier.get(key_of(5)) is None
    assert tier.stats()["errors"] == 0
    assert tier.stats()["corrupt"] == 3


@pytest.mark.parametrize("keep", [-1, 12], ids=["payload-short", "header-only"])
async def test_a_truncated_record_is_a_counted_miss(tier: RedisTier, raw: aioredis.Redis,
                                                    keep: int) -> None:
    await put(tier, key_of(2), b"x" * 1000)
    server_key = tier.server_key(key_of(2))
    record = await raw.get(server_key)
    assert isinstance(record, bytes) and record.endswith(b"x" * 1000)
    await raw.set(server_key, record[:keep])
    assert await tier.get(key_of(2)) is None
    assert await tier.fetch_many([key_of(2)]) == [None]
    assert tier.stats()["corrupt"] == 2


async def test_a_record_copied_from_another_key_is_a_miss(tier: RedisTier,
                                                          raw: aioredis.Redis) -> None:
    await put(tier, key_of(3), b"three")
    await put(tier, key_of(4), b"four")
    foreign = await raw.get(tier.server_key(key_of(3)))
    assert foreign is not None
    await raw.set(tier.server_key(key_of(4)), foreign)
    assert await tier.get(key_of(4)) is None
    assert await tier.fetch_many([key_of(4)]) == [None]
    assert tier.stats()["corrupt"] == 2
    assert await value_of(tier, key_of(3)) == b"three"


async def test_a_record_another_writer_replaced_is_superseded(redis_url: str) -> None:
    first, second = RedisTier(shared(redis_url)), RedisTier(shared(redis_url))
    await first.open()
    await second.open()
    try:
        await put(first, key_of(5), b"first's")
        await put(second, key_of(5), b"second's")
        assert await first.get(key_of(5)) is None  # held, but no longer its record
        assert first.stats()["superseded"] == 1
        assert await value_of(second, key_of(5)) == b"second's"
    finally:
        await first.close()
        await second.close()


async def test_another_key_prefix_is_never_served(redis_url: str, raw: aioredis.Redis) -> None:
    a = RedisTier(shared(redis_url, key_prefix="deploy-a:"))
    b = RedisTier(shared(redis_url, key_prefix="deploy-b:"))
    await a.open()
    await b.open()
    try:
        await put(a, key_of(6), b"a's value")
        assert await b.fetch_many([key_of(6)]) == [None]
        assert await b.get(key_of(6)) is None
        await put(b, key_of(6), b"b's value")
        assert await value_of(a, key_of(6)) == b"a's value"
        assert await value_of(b, key_of(6)) == b"b's value"
        assert set(await raw.keys("*o:*")) == {b"deploy-a:o:" + key_of(6),
                                                b"deploy-b:o:" + key_of(6)}
    finally:
        await a.close()
        await b.close()


async def test_delete_many_deletes_on_the_server(redis_url: str, raw: aioredis.Redis) -> None:
    tier = RedisTier(shared(redis_url, batch=4))

    async def objects() -> int:
        return int(await raw.dbsize())

    await tier.open()
    try:
        await check_delete_many(tier, objects)
    finally:
        await tier.close()


async def test_delete_many_deletes_on_a_cluster(redis_cluster: RedisClusterServers,
                                                redis_cluster_nodes: list[str]) -> None:
    tier = RedisTier(RedisTierConfig("shared", CAPACITY, cluster=tuple(redis_cluster_nodes),
                                     batch=4))

    async def objects() -> int:
        sizes = [server.command("DBSIZE") for server in redis_cluster.servers]
        return sum(size for size in sizes if isinstance(size, int))

    await tier.open()
    try:
        await check_delete_many(tier, objects)
    finally:
        await tier.close()


async def check_delete_many(tier: RedisTier, objects: Callable[[], Awaitable[int]]) -> None:
    """`delete_many` of keys held and keys another writer put: all gone from the server."""
    fleet = await objects()  # the fleet log's own keys (its epoch)
    keys = [key_of(200 + i) for i in range(10)]
    for key in keys:
        await put(tier, key, key)
    assert await objects() == fleet + 10
    tier.forget(keys[0])  # held no longer: an invalidation deletes it all the same
    before = tier.stats()["round_trips"]
    await tier.delete_many(keys)
    assert tier.stats()["round_trips"] - before == 3
    assert await objects() == fleet
    assert set(tier.keys()) == set() and tier.used == 0


async def test_calls_beyond_the_pool_wait_for_a_connection(redis_url: str) -> None:
    """With one connection, which the follower's blocking read of the log holds most of the
    time, concurrent calls queue for it: none fails."""
    tier = RedisTier(shared(redis_url, pool_size=1, timeout=0.4))
    await tier.open()
    try:
        keys = [key_of(300 + i) for i in range(8)]
        await asyncio.gather(*(put(tier, key, key * 3) for key in keys))
        assert await asyncio.gather(*(value_of(tier, key) for key in keys)) == [
            key * 3 for key in keys]
        assert tier.stats()["errors"] == 0
    finally:
        await tier.close()


# -- batches and expiry --------------------------------------------------------------------------
async def test_fetch_many_and_get_many_pipeline_per_batch(redis_url: str) -> None:
    writer, reader = RedisTier(shared(redis_url)), RedisTier(shared(redis_url, batch=4))
    await writer.open()
    await reader.open()
    try:
        keys = [key_of(100 + i) for i in range(10)]
        for i, key in enumerate(keys):
            await put(writer, key, bytes([i]) * (10 + i))
        before = reader.stats()["round_trips"]
        records = await reader.fetch_many(keys)
        assert reader.stats()["round_trips"] - before == 3
        assert reader.stats()["lookups"] == 10 and reader.stats()["lookup_hits"] == 10
        for i, (key, record) in enumerate(zip(keys, records, strict=True)):
            assert record is not None
            assert bytes(record.payload) == bytes([i]) * (10 + i)
            reader.adopt(key, 1, record)
        before = reader.stats()["round_trips"]
        found = await reader.get_many([*keys, key_of(999)])
        assert reader.stats()["round_trips"] - before == 3  # the key not held costs nothing
        assert found[-1] is None
        assert [payload_bytes(f[1]) for f in found[:-1] if f is not None] == [
            bytes([i]) * (10 + i) for i in range(10)]
    finally:
        await writer.close()
        await reader.close()


async def test_the_server_expires_objects_after_ttl(redis_url: str, raw: aioredis.Redis) -> None:
    tier = RedisTier(shared(redis_url, ttl=0.2))
    await tier.open()
    try:
        await put(tier, key_of(7), b"short-lived")
        assert 0 < await raw.pttl(tier.server_key(key_of(7))) <= 200
        assert await value_of(tier, key_of(7)) == b"short-lived"
        await asyncio.sleep(0.4)
        assert await tier.get(key_of(7)) is None
        assert not await raw.exists(tier.server_key(key_of(7)))
    finally:
        await tier.close()


@pytest.mark.parametrize("ttl", ["1ms", f"{MAX_SERVER_MS}ms"])
async def test_the_server_takes_the_ttls_the_loader_accepts(
    redis_url: str, raw: aioredis.Redis, ttl: str
) -> None:
    document = {"tiers": [
        {"name": "l1", "kind": "gpu", "device": "cpu", "capacity": "1MiB", "slot_size": "64KiB"},
        {"name": "shared", "kind": "redis", "capacity": "1MiB", "url": redis_url, "ttl": ttl}]}
    config = load_config(document).tiers[1]
    assert isinstance(config, RedisTierConfig)
    tier = RedisTier(config)
    await tier.open()
    try:
        await put(tier, key_of(8), b"bounded")  # refused by the server: a DeviceError
        assert await raw.pttl(tier.server_key(key_of(8))) in range(-2, MAX_SERVER_MS + 1)
    finally:
        await tier.close()


# -- a server that fails -------------------------------------------------------------------------
async def test_a_frozen_server_times_out_and_recovers(fresh_redis_server: RedisServer) -> None:
    tier = RedisTier(shared(fresh_redis_server.url, timeout=0.2))
    await tier.open()
    try:
        await put(tier, key_of(8), b"before the freeze")
        os.kill(fresh_redis_server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(DeviceError):
                await tier.get(key_of(8))
            assert 0.15 <= time.monotonic() - started < 1.5
            with pytest.raises(DeviceError):
                await put(tier, key_of(9), b"during the freeze")
        finally:
            os.kill(fresh_redis_server.pid, signal.SIGCONT)
        assert await after_one_failure(lambda: value_of(tier, key_of(8))) == b"before the freeze"
        await put(tier, key_of(9), b"after the thaw")
        assert await value_of(tier, key_of(9)) == b"after the thaw"
        assert tier.stats()["errors"] >= 2
        await eventually(lambda: bool(tier.stats()["log_connected"]))
    finally:
        await tier.close()


async def test_a_stalled_loop_cuts_off_no_call_in_flight(redis_url: str) -> None:
    """A stall of the event loop longer than the timeout, while gets and puts are on the wire,
    is not a slow server: the answers came in meanwhile (redis-py's own socket timeout, an
    asyncio timer, once fired in the same loop turn and failed every call in flight; its
    connect timeout, the same for a call opening a connection)."""
    tier = RedisTier(shared(redis_url, timeout=0.2))
    await tier.open()
    try:
        values = {key_of(100 + i): os.urandom(4096 + i) for i in range(16)}
        for key, data in list(values.items())[:8]:
            await put(tier, key, data)
        await asyncio.gather(*(value_of(tier, key) for key in values))  # connections opened
        gets = [value_of(tier, key) for key in list(values)[:8]]
        puts = [put(tier, key, data) for key, data in list(values.items())[8:]]
        calls = asyncio.gather(*gets, *puts)
        await asyncio.sleep(0)  # the calls send their commands
        await asyncio.sleep(0)
        # the loop is held up while the answers come in
        asyncio.get_running_loop().call_soon(time.sleep, 0.5)
        got = await calls
        assert got[:8] == list(values.values())[:8]
        assert [await value_of(tier, key) for key in values] == list(values.values())
        assert tier.stats()["errors"] == 0
    finally:
        await tier.close()


async def test_a_server_killed_and_restarted(fresh_redis_server: RedisServer) -> None:
    server = fresh_redis_server
    tier = RedisTier(shared(server.url, timeout=0.5))
    await tier.open()
    try:
        await put(tier, key_of(10), b"lost with the server")
        server.kill()
        with pytest.raises(DeviceError):
            await tier.get(key_of(10))
        with pytest.raises(DeviceError):
            await put(tier, key_of(11), b"nowhere to go")
        with pytest.raises(DeviceError):
            await tier.fetch_many([key_of(10)])
        await asyncio.to_thread(server.restart)
        await after_one_failure(lambda: put(tier, key_of(11), b"after the restart"))
        assert await value_of(tier, key_of(11)) == b"after the restart"
        # persistence is off: the crash took the object, and a get says so (a miss)
        assert await tier.get(key_of(10)) is None
        assert set(tier.keys()) == {key_of(11)}
        await eventually(lambda: bool(tier.stats()["log_connected"]))
        assert tier.stats()["log_reconnects"] >= 1
    finally:
        await tier.close()


async def test_a_missing_server_fails_the_open() -> None:
    tier = RedisTier(shared(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5))
    with pytest.raises(DeviceError):
        await tier.open()
    await tier.close()


def connected_clients(server: RedisServer) -> int:
    info = server.command("INFO", "clients")
    assert isinstance(info, bytes)
    line = next(line for line in info.splitlines() if line.startswith(b"connected_clients:"))
    return int(line.split(b":")[1])


async def test_an_open_that_fails_after_connecting_leaves_no_connection(
        fresh_redis_server: RedisServer) -> None:
    """The fleet's log key holds a string (another program's): the open answers its ping, then
    fails reading the log, and closes the connections it made on the way."""
    server = fresh_redis_server
    tier = RedisTier(shared(server.url))
    server.command("SET", tier.config.key_prefix.encode() + b"{fleet}:invalidations", "x")
    before = connected_clients(server)  # this query's own connection only
    with pytest.raises(DeviceError):
        await tier.open()
    assert connected_clients(server) == before


async def test_a_unix_socket_url() -> None:
    with RedisServer(unix_socket=True) as server:
        assert server.unix_socket is not None
        tier = RedisTier(shared(f"unix://{server.unix_socket}"))
        await tier.open()
        try:
            await put(tier, key_of(12), b"over a unix socket")
            assert await value_of(tier, key_of(12)) == b"over a unix socket"
        finally:
            await tier.close()


# -- passwords -----------------------------------------------------------------------------------
async def test_password_from_the_environment(password_server: RedisServer,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    config = shared(f"redis://{password_server.address}/0", password_env=PASSWORD_ENV)
    tier = RedisTier(config)
    await tier.open()
    try:
        await put(tier, key_of(13), b"authenticated")
        assert await value_of(tier, key_of(13)) == b"authenticated"
        assert PASSWORD not in repr(tier.describe())
        assert PASSWORD not in repr(config)
    finally:
        await tier.close()


@pytest.mark.parametrize("how", ["wrong-env", "wrong-url", "none"])
async def test_a_wrong_password_fails_the_open_and_is_never_shown(
        password_server: RedisServer, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    wrong = "pw-wrong-5d2b8e"
    address = password_server.address
    if how == "wrong-env":
        monkeypatch.setenv(PASSWORD_ENV, wrong)
        config = shared(f"redis://{address}/0", password_env=PASSWORD_ENV)
    elif how == "wrong-url":
        config = shared(f"redis://:{wrong}@{address}/0")
    else:
        config = shared(f"redis://{address}/0")
    tier = RedisTier(config)
    with pytest.raises(DeviceError) as caught:
        await tier.open()
    await tier.close()
    for secret in (PASSWORD, wrong):
        assert secret not in str(caught.value)
        assert secret not in repr(config)
        assert secret not in repr(tier.describe())


async def test_a_password_in_the_url_is_never_shown(password_server: RedisServer) -> None:
    assert PASSWORD in password_server.url
    config = shared(password_server.url)
    tier = RedisTier(config)
    await tier.open()
    try:
        await put(tier, key_of(14), b"authenticated by url")
        assert await value_of(tier, key_of(14)) == b"authenticated by url"
        assert PASSWORD not in repr(config)
        assert PASSWORD not in repr(tier.describe())
    finally:
        await tier.close()
    password_server.kill()
    down = RedisTier(config)
    with pytest.raises(DeviceError) as caught:
        await down.open()
    await down.close()
    assert PASSWORD not in str(caught.value)


# -- the command line ----------------------------------------------------------------------------
def cli_config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "shared.toml"
    path.write_text(f"""
[[tiers]]
name = "l1"
kind = "gpu"
device = "cpu"
capacity = "4MiB"
slot_size = "64KiB"

[[tiers]]
name = "shared"
kind = "redis"
capacity = "4MiB"
url = "{url}"
timeout = "500ms"
""")
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierkv.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_info_never_shows_the_password(tmp_path: Path, password_server: RedisServer) -> None:
    result = run_cli("info", "--config", str(cli_config(tmp_path, password_server.url)))
    assert result.returncode == 0, result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    assert f"server: redis://{password_server.address}/0" in result.stdout
    assert "reachable: yes" in result.stdout


def test_a_missing_server_is_a_one_line_cli_error(tmp_path: Path) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    result = run_cli("bench", "--config", str(cli_config(tmp_path, url)), "--quick")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("tierkv: error:")
    assert PASSWORD not in result.stdout + result.stderr
