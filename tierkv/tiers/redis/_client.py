"""The redis-py asyncio client of a redis tier: standalone (`url`) or Redis Cluster (`cluster`).

Built from the config alone, connected by the tier's open. Credentials come from the URL or from
the environment variable the config names; neither is ever put into a message: errors name the
server by `RedisTierConfig.display_url`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from tierkv.config import RedisTierConfig
from tierkv.errors import ConfigError
from tierkv.tiers.redis._joined import joining

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster



def import_client() -> Any:
    """The `redis` package, or a `ConfigError` saying how to install it."""
    try:
        import redis.asyncio
        import redis.asyncio.retry
        import redis.backoff
    except ImportError:
        raise ConfigError("the redis tier needs redis-py: pip install 'tierkv[redis]'") from None
    return redis


def make_client(config: RedisTierConfig) -> Redis | RedisCluster:
    """An unconnected client for `config` (connections open on first use)."""
    redis = import_client()
    password = os.environ.get(config.password_env) if config.password_env else None
    options: dict[str, Any] = {
        # no timeouts inside the client: the tier bounds every call itself (`_call`,
        # `_unpooled`: connecting included) with a cut-off that gives back what a stall of the
        # event loop took (`tierkv._deadline`); redis-py's are plain asyncio timers, which a
        # stall longer than the timeout fired in the same loop turn as the answers, failing
        # every call then on the wire (and counting each against the tier)
        "socket_timeout": None,
        "socket_connect_timeout": None,
        "max_connections": config.pool_size,
        # the tier bounds and reports every call itself; retrying inside the client would
        # stretch a call past its timeout
        "retry": redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 0),
    }
    if password is not None:
        options["password"] = password
    if config.url is not None:
        try:
            client: Redis = redis.asyncio.Redis.from_url(config.url, **options)
            # the query's parameters are the connections' keyword arguments: one it does not
            # take (a misspelt ssl_ca_certs) would be a TypeError at the first call, so make
            # a connection now (it connects on first use)
            pool: Any = client.connection_pool  # redis-py leaves make_connection untyped
            pool.connection_class = joining(pool.connection_class)  # the URL chose the class
            pool.make_connection()
        except ValueError as exc:  # redis-py's message quotes the scheme, not the credentials
            raise ConfigError(f"redis tier {config.name!r}: url: {exc}") from None
        except (TypeError, redis.exceptions.RedisError) as exc:  # quotes a name, not a password
            raise ConfigError(f"redis tier {config.name!r}: url: a query parameter redis-py "
                              f"refuses: {exc}") from None
        return client
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    nodes = []
    for node in config.cluster:
        host, _, port = node.rpartition(":")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    # `retry` (no retries) is the cluster client's own retry too
    cluster = RedisCluster(startup_nodes=nodes, **options)
    # the nodes discovered later are built from these arguments, the startup ones already were
    shared: dict[str, Any] = cluster.nodes_manager.connection_kwargs
    shared["connection_class"] = joining(shared["connection_class"])
    for startup in cluster.nodes_manager.startup_nodes.values():  # redis-py 5 to 8 alike
        startup.connection_class = joining(startup.connection_class)
    return cluster


def hiredis_available() -> bool:
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return False
    return bool(HIREDIS_AVAILABLE)
