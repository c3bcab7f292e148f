"""Parsing of a ``kind = "redis"`` tier table (the shared tier): where the server is, how to
authenticate, and the client's bounds. Nothing here connects; the tier checks the server when
it opens."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, unquote_plus, urlsplit

from tierkv.config.schema import RedisTierConfig

if TYPE_CHECKING:
    from tierkv.config._table import Table

_SCHEMES = ("redis://", "rediss://", "unix://")
_NODE = re.compile(r"^(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: query parameters refused in a url: `display_url` (messages, `tierkv info`) shows the query
_SECRET_PARAMETERS = ("password", "ssl_password")
#: query parameters that change what the client answers or how it retries, waits and speaks:
#: the tier reads bytes, retries through its own breaker, bounds each call itself and speaks
#: RESP2 (decode_responses=true made the fleet's survey fail at open with a
#: UnicodeDecodeError; a url's socket_timeout or max_connections silently overrode the tier's
#: `timeout` handling and `pool_size`); the value: the tier's key that sets it instead, if any
_TIER_PARAMETERS = {
    "decode_responses": None, "encoding": None, "encoding_errors": None, "retry": None,
    "retry_on_timeout": None, "retry_on_error": None, "connection_class": None,
    "parser_class": None, "protocol": None, "socket_timeout": "timeout",
    "socket_connect_timeout": "timeout", "timeout": "timeout", "max_connections": "pool_size",
}
#: query parameters that redis-py reads as numbers without bounds: a negative one loaded and
#: then misbehaved (health_check_interval=-5 sent a PING before every command)
_COUNT_PARAMETERS = ("db", "socket_read_size", "health_check_interval", "ssl_min_version")
#: query parameters of a url that name files, which redis-py hands to the ssl module
_FILE_PARAMETERS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
#: the longest key prefix (a key's prefix is repeated in every key on the server)
MAX_KEY_PREFIX = 256
#: the most milliseconds a duration sent to the server may count (SET PX, XREAD BLOCK): a
#: signed 64-bit count, less headroom for the server's clock, which it adds to it (an
#: expiry past 2**63 - 1 ms since 1970 is refused)
MAX_SERVER_MS = 1 << 62


def parse_redis_tier(t: Table, name: str, capacity: int, directory: Path | None
                     ) -> RedisTierConfig:
    """The redis tier of table `t`; `directory`: where the relative files its url names are
    (the config file's), None to leave them relative."""
    url = t.raw("url", None)
    cluster = t.raw("cluster", None)
    if (url is None) == (cluster is None):
        raise t.error("url", 'give exactly one of url = "redis://host:port" and '
                             'cluster = ["host:port", ...]')
    nodes: tuple[str, ...] = ()
    if url is not None:
        if not isinstance(url, str) or not url.startswith(_SCHEMES):
            # the value itself is not echoed: it may carry a password
            raise t.error("url", "expected a redis://, rediss:// or unix:// URL")
        if directory is not None:
            url = _anchored(url, directory)
        _check_url(t, url)
    else:
        nodes = _cluster_nodes(t, cluster)
    password_env = t.raw("password_env", None)
    if password_env is not None:
        if not isinstance(password_env, str) or not _ENV_NAME.match(password_env):
            raise t.error("password_env", "expected the name of an environment variable")
        if password_env not in os.environ:
            raise t.error("password_env", f"the environment variable {password_env} is not set")
        if url is not None and urlsplit(url).password:
            # redis-py lets the url's password win over the one given beside it, silently
            raise t.error("password_env", "the url carries a password too: give it in one "
                                          "place")
    prefix = t.string("key_prefix", "tierkv:")
    if len(prefix.encode()) > MAX_KEY_PREFIX:
        raise t.error("key_prefix", f"longer than {MAX_KEY_PREFIX} bytes")
    if "{" in prefix or "}" in prefix:
        # a hash tag would send every key of the tier to one cluster slot
        raise t.error("key_prefix", "must not contain { or } (cluster hash tags)")
    ttl = t.duration_or_off("ttl")
    if ttl is not None:
        if int(ttl * 1000) < 1:  # sent as PX 0, which the server refuses
            raise t.error("ttl", "at least 1ms: the server counts whole milliseconds")
        ttl = _sent(t, "ttl", ttl)
    return RedisTierConfig(
        name, capacity, url=url, cluster=nodes, password_env=password_env, key_prefix=prefix,
        ttl=ttl,
        pool_size=t.integer("pool_size", 16, low=1, high=4096),
        timeout=_sent(t, "timeout", t.duration("timeout", 1.0)),
        batch=t.integer("batch", 256, low=1, high=65536),
        retention=_sent(t, "retention", t.duration("retention", 86400.0)),
        latency=None if t.raw("latency", "probe") == "probe" else t.duration("latency", 0.0),
        bandwidth=None if t.raw("bandwidth", "probe") == "probe" else t.size("bandwidth", 0),
    )


def _sent(t: Table, key: str, seconds: float) -> float:
    """`seconds`, a duration the tier sends to the server in milliseconds: refused beyond what
    the server takes (every put then failed, or the loader's arithmetic overflowed)."""
    if seconds * 1000 > MAX_SERVER_MS:
        raise t.error(key, f"at most {MAX_SERVER_MS}ms: the server counts milliseconds in a "
                           "signed 64-bit integer")
    return seconds


def _anchored(url: str, directory: Path) -> str:
    """`url` with each relative file its query names (a CA, a client certificate or key) taken
    in `directory`; the rest of it, credentials included, as written. The ssl module opens
    them at the first connection, against whatever the working directory is by then."""
    # split as urlsplit and parse_qs split (a fragment first, then the query, then "&")
    rest, hash_mark, fragment = url.partition("#")
    head, question, query = rest.partition("?")
    parts = []
    for part in query.split("&") if question else ():
        name, _, value = part.partition("=")
        file = unquote_plus(value)
        if unquote_plus(name) in _FILE_PARAMETERS and file and not Path(file).is_absolute():
            parts.append(f"{name}={quote(str(directory / file), safe='/')}")
        else:
            parts.append(part)
    return f"{head}{question}{'&'.join(parts)}{hash_mark}{fragment}"


def _check_url(t: Table, url: str) -> None:
    """Refuse a url the client would refuse at open: one that does not parse, a port outside
    1..65535, a query parameter that would be shown or that the connections do not take, or
    whose value they cannot read. Messages quote a parameter's name, never the url itself (it
    may carry a password)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535"
        raise t.error("url", f"not a valid URL: {exc}") from None
    if port == 0:
        raise t.error("url", "port 0 is not a server's port (1..65535)")
    database = parts.path[1:]
    if parts.scheme != "unix" and database and not (database.isascii() and database.isdigit()):
        # redis-py took "/abc" for database 0 and failed at open on "/-1"
        raise t.error("url", "the path is the database number (redis://host:port/0): a "
                             "whole number, 0 or more")
    _check_query(t, url, parts.query)
    _check_with_client(t, url)


def _check_query(t: Table, url: str, query: str) -> None:
    """The query's parameters go to redis-py's connections as keyword arguments
    (``rediss://host:port/0?ssl_ca_certs=/path/ca.pem``); refuse those that would be shown or
    that a plain connection does not take (only the names are quoted, never a value)."""
    names = parse_qs(query)
    for name in names:
        if name in _SECRET_PARAMETERS:
            raise t.error("url", f"{name} must not be in the query, which messages and `tierkv "
                                 "info` show (a server password goes before the host, "
                                 "redis://:PASSWORD@host:port, or in password_env)")
        if name in _TIER_PARAMETERS:
            instead = _TIER_PARAMETERS[name]
            raise t.error("url", f"{name} is the tier's to set, not the url's" + (
                f" (the tier's {instead} key sets it)" if instead else ""))
        if name in _COUNT_PARAMETERS:
            for value in names[name]:
                if not value.strip().isdigit():
                    raise t.error("url", f"{name} must be a whole number, 0 or more")
        if name.startswith("ssl_") and not url.startswith("rediss://"):
            raise t.error("url", f"{name} needs a rediss:// URL (TLS)")


def _check_with_client(t: Table, url: str) -> None:
    """Build, unconnected, the connection the tier's client would make of `url`: redis-py reads
    the query's values (``socket_timeout=abc``) and refuses parameters its connections do not
    take only then, which was at open. Without redis-py the tier's open says how to install
    it."""
    try:
        from redis.asyncio import ConnectionPool
        from redis.exceptions import RedisError
    except ImportError:
        return
    try:
        pool: Any = ConnectionPool.from_url(url)  # redis-py leaves make_connection untyped
        pool.make_connection()  # connects on first use only
    except ValueError as exc:  # quotes a parameter's name or the scheme, not credentials
        raise t.error("url", str(exc)) from None
    except TypeError as exc:  # an unexpected keyword argument: quotes its name
        raise t.error("url", f"a query parameter redis-py refuses: {exc}") from None
    except RedisError as exc:  # ssl_cert_reqs=bogus: quotes the flag, not credentials
        raise t.error("url", f"a query parameter redis-py refuses: {exc}") from None


def _cluster_nodes(t: Table, cluster: object) -> tuple[str, ...]:
    if not isinstance(cluster, list) or not cluster:
        raise t.error("cluster", 'expected a list of "host:port" nodes')
    for node in cluster:
        match = _NODE.match(node) if isinstance(node, str) else None
        if match is None or not 0 < int(match["port"]) < 65536:
            raise t.error("cluster", f'{node!r} is not "host:port"')
    return tuple(cluster)
