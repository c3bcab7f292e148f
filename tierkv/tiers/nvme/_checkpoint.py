"""The NVMe tier's index checkpoint: written into free regions at close, loaded at open.

The log keeps enough regions FREE for it (`_reserve`), so a full log writes it too; only a log
too small for the reservation, or one whose reservation could not be restored, may find no room
and skip it (the next open scans).

Separate because it is the tier's whole-index persistence, apart from the log it summarises: the
msgpack checkpoint (`tierkv.formats.nvme_layout`), the superblock writes that record or clear it,
and the checks that make a damaged checkpoint fall back to a scan (`CorruptObjectError`).
`CheckpointIO` holds the tier's `LogState` and the write-behind (`RegionWrites`), which seals the
flushed head in place before the checkpoint is written.
"""

from __future__ import annotations

from dataclasses import replace

from tierkv.errors import CorruptObjectError
from tierkv.formats.nvme_layout import (
    MAX_CHECKPOINT_REGIONS,
    SUPERBLOCK_SIZE,
    Checkpoint,
    CheckpointEntry,
    CheckpointRegion,
    Superblock,
    align_up,
    checkpoint_chunks,
    checkpoint_total,
    decode_checkpoint,
    encode_checkpoint,
    encode_superblock,
)
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers.nvme._regions import RegionState
from tierkv.tiers.nvme._scan import read_range
from tierkv.tiers.nvme._state import LogState, log
from tierkv.tiers.nvme._tasks import settle
from tierkv.tiers.nvme._writes import RegionWrites


class CheckpointIO:
    """Superblock writes and the index checkpoint; see `tierkv.tiers.nvme.tier`."""

    __slots__ = ("_st", "_writes")

    def __init__(self, state: LogState, writes: RegionWrites) -> None:
        self._st = state
        self._writes = writes

    async def write_superblock(self, sb: Superblock) -> None:
        st = self._st
        _d, io, _s = st.dev_io()
        buf = st.pool.acquire(SUPERBLOCK_SIZE)
        try:
            buf.view[:SUPERBLOCK_SIZE] = encode_superblock(sb)
            await io.write(buf, 0, SUPERBLOCK_SIZE)
            await io.sync()
        finally:
            st.pool.release(buf)
        st.counters["bytes_written"] += SUPERBLOCK_SIZE

    def newest_on_media(self) -> tuple[int, int]:
        """The newest region use whose header is written, as ``(seq, index)``: the head's when
        it has one (no other is newer), else the newest region's that holds anything. A flush
        takes it before its sync, which then covers that header."""
        st = self._st
        head = st.head
        if head is not None and head.header_written:
            return head.seq, head.index
        return max(((r.seq, r.index) for r in st.regions
                    if r.state is not RegionState.FREE and r.header_written), default=(0, 0))

    async def record_newest(self, newest: tuple[int, int]) -> None:
        """After a flush made the log durable: name `newest` (`newest_on_media`, taken before
        its sync) in the superblock, which a later scan checks for (`NvmeRecovery`). One
        superblock write and sync, only when it is newer than the one recorded: at most once
        per region opened. Flushes call it one after another (`LogFlush`)."""
        st = self._st
        _d, _io, sb = st.dev_io()
        if newest[0] > sb.newest_seq:
            recorded = replace(sb, newest_seq=newest[0], newest_index=newest[1])
            await self.write_superblock(recorded)
            st.sb = recorded  # only once written: a failed write is done again next flush

    async def load(self, sb: Superblock) -> None:
        """Load the checkpoint `sb` names into the (empty) index; `CorruptObjectError` if bad."""
        st = self._st
        device, io, _s = st.dev_io()
        size = st.config.region_size
        # only the checkpoint's own blocks: the file may end right after them
        lengths = [align_up(min(size, sb.checkpoint_length - k * size), st.align)
                   for k in range(len(sb.checkpoint_regions))]
        if not lengths or lengths[-1] <= 0 or any(
                st.offset(i) + n > device.size
                for i, n in zip(sb.checkpoint_regions, lengths, strict=True)):
            # a truncated file holds no checkpoint past its end: scan what is left
            raise CorruptObjectError("checkpoint does not fit its regions or the media")
        parts = [await read_range(io, st.pool, st.offset(i), n)
                 for i, n in zip(sb.checkpoint_regions, lengths, strict=True)]
        data = b"".join(parts)
        total, check = checkpoint_total(data)
        if total != sb.checkpoint_length or check != sb.checkpoint_checksum:
            raise CorruptObjectError("checkpoint does not match the superblock")
        ckpt = decode_checkpoint(data, sb.uuid)
        st.next_seq = ckpt.next_seq
        for r in ckpt.regions:
            if r.index >= st.region_count or r.index in sb.checkpoint_regions \
                    or r.seq < sb.floor_seq:
                raise CorruptObjectError("checkpoint names an impossible region")
            if st.offset(r.index) + r.used > device.size:
                raise CorruptObjectError("checkpoint names a region past the end of the media")
            region = st.regions[r.index]
            region.state, region.seq, region.used = RegionState.SEALED, r.seq, r.used
            region.header_written = True
            region.last_access = r.last_access
            region.shadows = set(r.shadows)
            st.tick = max(st.tick, r.last_access)
        # a sealed region may shadow a FREE one: a region whose write failed, part of which may
        # still be on media (see `RegionWrites.drop_failed`); it is reused first after open
        if any(i >= st.region_count for r in ckpt.regions for i in r.shadows):
            raise CorruptObjectError("checkpoint region shadows an impossible region")
        for e in ckpt.entries:
            if e.region >= st.region_count:
                raise CorruptObjectError("checkpoint entry in an impossible region")
            target = st.regions[e.region]
            # entries lie packed after the region header block, at the log's granularity
            if target.state is not RegionState.SEALED or e.offset + e.length > target.used \
                    or e.offset < sb.alignment or e.offset % st.grain or e.length % st.grain \
                    or not e.nbytes < e.length:
                raise CorruptObjectError("checkpoint entry outside its region")
            try:
                kind = ValueKind(e.kind)
            except ValueError as exc:
                raise CorruptObjectError("checkpoint entry of unknown kind") from exc
            meta = ObjectMeta(kind, e.dtype, e.shape, e.nbytes, e.generation, e.parents)
            st.insert(e.key, target, offset=e.offset, length=e.length, meta=meta, hits=e.hits)

    async def write(self) -> None:
        """At close, after a successful flush: checkpoint the index and record it, if it fits."""
        st = self._st
        _d, io, sb = st.dev_io()
        if st.head is not None:
            self._writes.seal_in_place(st.head)
        regions = [CheckpointRegion(r.index, r.seq, r.used, r.last_access, tuple(sorted(r.shadows)))
                   for r in st.regions if r.state is RegionState.SEALED]
        # named as the newest: the newest region it describes (its chunks go to FREE ones)
        newest = max(((r.seq, r.index) for r in regions), default=(sb.newest_seq, sb.newest_index))
        sb = replace(sb, newest_seq=newest[0], newest_index=newest[1])
        entries = []
        for key in list(st.index.keys()):
            loc, meta = st.index.get(key), st.index.meta(key)
            assert loc is not None and meta is not None
            entries.append(CheckpointEntry(key, loc.region, loc.offset, loc.length, loc.hits,
                                           int(meta.kind), meta.dtype, meta.shape, meta.nbytes,
                                           meta.generation, meta.parents))
        data = encode_checkpoint(Checkpoint(sb.uuid, st.next_seq, tuple(regions), entries))
        chunks = checkpoint_chunks(data, st.config.region_size, st.align)
        free = st.regions.free_indices(min(len(chunks), MAX_CHECKPOINT_REGIONS))
        if len(chunks) > len(free) or len(chunks) > MAX_CHECKPOINT_REGIONS:
            st.counters["checkpoint_skipped"] += 1
            log.warning("%s: no room for a %d-byte checkpoint; the next open will scan",
                        st.name, len(data))
            return
        targets = tuple(free[: len(chunks)])
        for index in targets:  # a region kept FREE may still have its empty header going
            await settle(st.regions[index].writes)
        buf = st.pool.acquire(st.config.region_size)
        try:
            for chunk, index in zip(chunks, targets, strict=True):
                buf.view[: len(chunk)] = chunk
                await io.write(buf, st.offset(index), len(chunk))
                st.counters["bytes_written"] += len(chunk)
        finally:
            st.pool.release(buf)
        await io.sync()
        st.sb = sb.with_checkpoint(*checkpoint_total(data), targets)
        await self.write_superblock(st.sb)
