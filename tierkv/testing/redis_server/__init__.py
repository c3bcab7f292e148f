"""Real Redis servers for tests and benchmarks, started as subprocesses and stopped by pid.

`RedisServer` is one ``redis-server`` on 127.0.0.1 at a free port, persistence off, in a
directory of its own that `stop` removes; `kill` and `restart` (on the same port, so clients
reconnect) are there for fault tests. `RedisClusterServers` is three such servers joined into a
cluster of three masters by ``redis-cli --cluster create``. Both are context managers and both
start in the constructor, as `subprocess.Popen` does: an instance is a running server.

The methods block (they wait for a process to answer or to exit): call them outside the event
loop, or through `asyncio.to_thread` where a loop must keep running meanwhile.

Its parts: `_server` (one server process), `_cluster` (three joined), `_resp` (the RESP client
`command` both use, and that tests use to check a server by hand) and `_lease` (ports, and what
a finalizer releases). Every name is re-exported here: tests and benches import this package.
"""

from tierkv.testing.redis_server._cluster import RedisClusterServers
from tierkv.testing.redis_server._resp import HOST, Reply, command
from tierkv.testing.redis_server._server import (
    RedisServer,
    redis_cli_path,
    redis_missing,
    redis_server_path,
)

__all__ = [
    "HOST",
    "RedisClusterServers",
    "RedisServer",
    "Reply",
    "command",
    "redis_cli_path",
    "redis_missing",
    "redis_server_path",
]
