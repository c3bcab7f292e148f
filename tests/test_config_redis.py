"""The ``kind = "redis"`` tier table (`tierkv.config._redis`) and its place in the hierarchy.

As in tests/test_config.py, a `ConfigError` is checked by type and by the key path its message
starts with. Nothing here connects to a server (the loader never does), so no test needs
redis-server."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tierkv import ConfigError, load_config
from tierkv.config import GpuTierConfig, RedisTierConfig
from tierkv.config._redis import MAX_SERVER_MS

PASSWORD = "pw-3b9d0c61e2"
MiB = 1 << 20


def document(**redis: Any) -> dict[str, Any]:
    """A gpu tier on the CPU, then a redis tier with `redis`'s keys (a url by default)."""
    tier: dict[str, Any] = {"name": "shared", "kind": "redis", "capacity": "64MiB"}
    tier.update(redis if redis else {"url": "redis://127.0.0.1:6379/0"})
    return {"tiers": [{"name": "l1", "kind": "gpu", "device": "cpu", "capacity": "4MiB",
                       "slot_size": "64KiB"}, tier]}


def fails(doc: dict[str, Any], key_path: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    assert str(info.value).startswith(f"{key_path}: "), str(info.value)
    return info.value


def test_defaults() -> None:
    config = load_config(document())
    assert isinstance(config.tiers[0], GpuTierConfig)
    tier = config.tiers[1]
    assert isinstance(tier, RedisTierConfig)
    assert tier == RedisTierConfig("shared", 64 * MiB, url="redis://127.0.0.1:6379/0")
    assert (tier.cluster, tier.password_env, tier.key_prefix, tier.ttl) == ((), None, "tierkv:",
                                                                             None)
    assert (tier.pool_size, tier.timeout, tier.batch, tier.retention) == (16, 1.0, 256, 86400.0)
    assert (tier.latency, tier.bandwidth) == (None, None)
    assert tier.display_url == "redis://127.0.0.1:6379/0"


def test_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERKV_TEST_PASSWORD", PASSWORD)
    tier = load_config(document(
        url="rediss://cache.internal:6380/2", password_env="TIERKV_TEST_PASSWORD",
        key_prefix="prod-a:", ttl="200ms", pool_size=8, timeout="250ms", batch=4,
        retention="1h")).tiers[1]
    assert tier == RedisTierConfig(
        "shared", 64 * MiB, url="rediss://cache.internal:6380/2",
        password_env="TIERKV_TEST_PASSWORD", key_prefix="prod-a:", ttl=0.2, pool_size=8,
        timeout=0.25, batch=4, retention=3600.0)


@pytest.mark.parametrize("url", ["redis://h:1/0", "rediss://h:1", "unix:///run/redis.sock"])
def test_schemes(url: str) -> None:
    tier = load_config(document(url=url)).tiers[1]
    assert isinstance(tier, RedisTierConfig) and tier.url == url


def test_cluster() -> None:
    nodes = ["127.0.0.1:7000", "redis-b.internal:7001", "[::1]:7002"]
    tier = load_config(document(cluster=nodes)).tiers[1]
    assert isinstance(tier, RedisTierConfig)
    assert tier.url is None and tier.cluster == tuple(nodes)
    assert tier.display_url == "cluster " + ",".join(nodes)


# -- errors --------------------------------------------------------------------------------------
def test_url_and_cluster_both() -> None:
    fails(document(url="redis://h:1", cluster=["h:1"]), "tiers[1].url")


def test_neither_url_nor_cluster() -> None:
    doc = document()
    del doc["tiers"][1]["url"]
    fails(doc, "tiers[1].url")


@pytest.mark.parametrize("url", ["http://h:1", "h:1", "", 6379])
def test_bad_url(url: Any) -> None:
    fails(document(url=url), "tiers[1].url")


@pytest.mark.parametrize("url", [
    "redis://h:abc", "redis://h:99999", "redis://h:0", "redis://[::1", "redis://[::1:6379",
    "redis://127.0.0.1:1/0?socket_timeout=abc", "redis://127.0.0.1:1/0?max_connections=x",
    "redis://127.0.0.1:1/0?bogus=1", "unix:///run/redis.sock?db=abc",
    # these crashed the CLI with redis-py's own errors, or loaded and failed at open
    "rediss://127.0.0.1:1/0?ssl_cert_reqs=bogus", "redis://127.0.0.1:1/0?protocol=9",
    "redis://127.0.0.1:1/0?retry=x", "redis://127.0.0.1:1/0?decode_responses=true",
    "redis://127.0.0.1:1/0?encoding=nonexistent-codec",
    # database numbers redis-py took for 0 (abc) or refused only at open
    "redis://127.0.0.1:1/abc", "redis://127.0.0.1:1/-1", "rediss://127.0.0.1:1/0/1",
], ids=repr)
def test_a_url_the_client_would_refuse_is_refused_at_load(url: str) -> None:
    # these loaded, then failed at open (naming tiers.shared.url) or with a traceback
    pytest.importorskip("redis")
    fails(document(url=url), "tiers[1].url")


def test_a_url_refused_at_load_is_not_echoed() -> None:
    pytest.importorskip("redis")
    for url in (f"redis://:{PASSWORD}@h:abc", f"redis://:{PASSWORD}@h/0?socket_timeout=x",
                f"redis://:{PASSWORD}@[::1"):
        assert PASSWORD not in str(fails(document(url=url), "tiers[1].url"))


@pytest.mark.parametrize(("key", "value"), [
    ("ttl", "0.5ms"), ("ttl", "999us"), ("ttl", 0.0004), ("ttl", 1e30), ("ttl", "9" * 30 + "h"),
    ("timeout", 1e30), ("retention", 1e306), ("retention", "9" * 30 + "h"),
], ids=repr)
def test_a_duration_the_server_refuses_is_refused(key: str, value: Any) -> None:
    # a ttl of 0.5ms went out as PX 0 and 1e30 as an expiry past 64 bits: every put failed
    fails(document(url="redis://127.0.0.1:6379/0", **{key: value}), f"tiers[1].{key}")


def test_the_shortest_and_longest_ttl_load() -> None:
    for ttl, seconds in (("1ms", 0.001), (f"{MAX_SERVER_MS}ms", MAX_SERVER_MS / 1000)):
        tier = load_config(document(url="redis://127.0.0.1:6379/0", ttl=ttl)).tiers[1]
        assert isinstance(tier, RedisTierConfig) and tier.ttl == seconds


def test_a_bad_url_is_not_echoed() -> None:
    error = fails(document(url=f"http://:{PASSWORD}@h:1"), "tiers[1].url")
    assert PASSWORD not in str(error)


@pytest.mark.parametrize("cluster", [[], "h:1", ["h"], ["h:"], ["h:0"], ["h:65536"],
                                     ["h:1", "no port"], [7000], ["redis://h:1"]],
                         ids=repr)
def test_bad_cluster(cluster: Any) -> None:
    fails(document(cluster=cluster), "tiers[1].cluster")


def test_redis_tier_not_last() -> None:
    doc = document()
    doc["tiers"].append({"name": "l2", "kind": "gpu", "device": "cpu", "capacity": "4MiB",
                         "slot_size": "64KiB"})
    fails(doc, "tiers[1].kind")


def test_redis_tier_first() -> None:
    doc = document()
    doc["tiers"] = doc["tiers"][1:]
    fails(doc, "tiers[0].kind")


def test_two_redis_tiers() -> None:
    doc = document()
    doc["tiers"].append({**copy.deepcopy(doc["tiers"][1]), "name": "again"})
    fails(doc, "tiers[1].kind")


@pytest.mark.parametrize("prefix", ["{tenant}:", "a}", "x" * 257, ""])
def test_bad_key_prefix(prefix: str) -> None:
    fails(document(url="redis://h:1", key_prefix=prefix), "tiers[1].key_prefix")


def test_password_env_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERKV_TEST_UNSET", raising=False)
    fails(document(url="redis://h:1", password_env="TIERKV_TEST_UNSET"), "tiers[1].password_env")


@pytest.mark.parametrize("name", ["", "1ABC", "has space", 5])
def test_password_env_not_a_name(name: Any) -> None:
    fails(document(url="redis://h:1", password_env=name), "tiers[1].password_env")


@pytest.mark.parametrize(("key", "value"), [("pool_size", 0), ("batch", 0), ("timeout", "0s"),
                                            ("ttl", "soon"), ("retention", -1)])
def test_bad_bounds(key: str, value: Any) -> None:
    fails(document(url="redis://h:1", **{key: value}), f"tiers[1].{key}")


@pytest.mark.parametrize("key", ["bogus", "path", "slot_size"])
def test_unknown_key(key: str) -> None:
    fails(document(url="redis://h:1", **{key: "x"}), f"tiers[1].{key}")


def test_the_password_in_the_url_is_never_shown() -> None:
    url = f"redis://tenant:{PASSWORD}@cache.internal:6379/0"
    config = load_config(document(url=url))
    tier = config.tiers[1]
    assert isinstance(tier, RedisTierConfig) and tier.url == url
    assert PASSWORD not in repr(config)
    assert PASSWORD not in repr(tier)
    assert PASSWORD not in tier.display_url
    assert tier.display_url == "redis://cache.internal:6379/0"


@pytest.mark.parametrize(("url", "says"), [
    ("redis://127.0.0.1:1/0?socket_timeout=5", "the tier's timeout key sets it"),
    ("redis://127.0.0.1:1/0?socket_connect_timeout=5", "the tier's timeout key sets it"),
    ("redis://127.0.0.1:1/0?max_connections=2", "the tier's pool_size key sets it"),
    ("redis://127.0.0.1:1/0?retry_on_timeout=yes", "tier's to set"),
    ("redis://127.0.0.1:1/0?health_check_interval=-5", "a whole number, 0 or more"),
    ("redis://127.0.0.1:1/0?db=-1", "a whole number, 0 or more"),
    ("unix:///run/redis.sock?socket_read_size=-4096", "a whole number, 0 or more"),
], ids=repr)
def test_a_url_parameter_the_tier_sets_or_a_negative_count_is_refused(url: str, says: str
                                                                       ) -> None:
    # these loaded and silently overrode the tier's own bounds (a url's socket_timeout and
    # max_connections win over what the tier passes), or misbehaved at open
    assert says in str(fails(document(url=url), "tiers[1].url"))


def test_a_password_in_the_url_and_in_password_env_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the url's password won, silently, over the one named by password_env
    monkeypatch.setenv("TIERKV_TEST_PASSWORD", "from-env")
    message = str(fails(document(url=f"redis://:{PASSWORD}@h:1",
                                 password_env="TIERKV_TEST_PASSWORD"), "tiers[1].password_env"))
    assert "one place" in message and PASSWORD not in message
    load_config(document(url="redis://user@h:1", password_env="TIERKV_TEST_PASSWORD"))
