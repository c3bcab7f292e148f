"""Opening the tiers and indexing what the persistent ones recovered.

Tiers open fastest first. Each persistent tier reports the objects it found intact on its media;
of two copies of a key the newest generation wins and the older copy is deleted, equal
generations are the same object held twice (inclusive caching). Generations of later puts start
above the largest one recovered. Every tier opens before any is indexed: a tier that sat out a
session of the hierarchy is refused or cleared first (`_membership`). If a tier fails to open,
those already open are closed again.
The tiers' drop listeners are installed before anything is written at open (a delete of a
superseded copy, this session's membership record, the engine's own records): a write into a
full log reclaims a region, and its entries must neither stay listed by the index nor be
indexed afterwards from the list the tier recovered before the drop. Until the index holds
everything recovered, a reclaim keeps what it can (the scheduler knows no object yet).
Objects the engine keeps for itself (`keys.is_engine_key`: the fleet cursor) are not indexed;
`EngineState.own` lists where they were found.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence

from tierkv.engine._index import IndexEntry
from tierkv.engine._membership import record_membership, settle_membership
from tierkv.engine._state import EngineState, log
from tierkv.engine.dag import DependencyCycleError
from tierkv.errors import DeviceError
from tierkv.formats.membership import Membership
from tierkv.keys import PROBE_PREFIX, is_engine_key
from tierkv.tiers.base import RecoveredObject, Tier


async def open_tiers(state: EngineState) -> dict[int, Membership]:
    """Open the tiers and index what they recovered; returns the membership records a tier
    did not take yet (`insist_on_records`)."""
    opened: list[Tier] = []
    started = time.perf_counter()
    try:
        recovered: list[list[RecoveredObject]] = []
        for tier in state.tiers:
            recovered.append(list(await tier.open()))
            opened.append(tier)
        dropped: list[set[bytes]] = [set() for _ in state.tiers]
        for index, tier in enumerate(state.tiers):
            tier.set_drop_listener(functools.partial(_dropped_at_open, state, index,
                                                     dropped[index]))
            tier.set_reclaim_worth(_keep_all)
        # before indexing: it settles two copies of a key by generation, and a tier that sat
        # a session out would win with older values (`_membership`)
        kept = await settle_membership(state, recovered)
        for index in range(len(state.tiers)):
            await _adopt(state, index, recovered[index], dropped[index])
        listen_to_tiers(state)
        failed = await record_membership(state, kept)
        state.counters.recovery_s = time.perf_counter() - started
        return failed
    except BaseException:
        for tier in reversed(opened):
            await tier.close()
        raise


def listen_to_tiers(state: EngineState) -> None:
    """Have every tier tell the engine what it drops and frees on its own, and ask the
    scheduler which entries a reclaim keeps."""
    for index, tier in enumerate(state.tiers):
        tier.set_drop_listener(functools.partial(state.dropped, index))
        tier.set_space_listener(state.spaces[index].freed)
        if tier.reclaims_space:
            # which copies a reclaimed region keeps is policy (`lru`: the tier's own rule, but
            # for the engine's records and the last durable copies, `_reclaim_worth`)
            tier.set_reclaim_worth(functools.partial(_reclaim_worth, state, index))


def _reclaim_worth(state: EngineState, tier: int, key: bytes) -> float | None:
    """The scheduler's worth of `key`'s copy in `tier`, but for a copy a write-through put
    waits to see flushed: that is worth keeping at any price."""
    if key in state.syncing:
        return math.inf
    entry = state.index.get(key)
    return state.scheduler.reclaim_worth(tier, key, entry.locations if entry else ())


def _dropped_at_open(state: EngineState, tier: int, dropped: set[bytes],
                     keys: Sequence[bytes], for_room: bool) -> None:
    """A tier dropped copies while the engine indexes what the tiers recovered: those indexed
    already are forgotten, the others are not indexed (`_adopt`); both count as drops (the
    open evicted them)."""
    dropped.update(keys)
    state.counters.drops += sum(1 for key in keys
                                if key not in state.index and not is_engine_key(key))
    state.dropped(tier, keys, for_room)


def _keep_all(_key: bytes) -> float:
    return math.inf


async def _adopt(state: EngineState, tier_index: int, recovered: list[RecoveredObject],
                 dropped: set[bytes]) -> None:
    """Index the objects `tier_index` recovered, but those it has `dropped` since; each
    indexed is counted (`recovered`: not the engine's own records, probes and older copies,
    which an empty cache counted as recovered objects)."""
    index = state.index
    now = state.now()
    for obj in recovered:
        if obj.key in dropped:
            continue
        if obj.key.startswith(PROBE_PREFIX):
            # the profile probe's, left by a process killed between its write and its delete:
            # indexed, it took space and counted as an object for good
            await _delete_copy(state, tier_index, obj.key)
            continue
        if is_engine_key(obj.key):
            state.own.setdefault(obj.key, []).append(tier_index)
            index.adopt_generation(obj.meta.generation)
            continue
        entry = index.get(obj.key)
        if entry is not None and entry.generation > obj.meta.generation:
            await _delete_superseded(state, tier_index, obj.key)
            continue
        if entry is not None and entry.generation < obj.meta.generation:
            index.detach(obj.key, replaced=True)
            for older in entry.locations:
                await _delete_superseded(state, older, obj.key)
            entry = None
        if obj.key in dropped:  # while an older copy was deleted (a write: a reclaim)
            continue
        if entry is None:
            entry = IndexEntry(obj.key, obj.meta)  # with the generation found on media
        index.add_copy(entry, tier_index, now)
        state.counters.recovered[state.names[tier_index]] += 1
        index.adopt_generation(obj.meta.generation)
        try:  # the DAG comes back with the objects: each header names its parents
            state.dag.set_parents(obj.key, obj.meta.parents)
        except DependencyCycleError as exc:
            state.counters.dag_edges_refused += 1
            log.warning("recovery: %s; the edges of that object are not restored", str(exc))


async def _delete_superseded(state: EngineState, tier: int, key: bytes) -> None:
    """Delete an older copy of `key` in `tier` (`_delete_copy`): the newer copy is what the
    index lists, and wins again at the next open if the device refuses."""
    state.counters.recovered_superseded += 1
    await _delete_copy(state, tier, key)


async def _delete_copy(state: EngineState, tier: int, key: bytes) -> None:
    """Delete a copy of `key` in `tier` that the index does not list. One the device refuses
    stays on its media and is kept to retry and record like any refused delete
    (`_tombstones`)."""
    try:
        await state.guards[tier].delete(state.tiers[tier].delete, key)
    except DeviceError as exc:
        log.warning("recovery: tier %s failed to delete a copy (kept to retry): %s",
                    state.names[tier], str(exc))
        if state.refused_delete is not None:
            state.refused_delete(key, tier)


def cut_off_by_damage(state: EngineState, departed_lost: bool) -> list[bytes]:
    """Keys that something recovered derives from while nothing says what they derive from,
    because damage took what did: a tier found their record damaged at open
    (`Tier.damaged_at_open`) and no intact copy was indexed (their header was where their
    parents were written), or, `departed_lost`, the record of edges into keys that left is
    unreadable (then every key that holds no object and has children). What derives from them
    must go: an invalidation of their ancestors no longer reaches it (a -> b -> c, b's record
    damaged: c survived a new value of a, also after every later restart)."""
    dag, index = state.dag, state.index
    suspects: set[bytes] = set(dag) if departed_lost else set()
    for tier in state.tiers:
        suspects |= tier.damaged_at_open()
    return sorted(key for key in suspects if key not in index and dag.has_children(key)
                  and not dag.has_parents(key) and not is_engine_key(key))
