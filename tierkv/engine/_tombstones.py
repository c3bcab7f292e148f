"""Deletes a failing device refused: retried, and recorded so that the object never comes back.

A delete (of `delete`, `invalidate`, an overwriting `put`, the scrub of a cancelled write, the
older of two copies that recovery finds, the profile probe's) that a persistent tier fails
leaves a copy on its media that the index no longer lists: a reopen would recover it as live,
and a deleted or overwritten value would come back. Such a copy is *pending* here: its key and
the tiers that may still hold it. The health watch retries them every second while any is
pending, in the background (`tick`): an engine that never flushes kept the copies, and their
space, until it closed. `flush` (and so `close`) first
retries each pending delete under the key's gate, then writes what is still pending as
tombstones (`tierkv.formats.tombstones`: every copy of the key up to a generation bound is
dead) into the persistent tiers that take the record (two where there are two: `_own`), before
the tiers' syncs: a flush that returns covers the deletes that returned before it, as it covers
the puts. Flushes run one at a time (`_flush`), so `settle` is never two at once: the record
last written is the one the last flush computed. A flush that can write the record nowhere
raises `DeviceError`.

The bound is taken under the key's gate, so no put of the key is half-way: with no entry
indexed, every generation numbered so far; with one, the generations below its own (its copies,
which the index lists, are live; a copy the refusing tier holds of it was overwritten by it).
At open, once every tier has been indexed, the records found are applied: entries at or below
their bound are removed and their copies deleted (pending again where a tier still refuses),
and later puts are numbered above every bound.
"""

from __future__ import annotations

import asyncio
import logging

from tierkv.engine._copies import CopyOps
from tierkv.engine._own import keep_own, own_tiers, read_records
from tierkv.engine._state import EngineState
from tierkv.errors import DeviceError, TierKVError
from tierkv.formats.tombstones import decode_tombstones, encode_tombstones
from tierkv.keys import TOMBSTONES_KEY

log = logging.getLogger("tierkv.engine")


class Tombstones:
    __slots__ = ("_copies", "_pending", "_recorded", "_retrying", "_st")

    def __init__(self, state: EngineState, copies: CopyOps) -> None:
        self._st = state
        self._copies = copies
        #: key → the persistent tiers whose delete of its copy failed
        self._pending: dict[bytes, set[int]] = {}
        #: the bounds the record on media holds (last written, or found at open)
        self._recorded: dict[bytes, int] = {}
        state.record_dropped[TOMBSTONES_KEY] = self._unrecorded
        #: the background retry in progress (`tick`), if any
        self._retrying: asyncio.Task[None] | None = None
        state.refused_delete = self.refused

    @property
    def pending(self) -> int:
        """Keys with a copy a tier refused to delete, not yet deleted."""
        return len(self._pending)

    def refused(self, key: bytes, tier: int) -> None:
        """`tier` failed to delete `key`'s copy, which the index no longer lists."""
        device = self._st.tiers[tier]
        if device.shared:
            if self._st.refused_shared_delete is not None:  # deleted again by the fleet's log
                self._st.refused_shared_delete(key)
            return
        if not device.persistent:
            return  # gone at the next open anyway
        tiers = self._pending.setdefault(key, set())
        if tier not in tiers:
            tiers.add(tier)
            self._st.counters.deletes_refused += 1

    def tick(self) -> None:
        """The health watch's call, every second: retry the pending deletes in the background
        (one pass at a time) where a tier holding one takes calls again. What is still refused
        waits for the next tick, and a flush records it."""
        st = self._st
        if not self._pending or st.closing or (self._retrying and not self._retrying.done()):
            return
        keys = [key for key, tiers in self._pending.items()
                if any(st.scheduler.usable[tier] for tier in tiers)]
        if keys:
            self._retrying = st.spawn(self._retry_all(keys))

    async def _retry_all(self, keys: list[bytes]) -> None:
        for key in keys:
            if self._st.closing:
                return
            await self._retry(key)

    async def settle(self) -> None:
        """Retry the pending deletes; record those still refused (`flush`, before the syncs).
        `DeviceError` if they could not be recorded anywhere."""
        bounds: dict[bytes, int] = {}
        for key in list(self._pending):
            bound = await self._retry(key)
            if bound is not None:
                bounds[key] = bound
        if bounds != self._recorded:
            await self._record(bounds)

    async def _retry(self, key: bytes) -> int | None:
        """Delete `key`'s refused copies again; the bound of its tombstone if one still
        stands, else None."""
        st = self._st
        async with st.keys.hold(key):
            tiers = self._pending.get(key)
            if tiers is None:
                return None
            entry = st.index.get(key)
            for tier in sorted(tiers):
                if entry is not None and tier in entry.locations:
                    tiers.discard(tier)  # a later value's copy replaced the refused one
                    continue
                try:
                    await st.guards[tier].delete(st.tiers[tier].delete, key)
                except TierKVError:
                    continue
                tiers.discard(tier)
                st.counters.deletes_retried += 1
                st.spaces[tier].freed()
            if not tiers:
                del self._pending[key]
                return None
            return st.index.issued if entry is None else entry.generation - 1

    def _unrecorded(self, _tier: int) -> None:
        """A tier dropped a copy of the record: the next flush writes it again."""
        self._recorded = {}

    async def _record(self, bounds: dict[bytes, int]) -> None:
        st = self._st
        if not bounds:  # nothing refused any more: the older records are void
            await keep_own(st, TOMBSTONES_KEY, None)
            self._recorded = bounds
            return
        try:
            # an older record left behind stays true (generations only grow)
            await keep_own(st, TOMBSTONES_KEY, encode_tombstones(bounds), own_tiers(st))
        except TierKVError as exc:
            raise DeviceError(
                f"{len(bounds)} deletes that a device refused could not be recorded in any "
                "persistent tier: those objects may come back after a restart") from exc
        self._recorded = bounds

    async def recover(self) -> None:
        """At open: apply the tombstones recorded by earlier runs to what the tiers recovered."""
        st = self._st
        found: dict[bytes, int] = {}
        for bounds in await read_records(
                st, TOMBSTONES_KEY, decode_tombstones,
                "the record of refused deletes is unreadable (objects deleted while a device "
                "refused may come back)"):
            for key, bound in bounds.items():
                found[key] = max(found.get(key, 0), bound)
        self._recorded = found
        for key, bound in found.items():
            st.index.adopt_generation(bound)
            entry = st.index.get(key)
            if entry is None or entry.generation > bound:
                continue
            async with st.keys.hold(key) as claim:
                entry = st.index.detach(key)
                if entry is not None:
                    await self._copies.discard(entry, claim)
                    st.counters.recovered_tombstoned += 1
