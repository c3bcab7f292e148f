"""The fault soak (`tierkv bench --faults SPEC`): concurrent clients drive a mixed workload
through the hierarchy while the faults of `SPEC` fire, with cancellations and reopen cycles,
and every answer is checked against a log of what was acknowledged.

Hierarchy: the config's tiers, resized so that the soak's key space spills through all of them
(as the trace replay resizes them): a gpu tier of 16 KiB slots holding an eighth of the working
set; a pmem pool of 8 MiB kept 85-90 % free (its watermarks) where an nvme log follows, so
that demotion keeps the log busy; an nvme log of 1 MiB regions with room for everything an
epoch writes (a region reclaim drops live entries: a loss that is the cache's, not a fault's);
a redis tier as configured, under a key prefix of the epoch's own. Persistent tiers get fresh
media in scratch directories beside their configured paths, deleted at the end. `[health]` is
the config's, its cool-down capped at `COOLDOWN_CAP` so that breakers cycle within minutes.

Workload: `clients` tasks, each the only writer of its keys, so the log knows what each key may
hold; each operation is a put (of a new version), a delete, a get, a get_many of four keys, or a
flush. A tenth of the puts and gets get a timeout of 0-2 ms (`asyncio.wait_for`), which cancels
many of them. A value is 64 B to `size` bytes (log-uniform), the encoding of its key and
version, so that what a get returns is recognised: the version last put, or a miss, is right; an
older version of the key is *stale*; anything else is *corrupt*.

Rounds: the operations are spread over `rounds`; each round ends with a close while the faults
still fire and a reopen while they do not (recovery is not what is faulted here). After a close
that returned, a key holds the version last put or nothing; after one that raised, any version
written since the last close that returned. An epoch ends when the nvme log has less than half
its regions free (or the operations are done): the faults stop, the engine is closed and
reopened, and every key is read. A key that held a *durable* version and misses is *lost*:
under ``write_through`` the version of every put that returned; under ``write_back`` the
version the engine served just before that close (an acknowledged put may still be lost to a
failing device until a flush covers it — counted as ``dropped_before_the_last_close`` — and
even a flushed one while a promotion out of the pool has moved it up, off the media, until the
next flush). The next epoch starts on fresh media under a fresh key prefix.

Goals: nothing served corrupt; nothing stale during a round; nothing lost but what detected
corruption explains (a flip caught by a checksum drops the copy it hit, and an object whose
only copy that was is gone: each such loss is also a counted checksum failure). Stale versions
after a reopen are reported apart (a delete or overwrite a failing device refused is recorded
as a tombstone at the next flush, `tierkv.engine._tombstones`; one it could not record, or one
the shared tier still holds, is what would show here).

A call that takes longer than `STUCK` seconds is cancelled and counted (``stuck``): a bug, or a
hang fault on what the engine must wait for — a tier's flush, or the nvme device's writes that
a flush waits for (reads, puts and deletes are cut off at ``slow_operation``: hangs with
``;ops=get|put|delete`` on a tier, ``;ops=get`` on the nvme device).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import random
import shutil
import struct
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from tierkv.bench.common import Progress, Row, no_progress
from tierkv.config import (
    MIN_PMEM_POOL,
    NVME_SUPERBLOCK,
    Config,
    GpuTierConfig,
    NvmeTierConfig,
    PmemTierConfig,
    RedisTierConfig,
    TierConfig,
    WritePolicy,
)
from tierkv.errors import ConfigError, TierKVError
from tierkv.testing.faults import FaultPlan, open_with_faults

T = TypeVar("T")

#: keys each client owns
KEYS_PER_CLIENT = 64
MIN_VALUE = 64
SLOT = 16 << 10
REGION = 1 << 20
#: the longest cool-down a soak runs with (seconds)
COOLDOWN_CAP = 5.0
#: an epoch ends once fewer than this share of the nvme log's regions are free
EPOCH_FREE = 0.5
#: operations between two reopens, by default
ROUND = 2000
#: seconds after which a call counts as stuck and is cancelled
STUCK = 30.0
#: the prefix of a value: its version and a digest of its key
_HEADER = struct.Struct("<QQ")


def _digest(key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def encode(key: bytes, version: int, size: int) -> bytes:
    """The value of `key` at `version`: `size` bytes that say which they are."""
    body = hashlib.shake_128(b"%s/%d/%d" % (key, version, size)).digest(size - _HEADER.size)
    return _HEADER.pack(version, _digest(key)) + body


def decode(key: bytes, data: bytes) -> int | None:
    """The version of `key` that `data` is, or None: not a value of `key` (corrupt)."""
    if len(data) < MIN_VALUE:
        return None
    version, digest = _HEADER.unpack_from(data)
    if digest != _digest(key) or data != encode(key, version, len(data)):
        return None
    return int(version)


@dataclass(slots=True)
class _KeyLog:
    """What one key may hold now, what a reopen may bring back, and whether its value is
    durable."""

    name: bytes
    #: the versions a get may return now (a miss is always allowed)
    now: set[int] = field(default_factory=set)
    #: the versions a reopen may bring back: those it might hold at the last close that
    #: returned, and every version put since
    recoverable: set[int] = field(default_factory=set)
    #: the last attempt was a put that returned
    acked: bool = False
    #: its value must survive: a write-through put returned, or the engine served it just
    #: before the epoch's last close (write-back: a put that returned may still be lost to a
    #: failing device until a flush or close covers it, and a flushed object leaves the media
    #: again when a promotion out of the pool moves it up)
    durable: bool = False
    #: a reopen happened since the last attempt
    reopened: bool = False

    def attempted(self, version: int, *, acked: bool, cancelled: bool, durable: bool) -> None:
        """A put of `version` (0: a delete) ended: returned (`acked` for a put; `durable`:
        under write-through), failed (the key holds the new value or none), or was cancelled (it
        may not have started: the old value may stay, as `tests/engine/test_cancellation.py`
        models it)."""
        if self.reopened:
            self.now = set(self.recoverable)
        new = {version} if version else set()
        self.now = self.now | new if cancelled else new
        self.recoverable |= new
        self.acked, self.durable, self.reopened = acked, acked and durable, False

    def closed(self) -> None:
        """A close returned: what the key may hold is all a reopen may bring back."""
        if self.reopened:
            self.now = set(self.recoverable)
            self.reopened = False
        self.recoverable = set(self.now)

    def allowed(self) -> set[int]:
        return self.recoverable if self.reopened else self.now


@dataclass
class _Run:
    plan: FaultPlan
    operations: int
    clients: int
    size: int
    rounds: int
    working_set: int
    log_bytes: int
    #: whether a close makes anything durable (the hierarchy has a persistent tier)
    persistent: bool
    #: whether a put that returned is durable already
    write_through: bool
    progress: Progress
    counts: Counter[str] = field(default_factory=Counter)
    transitions: Counter[str] = field(default_factory=Counter)
    #: corruption the tiers caught (checksums failed)
    detected: int = 0
    version: int = 0
    left: int = 0

    def next_version(self) -> int:
        self.version += 1
        return self.version


@contextlib.contextmanager
def soak_hierarchy(config: Config, working_set: int, log_bytes: int, prefix: str
                   ) -> Iterator[Config]:
    """`config` resized for a soak (see the module), its persistent tiers on fresh media in
    scratch directories deleted on exit, its redis tier's keys under `prefix`."""
    scratch: list[Path] = []
    try:
        tiers: list[TierConfig] = []
        for index, tier in enumerate(config.tiers):
            below = any(isinstance(t, NvmeTierConfig) for t in config.tiers[index + 1:])
            if isinstance(tier, GpuTierConfig):
                slot = min(tier.slot_size, SLOT)
                capacity = max(slot, working_set // 8 // slot * slot)
                tiers.append(replace(tier, capacity=capacity, slot_size=slot))
            elif isinstance(tier, RedisTierConfig):
                tiers.append(replace(tier, key_prefix=f"{tier.key_prefix}{prefix}:"))
            elif isinstance(tier, PmemTierConfig):
                scratch.append(directory := _scratch_dir(tier))
                if below:
                    pool = replace(tier, capacity=MIN_PMEM_POOL, free_low=0.85, free_high=0.9)
                else:  # the last local tier: room for all, nothing evicted
                    pool = replace(tier, capacity=max(MIN_PMEM_POOL, 4 * working_set))
                tiers.append(replace(pool, path=directory / tier.path.name, format=True))
            else:
                assert isinstance(tier, NvmeTierConfig)
                scratch.append(directory := _scratch_dir(tier))
                regions = max(16, math.ceil(log_bytes / REGION))
                tiers.append(replace(tier, path=directory / tier.path.name, format=True,
                                     capacity=NVME_SUPERBLOCK + regions * REGION,
                                     region_size=REGION))
        health = replace(config.health, cooldown=min(config.health.cooldown, COOLDOWN_CAP))
        yield replace(config, tiers=tuple(tiers), health=health)
    finally:
        for directory in scratch:
            shutil.rmtree(directory, ignore_errors=True)


def _scratch_dir(tier: PmemTierConfig | NvmeTierConfig) -> Path:
    try:
        return Path(tempfile.mkdtemp(prefix="tierkv-soak-", dir=tier.path.parent))
    except OSError as exc:
        raise ConfigError(f"{tier.name}.path: cannot make a scratch directory for the soak in "
                          f"{tier.path.parent}: {exc.strerror or exc}") from None


async def _within(call: Awaitable[T], run: _Run, cut: float | None = None) -> T:
    """`call`, cancelled after `cut` seconds (TimeoutError) or after `STUCK` (counted)."""
    limit = STUCK if cut is None else min(cut, STUCK)
    started = time.monotonic()
    try:
        return await asyncio.wait_for(call, limit)
    except TimeoutError:
        if time.monotonic() - started >= STUCK:
            run.counts["stuck"] += 1
        raise


def _check(run: _Run, log: _KeyLog, got: object, *, final: bool = False) -> int | None:
    """Count what a get of `log`'s key answered; the version it served if that was right."""
    counts = run.counts
    counts["gets_checked"] += 1
    if got is None:
        counts["misses"] += 1
        if final and log.durable:
            counts["lost"] += 1
        return None
    version = decode(log.name, bytes(got)) if isinstance(got, bytes) else None
    if version is None:
        counts["served_corrupt"] += 1
    elif version not in log.allowed():
        counts["served_stale_after_reopen" if log.reopened else "served_stale"] += 1
    else:
        counts["hits"] += 1
        return version
    return None


async def _held(kv: Any, run: _Run, logs: list[_KeyLog]) -> None:
    """Before the last close of an epoch (the faults off): what each key holds now is what it
    must hold after the close and a reopen (durable), whatever the faults took before."""
    found = await _within(kv.get_many([log.name for log in logs]), run)
    for log, got in zip(logs, found, strict=True):
        version = _check(run, log, got)
        if version is not None:
            log.now, log.durable = {version}, run.persistent
        elif log.acked:
            run.counts["dropped_before_the_last_close"] += 1


async def _client(kv: Any, run: _Run, logs: list[_KeyLog], rng: random.Random) -> None:
    counts = run.counts
    while run.left > 0:
        run.left -= 1
        roll = rng.random()
        log = rng.choice(logs)
        timeout = rng.uniform(0.0, 0.002) if rng.random() < 0.1 else None
        try:
            if roll < 0.40:
                version = run.next_version()
                size = int(math.exp(rng.uniform(math.log(MIN_VALUE), math.log(run.size))))
                acked = cancelled = False
                try:
                    await _within(kv.put(log.name, encode(log.name, version, size)), run,
                                  timeout)
                    acked = True
                    counts["puts"] += 1
                except TimeoutError:
                    cancelled = True
                    raise
                finally:
                    log.attempted(version, acked=acked, cancelled=cancelled,
                                  durable=run.write_through and run.persistent)
            elif roll < 0.45:
                cancelled = False
                try:
                    await _within(kv.delete(log.name), run)
                    counts["deletes"] += 1
                except TimeoutError:
                    cancelled = True
                    raise
                finally:
                    log.attempted(0, acked=False, cancelled=cancelled, durable=False)
            elif roll < 0.80:
                _check(run, log, await _within(kv.get(log.name), run, timeout))
            elif roll < 0.95:
                batch = rng.sample(logs, min(4, len(logs)))
                found = await _within(kv.get_many([one.name for one in batch]), run)
                for one, got in zip(batch, found, strict=True):
                    _check(run, one, got)
            else:
                await _within(kv.flush(), run)
                counts["flushes"] += 1
        except TimeoutError:
            counts["cancelled"] += 1
        except TierKVError as exc:
            counts[f"failed:{type(exc).__name__}"] += 1


async def _open(config: Config, plan: FaultPlan) -> Any:
    """The engine on `config`, opened while the faults do not fire."""
    enabled, plan.enabled = plan.enabled, False
    try:
        return await open_with_faults(config, plan)
    finally:
        plan.enabled = enabled


#: the tiers' counters of corruption they caught (nvme and pmem checksums, redis records)
CORRUPTION_COUNTERS = ("checksum_failures", "checksum_misses", "corrupt_freed_at_open", "corrupt")


async def _close(kv: Any, run: _Run, logs: list[_KeyLog]) -> None:
    """Close, the engine's figures kept first; when the close returns, what each key holds is
    its last attempt (and durable if put)."""
    stats = kv.stats()
    run.transitions.update(stats["engine"]["breaker_transitions"])
    run.detected += sum(tier.get(name, 0) for tier in stats["tiers"].values()
                        for name in CORRUPTION_COUNTERS)
    try:
        await _within(kv.close(), run)
    except TimeoutError:
        raise TierKVError(f"the soak stopped: a close did not return within {STUCK:g} s (a "
                          "hang fault on writes? give hangs ;ops=get)") from None
    except TierKVError as exc:
        run.counts[f"close_failed:{type(exc).__name__}"] += 1
        return
    for log in logs:
        log.closed()


def _log_free(kv: Any) -> float:
    """The share of the nvme log's regions that are free (1.0 without a log)."""
    for tier in kv.stats()["tiers"].values():
        if tier.get("kind") == "nvme":
            total = tier["regions_used"] + tier["regions_free"]
            return float(tier["regions_free"] / total) if total else 1.0
    return 1.0


async def run_fault_soak(
    config: Config, plan: FaultPlan, *, operations: int, clients: int = 8, size: int = 64 << 10,
    rounds: int | None = None, log_bytes: int | None = None, progress: Progress = no_progress,
) -> tuple[dict[str, Any], list[Row]]:
    """The soak of the module's docstring: `operations` calls of `clients` tasks over `rounds`
    (default: one per `ROUND` operations, at least 4), under `plan` (seeded by its seed);
    results and rows."""
    rounds = rounds or max(4, operations // ROUND)
    if operations < 1 or clients < 1 or rounds < 1:
        raise ConfigError("the soak needs at least one operation, client and round")
    if size < MIN_VALUE:
        raise ConfigError(f"--size: the soak's values are at least {MIN_VALUE} bytes")
    keys = clients * KEYS_PER_CLIENT
    mean = (size - MIN_VALUE) / math.log(size / MIN_VALUE) if size > MIN_VALUE else size
    working_set = int(keys * mean)
    log_bytes = log_bytes or max(64 << 20, 32 * working_set)
    persistent = any(isinstance(t, PmemTierConfig | NvmeTierConfig) for t in config.tiers)
    write_through = config.engine.write_policy is WritePolicy.WRITE_THROUGH
    run = _Run(plan, operations, clients, size, rounds, working_set, log_bytes, persistent,
               write_through, progress)
    epochs = done = 0
    started = time.perf_counter()
    try:
        while done < operations:
            epochs += 1
            done = await _epoch(config, run, epochs, done)
    finally:
        plan.enabled = True
    elapsed = time.perf_counter() - started
    return _report(run, operations, elapsed, epochs)


async def _epoch(config: Config, run: _Run, epoch: int, done: int) -> int:
    """Rounds on fresh media until the log fills or the operations are done, then every key
    read back with the faults off; returns the operations done so far."""
    plan, operations = run.plan, run.operations
    per_round = max(1, operations // run.rounds)
    prefix = f"soak-{uuid.uuid4().hex[:8]}"
    logs = [_KeyLog(f"{prefix}/{i}".encode()) for i in range(run.clients * KEYS_PER_CLIENT)]
    with soak_hierarchy(config, run.working_set, run.log_bytes, prefix) as soak:
        kv = await _open(soak, plan)
        try:
            while done < operations:
                run.left = step = min(per_round, operations - done)
                await asyncio.gather(*(
                    _client(kv, run, logs[c::run.clients],
                            random.Random(f"{plan.seed}/{epoch}/{done}/{c}"))
                    for c in range(run.clients)))
                done += step
                run.progress("fault soak", done, operations)
                free = _log_free(kv)
                if free < EPOCH_FREE or done >= operations:
                    break
                await _close(kv, run, logs)  # the faults still fire
                run.counts["reopens"] += 1
                kv = await _open(soak, plan)
                for log in logs:
                    log.reopened = True
            plan.enabled = False
            await _held(kv, run, logs)
            await _close(kv, run, logs)
            kv = await _open(soak, plan)
            for log in logs:
                log.reopened = True
            found = await kv.get_many([log.name for log in logs])
            for log, got in zip(logs, found, strict=True):
                _check(run, log, got, final=True)
        finally:
            with contextlib.suppress(TierKVError):
                await kv.close()
            plan.enabled = True
    return done


def _report(run: _Run, operations: int, elapsed: float, epochs: int
            ) -> tuple[dict[str, Any], list[Row]]:
    counts, transitions, checksum_failures = run.counts, run.transitions, run.detected
    lost = counts["lost"]
    unexplained = max(0, lost - checksum_failures)
    result: dict[str, Any] = {
        "operations": operations, "seconds": elapsed, "ops_per_s": operations / elapsed,
        "clients": run.clients, "max_value_bytes": run.size, "epochs": epochs,
        "rounds": run.rounds, "working_set_bytes": run.working_set,
        "log_bytes": run.log_bytes,
        "seed": run.plan.seed, "faults_fired": dict(run.plan.fired),
        "breaker_transitions": dict(transitions), "counts": dict(counts),
        "checksum_failures_detected": checksum_failures,
        "lost": lost, "lost_unexplained": unexplained,
        "served_corrupt": counts["served_corrupt"], "served_stale": counts["served_stale"],
        "served_stale_after_reopen": counts["served_stale_after_reopen"],
        "stuck": counts["stuck"],
    }
    rows = [
        Row(f"fault soak: operations, {run.clients} clients", "ops", operations),
        Row("fault soak: throughput", "ops/s", operations / elapsed),
        Row("fault soak: faults injected", "faults", sum(run.plan.fired.values())),
        Row("fault soak: breaker transitions", "changes", sum(transitions.values())),
        Row("fault soak: calls cancelled by a timeout", "calls", counts["cancelled"]),
        Row("fault soak: gets checked", "gets", counts["gets_checked"]),
        Row("fault soak: served corrupt", "gets", counts["served_corrupt"], at_most=0),
        Row("fault soak: served stale during a round", "gets", counts["served_stale"],
            at_most=0),
        Row("fault soak: served stale after a reopen", "gets",
            counts["served_stale_after_reopen"]),
        Row("fault soak: durable objects lost", "objects", lost),
        Row("fault soak: lost beyond detected corruption", "objects", unexplained, at_most=0),
        Row("fault soak: calls stuck", "calls", counts["stuck"], at_most=0),
    ]
    return result, rows
