"""The HTTP server of `tierkv serve-metrics`: prometheus_client's exposition at ``/metrics``
and nothing else. `prometheus_client.start_http_server` answers every path with the metrics (a
typo in a scrape config, a health checker's ``/``, a crawler), so a wrong path looked right."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

#: the one path answered
METRICS_PATH = "/metrics"

StartResponse = Callable[..., Any]
App = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per scrape: a slow client does not hold up the others."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per request (the command's output is its own messages)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


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
