"""What the engine keeps private: its files (mode 0600), tenants' blocks (identical token ids in
two namespaces never meet), and the shared tier's credentials (never in stats, info or errors)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import hierarchy_config
from tierkv.testing.redis_server import RedisServer

pytestmark = [pytest.mark.pmem, pytest.mark.uring]


async def test_the_pool_and_the_log_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    config = hierarchy_config(tmp_path, ("gpu", "pmem", "nvme"))
    async with tierkv.open(config) as kv:
        await kv.put(b"k", b"v" * 1000)
        await kv.flush()
    for name in ("tierkv.pool", "tierkv.log"):
        mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
        assert mode == 0o600, f"{name} has mode {mode:o}"


async def test_tenants_with_identical_tokens_never_share_a_block(tmp_path: Path) -> None:
    tokens = list(range(64))
    keys = {tenant: tierkv.block_keys(tokens, block_size=16, model="m@1", rope_theta=1e4,
                                      namespace=tenant) for tenant in (b"a", b"b")}
    assert not set(keys[b"a"]) & set(keys[b"b"])
    async with tierkv.open(hierarchy_config(tmp_path, ("gpu", "pmem", "nvme"))) as kv:
        await kv.put_many([(key, b"a%d" % i * 100) for i, key in enumerate(keys[b"a"])])
        assert await kv.get_many(keys[b"b"]) == [None] * 4
        assert await kv.invalidate_model("m@1") == 4  # a's blocks; b never had any


@pytest.mark.redis
async def test_the_shared_tiers_password_is_in_no_stats_no_log_and_no_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret = "s3cret-Pa55word"
    with RedisServer(password=secret) as server:
        config = hierarchy_config(tmp_path, ("gpu",))
        config["tiers"].append({"name": "shared", "kind": "redis", "capacity": "64MiB",
                                "url": server.url})
        async with tierkv.open(config) as kv:
            await kv.put(b"k", b"v")
            await kv.settle()
            assert secret not in repr(kv.stats())
            assert secret not in repr(kv.config)
            server.kill()
            assert await kv.get(b"unknown") is None  # the lookup fails: a miss, logged
        wrong = dict(config["tiers"][-1], url=server.url.replace(secret, "wrong-" + secret))
        server.restart()
        with pytest.raises(tierkv.DeviceError) as failed:
            async with tierkv.open(dict(config, tiers=[config["tiers"][0], wrong])):
                pass
        assert secret not in str(failed.value)
    assert "the shared tier failed a lookup" in caplog.text  # the outage was logged...
    assert secret not in caplog.text  # ...without the credentials


@pytest.mark.parametrize("url", [
    "rediss://user:s3cret@host:6380/0?ssl_ca_certs=/ca.pem&password=s3cret&ssl_password=s3cret",
    "redis://host:6379?password=s3cret&db=2",
    "redis://:s3cret@host:6379",
    "redis://host:6379/0?USERNAME=s3cret&Password=s3cret",
])
def test_a_url_is_shown_without_its_credentials_wherever_they_are(url: str) -> None:
    from tierkv.config.schema import redact_url

    shown = redact_url(url)
    assert "s3cret" not in shown
    assert shown.startswith(url.partition("://")[0] + "://host:")
    if "ssl_ca_certs" in url:
        assert shown.endswith("?ssl_ca_certs=/ca.pem")
