"""The fault soak (`tierkv bench --faults SPEC`): concurrent clients drive a mixed workload
through the hierarchy while the faults of `SPEC` fire, with cancellations and reopen cycles,
and every answer is checked against a log of what was acknowledged.

Hierarchy: the config's tiers, resized so that the soak's key space spills through all of them,
the persistent ones on fresh media deleted at the end, the breakers' cool-down capped so that
they cycle within minutes (the sizes: `tierkv.bench.faults_hierarchy`).

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
reopened, and every key is read (`_read_back`: a key that `get_many` missed while the engine
still holds it is read again, alone: a read cut off at ``slow_operation`` is not a loss). A key
that held a *durable* version and misses is *lost*:
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

Diagnostics: each lost object is counted by the tier the read before the epoch's last close
found it in (``lost_from``), and each epoch's last reopen reports what the tiers recovered and
let go (``final_reopens``: superseded, tombstoned, freed at open, checkpoint or scan), so that a
loss can be traced to the close, the recovery or the faults before.

A call that takes longer than `STUCK` seconds is cancelled and counted (``stuck``): a bug, or a
hang fault on what the engine must wait for — a tier's flush, or the nvme device's writes that
a flush waits for (reads, puts and deletes are cut off at ``slow_operation``: hangs with
``;ops=get|put|delete`` on a tier, ``;ops=get`` on the nvme device).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from tierkv.bench.common import Progress, Row, no_progress
from tierkv.bench.faults_hierarchy import COOLDOWN_CAP, REGION, SLOT, soak_hierarchy
from tierkv.bench.faults_keylog import MIN_VALUE, _check, _KeyLog, _Run, decode, encode
from tierkv.config import Config, NvmeTierConfig, PmemTierConfig, WritePolicy
from tierkv.errors import ConfigError, TierKVError
from tierkv.testing.faults import FaultPlan, open_with_faults

__all__ = [
    "COOLDOWN_CAP",
    "CORRUPTION_COUNTERS",
    "EPOCH_FREE",
    "KEYS_PER_CLIENT",
    "MIN_VALUE",
    "REGION",
    "ROUND",
    "SLOT",
    "STUCK",
    "decode",
    "encode",
    "run_fault_soak",
    "soak_hierarchy",
]

T = TypeVar("T")

#: keys each client owns
KEYS_PER_CLIENT = 64
#: an epoch ends once fewer than this share of the nvme log's regions are free
EPOCH_FREE = 0.5
#: operations between two reopens, by default
ROUND = 2000
#: seconds after which a call counts as stuck and is cancelled
STUCK = 30.0


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


#: how long a read back keeps reading, one at a time, an object that its `get_many` missed
#: while the engine still holds it (seconds; the breaker's cool-down and a poll or two)
REREAD_FOR = COOLDOWN_CAP + 2.0


async def _read_back(kv: Any, run: _Run, logs: list[_KeyLog]) -> list[Any]:
    """Every key's value (the faults off): one `get_many`, then each key it missed that the
    engine still holds read again alone until served or no longer held (at most `REREAD_FOR`
    seconds). Such a miss is a read that failed, not an object that is gone: every read in
    flight is cut off at `slow_operation` when the process is held up for longer than that (a
    loaded machine: one CI run so counted 32 objects on media as lost, `get_many`'s 32 reads
    in flight), and enough of them open the tier's breaker, which skips it until its
    cool-down ends. Counted in ``reread``, and in ``reread_failed`` where none served it."""
    found: list[Any] = await _within(kv.get_many([log.name for log in logs]), run)
    deadline = time.monotonic() + REREAD_FOR
    for position, log in enumerate(logs):
        if found[position] is not None or not await kv.contains(log.name):
            continue
        run.counts["reread"] += 1
        pause = 0.05
        while True:
            found[position] = got = await _within(kv.get(log.name), run)
            if got is not None or not await kv.contains(log.name):
                break
            if time.monotonic() >= deadline:
                run.counts["reread_failed"] += 1
                break
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)
    return found


async def _held(kv: Any, run: _Run, logs: list[_KeyLog]) -> None:
    """Before the last close of an epoch (the faults off): what each key holds now is what it
    must hold after the close and a reopen (durable), whatever the faults took before."""
    found = await _read_back(kv, run, logs)
    for log, got in zip(logs, found, strict=True):
        version = _check(run, log, got)
        if version is not None:
            log.now, log.durable = {version}, run.persistent
            log.held_in = await kv.locate(log.name)
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


def _corruption(stats: dict[str, Any]) -> int:
    """The corruption the tiers caught since the engine opened."""
    return sum(tier.get(name, 0) for tier in stats["tiers"].values()
               for name in CORRUPTION_COUNTERS)


#: what an open tells of what it recovered and what it let go (the soak reports these for each
#: epoch's last reopen, so that a loss can be traced to where it happened)
RECOVERY_FIGURES = ("recovered_superseded", "recovered_tombstoned", "corrupt_freed_at_open",
                    "superseded_freed_at_open", "over_capacity_at_open", "tombstones_applied",
                    "entries_dropped", "recovered_from")


def _recovery(stats: dict[str, Any]) -> dict[str, Any]:
    """The recovery figures of an engine just opened."""
    engine = stats["engine"]
    figures: dict[str, Any] = {"recovered": dict(engine["recovered"])}
    figures.update({name: engine[name] for name in RECOVERY_FIGURES if name in engine})
    for tier, counters in stats["tiers"].items():
        figures.update({f"{tier}.{name}": counters[name] for name in RECOVERY_FIGURES
                        if name in counters})
    return figures


async def _close(kv: Any, run: _Run, logs: list[_KeyLog]) -> None:
    """Close, the engine's figures kept first; when the close returns, what each key holds is
    its last attempt (and durable if put)."""
    stats = kv.stats()
    run.transitions.update(stats["engine"]["breaker_transitions"])
    run.detected += _corruption(stats)
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
            run.final_opens.append(_recovery(kv.stats()))
            found = await _read_back(kv, run, logs)
            for log, got in zip(logs, found, strict=True):
                _check(run, log, got, final=True)
            run.detected += _corruption(kv.stats())  # what the reads back caught
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
        "lost_from": dict(run.lost_from), "final_reopens": run.final_opens,
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
