"""`tierkv serve-metrics`: open an engine on a config and serve its metrics over HTTP until
SIGINT or SIGTERM, then close the engine (which flushes to the persistent tiers) and return.

The scrapes are answered at ``/metrics`` (any other path is a 404) on threads of their own
(`_http`); each takes the engine's snapshot on the loop (`EngineCollector`). The registry is a
fresh one with the engine's collector and prometheus_client's process, platform and GC
collectors.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
)

from tierkv.engine.opener import ConfigSource, open_engine
from tierkv.errors import ConfigError
from tierkv.metrics._http import start_metrics_server
from tierkv.metrics.prometheus import register, unregister

#: called once the server listens: (host, port bound)
Ready = Callable[[str, int], None]


async def serve_metrics(config: ConfigSource, host: str = "127.0.0.1", port: int = 9464, *,
                        ready: Ready | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve ``/metrics`` of an engine opened on `config` at `host`:`port` (0: a free port,
    which `ready` is told) until SIGINT or SIGTERM, or, when `stop` is given, until it is set
    (the signals are then left to the caller). `ConfigError` if the address cannot be bound
    (before the engine is opened)."""
    loop = asyncio.get_running_loop()
    stopping = stop if stop is not None else asyncio.Event()
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    # bound first: an address in use refused after the open had run recovery and rewritten
    # the pool and the log for nothing
    try:
        server, thread = start_metrics_server(host, port, registry)
    except OSError as exc:  # unknown host, in use, not this machine's, a privileged port
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
    serving = True

    async def stop_serving() -> None:
        nonlocal serving
        if serving:
            serving = False
            # a scrape in progress may be waiting for this loop: keep it turning meanwhile
            await asyncio.to_thread(server.shutdown)
            server.server_close()
            await asyncio.to_thread(thread.join)

    try:
        kv = await open_engine(config)
        try:
            engine_collector = register(kv, registry)
            # with `stop`, the caller decides what sets it (the CLI: its own signal handling)
            signals = (signal.SIGINT, signal.SIGTERM) if stop is None else ()
            try:
                for signum in signals:
                    loop.add_signal_handler(signum, stopping.set)
                if ready is not None:
                    ready(host, int(server.server_port))
                await stopping.wait()
            finally:
                for signum in signals:
                    loop.remove_signal_handler(signum)
                await stop_serving()  # no scrape reads the engine once it closes
                unregister(engine_collector)
        finally:
            await kv.close()
    finally:
        await stop_serving()
