"""The HTTP server of `tierkv serve-metrics`: prometheus_client's exposition at ``/metrics``
and nothing else. `prometheus_client.start_http_server` answers every path with the metrics (a
typo in a scrape config, a health checker's ``/``, a crawler), so a wrong path looked right."""

from __future__ import annotations

import errno
import io
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

#: the one path answered
METRICS_PATH = "/metrics"

StartResponse = Callable[..., Any]
App = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


#: connections served at once; those beyond are closed at once (a scraper makes one or two)
MAX_CONNECTIONS = 64
#: seconds a connection may stay silent before it is closed
IDLE_TIMEOUT = 10.0


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per scrape: a slow client does not hold up the others. Bounded: a client
    that opened connections and sent nothing held a thread and a descriptor each for good,
    and once the process ran out of descriptors the failing accept spun a core and no scrape
    was answered."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._active = 0
        self._count_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.1)  # the listener stays readable: retried at once, it spun
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count_lock:
            full = self._active >= MAX_CONNECTIONS
            if not full:
                self._active += 1
        if full:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._ended()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._ended()

    def _ended(self) -> None:
        with self._count_lock:
            self._active -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client's failure (it went silent, it hung up) is not the command's to print: a
        traceback per idle connection closed filled stderr."""


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per request (the command's output is its own messages); a connection
    silent for `IDLE_TIMEOUT` is closed."""

    timeout = IDLE_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def get_stderr(self) -> io.StringIO:
        # where wsgiref writes the traceback of a scrape that failed (answered 500)
        return io.StringIO()


def _only_metrics(app: App) -> App:
    def routed(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") == METRICS_PATH:
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"not found: the metrics are at {METRICS_PATH}\n".encode()]

    return routed


def start_metrics_server(host: str, port: int, registry: CollectorRegistry
                         ) -> tuple[WSGIServer, threading.Thread]:
    """Serve `registry` at `host`:`port` (0: a free port) on a thread of its own, which the
    caller ends with ``server.shutdown()``; OSError where the address cannot be bound."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]

    class Server(_ThreadingServer):
        address_family = family  # an IPv6 host needs an AF_INET6 socket

    server = make_server(str(address[0]), port, _only_metrics(make_wsgi_app(registry)),
                         Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="tierkv-metrics", daemon=True)
    thread.start()
    return server, thread
