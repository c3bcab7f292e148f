"""A cluster of real redis servers for a test (`RedisClusterServers`): three `RedisServer`
nodes joined by ``redis-cli --cluster create``.

Apart from the single server because a cluster is built on top of it (its nodes are
`RedisServer` instances) and adds only the join and the wait for ``cluster_state:ok``.
"""

from __future__ import annotations

import signal
import subprocess
import time
from types import TracebackType

from tierkv.errors import DeviceError
from tierkv.testing.redis_server._server import RedisServer, redis_cli_path

#: how often the cluster's state is read while the nodes gossip their way to ``ok``
_CLUSTER_INTERVAL = 0.05


class RedisClusterServers:
    """Three `RedisServer` cluster nodes joined into one cluster of three masters (no replicas)
    by ``redis-cli --cluster create``, ready once the constructor returns: every node reports
    ``cluster_state:ok``.

    Raises `DeviceError` when ``redis-cli`` is not on PATH, a node does not start, the join
    fails or the cluster is not ``ok`` within `start_timeout` seconds; the nodes started so far
    are stopped first.
    """

    def __init__(self, *, maxmemory: int | None = None, start_timeout: float = 30.0) -> None:
        cli = redis_cli_path()
        if cli is None:
            raise DeviceError("redis-cli is not on PATH")
        self._servers: list[RedisServer] = []
        try:
            for _ in range(3):
                self._servers.append(RedisServer(maxmemory=maxmemory, cluster=True))
            self._join(cli, start_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def servers(self) -> tuple[RedisServer, ...]:
        return tuple(self._servers)

    @property
    def nodes(self) -> list[str]:
        """``127.0.0.1:PORT`` of each master."""
        return [server.address for server in self._servers]

    def stop(self) -> None:
        """Stop every node (see `RedisServer.stop`), all of them signalled before any is waited
        for: each takes up to a tenth of a second to act on SIGTERM."""
        for server in self._servers:
            server._signal(signal.SIGTERM)
        for server in self._servers:
            server._finish(10.0)

    def __enter__(self) -> RedisClusterServers:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<RedisClusterServers {' '.join(self.nodes)}>"

    def _join(self, cli: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        argv = [cli, "--cluster", "create", *self.nodes,
                "--cluster-replicas", "0", "--cluster-yes"]
        try:
            created = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                     text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise DeviceError(f"redis-cli --cluster create took over {timeout} s") from exc
        if created.returncode != 0:
            raise DeviceError(f"redis-cli --cluster create failed ({created.returncode}):\n"
                              f"{created.stdout}{created.stderr}")
        # the nodes learn of each other's slots by gossip: nothing to wait on but the state
        for server in self._servers:
            while True:
                info = server.command("CLUSTER", "INFO")
                if isinstance(info, bytes) and b"cluster_state:ok" in info:
                    break
                if time.monotonic() >= deadline:
                    raise DeviceError(f"cluster node {server.address} not ok within "
                                      f"{timeout} s:\n{info!r}")
                time.sleep(_CLUSTER_INTERVAL)
