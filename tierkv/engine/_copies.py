"""Copies of one object in the tiers, written, read and deleted with the index kept in step.

The mechanics every engine operation shares: puts, moves, `flush`, pins and the scrub of what a
cancelled operation left (`_keys`). Each is called by the holder of the key (`KeyGate.hold`),
so no other write or delete of the key runs meanwhile; what may still change under it is the
index entry itself (a get that finds a copy corrupt forgets it; a tier that reclaims space
reports what it dropped), which is why each index change is made after the IO, in one step,
and checked (`Index.add_copy` refuses a detached entry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Collection

from tierkv.engine._departed import DepartedEdges
from tierkv.engine._index import IndexEntry
from tierkv.engine._keys import Claim
from tierkv.engine._state import EngineState
from tierkv.errors import DeviceError, TierFullError, TierKVError
from tierkv.formats.value import ObjectMeta, Payload

log = logging.getLogger("tierkv.engine")


class CopyOps:
    __slots__ = ("_departed", "_scrubs_failing", "_st")

    def __init__(self, state: EngineState, departed: DepartedEdges) -> None:
        self._st = state
        #: records the edges of a copy's ancestors that only volatile copies hold (`store_in`)
        self._departed = departed
        #: tiers whose last scrub failed: logged once until one succeeds (a server down
        #: failed every put's share, and the log took a line per key)
        self._scrubs_failing: set[int] = set()

    async def read(self, entry: IndexEntry, tier: int) -> tuple[ObjectMeta, Payload] | None:
        """The object from `tier`'s copy; ``None`` if the tier failed (counted) or lost it (a
        checksum failure: the copy is forgotten)."""
        st = self._st
        try:
            got = await st.guards[tier].read(st.tiers[tier].get, entry.key)
        except DeviceError as exc:
            st.device_failed(tier, "to read an object", exc)
            return None
        if got is not None and got[0].generation == entry.generation:
            return got
        self.lost(entry, tier)
        return None

    @contextlib.asynccontextmanager
    async def borrow(self, entry: IndexEntry, tier: int) -> AsyncIterator[Payload | None]:
        """The payload of `entry`'s copy in `tier`, for another tier's put to copy from (``None``
        as `read` would). Where the tier lends host memory (the gpu tier's slots on the CPU) it
        is a view of that memory, pinned for the duration, so a move copies its bytes once, off
        the loop where the target copies on worker threads; elsewhere a `read` copy."""
        device = self._st.pinning[tier]
        if device is not None and await device.contains(entry.key):
            lent = device.lend_host(entry.key)
            if lent is not None:
                token, view = lent
                try:
                    yield view
                finally:
                    device.release_pin(token)
                return
        got = await self.read(entry, tier)
        yield None if got is None else got[1]

    def lost(self, entry: IndexEntry, tier: int) -> None:
        """`tier` no longer holds a valid copy of `entry`: it failed its checksum or, in the
        shared tier, the server evicted it or another engine replaced it (`shared_lost`: the
        server's own eviction is no damage, and counted as corrupt it raised false alarms)."""
        if tier in entry.locations and not entry.detached:
            if self._st.tiers[tier].shared:
                self._st.counters.shared_lost += 1
            else:
                self._st.counters.corrupt_reads += 1
            if self._st.index.remove_copy(entry, tier):
                self._st.counters.drops += 1

    async def store(self, entry: IndexEntry, payload: Payload, start: int, claim: Claim, *,
                    fall_through: bool = True, insist: bool = False) -> int:
        """Write a copy into `start` or, if it cannot take one, into the next tier down that can
        (`fall_through`). A tier that is full but has victims to move out is waited for
        (backpressure); a tier that can make no room (everything pinned or busy) or fails is
        skipped. Returns the tier written. `insist` (a flush): the writes are made whatever the
        tiers' breakers say (`Guard.insist`), and fall through to persistent tiers only.

        Raises `TierFullError` when a tier stayed full for `space_timeout` or no tier took the
        object, `DeviceError` when the tiers that could take it failed (the last error), and
        `EngineClosedError` when the engine closes meanwhile.
        """
        st = self._st
        failure: Exception | None = None
        tier: int | None = start
        while tier is not None:
            try:
                if await self.store_in(entry, payload, tier, claim, wait=True, insist=insist):
                    return tier
            except DeviceError as exc:
                st.device_failed(tier, "a write", exc)
                failure = exc
            if not fall_through:
                break
            tier = (st.scheduler.durable_tier(entry.nbytes, tier + 1, any_breaker=True) if insist
                    else st.scheduler.next_tier(entry.nbytes, tier))
        if failure is not None:
            try:
                raise failure
            finally:
                # this frame is in the error's traceback: the local made a cycle that kept
                # `payload` alive (a view lent by the gpu tier: its slots stayed taken) until
                # a full collection of the garbage collector
                failure = None
        # every tier tried can hold the object but made no room: what fills it cannot move out
        raise TierFullError(f"no tier has room for an object of {entry.nbytes} bytes: each that "
                            "can hold it is full of objects that cannot be moved out now "
                            "(pinned, or held by operations in progress)")

    async def store_in(self, entry: IndexEntry, payload: Payload, tier: int, claim: Claim, *,
                       wait: bool, insist: bool = False) -> bool:
        """Write a copy into `tier` and record it; False if the tier has no room and cannot make
        any (or, without `wait`, has none now). A copy written for an entry that was detached
        meanwhile stays marked dirty: the key's scrub deletes it."""
        st = self._st
        device, space, nbytes = st.tiers[tier], st.spaces[tier], entry.nbytes
        deadline: float | None = None
        guard = st.guards[tier]
        write = guard.insist if insist else guard.write
        while True:
            # room a departure freed for writers it woke is theirs: a writer that came later and
            # took it sent them back to wait behind it, again and again, until some waited out
            # `space_timeout` with the tier busy (queueing behind writers not woken yet would
            # make a convoy instead: they wait for a departure, which a tier with room never
            # makes)
            if device.reclaims_space or (device.fits(nbytes)
                                         and (deadline is not None or not space.promised)):
                if (device.persistent and not device.shared and st.dag.has_parents(entry.key)
                        and await self._departed.ahead_of(entry.key, into=tier)):
                    continue  # the record's write awaited: the room is looked at again
                claim.mark(tier)
                try:
                    await write(device.put, entry.key, entry.meta, payload)
                except TierFullError:
                    claim.clear(tier)  # the put stored nothing
                else:
                    if st.index.add_copy(entry, tier, st.now()):
                        claim.clear(tier)
                    st.counters.written_bytes[st.names[tier]] += nbytes
                    space.stored()
                    return True
            if not wait:
                space.cue.set()
                return False
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + space.timeout
                st.counters.space_waits += 1
            try:
                if not await space.wait_for_room(nbytes, deadline):
                    return False
            except TierFullError:
                st.counters.space_timeouts += 1
                raise

    async def remove(self, entry: IndexEntry, tier: int, claim: Claim) -> bool:
        """Delete `entry`'s copy in `tier`, forgetting it first (a get no longer goes there).
        True when that was the object's last copy (it has left the cache)."""
        st = self._st
        last = st.index.remove_copy(entry, tier)
        claim.mark(tier)
        if await self.delete(entry.key, tier):
            claim.clear(tier)
        elif st.refused_delete is not None:  # the key's scrub retries; a flush records it
            st.refused_delete(entry.key, tier)
        return last

    async def discard(self, entry: IndexEntry, claim: Claim, *, keep_shared: bool = False,
                      spare: Collection[int] = ()) -> None:
        """Delete every copy of an entry already detached from the index; `keep_shared`: the
        shared tier's copy is only forgotten, not deleted (another engine invalidated it);
        `spare`: those tiers' copies are only forgotten, left on media for the caller to
        delete, their tiers marked dirty (scrubbed if the caller fails)."""
        st = self._st
        for tier in list(entry.locations):
            device = st.tiers[tier]
            if tier in spare:
                st.index.remove_copy(entry, tier)
                claim.mark(tier)
            elif keep_shared and device.shared:
                st.index.remove_copy(entry, tier)
                device.forget(entry.key)
                st.spaces[tier].freed()
            else:
                await self.remove(entry, tier, claim)

    async def delete(self, key: bytes, tier: int) -> bool:
        """Delete `key` in `tier`; False (logged, counted) if the tier failed."""
        st = self._st
        try:
            await st.guards[tier].delete(st.tiers[tier].delete, key)
        except DeviceError as exc:
            st.device_failed(tier, "a delete", exc)
            return False
        st.commits[tier].note()
        st.spaces[tier].freed()
        return True

    async def scrub(self, key: bytes, dirty: set[int]) -> None:
        """Delete `key`'s copies that the index does not list from the `dirty` tiers."""
        st = self._st
        for tier in sorted(dirty):
            entry = st.index.get(key)
            if entry is None or tier not in entry.locations:
                try:
                    existed = await st.guards[tier].delete(st.tiers[tier].delete, key)
                except TierKVError as exc:  # a failing or closed tier: the orphan stays
                    if isinstance(exc, DeviceError):
                        st.counters.device_errors += 1
                        if st.refused_delete is not None:  # until a flush deletes or records it
                            st.refused_delete(key, tier)
                    if tier not in self._scrubs_failing:
                        self._scrubs_failing.add(tier)
                        log.warning("tier %s: deleting what a failed or cancelled write may have "
                                    "left failed (logged once until one succeeds): %s",
                                    st.names[tier], str(exc))
                else:
                    self._scrubs_failing.discard(tier)
                    st.counters.orphans_scrubbed += existed
                    st.commits[tier].note()
                    st.spaces[tier].freed()
            dirty.discard(tier)
