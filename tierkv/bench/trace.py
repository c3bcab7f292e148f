"""Replay of a real KV-cache request trace through the engine, under prefix semantics.

The trace is in the Mooncake format (`read_trace`): one JSON object per line with a
``timestamp`` (milliseconds) and ``hash_ids``, one id per 512-token block of the prompt, ids
chained so that equal leading runs mean equal prefixes. Each capacity point (`replay`) opens a
fresh engine on the config resized to that point (`tierkv.bench.trace_config`) and replays the
requests as an inference server would (`replay_point`): `get_many` over the request's block keys;
the leading run of hits is what the cache serves (block i is usable only when blocks 0..i-1 are);
every block missing from the first miss on is computed and `put`, chained to its parent. Blocks
found behind the first miss are left where they are: their get already counted as an access, and
a put would overwrite them (invalidating their descendants). Values are `block_size` random bytes.

The engine runs on a virtual clock that reads the current request's trace timestamp, so score
decay and TTLs see trace time while the replay runs as fast as it can. Beside each point: the
offline LRU and Belady MIN hit ratios of the same number of blocks (`trace_baselines`), and the
report (`trace_report`).

Which tier served a block: each key is `locate`d just before the request's `get_many` (an index
lookup, cheap enough for every request), and the served leading run is counted by the fastest tier
that held it then. The engine's own hit counters, reported beside, count every block found,
behind the first miss too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tierkv.bench.common import Progress, Row, no_progress
from tierkv.bench.trace_baselines import lru_hit_ratio, min_hit_ratio
from tierkv.bench.trace_config import ReplayPolicy, capacity_point
from tierkv.bench.trace_report import Baselines, point_result, point_rows, summary
from tierkv.config import Config
from tierkv.engine import Engine
from tierkv.engine import open as open_engine
from tierkv.errors import ConfigError
from tierkv.keys import BlockKey

TRACE_BLOCK_TOKENS = 512
#: requests between two samples of what the hierarchy holds
SAMPLE_EVERY = 64
#: the largest id a block key can encode (`block_key` packs it into 8 bytes)
MAX_HASH_ID = (1 << 64) - 1


class TraceRequest(NamedTuple):
    """One request of a trace: when it came (seconds from the trace start) and its blocks."""

    timestamp: float
    hash_ids: tuple[int, ...]


#: the longest line of a trace read (its line end included): a record takes a few KiB
MAX_LINE = 16 << 20


def read_trace(path: Path, limit: int | None = None) -> Iterator[TraceRequest]:
    """The requests of a Mooncake JSON-lines trace, in order (the first `limit` of them).

    Raises `ValueError` naming the file and line of the first record that is not a JSON object
    with a non-negative number ``timestamp`` (ms, never decreasing) and a list of integer
    ``hash_ids`` in 0..2**64-1; ``input_length`` and ``output_length`` are optional but, if
    present, non-negative integers; and naming a line longer than `MAX_LINE`. Blank lines are
    skipped; `OSError` if the file cannot be read.
    """
    previous = 0.0
    count = 0
    with path.open("rb") as lines:
        # each line read up to a bound: a file without line ends (a pool named by mistake,
        # /dev/zero) was read whole as its first line, a MemoryError or the OOM killer; and
        # decoded alone, so that bytes that are not UTF-8 are reported with their line
        for number, raw in enumerate(iter(lambda: lines.readline(MAX_LINE + 1), b""), start=1):
            if limit is not None and count >= limit:
                return
            if len(raw) > MAX_LINE:
                raise ValueError(f"{path}:{number}: longer than {MAX_LINE} bytes: not a "
                                 "trace record")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{number}: not UTF-8 text: not a trace record"
                                 ) from None
            if not line.strip():
                continue
            request = _parse_record(line, f"{path}:{number}", previous)
            previous = request.timestamp
            count += 1
            yield request


def _parse_record(line: str, where: str, previous: float) -> TraceRequest:
    try:
        record = json.loads(line)
    except RecursionError:  # arrays or objects nested thousands deep
        raise ValueError(f"{where}: not JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python reads
        raise ValueError(f"{where}: not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    stamp = record.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not stamp >= 0:
        raise ValueError(f"{where}: timestamp must be a non-negative number of ms, got "
                         f"{_shown(stamp)}")
    try:
        seconds = float(stamp) / 1000  # an integer beyond a float's range overflows
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds):
        raise ValueError(f"{where}: timestamp is beyond any clock: {_shown(stamp)}")
    if seconds < previous:
        raise ValueError(f"{where}: timestamp {stamp!r} is before the previous request's")
    ids = record.get("hash_ids")
    if not isinstance(ids, list) or not all(
            type(i) is int and 0 <= i <= MAX_HASH_ID for i in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers in 0..2**64-1")
    for name in ("input_length", "output_length"):
        value = record.get(name, 0)
        if type(value) is not int or value < 0:
            raise ValueError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return TraceRequest(seconds, tuple(ids))


def _shown(value: object) -> str:
    """`value` for a message: an integer too long to print whole is shown by its length."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)


def block_key(hash_id: int, position: int) -> BlockKey:
    """The key of block `position` of a request, whose trace id is `hash_id`."""
    digest = hashlib.sha256(b"tierkv.trace\x00" + hash_id.to_bytes(8, "little")).digest()
    return BlockKey(digest[:16], (position + 1) * TRACE_BLOCK_TOKENS, 10000.0)


class TraceClock:
    """The engine's clock during a replay: the current request's timestamp, in seconds."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class PointCounts:
    """What one replay saw: prefix-served blocks, puts, lookups, what the hierarchy held."""

    requests: int = 0
    references: int = 0
    served: int = 0
    #: served blocks by the tier that held them (the fastest copy) when the request looked up
    served_by_tier: Counter[str] = field(default_factory=Counter)
    puts: int = 0
    lookup_us: list[float] = field(default_factory=list)
    #: distinct objects the engine held (sampled every `SAMPLE_EVERY` requests): the most at
    #: once, and the sum over the samples of the second half of the replay (the cache full, its
    #: warm-up over); the most bytes each tier used
    max_objects: int = 0
    objects_sampled: int = 0
    samples: int = 0
    max_used: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def mean_objects(self) -> float:
        return self.objects_sampled / self.samples if self.samples else 0.0


async def replay_point(kv: Engine, requests: Sequence[TraceRequest], clock: TraceClock, *,
                       block_size: int, phase: str, progress: Progress = no_progress,
                       ) -> PointCounts:
    """Replay `requests` through `kv` (see the module docstring), then let it settle."""
    value = os.urandom(block_size)
    counts = PointCounts(requests=len(requests))
    keys_of: dict[tuple[int, int], BlockKey] = {}
    started = time.perf_counter()
    for number, request in enumerate(requests):
        clock.now = request.timestamp
        keys = [keys_of.get((h, p)) or keys_of.setdefault((h, p), block_key(h, p))
                for p, h in enumerate(request.hash_ids)]
        # where each block is before the lookup: the tier the get reads it from
        located = [await kv.locate(key) for key in keys]
        t0 = time.perf_counter_ns()
        found = await kv.get_many(keys)
        counts.lookup_us.append((time.perf_counter_ns() - t0) / 1000)
        prefix = next((i for i, got in enumerate(found) if got is None), len(keys))
        counts.references += len(keys)
        counts.served += prefix
        counts.served_by_tier.update(tier for tier in located[:prefix] if tier is not None)
        for i in range(prefix, len(keys)):
            if found[i] is None:
                await kv.put(keys[i], value, parents=(keys[i - 1],) if i else ())
                counts.puts += 1
        if number % SAMPLE_EVERY == 0:
            _sample(kv, counts, steady=2 * number >= len(requests))
            progress(phase, number, len(requests))
    await kv.settle()
    counts.seconds = time.perf_counter() - started
    _sample(kv, counts, steady=True)
    progress(phase, len(requests), len(requests))
    return counts


def _sample(kv: Engine, counts: PointCounts, *, steady: bool) -> None:
    objects = kv.stats()["engine"]["objects"]
    counts.max_objects = max(counts.max_objects, objects)
    if steady:
        counts.objects_sampled += objects
        counts.samples += 1
    for tier in kv.tiers:
        counts.max_used[tier.name] = max(counts.max_used[tier.name], tier.used)


def _check_block_fits(kv: Engine, block_size: int) -> None:
    for tier in kv.tiers:
        if not tier.can_ever_hold(block_size):
            raise ConfigError(f"--block-size: {block_size} bytes do not fit one object of tier "
                              f"{tier.name!r}")


async def replay(config: Config, requests: Sequence[TraceRequest], *,
                 capacities: Sequence[float], policy: ReplayPolicy, block_size: int,
                 progress: Progress = no_progress) -> tuple[dict[str, Any], list[Row]]:
    """Replay `requests` at each capacity (a fraction of the trace's distinct blocks) through a
    fresh engine on `config` resized to it, beside the offline baselines of as many blocks.

    Returns the JSON result (``points``, one record per capacity, beside the averages over them
    and the trace's sizes) and the rows printed.
    Raises `ConfigError` when the config cannot be resized or a block does not fit a tier.
    """
    ids = [request.hash_ids for request in requests]
    distinct = len({block for blocks in ids for block in blocks})
    points: list[dict[str, Any]] = []
    rows: list[Row] = []
    for fraction in capacities:
        total_bytes = int(fraction * distinct * block_size)
        label = f"{fraction * 100:g}%"
        with capacity_point(config, total_bytes, block_size, policy) as (sized, sizings):
            counts, stats, opened = await _run_point(
                sized, requests, block_size, f"trace {label}", progress)
        holdable = sum(capacity // footprint for capacity, footprint in opened.values())
        baselines = _baselines(ids, total_bytes // block_size, holdable,
                               round(counts.mean_objects))
        result = point_result(counts, stats, fraction=fraction, total_bytes=total_bytes,
                              block_size=block_size, baselines=baselines, sizings=sizings,
                              opened=opened)
        points.append(result)
        rows.extend(point_rows(label, result))
    document, summary_rows = summary(points)
    document.update(
        requests=len(requests),
        block_references=sum(len(blocks) for blocks in ids),
        distinct_blocks=distinct,
        block_size=block_size,
        policy=policy.value,
        points=points,
    )
    return document, rows + summary_rows


def _baselines(ids: Sequence[Sequence[int]], blocks: int, holdable: int, held: int
               ) -> Baselines:
    """LRU and MIN of `blocks`; LRU of the `holdable` blocks the tiers had room for and of the
    `held` blocks they held on average once full."""
    t0 = time.perf_counter()
    lru = lru_hit_ratio(ids, blocks)
    t1 = time.perf_counter()
    best = min_hit_ratio(ids, blocks)
    t2 = time.perf_counter()
    return Baselines(blocks, lru, best, t1 - t0, t2 - t1,
                     holdable=holdable, lru_at_holdable=lru_hit_ratio(ids, holdable),
                     held=held, lru_at_held=lru_hit_ratio(ids, held))


async def _run_point(config: Config, requests: Sequence[TraceRequest], block_size: int,
                     phase: str, progress: Progress,
                     ) -> tuple[PointCounts, dict[str, Any], dict[str, tuple[int, int]]]:
    """One capacity point: (counts, the engine's stats after settling, and each tier's
    (capacity, footprint of one block) as opened)."""
    clock = TraceClock()
    async with open_engine(config, clock=clock) as kv:
        _check_block_fits(kv, block_size)
        overheads = {tier.name: (tier.capacity, tier.footprint(block_size)) for tier in kv.tiers}
        counts = await replay_point(kv, requests, clock, block_size=block_size, phase=phase,
                                    progress=progress)
        stats = kv.stats()
    return counts, stats, overheads

