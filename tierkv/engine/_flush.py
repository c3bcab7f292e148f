"""`flush`: the barrier that puts everything stored before it on persistent media.

It snapshots the objects no persistent tier holds (the index's unflushed set), writes a copy of
each into the first persistent tier that can hold it (holding each key in turn, so a move or put
of the key in progress finishes first; an object changed meanwhile needs nothing), at most
`migration_concurrency` at once, then flushes every persistent tier through its group commit. An
object that cannot be made durable makes `flush` raise (the first such error) once the others
are done. Objects stored after `flush` was called are not covered. Deletes a persistent tier
refused are first retried, and those still refused recorded as tombstones (`_tombstones`), and
the edges into keys whose objects left are recorded (`_departed`), so the syncs cover them as
well.

One flush runs at a time (`GroupCommit`, as the tiers' flushes): a flush asked for while
another runs waits for it to end, then runs once more, shared by everyone who asked meanwhile.
Two at once wrote the engine's records (the tombstones) side by side: the earlier flush's
record, without a delete refused after it began, could land last, after the later flush had
returned, and a crash then brought the deleted value back. No lock is held across the IO: the
flush is a task of its own, which a caller that stops waiting leaves running (`close` waits
for it like any other caller). Waiting for that task is also a turn of the loop, even when
there is nothing to do, so a task flushing in a loop never starves the others.
"""

from __future__ import annotations

import asyncio
import logging

from tierkv._concurrency import bounded_map
from tierkv.engine._commit import GroupCommit
from tierkv.engine._copies import CopyOps
from tierkv.engine._departed import DepartedEdges
from tierkv.engine._index import IndexEntry
from tierkv.engine._membership import write_unrecorded
from tierkv.engine._state import EngineState
from tierkv.engine._tombstones import Tombstones
from tierkv.errors import DeviceError, TierKVError

log = logging.getLogger("tierkv.engine")


class Flusher:
    __slots__ = ("_copies", "_departed", "_one", "_st", "_tombstones")

    def __init__(self, state: EngineState, copies: CopyOps, tombstones: Tombstones,
                 departed: DepartedEdges) -> None:
        self._st = state
        self._copies = copies
        self._tombstones = tombstones
        self._departed = departed
        #: the single flight: a flush covers every caller that asked before it started
        self._one = GroupCommit(self._flush)

    async def flush(self) -> None:
        """Return once a flush that started after this call has ended; raise its error. Always
        suspends (it waits for the flush's task): with nothing volatile in a hierarchy without
        a persistent tier, or whose tiers had nothing to write and no group commit, a flush
        used to complete without it, and a task flushing in a loop (a checkpointer) kept every
        other task from running."""
        await self._one.sync()

    async def _flush(self) -> None:
        st = self._st
        if not any(tier.persistent for tier in st.tiers):
            return
        failures: list[TierKVError] = []
        st.flushes_begun += 1
        st.flushing = True
        try:
            persisted: list[tuple[IndexEntry, int]] = []
            try:
                await self._tombstones.settle()
            except DeviceError as exc:
                log.warning("flush: %s", str(exc))
                failures.append(exc)
            await self._departed.record()
            await write_unrecorded(st)

            async def persist(entry: IndexEntry) -> None:
                try:
                    placed = await self._persist(entry)
                except TierKVError as exc:
                    log.warning("flush could not persist an object: %s", str(exc))
                    failures.append(exc)
                else:
                    if placed is not None:
                        persisted.append((entry, placed))

            pending = st.index.volatile()
            for attempt in range(2):
                persisted.clear()
                await bounded_map(persist, pending, st.config.scheduler.migration_concurrency)
                for index, tier in enumerate(st.tiers):
                    if tier.persistent:
                        await st.commits[index].sync()
                if st.stranding:  # objects whose lasting copies a reclaim dropped: gone
                    await asyncio.wait(set(st.stranding))
                # a copy written and gone by the time its sync returned: moved up since (an
                # exclusive promotion), dropped by a failed write whose error an earlier flush
                # took, or pinned and dropped by a full log's reclaim: either way this flush
                # has not made it durable yet; write it once more
                lost = [(entry, placed) for entry, placed in persisted if not entry.detached
                        and not any(st.tiers[t].persistent for t in entry.locations)]
                pending = [entry for entry, _ in lost]
                if not pending:
                    break
                if attempt:
                    failures.append(DeviceError(
                        f"{len(lost)} objects flush wrote into tier {st.names[lost[0][1]]!r} "
                        "lost their persistent copies before the sync returned (a failed write, "
                        "or pinned objects the tiers below had to drop for room)"))
            if failures:
                raise failures[0]
        finally:
            st.flushing = False
            # the errors' tracebacks hold `persist`'s frames, which hold this list: a cycle
            # that kept the payloads those frames borrowed (views over gpu slots, which stayed
            # taken) alive until a full collection of the garbage collector
            failures.clear()

    async def _persist(self, entry: IndexEntry) -> int | None:
        """Write a copy of `entry` into a persistent tier; the tier, or None if none was
        needed (or none can hold it)."""
        st = self._st
        async with st.keys.hold(entry.key) as claim:
            if entry.detached or any(st.tiers[t].persistent for t in entry.locations):
                return None
            # a tier whose breaker is open is passed over only if another can take the copy:
            # skipping them all returned a flush (and a close) with the objects only in memory
            durable = st.scheduler.barrier_tier(entry.nbytes)
            if durable is None or not entry.locations:
                return None
            async with self._copies.borrow(entry, entry.locations[0]) as payload:
                if payload is not None:
                    return await self._copies.store(entry, payload, durable, claim,
                                                    insist=True)
        return None
