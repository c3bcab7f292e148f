"""`tierkv bench --device redis`: the shared tier beside raw redis-py on the same server.

One server for everything: a private ``redis-server`` (`RedisServer`: loopback, persistence off,
stopped at the end) or the one at `url`, where the benchmark writes only under a fresh random
key prefix and deletes every key under it afterwards (never ``FLUSHALL``). The baseline is
redis-py's asyncio client with hiredis (``Redis.from_url(url)``) moving the same bytes in the
same run:

- put: `RedisTier.put` of `count` keys from `TASKS` tasks, beside plain ``SET`` of the same
  payloads from as many tasks, and beside pipelined ``SET`` batches of `BATCH` keys; the same
  puts issued `BATCH` at a time by each task (``asyncio.gather``: the engine shares its puts in
  the background, many at once), which the tier's batcher sends in one pipeline per batch,
  beside the same pipelined ``SET`` batches;
- get_many: `RedisTier.get_many` of batches of `BATCH` held keys from `TASKS` tasks, beside a
  ``pipeline(transaction=False)`` of ``GET`` of the same server keys, same batches, same tasks;
- the cross-engine hit (`tierkv.bench.redis_hits`).

Each throughput case runs as pairs (3 with --quick, 7 in full), the tier and its baseline next
to each other, the side that goes first alternating; its row is the pair whose ratio is the
median (both figures from that pair), with the range of the ratios in the case text and every
pair in the JSON. Every write phase starts with none of the bench's keys on the server: the
server reuses the memory the last phase freed, and a phase that followed a deletion ran up to
1.8x faster than one that followed a phase whose keys were still there. Both reads follow an
untimed read of the same keys. --quick pipelines `QUICK_BATCH` keys and moves 4 MiB per phase
(at least a batch per task), 128 MiB in full.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tierkv._units import format_size
from tierkv.bench.common import Progress, Row, no_progress
from tierkv.config import RedisTierConfig
from tierkv.config.schema import redact_url
from tierkv.errors import ConfigError, DeviceError
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.testing.redis_server import RedisServer, redis_server_path
from tierkv.tiers.redis import RedisTier

T = TypeVar("T")
SIZES = (64 << 10, 1 << 20)
#: the least tier / raw ratio the project aims for (put and get_many)
TARGET = 0.8
#: concurrent tasks on each side
TASKS = 8
#: keys per pipelined round trip, both sides (the tier's `batch` is set to it); --quick: 4
BATCH = 16
QUICK_BATCH = 4
_SCHEMES = ("redis://", "rediss://", "unix://")
#: generous: a pipelined batch of 16 MiB on a loaded 2-core box must not count as a failure
TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class Pair:
    """One tier figure beside the baseline figure measured next to it."""

    tier: float
    raw: float
    raw_first: bool

    @property
    def ratio(self) -> float:
        return self.tier / self.raw


async def run_redis_bench(url: str | None = None, *, quick: bool = False,
                          progress: Progress = no_progress) -> tuple[dict[str, Any], list[Row]]:
    """Run the benchmark (see the module docstring) on the server at `url`, or on a private
    ``redis-server`` when `url` is None; JSON-able result and its rows. A missing
    ``redis-server`` or a server that does not answer raises `DeviceError`, a `url` that is not
    a redis URL `ConfigError`."""
    if url is not None and not url.startswith(_SCHEMES):
        # the value itself is not echoed: it may carry a password
        raise ConfigError("--url: expected a redis://, rediss:// or unix:// URL")
    server: RedisServer | None = None
    if url is None:
        if redis_server_path() is None:
            raise DeviceError("--device redis: redis-server is not on PATH (Debian's "
                              "redis-server package; scripts/setup installs it), or give --url")
        server = await asyncio.to_thread(RedisServer)
        url = server.url
    try:
        result, rows = await _run(url, quick, progress)
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)
    result["private_server"] = server is not None
    return result, rows


async def _run(url: str, quick: bool, progress: Progress) -> tuple[dict[str, Any], list[Row]]:
    from tierkv.bench.redis_hits import cross_engine_hits

    prefix = f"tierkv-bench-{secrets.token_hex(6)}:"
    config = RedisTierConfig("bench", 8 << 30, url=url, key_prefix=prefix, timeout=TIMEOUT,
                             batch=BATCH, pool_size=2 * TASKS)
    tier = RedisTier(config)
    # first: no redis-py is a ConfigError, a server that does not answer a DeviceError naming it
    await tier.open()
    import redis.asyncio

    raw = redis.asyncio.Redis.from_url(url)
    try:
        try:
            info = await raw.info("server")
            await _warm_up(tier, raw, prefix)
            rows: list[Row] = []
            pairs: dict[str, Any] = {}
            for size in SIZES:
                size_rows, size_pairs = await _throughput(tier, raw, prefix, size, quick=quick,
                                                          progress=progress)
                rows += size_rows
                pairs.update(size_pairs)
            hit_rows, hits = await cross_engine_hits(url, prefix, tier, raw, quick=quick,
                                                     progress=progress)
            rows += hit_rows
        finally:
            await tier.close()
            try:
                await _delete_prefix(raw, prefix)
            finally:
                await raw.aclose()
    except (redis.exceptions.RedisError, OSError) as exc:
        raise DeviceError(f"redis bench: {config.display_url}: {type(exc).__name__}: "
                          f"{exc}") from None
    result = {"device": "redis", "server": redact_url(url),
              "redis_version": info.get("redis_version", "?"),
              "client": tier.describe()["client"],
              "quick": quick, "tasks": TASKS, "pairs": pairs,
              "cross_engine": hits, "rows": [row.to_json() for row in rows]}
    return result, rows


def _meta(size: int) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), size, 1)


async def _throughput(tier: RedisTier, raw: Any, prefix: str, size: int, *, quick: bool,
                      progress: Progress) -> tuple[list[Row], dict[str, Any]]:
    phase_bytes = (4 if quick else 128) << 20
    rounds = 3 if quick else 7
    batch = QUICK_BATCH if quick else BATCH
    # every task has a batch to pipeline at least
    count = max(TASKS * batch, phase_bytes // size // batch * batch)
    data = os.urandom(size)
    meta = _meta(size)
    keys = [b"\x02bench-%d" % i for i in range(count)]
    server_keys = [tier.server_key(key) for key in keys]
    raw_keys = [prefix.encode() + b"raw:%d" % i for i in range(count)]
    found: list[int] = []

    async def tier_put(key: bytes) -> None:
        await tier.put(key, meta, data)

    async def tier_puts_together(some: Sequence[bytes]) -> None:
        # a batch's puts issued at once: the tier's batcher sends them in one pipeline
        await asyncio.gather(*(tier.put(key, meta, data) for key in some))

    async def raw_set(key: bytes) -> None:
        await raw.set(key, data)

    async def raw_set_batch(some: Sequence[bytes]) -> None:
        pipe = raw.pipeline(transaction=False)
        for key in some:
            pipe.set(key, data)
        await pipe.execute()

    async def tier_get_many(some: Sequence[bytes]) -> None:
        got = await tier.get_many(some)
        found.append(sum(item is not None and len(item[1]) == size for item in got))

    async def raw_get_batch(some: Sequence[bytes]) -> None:
        pipe = raw.pipeline(transaction=False)
        for key in some:
            pipe.get(key)
        found.append(sum(value is not None and len(value) >= size
                         for value in await pipe.execute()))

    async def raw_puts() -> tuple[float, float]:
        """Plain SETs, then pipelined ones, each into keys that do not exist yet."""
        plain = await _lanes(raw_keys, raw_set)
        await raw.unlink(*raw_keys)
        pipelined = await _lanes(_batches(raw_keys, batch), raw_set_batch)
        await raw.unlink(*raw_keys)
        return plain, pipelined

    async def tier_round(raw_first: bool) -> tuple[float, float, float, float]:
        """Tier puts, then both reads of what they wrote, in the order given, then the same
        puts issued a batch at a time; then none of it is left."""
        put = await _lanes(keys, tier_put)
        await _lanes(_batches(server_keys, batch), raw_get_batch)  # untimed: both reads warm
        found.clear()
        if raw_first:
            get_raw = await _lanes(_batches(server_keys, batch), raw_get_batch)
            get_many = await _lanes(_batches(keys, batch), tier_get_many)
        else:
            get_many = await _lanes(_batches(keys, batch), tier_get_many)
            get_raw = await _lanes(_batches(server_keys, batch), raw_get_batch)
        if sum(found) != 2 * count:
            raise DeviceError(f"redis bench: {2 * count - sum(found)} of the objects just "
                              "written were not read back (did the server evict them?)")
        await tier.delete_many(keys)
        together = await _lanes(_batches(keys, batch), tier_puts_together)
        await tier.delete_many(keys)
        return put, together, get_many, get_raw

    cases: dict[str, list[Pair]] = {"put": [], "put_pipelined": [], "put_together": [],
                                    "get_many": []}
    label = format_size(size)
    rate = size * count / (1 << 20)
    for n in range(rounds):
        # every write phase starts with none of the bench's keys on the server (the server
        # reuses the memory the last phase freed: the first writer of a round would otherwise
        # be faster)
        raw_first = n % 2 == 1
        if raw_first:
            set_s, set_pipelined = await raw_puts()
            put, together, get_many, get_raw = await tier_round(raw_first)
        else:
            put, together, get_many, get_raw = await tier_round(raw_first)
            set_s, set_pipelined = await raw_puts()
        cases["put"].append(Pair(rate / put, rate / set_s, raw_first))
        cases["put_pipelined"].append(Pair(rate / put, rate / set_pipelined, raw_first))
        cases["put_together"].append(Pair(rate / together, rate / set_pipelined, raw_first))
        cases["get_many"].append(Pair(rate / get_many, rate / get_raw, raw_first))
        progress(f"redis {label}", n + 1, rounds)
    rows = [
        _pair_row(f"put {label}, {TASKS} tasks", cases["put"],
                  f"redis-py SET, {TASKS} tasks"),
        _pair_row(f"put {label}, {TASKS} tasks, vs pipelined", cases["put_pipelined"],
                  f"redis-py pipelined SET x{batch}, {TASKS} tasks"),
        _pair_row(f"put {label} x{batch} at once, {TASKS} tasks", cases["put_together"],
                  f"redis-py pipelined SET x{batch}, {TASKS} tasks"),
        _pair_row(f"get_many {label} x{batch}, {TASKS} tasks", cases["get_many"],
                  f"redis-py pipelined GET x{batch}, {TASKS} tasks"),
    ]
    details: dict[str, Any] = {f"{name} {label}": _pair_json(pairs)
                               for name, pairs in cases.items()}
    details[f"count {label}"] = count
    details[f"batch {label}"] = batch
    return rows, details


async def _warm_up(tier: RedisTier, raw: Any, prefix: str) -> None:
    """Open `TASKS` connections in each client's pool, so that no timed phase opens one."""
    keys = [b"\x02warm-%d" % i for i in range(TASKS)]
    raw_keys = [prefix.encode() + b"warm:%d" % i for i in range(TASKS)]
    await _lanes(keys, lambda key: tier.put(key, _meta(1), b"\0"))
    await _lanes(raw_keys, lambda key: raw.set(key, b"\0"))
    await tier.delete_many(keys)
    await raw.unlink(*raw_keys)


def _batches(keys: Sequence[bytes], batch: int) -> list[Sequence[bytes]]:
    return [keys[start:start + batch] for start in range(0, len(keys), batch)]


async def _lanes(items: Iterable[T], request: Callable[[T], Awaitable[object]]) -> float:
    """Seconds to run `request` for every item from `TASKS` tasks."""
    pending = iter(items)

    async def lane() -> None:
        for item in pending:
            await request(item)

    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(TASKS)))
    return time.perf_counter() - start


def median_pair(pairs: Sequence[Pair]) -> Pair:
    """The pair whose ratio is the median (the lower middle one of an even count)."""
    return sorted(pairs, key=lambda pair: pair.ratio)[(len(pairs) - 1) // 2]


def _pair_row(case: str, pairs: Sequence[Pair], baseline: str) -> Row:
    middle = median_pair(pairs)
    ratios = [pair.ratio for pair in pairs]
    return Row(f"{case} (median of {len(pairs)} pairs, {min(ratios):.2f}\u2013{max(ratios):.2f})",
               "MiB/s", middle.tier, middle.raw, baseline, TARGET)


def _pair_json(pairs: Sequence[Pair]) -> dict[str, Any]:
    return {"median_ratio": median_pair(pairs).ratio, "ratios": [p.ratio for p in pairs],
            "tier": [p.tier for p in pairs], "raw": [p.raw for p in pairs],
            "raw_first": [p.raw_first for p in pairs]}


async def _delete_prefix(raw: Any, prefix: str) -> None:
    """Delete every key under `prefix` (the bench's own: a fresh random prefix)."""
    batch: list[bytes] = []
    async for key in raw.scan_iter(match=prefix + "*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            await raw.unlink(*batch)
            batch.clear()
    if batch:
        await raw.unlink(*batch)
