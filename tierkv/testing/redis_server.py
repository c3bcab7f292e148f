"""Real Redis servers for tests and benchmarks, started as subprocesses and stopped by pid.

`RedisServer` is one ``redis-server`` on 127.0.0.1 at a free port, persistence off, in a
directory of its own that `stop` removes; `kill` and `restart` (on the same port, so clients
reconnect) are there for fault tests. `RedisClusterServers` is three such servers joined into a
cluster of three masters by ``redis-cli --cluster create``. Both are context managers and both
start in the constructor, as `subprocess.Popen` does: an instance is a running server.

The methods block (they wait for a process to answer or to exit): call them outside the event
loop, or through `asyncio.to_thread` where a loop must keep running meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, TypeAlias
from urllib.parse import quote

from tierkv.errors import DeviceError
from tierkv.testing.redis_tls import TlsFiles, client_context, make_certificates, wrap

logger = logging.getLogger(__name__)

#: a RESP2 reply: simple and bulk strings as bytes, integers, nil, arrays (error replies raise)
Reply: TypeAlias = "bytes | int | list[Reply] | None"

HOST = "127.0.0.1"

#: tries at a fresh port when another process takes the probed one before the server binds it
_PORT_ATTEMPTS = 5
#: how long the server's readiness checks sleep between tries (the server starts in ~10 ms)
_READY_INTERVAL = 0.01
#: how often the cluster's state is read while the nodes gossip their way to ``ok``
_CLUSTER_INTERVAL = 0.05
_LOG_TAIL_LINES = 20


def redis_server_path() -> str | None:
    """Where ``redis-server`` is on PATH, or ``None``."""
    return shutil.which("redis-server")


def redis_cli_path() -> str | None:
    """Where ``redis-cli`` is on PATH, or ``None``."""
    return shutil.which("redis-cli")


def redis_missing() -> str | None:
    """``None`` when ``redis-server`` and ``redis-cli`` are both on PATH, else why not."""
    absent = [name for name, path in (("redis-server", redis_server_path()),
                                      ("redis-cli", redis_cli_path())) if path is None]
    if absent:
        return (f"{' and '.join(absent)} not on PATH (Debian's redis-server package provides "
                "both; scripts/setup installs it)")
    return None


def command(port: int, *args: str | bytes | int, password: str | None = None,
            timeout: float = 5.0, tls: ssl.SSLContext | None = None) -> Reply:
    """Send one command to the server at 127.0.0.1:`port` over a connection of its own
    (``AUTH`` first when `password` is given; over TLS with `tls`) and return its reply.

    Raises `OSError` when no connection can be made or it breaks (`ssl.SSLError`, one, when the
    TLS handshake fails), `DeviceError` on an error reply.
    """
    with wrap(socket.create_connection((HOST, port), timeout=timeout), tls, HOST) as sock, \
            sock.makefile("rb") as stream:
        if password is not None:
            sock.sendall(_encode(("AUTH", password)))
            _read_reply(stream)
        sock.sendall(_encode(args))
        return _read_reply(stream)


def _encode(args: Sequence[str | bytes | int]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts += [b"$%d\r\n" % len(data), data, b"\r\n"]
    return b"".join(parts)


def _read_reply(stream: BinaryIO) -> Reply:
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionResetError("the redis server closed the connection mid-reply")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise DeviceError(f"redis replied with an error: {rest.decode(errors='replace')}")
    if kind == b":":
        return int(rest)
    if kind == b"$":
        length = int(rest)
        if length < 0:
            return None
        data = stream.read(length + 2)
        if len(data) != length + 2:
            raise ConnectionResetError("the redis server closed the connection mid-reply")
        return data[:-2]
    if kind == b"*":
        count = int(rest)
        return None if count < 0 else [_read_reply(stream) for _ in range(count)]
    raise DeviceError(f"not a RESP2 reply: {line!r}")


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports that nothing listened on a moment ago (all probes bound at once)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                  for _ in range(count)]
        for probe in probes:
            probe.bind((HOST, 0))
        return [int(probe.getsockname()[1]) for probe in probes]


class _PortTaken(Exception):
    """The server exited because another process holds its port."""


class _Lease:
    """What a `RedisServer` holds: its process and directory (the finalizer's view of it)."""

    def __init__(self, directory: Path) -> None:
        self.directory: Path | None = directory
        self.process: subprocess.Popen[bytes] | None = None


def _release(lease: _Lease) -> None:
    """Finalizer of a `RedisServer` never stopped: kill its process, remove its directory."""
    if lease.process is not None and lease.process.poll() is None:
        warnings.warn(f"redis-server pid {lease.process.pid} was never stopped; killing it",
                      ResourceWarning, stacklevel=1)
        lease.process.kill()
        lease.process.wait()
    lease.process = None
    if lease.directory is not None:
        shutil.rmtree(lease.directory, ignore_errors=True)
        lease.directory = None


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 at a free port, running once the constructor returns.

    Persistence is off (``--save ""``, ``--appendonly no``); the server works in a temporary
    directory of its own (its log is ``redis.log`` there) that `stop` removes. `maxmemory` (bytes)
    caps its memory with ``allkeys-lru`` eviction; `password` sets ``requirepass`` (and goes into
    `url`); `unix_socket` makes it listen on ``redis.sock`` in its directory too (`unix_socket`
    then holds the path). `cluster` starts it as a cluster node, not yet in any cluster (see
    `RedisClusterServers`), with its cluster bus on a second free port. `tls` makes it speak
    only TLS on its port (``rediss://`` `url`), with a throw-away CA and server certificate in
    its directory (`ca_file`; `tierkv.testing.redis_tls`); not with `cluster`.

    Raises `DeviceError` when ``redis-server`` is not on PATH or the server does not answer
    ``PING`` within `start_timeout` seconds (the message ends with its log's last lines). Not
    safe to use from several threads at once.
    """

    def __init__(self, *, maxmemory: int | None = None, password: str | None = None,
                 unix_socket: bool = False, cluster: bool = False, tls: bool = False,
                 start_timeout: float = 10.0) -> None:
        executable = redis_server_path()
        if executable is None:
            raise DeviceError("redis-server is not on PATH")
        if tls and cluster:
            raise ValueError("a TLS cluster node is not supported")
        self._executable = executable
        self._maxmemory = maxmemory
        self._password = password
        self._want_unix_socket = unix_socket
        self._cluster = cluster
        self._tls = tls
        self._tls_files: TlsFiles | None = None
        self._client_tls: ssl.SSLContext | None = None
        self._start_timeout = start_timeout
        self._lease = _Lease(Path(tempfile.mkdtemp(prefix="tierkv-redis-")))
        self._finalizer = weakref.finalize(self, _release, self._lease)
        self._port = 0
        self._cluster_port: int | None = None
        self._pid = 0
        self._unix_socket: str | None = None
        try:
            self._start_at_free_port()
        except BaseException:
            self._finalizer.detach()
            _release_quietly(self._lease)
            raise

    # -- what clients need ---------------------------------------------------------------------

    @property
    def host(self) -> str:
        return HOST

    @property
    def port(self) -> int:
        """The TCP port; the same across `restart`."""
        return self._port

    @property
    def cluster_port(self) -> int | None:
        """The cluster bus port of a `cluster` node, else ``None``."""
        return self._cluster_port

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"{HOST}:{self._port}"

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0`` (``rediss://`` with `tls`)."""
        auth = "" if self._password is None else f":{quote(self._password, safe='')}@"
        return f"{'rediss' if self._tls else 'redis'}://{auth}{HOST}:{self._port}/0"

    @property
    def ca_file(self) -> Path | None:
        """With `tls`, the CA certificate (PEM) that signed the server's; else ``None``."""
        return None if self._tls_files is None else self._tls_files.ca_file

    @property
    def unix_socket(self) -> str | None:
        """The path of the unix socket it listens on, if it was asked to."""
        return self._unix_socket

    @property
    def pid(self) -> int:
        """The pid of the latest process (after `stop` or `kill`, the one that was stopped)."""
        return self._pid

    @property
    def running(self) -> bool:
        process = self._lease.process
        return process is not None and process.poll() is None

    @property
    def log_path(self) -> Path:
        return self._directory / "redis.log"

    def command(self, *args: str | bytes | int, timeout: float = 5.0) -> Reply:
        """One command on a connection of its own (see the module-level `command`)."""
        return command(self._port, *args, password=self._password, timeout=timeout,
                       tls=self._client_tls)

    # -- lifecycle -----------------------------------------------------------------------------

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server, wait up to `timeout` seconds for it to exit (SIGKILL after that),
        and remove its directory. Does nothing more when it is stopped already."""
        self._signal(signal.SIGTERM)
        self._finish(timeout)

    def kill(self) -> None:
        """SIGKILL the server and reap it (a crash: its directory stays, for `restart`)."""
        self._end(signal.SIGKILL, None)

    def restart(self) -> None:
        """Start the server again on the same port (stopping it first if it runs): clients that
        held connections reconnect to the same address. Raises `DeviceError` when it does not
        come up, for one because another process took the port meanwhile."""
        self._end(signal.SIGTERM, 10.0)
        if self._lease.directory is None:
            self._lease.directory = Path(tempfile.mkdtemp(prefix="tierkv-redis-"))
        try:
            self._start()
        except _PortTaken as exc:
            raise DeviceError(f"redis-server could not restart on port {self._port}: "
                              f"{exc}") from None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<RedisServer {self.address} pid {self._pid} {state}>"

    # -- the process -------------------------------------------------------------------------

    @property
    def _directory(self) -> Path:
        if self._lease.directory is None:
            raise DeviceError(f"redis-server {self.address} is stopped; its directory is gone")
        return self._lease.directory

    def _start_at_free_port(self) -> None:
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            ports = _free_ports(2 if self._cluster else 1)
            self._port = ports[0]
            self._cluster_port = ports[1] if self._cluster else None
            try:
                self._start()
            except _PortTaken as exc:
                logger.debug("redis-server: port taken (attempt %d): %s", attempt, exc)
                continue
            return
        raise DeviceError(f"redis-server found no free port in {_PORT_ATTEMPTS} attempts")

    def _argv(self) -> list[str]:
        tls = self._tls_files
        # with TLS, the port speaks TLS only (no plain port)
        ports = ["--port", str(self._port)] if tls is None else [
            "--port", "0", "--tls-port", str(self._port), "--tls-cert-file", str(tls.cert_file),
            "--tls-key-file", str(tls.key_file), "--tls-ca-cert-file", str(tls.ca_file),
            "--tls-auth-clients", "no"]
        argv = [self._executable, "--bind", HOST, *ports,
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--dir", str(self._directory)]
        if self._maxmemory is not None:
            argv += ["--maxmemory", str(self._maxmemory), "--maxmemory-policy", "allkeys-lru"]
        if self._password is not None:
            argv += ["--requirepass", self._password]
        if self._unix_socket is not None:
            argv += ["--unixsocket", self._unix_socket,
                     "--unixsocketperm", "700"]
        if self._cluster_port is not None:
            argv += ["--cluster-enabled", "yes", "--cluster-port", str(self._cluster_port),
                     "--cluster-config-file", f"nodes-{self._port}.conf",
                     "--cluster-node-timeout", "2000"]
        return argv

    def _start(self) -> None:
        """Spawn the server and wait for its PONG; raises `_PortTaken` if it could not bind."""
        self._unix_socket = (str(self._directory / "redis.sock") if self._want_unix_socket
                             else None)
        if self._tls and (self._tls_files is None or not self._tls_files.ca_file.exists()):
            # a restart after `stop` has a new directory, and so a new CA
            self._tls_files = make_certificates(self._directory)
            self._client_tls = client_context(self._tls_files.ca_file)
        with self.log_path.open("ab") as log:
            # what this process logs starts here: earlier runs' lines are no evidence
            log_offset = log.tell()
            process = subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=self._directory)
        self._lease.process = process
        self._pid = process.pid
        try:
            self._wait_ready(process, log_offset)
        except BaseException:
            self._end(signal.SIGKILL, None)
            raise
        logger.debug("redis-server pid %d listening on %s", process.pid, self.address)

    def _wait_ready(self, process: subprocess.Popen[bytes], log_offset: int) -> None:
        # redis-server has no readiness signal every build offers (sd_notify needs systemd
        # support compiled in), so ask until it answers; the wait on the process between the
        # tries ends at once when the server exits instead of coming up
        deadline = time.monotonic() + self._start_timeout
        while True:
            try:
                if self.command("PING", timeout=1.0) == b"PONG":
                    return
            except (OSError, DeviceError):
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeviceError(f"redis-server pid {process.pid} did not answer PING on "
                                  f"{self.address} within {self._start_timeout} s\n"
                                  f"{self._log_tail(log_offset)}")
            try:
                returncode = process.wait(timeout=min(_READY_INTERVAL, remaining))
            except subprocess.TimeoutExpired:
                continue
            tail = self._log_tail(log_offset)
            if in_use := [line for line in tail.splitlines() if "Address already in use" in line]:
                raise _PortTaken(in_use[0])
            raise DeviceError(f"redis-server exited with status {returncode} before "
                              f"answering PING on {self.address}\n{tail}")

    def _end(self, sig: signal.Signals, timeout: float | None) -> None:
        self._signal(sig)
        self._reap(timeout)

    def _signal(self, sig: signal.Signals) -> None:
        process = self._lease.process
        if process is not None and process.poll() is None:
            process.send_signal(sig)

    def _reap(self, timeout: float | None) -> None:
        """Wait up to `timeout` seconds (``None``: as long as it takes) for the signalled
        process to exit, then SIGKILL it."""
        process = self._lease.process
        if process is None:
            return
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("redis-server pid %d still runs %.1f s after SIGTERM; killing it",
                           process.pid, timeout)
            process.kill()
            process.wait()
        self._lease.process = None
        logger.debug("redis-server pid %d on %s exited with status %d", process.pid,
                     self.address, process.returncode)

    def _finish(self, timeout: float) -> None:
        """The end of `stop`, once SIGTERM is sent: reap the process, remove the directory."""
        self._reap(timeout)
        if self._lease.directory is not None:
            shutil.rmtree(self._lease.directory, ignore_errors=True)
            self._lease.directory = None

    def _log_tail(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(offset)
                lines = log.read().decode(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(lines[-_LOG_TAIL_LINES:])


def _release_quietly(lease: _Lease) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        _release(lease)


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
