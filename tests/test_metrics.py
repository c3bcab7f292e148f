"""Metrics: the typed snapshot `kv.metrics()` after a known workload, its Prometheus exposition
scraped over real HTTP on 127.0.0.1 (an embedded registry, and `tierkv serve-metrics` as a
subprocess stopped with SIGTERM) and parsed with prometheus_client's own parser, and the
miss-storm alert: a flood of misses on one prefix raises it (metric and callback), three even
prefixes do not."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

import tierkv
from tests.engine._configs import hierarchy_config
from tests.engine.conftest import l1_config
from tierkv.health import BreakerState, MissStormAlert
from tierkv.metrics import EngineMetrics, Histogram, register, unregister
from tierkv.metrics.prometheus import EngineCollector
from tierkv.testing import Stepped

ALERT_BITS = 1.2  # [health] entropy_alert_bits, the default


class Clock:
    """The engine's clock, moved by hand (the miss-storm window runs on it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def workload(kv: tierkv.Engine) -> None:
    """10 puts of 100 bytes, 5 hits, 3 misses."""
    for i in range(10):
        await kv.put(f"k{i}", bytes([i]) * 100)
    for i in range(5):
        assert await kv.get(f"k{i}") == bytes([i]) * 100
    for i in range(3):
        assert await kv.get(f"absent{i}") is None


def parse(text: str) -> dict[str, Metric]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Metric], sample: str, **labels: str) -> float:
    """The value of the one sample called `sample` with exactly `labels`."""
    family = sample.removesuffix("_total") if sample.endswith("_total") else sample
    for suffix in ("_bucket", "_count", "_sum"):
        if family not in families and family.endswith(suffix):
            family = family.removesuffix(suffix)
    found = [s.value for s in families[family].samples if s.name == sample and s.labels == labels]
    assert len(found) == 1, (sample, labels, families[family].samples)
    return float(found[0])


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        body: bytes = response.read()
    return body.decode()


def check_histogram(families: dict[str, Metric], name: str, expected: Histogram,
                    **labels: str) -> None:
    """Buckets cumulative and monotonic, ``+Inf`` = ``_count`` = the snapshot's count."""
    buckets = sorted((float(s.labels["le"]), s.value) for s in families[name].samples
                      if s.name == f"{name}_bucket"
                      and {k: v for k, v in s.labels.items() if k != "le"} == labels)
    assert [le for le, _ in buckets] == [*expected.bounds, float("inf")]
    counts = [count for _, count in buckets]
    assert counts == sorted(counts)
    assert counts == list(expected.cumulative())
    assert counts[-1] == value(families, f"{name}_count", **labels) == expected.count
    assert value(families, f"{name}_sum", **labels) == pytest.approx(expected.sum)


def check_exposition(families: dict[str, Metric], m: EngineMetrics) -> None:
    """The exposition of the workload's engine (one tier "l1") against its snapshot."""
    l1 = m.tier("l1")
    for family in families.values():
        if not family.name.startswith("tierkv_"):
            continue
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        if family.type == "histogram":
            assert family.name.endswith("_seconds")
    assert families["tierkv_tier_hits"].type == "counter"
    assert value(families, "tierkv_tier_hits_total", tier="l1") == l1.hits == 5
    assert value(families, "tierkv_tier_misses_total", tier="l1") == l1.misses == 3
    assert value(families, "tierkv_tier_bytes_written_total", tier="l1") == 1000
    assert value(families, "tierkv_tier_bytes_read_total", tier="l1") == 500
    assert families["tierkv_tier_used_bytes"].type == "gauge"
    assert value(families, "tierkv_tier_used_bytes", tier="l1") == l1.used_bytes > 0
    assert value(families, "tierkv_tier_capacity_bytes", tier="l1") == 64 << 10
    assert value(families, "tierkv_tier_info", tier="l1", kind="gpu", persistent="false") == 1
    assert value(families, "tierkv_breaker_state", tier="l1", state="closed") == 1
    assert value(families, "tierkv_breaker_state", tier="l1", state="open") == 0
    assert value(families, "tierkv_breaker_state", tier="l1", state="half_open") == 0
    assert value(families, "tierkv_gets_total") == m.gets == 8
    assert value(families, "tierkv_misses_total") == m.misses == 3
    assert value(families, "tierkv_puts_total") == m.puts == 10
    assert value(families, "tierkv_objects") == m.objects == 10
    assert value(families, "tierkv_dag_edges") == m.dag_edges
    assert value(families, "tierkv_migrations_in_flight") == 0
    assert value(families, "tierkv_recovery_seconds") == pytest.approx(m.recovery_seconds)
    assert value(families, "tierkv_miss_storm_alerts_total") == 0
    assert families["tierkv_get_latency_seconds"].type == "histogram"
    check_histogram(families, "tierkv_get_latency_seconds", l1.get_latency,
                    tier="l1", result="hit")
    check_histogram(families, "tierkv_get_latency_seconds", m.miss_latency,
                    tier="", result="miss")
    check_histogram(families, "tierkv_put_latency_seconds", l1.put_latency, tier="l1")


# -- the snapshot --------------------------------------------------------------------------------
async def test_the_snapshot_counts_a_known_workload() -> None:
    async with tierkv.open(l1_config()) as kv:
        await workload(kv)
        m = kv.metrics()
        stats = kv.stats()
    assert (m.gets, m.misses, m.puts, m.objects) == (8, 3, 10, 10)
    assert stats["tiers"]["l1"]["get_latency"]["count"] == 5
    assert stats["engine"]["miss_latency"]["counts"] == list(m.miss_latency.counts)
    [l1] = m.tiers
    assert l1 is m.tier("l1")
    assert (l1.hits, l1.misses, l1.bytes_written, l1.bytes_read) == (5, 3, 1000, 500)
    assert (l1.get_latency.count, m.miss_latency.count, l1.put_latency.count) == (5, 3, 10)
    assert 0 < l1.get_latency.sum < 5 and all(b > a for a, b in zip(
        l1.get_latency.bounds, l1.get_latency.bounds[1:], strict=False))
    assert l1.admission is None and l1.breaker.state is BreakerState.CLOSED
    assert m.migrations_in_flight == 0 and m.miss_storm.detector.misses == 3
    assert m.get_many_latency.count == 0
    with pytest.raises(KeyError):
        m.tier("nvme")


def test_histogram_cumulative_counts_and_quantile_bounds() -> None:
    histogram = Histogram(bounds=(0.001, 0.01, 0.1), counts=(2, 0, 7, 1), sum=0.5)
    assert histogram.count == 10
    assert histogram.cumulative() == (2, 2, 9, 10)
    assert histogram.quantile(0.1) == 0.001
    assert histogram.quantile(0.5) == 0.1
    assert histogram.quantile(1.0) == float("inf")
    assert Histogram((1.0,), (0, 0), 0.0).quantile(0.5) is None
    with pytest.raises(ValueError):
        histogram.quantile(1.5)


async def test_get_many_is_timed_once_per_call() -> None:
    async with tierkv.open(l1_config()) as kv:
        await kv.put("a", b"1")
        assert await kv.get_many(["a", "b"]) == [b"1", None]
        m = kv.metrics()
    assert m.get_many_latency.count == 1
    assert (m.gets, m.misses, m.tier("l1").hits) == (2, 1, 1)


# -- Prometheus ----------------------------------------------------------------------------------
async def test_an_embedded_registry_is_scraped_over_http() -> None:
    async with tierkv.open(l1_config()) as kv:
        await workload(kv)
        registry = CollectorRegistry()
        collector = register(kv, registry)
        server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        try:
            # the server answers on a thread of its own, which hands the snapshot to this loop
            text = await asyncio.to_thread(
                scrape, f"http://127.0.0.1:{server.server_port}/metrics")
        finally:
            server.shutdown()
            server.server_close()
            thread.join()
        unregister(collector)
        expected = kv.metrics()
    check_exposition(parse(text), expected)


async def test_register_unregister_and_one_engine_per_registry() -> None:
    async with tierkv.open(l1_config()) as kv, tierkv.open(l1_config()) as other:
        registry = CollectorRegistry()
        collector = register(kv, registry)
        with pytest.raises(ValueError):
            register(other, registry)
        assert "tierkv_objects" in parse(generate_latest(registry).decode())
        unregister(collector)
        unregister(collector)  # a no-op the second time
        assert not parse(generate_latest(registry).decode())
        register(other, registry)



def tier_counters(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """Every tier's hits and misses in the exposition: (sample, tier) → value."""
    families = parse(generate_latest(registry).decode())  # on the loop: read directly
    return {(sample.name, sample.labels["tier"]): sample.value
            for name in ("tierkv_tier_hits", "tierkv_tier_misses")
            for sample in families[name].samples}


async def test_tier_counters_never_decrease_while_gets_are_in_flight(tmp_path: Path) -> None:
    """A get read from the log after a reopen, scraped at each of its awaits: no tier's hits or
    misses go down (a get still reading counted as a miss of the tier about to serve it, and
    stopped counting once served); one cancelled there counts as no tier's miss either, so
    the last tier's misses stay the engine's."""
    config = hierarchy_config(tmp_path, ("gpu", "nvme"))
    async with tierkv.open(config) as kv:
        await kv.put("a", os.urandom(10_000))
        await kv.put("b", os.urandom(10_000))
    async with tierkv.open(config) as kv:  # the gpu tier is empty: gets read the log
        registry = CollectorRegistry()
        register(kv, registry)
        seen = [tier_counters(registry)]
        get = Stepped(kv.get("a"))
        while await get.step():
            seen.append(tier_counters(registry))
        seen.append(tier_counters(registry))
        assert get.result() is not None
        for before, after in itertools.pairwise(seen):
            assert all(after[sample] >= value for sample, value in before.items()), (before,
                                                                                     after)
        assert seen[-1][("tierkv_tier_hits_total", "nvme")] == 1
        assert seen[-1][("tierkv_tier_misses_total", "gpu")] == 1
        assert seen[-1][("tierkv_tier_misses_total", "nvme")] == 0
        cancelled = Stepped(kv.get("b"))
        assert await cancelled.step()  # reading "b" from the log
        with pytest.raises(asyncio.CancelledError):
            await cancelled.cancel()
        m = kv.metrics()
    assert m.tier("nvme").misses == m.misses == 0


async def test_a_shared_miss_is_timed_as_a_miss_while_other_gets_hit(redis_url: str) -> None:
    """A get that missed locally awaited the shared tier's lookup while another get hit the
    first tier: the miss took that tier for the one that served it, and was timed (and
    traced) as its hit: 200 of 200."""
    config = l1_config()
    config["tiers"].append({"name": "shared", "kind": "redis", "url": redis_url,
                            "capacity": "8MiB"})
    async with tierkv.open(config) as kv:
        await kv.put("hot", b"x" * 100)

        async def hit() -> None:
            for _ in range(200):
                assert await kv.get("hot") == b"x" * 100
                await asyncio.sleep(0)

        missed = await asyncio.gather(*(kv.get(f"absent/{i}") for i in range(200)), hit())
        assert missed[:200] == [None] * 200
        m = kv.metrics()
    assert m.misses == m.miss_latency.count == 200
    assert m.tier("l1").hits == m.tier("l1").get_latency.count == 200


async def test_copies_the_logs_reclaim_drops_count_as_its_evictions(tmp_path: Path) -> None:
    """`tierkv_tier_evictions_total` counts copies that left a tier for room: the log's own
    reclaims were not counted (510 objects dropped, 0 evictions)."""
    config = hierarchy_config(tmp_path, ("nvme",), nvme={"capacity": 8 << 20,
                                                         "region_size": 1 << 20})
    async with tierkv.open(config) as kv:
        for i in range(200):
            await kv.put(f"k{i}", os.urandom(100_000))
        stats = kv.stats()["engine"]
    assert stats["drops"] > 100
    assert stats["evictions"] == {"nvme": stats["drops"]}


def _scrape_until(stop: threading.Event, collectors: list[EngineCollector],
                  outcomes: list[str]) -> None:
    """From another thread: scrape the first collector registered, until `stop`."""
    while not collectors and not stop.is_set():
        time.sleep(0.0001)
    while not stop.is_set():
        try:
            collectors[0].collect()
        except Exception as exc:  # what the defect raised, after the timeout
            outcomes.append(type(exc).__name__)
            return


async def _open_register_close(collectors: list[EngineCollector]) -> None:
    kv = await tierkv.open(l1_config())
    collectors.append(register(kv, CollectorRegistry(), timeout=2.0))
    await asyncio.sleep(0.001)
    await kv.close()


def test_a_scrape_as_the_engines_loop_ends_reads_the_engine_directly() -> None:
    """A scrape from another thread handed its snapshot to the engine's loop; when the loop
    ended before running it, the scrape waited out its whole timeout and failed."""
    outcomes: list[str] = []
    for _ in range(40):
        stop = threading.Event()
        collectors: list[EngineCollector] = []
        thread = threading.Thread(target=_scrape_until, args=(stop, collectors, outcomes))
        thread.start()
        try:
            asyncio.run(_open_register_close(collectors))
        finally:
            stop.set()
            thread.join(10)
        assert not thread.is_alive()
    assert outcomes == []


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`tierkv serve-metrics` on a gpu + nvme config whose log holds 4 objects, listening on
    a free port of 127.0.0.1; yields the process and its URL, killed if a test leaves it."""
    config = tmp_path / "devices.toml"
    config.write_text(
        '[[tiers]]\nname = "l1"\nkind = "gpu"\ndevice = "cpu"\ncapacity = "64KiB"\n'
        'slot_size = "4KiB"\n\n'
        f'[[tiers]]\nname = "nvme"\nkind = "nvme"\npath = "{tmp_path / "tierkv.log"}"\n'
        'capacity = "16MiB"\nregion_size = "1MiB"\n')

    async def fill() -> None:
        async with tierkv.open(config) as kv:
            for i in range(4):
                await kv.put(f"k{i}", os.urandom(1000))

    asyncio.run(fill())  # closing flushes them into the log
    process = subprocess.Popen(
        [sys.executable, "-m", "tierkv.cli", "serve-metrics", "--config", str(config),
         "--port", "0", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, process.kill)  # a hung server fails the test, not the run
    watchdog.start()
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once it listens
        match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert match, (line, process.stderr.read() if process.stderr else "")
        yield process, match.group(0)
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_serve_metrics_answers_a_scrape_and_stops_on_sigterm(
        served: tuple[subprocess.Popen[str], str]) -> None:
    process, url = served
    families = parse(scrape(url))
    assert value(families, "tierkv_objects") == 4
    assert value(families, "tierkv_tier_recovered_objects", tier="nvme") == 4
    assert value(families, "tierkv_tier_capacity_bytes", tier="l1") == 64 << 10
    assert value(families, "tierkv_tier_info", tier="nvme", kind="nvme", persistent="true") == 1
    assert value(families, "tierkv_recovery_seconds") > 0
    assert value(families, "tierkv_breaker_state", tier="nvme", state="closed") == 1
    assert "process_cpu_seconds" in families  # prometheus_client's process collector
    for wrong in ("/", "/metric", "/metrics/x", "/favicon.ico"):  # all answered with metrics
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(url.removesuffix("/metrics") + wrong, timeout=30)
        assert answer.value.code == 404 and b"/metrics" in answer.value.read()
    assert "tierkv_objects" in scrape(url + "?name[]=tierkv_objects")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert "Traceback" not in (process.stderr.read() if process.stderr else "")


def test_serve_metrics_bounds_and_closes_idle_connections(
        served: tuple[subprocess.Popen[str], str]) -> None:
    """Connections that send nothing: each held a thread and a descriptor for good, and with
    the process out of descriptors its accept loop spun a core and no scrape was answered.
    The server takes at most 64 at once (closing the rest at once), closes a connection
    silent for 10 s, and prints no traceback for either."""
    process, url = served
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    threads_before = len(os.listdir(f"/proc/{process.pid}/task"))
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(100)]
    try:
        time.sleep(1.0)
        assert len(os.listdir(f"/proc/{process.pid}/task")) <= threads_before + 64 + 2
        for connection in idle:
            connection.settimeout(15)
        closed = sum(connection.recv(1) == b"" for connection in idle)  # all, in time
        assert closed == 100
    finally:
        for connection in idle:
            connection.close()
    assert "tierkv_objects" in scrape(url)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert "Traceback" not in (process.stderr.read() if process.stderr else "")


# -- miss storms ---------------------------------------------------------------------------------
async def test_a_flood_of_misses_on_one_prefix_raises_the_alert() -> None:
    clock = Clock()
    alerts: list[MissStormAlert] = []
    async with tierkv.open(l1_config(), clock=clock) as kv:
        kv.on_miss_storm(alerts.append)
        for i in range(95):
            assert await kv.get(f"tenant-a/{i}") is None
        for i in range(5):
            assert await kv.get(f"tenant-b/{i}") is None
        assert alerts == []  # checked at the first miss (too few then); the next is 5 s on
        clock.now += 5.0
        assert await kv.get("tenant-a/last") is None
        [alert] = alerts
        m = kv.metrics()
        registry = CollectorRegistry()
        register(kv, registry)
        families = parse(generate_latest(registry).decode())  # on the loop: read directly
    assert alert.top_prefix == b"\x03tenant-a"  # the str tag, the key up to its "/"
    assert alert.bits < ALERT_BITS and alert.share > 0.9 and alert.misses == 101
    assert m.miss_storm.detector.alerts == 1 and m.miss_storm.detector.alerting
    assert m.miss_storm.watching
    assert value(families, "tierkv_miss_storm_alerts_total") == 1
    assert value(families, "tierkv_miss_storm_alerting") == 1
    assert value(families, "tierkv_miss_storm_entropy_bits") == pytest.approx(alert.bits, abs=0.1)
    assert value(families, "tierkv_miss_storm_threshold_bits") == ALERT_BITS


async def test_three_even_prefixes_raise_no_alert() -> None:
    clock = Clock()
    alerts: list[MissStormAlert] = []
    async with tierkv.open(l1_config(), clock=clock) as kv:
        kv.on_miss_storm(alerts.append)
        for i in range(30):
            for tenant in ("a", "b", "c"):
                assert await kv.get(f"{tenant}:{i}".encode()) is None
        clock.now += 5.0
        assert await kv.get(b"a:last") is None
        m = kv.metrics()
        registry = CollectorRegistry()
        register(kv, registry)
        families = parse(generate_latest(registry).decode())
    assert alerts == []
    assert m.miss_storm.detector.checks == 2 and m.miss_storm.detector.alerts == 0
    assert m.miss_storm.detector.bits == pytest.approx(1.58, abs=0.01)
    assert m.miss_storm.detector.prefixes == 3
    assert value(families, "tierkv_miss_storm_alerts_total") == 0
    assert value(families, "tierkv_miss_storm_alerting") == 0


async def test_block_keys_miss_under_their_model() -> None:
    clock = Clock()
    alerts: list[MissStormAlert] = []
    hot = tierkv.block_keys(list(range(16 * 40)), block_size=16, model="llama@1",
                            rope_theta=1e4, namespace=b"tenant-1")
    cold = tierkv.block_keys(list(range(16)), block_size=16, model="qwen@2", rope_theta=1e6)
    async with tierkv.open(l1_config(), clock=clock) as kv:
        kv.on_miss_storm(alerts.append)
        assert await kv.get_many([*hot, *cold]) == [None] * 41
        clock.now += 5.0
        assert await kv.get(cold[0]) is None
    [alert] = alerts
    assert alert.top_prefix == b"\x01llama@1"
    assert alert.misses == 42


async def test_a_key_space_of_one_part_never_storms() -> None:
    """Block keys of one model (a trace replay, a single-model server) all miss under one
    prefix: 0 bits, and no storm until a miss under another prefix shows the space has parts."""
    clock = Clock()
    alerts: list[MissStormAlert] = []
    chain = tierkv.block_keys(list(range(16 * 60)), block_size=16, model="llama@1",
                              rope_theta=1e4)
    async with tierkv.open(l1_config(), clock=clock) as kv:
        kv.on_miss_storm(alerts.append)
        for block in chain[:30]:
            assert await kv.get(block) is None
        clock.now += 5.0
        assert await kv.get(chain[30]) is None
        quiet = kv.metrics().miss_storm
        assert await kv.get("tenant/x") is None  # a second part of the key space
        for block in chain[31:]:
            assert await kv.get(block) is None
        clock.now += 5.0
        assert await kv.get(chain[0]) is None
        watched = kv.metrics().miss_storm
    assert not quiet.watching and quiet.detector.alerts == 0 and quiet.detector.bits == 0
    assert watched.watching and watched.detector.alerts == 1
    [alert] = alerts
    assert alert.top_prefix == b"\x01llama@1"


async def test_a_failing_callback_is_logged_and_the_get_answers(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()

    def broken(alert: MissStormAlert) -> None:
        raise RuntimeError("the application's bug")

    async with tierkv.open(l1_config(), clock=clock) as kv:
        kv.on_miss_storm(broken)
        await kv.get("u/0")
        for i in range(30):
            await kv.get(f"t/{i}")
        clock.now += 5.0
        with caplog.at_level(logging.ERROR, logger="tierkv.engine"):
            assert await kv.get("t/last") is None
        assert kv.metrics().miss_storm.detector.alerts == 1
        kv.on_miss_storm(None)
    assert any(record.exc_info for record in caplog.records if record.name == "tierkv.engine")
