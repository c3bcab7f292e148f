"""The redis tier over TLS, against a real redis-server TLS port (`RedisServer(tls=True)`, its
certificate signed by a throw-away CA of `tierkv.testing.redis_tls`).

A user names the CA in the URL's query, ``rediss://host:port/0?ssl_ca_certs=/path/ca.pem``
(redis-py passes query parameters to its connections: ``ssl_cert_reqs``, ``ssl_certfile`` and
``ssl_keyfile`` the same way). With it the tier, loaded from a config as a user's would be,
stores and serves objects byte for byte; with another CA, or with a plain ``redis://`` URL to
the TLS port, the open fails with a `DeviceError` that shows no password; ``ssl_*`` parameters
on a plain URL, a password in the query and a misspelt parameter are `ConfigError`s."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis.asyncio as aioredis

from tests.tiers.test_redis_tier import cli_config, run_cli
from tierkv import ConfigError, load_config
from tierkv.config import RedisTierConfig
from tierkv.errors import DeviceError
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.testing import payload_bytes
from tierkv.testing.redis_server import RedisServer, command, redis_missing
from tierkv.testing.redis_tls import client_context, make_certificates, openssl_missing
from tierkv.tiers.redis import RedisTier

pytestmark = pytest.mark.redis

PASSWORD = "pw-tls-5e0a91c7d3"
CAPACITY = 8 << 20
#: sizes around TLS's 16 KiB record, and one of many records
SIZES = (0, 1, 16383, 16384, 16385, 300_001)


def _skip_without_tls() -> None:
    if reason := redis_missing() or openssl_missing():
        pytest.skip(f"redis tls: {reason}")


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A directory of the module's own: another CA, config files."""
    with tempfile.TemporaryDirectory(prefix="tierkv-redis-tls-test-") as directory:
        yield Path(directory)


@pytest.fixture(scope="module")
def tls_server() -> Iterator[RedisServer]:
    """A server of this module's own that speaks TLS only, with a password; stopped at the
    module's end."""
    _skip_without_tls()
    with RedisServer(tls=True, password=PASSWORD) as server:
        yield server


@pytest.fixture
def server(tls_server: RedisServer) -> RedisServer:
    tls_server.command("FLUSHALL")
    return tls_server


@pytest.fixture(scope="module")
def other_ca(scratch: Path) -> Path:
    """A CA that did not sign the server's certificate."""
    _skip_without_tls()
    directory = scratch / "other-ca"
    directory.mkdir()
    return make_certificates(directory).ca_file


def with_ca(url: str, ca_file: Path | None) -> str:
    assert ca_file is not None
    return f"{url}?ssl_ca_certs={quote(str(ca_file))}"


def document(url: str) -> dict[str, Any]:
    return {"tiers": [{"name": "l1", "kind": "gpu", "device": "cpu", "capacity": "4MiB",
                       "slot_size": "64KiB"},
                      {"name": "shared", "kind": "redis", "capacity": CAPACITY, "url": url}]}


def loaded(url: str) -> RedisTierConfig:
    """The redis tier of a config naming `url`, as the loader makes it."""
    tier = load_config(document(url)).tiers[1]
    assert isinstance(tier, RedisTierConfig)
    return tier


def meta(data: bytes) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), len(data), 1)


def key_of(i: int) -> bytes:
    return b"\x02redis-tls-" + str(i).encode()


def shows_no_password(exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc)) + repr(exc)
    assert PASSWORD not in text, text


# -- the server --------------------------------------------------------------------------------
def test_the_server_speaks_tls_only(tls_server: RedisServer) -> None:
    assert tls_server.url == f"rediss://:{PASSWORD}@{tls_server.address}/0"
    assert tls_server.ca_file is not None and tls_server.ca_file.is_file()
    assert tls_server.command("PING") == b"PONG"  # over TLS, verified against the CA
    with pytest.raises(OSError):  # plain RESP: the server drops the connection
        command(tls_server.port, "PING", timeout=2.0)
    context = client_context(tls_server.ca_file)
    for name in ("127.0.0.1", "localhost"):
        with socket.create_connection(("127.0.0.1", tls_server.port), timeout=2.0) as raw, \
                context.wrap_socket(raw, server_hostname=name) as sock:
            certificate = sock.getpeercert()
            assert certificate is not None
            assert certificate["subjectAltName"] == (("IP Address", "127.0.0.1"),
                                                     ("DNS", "localhost"))


def test_a_plain_server_is_unchanged() -> None:
    with RedisServer() as plain:
        assert plain.url == f"redis://{plain.address}/0"
        assert plain.ca_file is None
        assert command(plain.port, "PING") == b"PONG"


# -- the tier ----------------------------------------------------------------------------------
async def test_the_tier_round_trips_over_tls(server: RedisServer) -> None:
    config = loaded(with_ca(server.url, server.ca_file))
    assert config.url is not None and "ssl_ca_certs=" in config.url
    tier = RedisTier(config)
    await tier.open()
    raw = aioredis.Redis.from_url(config.url)
    try:
        values = {key_of(i): os.urandom(size) for i, size in enumerate(SIZES)}
        for key, data in values.items():
            await tier.put(key, meta(data), memoryview(data))
        for key, data in values.items():
            got = await tier.get(key)
            assert got is not None and payload_bytes(got[1]) == data
            assert await tier.contains(key)
        missing = key_of(len(SIZES))
        many = await tier.get_many([*values, missing])
        assert [None if got is None else payload_bytes(got[1]) for got in many] == [
            *values.values(), None]
        # on this server, in the tier's records: read past the tier with a client of its own
        assert await raw.exists(*(tier.server_key(key) for key in values)) == len(values)
        first = key_of(0)
        assert await tier.delete(first)
        assert await tier.get(first) is None
        assert not await raw.exists(tier.server_key(first))
        assert tier.stats()["errors"] == 0
        described = tier.describe()["server"]
        assert described.startswith(f"rediss://{server.address}/0?ssl_ca_certs=")
        assert PASSWORD not in repr(tier.describe()) + repr(config)
    finally:
        await raw.aclose()
        await tier.close()


async def test_another_ca_fails_the_open(server: RedisServer, other_ca: Path) -> None:
    tier = RedisTier(loaded(with_ca(server.url, other_ca)))
    with pytest.raises(DeviceError) as caught:
        await tier.open()
    await tier.close()
    assert "certificate verify failed" in str(caught.value).lower()
    assert str(caught.value).startswith(f"redis tier 'shared': rediss://{server.address}/0?")
    shows_no_password(caught.value)


async def test_no_ca_fails_the_open(server: RedisServer) -> None:
    # the system's CAs did not sign it either
    tier = RedisTier(loaded(server.url))
    with pytest.raises(DeviceError) as caught:
        await tier.open()
    await tier.close()
    assert "certificate verify failed" in str(caught.value).lower()
    shows_no_password(caught.value)


async def test_a_plain_url_to_the_tls_port_fails_the_open(server: RedisServer) -> None:
    url = server.url.replace("rediss://", "redis://", 1)
    tier = RedisTier(loaded(url))
    with pytest.raises(DeviceError) as caught:
        await tier.open()
    await tier.close()
    assert str(caught.value).startswith(f"redis tier 'shared': redis://{server.address}/0")
    shows_no_password(caught.value)


def test_info_over_tls(server: RedisServer, scratch: Path) -> None:
    path = cli_config(scratch, with_ca(server.url, server.ca_file))
    result = run_cli("info", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert "reachable: yes" in result.stdout
    assert f"server: rediss://{server.address}/0?ssl_ca_certs=" in result.stdout
    assert PASSWORD not in result.stdout + result.stderr


# -- what the config refuses -------------------------------------------------------------------
@pytest.mark.parametrize("parameter", ["ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile",
                                       "ssl_keyfile"])
def test_ssl_parameters_need_rediss(parameter: str) -> None:
    for url in (f"redis://127.0.0.1:6379/0?{parameter}=x", f"unix:///run/r.sock?{parameter}=x"):
        with pytest.raises(ConfigError) as caught:
            loaded(url)
        assert str(caught.value).startswith("tiers[1].url: "), str(caught.value)
        assert parameter in str(caught.value) and "rediss://" in str(caught.value)


@pytest.mark.parametrize("parameter", ["password", "ssl_password"])
def test_a_password_in_the_query_is_refused_unshown(parameter: str) -> None:
    with pytest.raises(ConfigError) as caught:
        loaded(f"rediss://127.0.0.1:6379/0?ssl_ca_certs=/ca.pem&{parameter}={PASSWORD}")
    assert str(caught.value).startswith("tiers[1].url: "), str(caught.value)
    assert parameter in str(caught.value)
    shows_no_password(caught.value)


def test_every_tls_parameter_passes_the_loader() -> None:
    url = ("rediss://127.0.0.1:6379/0?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required"
           "&ssl_certfile=/client.pem&ssl_keyfile=/client.key")
    assert loaded(url).url == url


def test_a_misspelt_parameter_is_a_config_error_at_load() -> None:
    # no server is asked: the client refuses the parameter before connecting
    with pytest.raises(ConfigError) as caught:
        loaded(f"rediss://:{PASSWORD}@127.0.0.1:1/0?ssl_ca_cert=/ca.pem")
    assert str(caught.value).startswith("tiers[1].url: "), str(caught.value)
    assert "ssl_ca_cert" in str(caught.value)
    shows_no_password(caught.value)


async def test_a_misspelt_parameter_of_a_config_built_in_code_is_a_config_error_at_open(
) -> None:
    url = f"rediss://:{PASSWORD}@127.0.0.1:1/0?ssl_ca_cert=/ca.pem"
    tier = RedisTier(RedisTierConfig("shared", 1 << 20, url=url))
    with pytest.raises(ConfigError) as caught:
        await tier.open()
    await tier.close()
    assert str(caught.value).startswith("redis tier 'shared': url: "), str(caught.value)
    assert "ssl_ca_cert" in str(caught.value)
    shows_no_password(caught.value)
