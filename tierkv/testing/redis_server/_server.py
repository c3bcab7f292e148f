"""One real ``redis-server`` process for a test (`RedisServer`), and where the redis binaries
are (`redis_server_path`, `redis_cli_path`, `redis_missing`).

Apart from the cluster (`_cluster`), which is three of these joined, and from the RESP client
(`_resp`) and the lease (`_lease`) it uses: this module is the process's life, from spawning it
and waiting for its PONG to signalling and reaping it.
"""

from __future__ import annotations

import logging
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from tierkv.errors import DeviceError
from tierkv.testing.redis_server._lease import (
    _free_ports,
    _Lease,
    _PortTaken,
    _release,
    _release_quietly,
)
from tierkv.testing.redis_server._resp import HOST, Reply, command
from tierkv.testing.redis_tls import TlsFiles, client_context, make_certificates

logger = logging.getLogger(__name__)

#: tries at a fresh port when another process takes the probed one before the server binds it
_PORT_ATTEMPTS = 5
#: how long the server's readiness checks sleep between tries (the server starts in ~10 ms)
_READY_INTERVAL = 0.01
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
