"""Opening the NVMe tier's media: validate or format the superblock, then recover the index.

Separate because it is the open-time decision, one rule whatever ``format`` says: a usable log
(a valid superblock of this layout version and of the configured region size and count) is
always recovered, never wiped. New media is formatted: a file created by this open or of size
0, or a block device whose superblock is all zeros (it cannot be truncated; `tierkv format`
zeroes it). Anything else (another format, a regular file's zeroed or any damaged superblock,
another version or geometry, a file shorter than a superblock) is formatted only with
``format = true`` and otherwise refused with a `DeviceError` naming the path, leaving it
untouched. Recovery loads the checkpoint or rebuilds the index by scanning regions (`_scan`);
media shorter than the configured log is recovered with what it holds (a checkpoint past its end
is unusable, regions past it are empty). A scan also checks that the region the superblock names
as the newest a flush made durable is still there, else drops what it cannot order (`_scan`).
`NvmeRecovery` holds the tier's `LogState` and the checkpoint layer (`CheckpointIO`) whose
superblock writes and loads it uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from tierkv._units import format_size
from tierkv.errors import CorruptObjectError, DeviceError
from tierkv.formats.nvme_layout import (
    SUPERBLOCK_SIZE,
    BlankSuperblockError,
    ForeignFormatError,
    OlderLayoutError,
    Superblock,
    decode_superblock,
    new_uuid,
)
from tierkv.tiers.nvme._checkpoint import CheckpointIO
from tierkv.tiers.nvme._device import Device
from tierkv.tiers.nvme._regions import RegionState
from tierkv.tiers.nvme._scan import ScannedRegion, Unidentified, scan_regions
from tierkv.tiers.nvme._state import LogState, log


def _allocate(device: Device, need: int) -> None:
    """Give a file log blocks for all of its `need` bytes now: a region write must never find
    the file system full later (ENOSPC fails that region's flush). Blocks already allocated
    cost nothing; a block device has them."""
    if device.block_device:
        return
    try:
        os.posix_fallocate(device.fd, 0, need)
    except OSError as exc:
        raise DeviceError(f"{device.path}: cannot allocate {need} bytes for the log: "
                          f"{exc.strerror}") from exc


def _fill_holes(device: Device, need: int) -> None:
    """`_allocate` for a log being recovered, which may have been copied or restored sparse.
    Where its file system no longer has room for the holes, the log still opens with what it
    holds (a warm cache is worth more than a refusal): a warning says that a region write may
    then fail for want of space (its flush raises; nothing acknowledged is lost)."""
    if device.block_device:
        return
    stat = os.fstat(device.fd)
    missing = need - stat.st_blocks * 512
    if missing <= 0:
        return
    fs = os.fstatvfs(device.fd)
    free = fs.f_bavail * fs.f_frsize
    if free >= missing:
        try:
            os.posix_fallocate(device.fd, 0, need)
            return
        except OSError as exc:
            reason = exc.strerror
    else:
        reason = f"its file system has {format_size(free)} free"
    log.warning("%s: the log file lacks blocks for %s of its %s (%s): a region write may fail "
                "for want of space", device.path, format_size(missing), format_size(need), reason)


@dataclass(frozen=True, slots=True)
class _Unusable:
    """Why the media holds no usable log."""

    reason: str
    blank: bool = False  # its superblock is all zeros


class NvmeRecovery:
    """Superblock validation or formatting and index recovery at open; see `tierkv.tiers.nvme`."""

    __slots__ = ("_checkpoint", "_st")

    def __init__(self, state: LogState, checkpoint: CheckpointIO) -> None:
        self._st = state
        self._checkpoint = checkpoint

    async def load_or_format(self, device: Device) -> None:
        """Recover the log on `device`, or format it where the rule allows (module docstring)."""
        st = self._st
        need = SUPERBLOCK_SIZE + st.region_count * st.config.region_size
        if not device.created and device.size > 0:
            found = await self._read_superblock(device)
            if isinstance(found, Superblock):
                _fill_holes(device, need)  # a copied or restored log may be sparse
                st.sb = found
                st.reset_index()  # for the log's granularity
                await self._recover(found)
                return
            if found.blank and device.block_device:
                log.info("%s: zeroed superblock: a new device; formatting it", device.path)
            elif not st.config.format:
                raise DeviceError(f"{device.path}: {found.reason}; set format = true to "
                                  "overwrite it")
            else:
                log.warning("%s: %s; formatting it (format = true)", device.path, found.reason)
        if device.block_device and device.size < need:
            raise DeviceError(
                f"{device.path}: {device.size} bytes is smaller than the configured {need}"
            )
        await self._format(device, need)

    async def _read_superblock(self, device: Device) -> Superblock | _Unusable:
        """The superblock of a usable log of the configured geometry, or why there is none."""
        st = self._st
        if device.size < SUPERBLOCK_SIZE:
            return _Unusable(f"{device.size} bytes of another format (shorter than a superblock)")
        io = st.io
        assert io is not None
        buf = st.pool.acquire(SUPERBLOCK_SIZE)
        try:
            await io.read(buf, 0, SUPERBLOCK_SIZE)
            existing = decode_superblock(buf.view[:SUPERBLOCK_SIZE])
        except BlankSuperblockError:
            return _Unusable("its superblock is all zeros", blank=True)
        except OlderLayoutError as exc:
            return _Unusable(f"holds {exc}, and must be formatted (its objects are lost)")
        except ForeignFormatError as exc:
            return _Unusable(f"holds no tierkv log of this version ({exc})")
        except CorruptObjectError as exc:
            return _Unusable(f"damaged tierkv superblock ({exc})")
        finally:
            st.pool.release(buf)
        if (existing.region_size, existing.region_count) != (st.config.region_size,
                                                             st.region_count):
            return _Unusable(f"formatted with region_size {existing.region_size} x "
                             f"{existing.region_count} regions, the config asks for "
                             f"{st.config.region_size} x {st.region_count}")
        return existing

    async def _format(self, device: Device, need: int) -> None:
        st = self._st
        if not device.block_device:
            try:
                os.ftruncate(device.fd, need)
            except OSError as exc:
                raise DeviceError(f"{device.path}: cannot size the file to {need} bytes: "
                                  f"{exc.strerror}") from exc
        _allocate(device, need)
        sb = Superblock(st.config.region_size, st.config.capacity, st.region_count,
                        new_uuid(), device.alignment)
        # A reformatted device may hold regions of the old uuid; they are ignored by the scan.
        st.sb = sb
        st.reset_index()
        await self._checkpoint.write_superblock(sb)
        st.recovered_from = "new"

    async def _recover(self, sb: Superblock) -> None:
        st = self._st
        if sb.checkpoint_length:
            try:
                await self._checkpoint.load(sb)
            except CorruptObjectError as exc:
                log.warning("%s: checkpoint unusable (%s); scanning regions", st.name, exc)
                st.reset_index()
            else:
                st.recovered_from = "checkpoint"
                st.sb = sb.without_checkpoint()
                await self._checkpoint.write_superblock(st.sb)  # a crash from now on must scan
                return
        scanned = await self._scan(sb)
        st.recovered_from = "scan"
        if scanned != sb:  # the checkpoint it could not use, or a floor over lost history
            st.sb = scanned.without_checkpoint()
            await self._checkpoint.write_superblock(st.sb)
        # what a crash left written may never have been synced: it is now, so that what the
        # scan found is on media (`NvmeTier.on_media`)
        _d, io, _sb = st.dev_io()
        await io.sync()

    async def _scan(self, sb: Superblock) -> Superblock:
        """Rebuild the index from the regions; returns `sb` as it must now be recorded.

        Where the region use the superblock names as the newest a flush made durable is gone
        (its header destroyed, the media cut short), the records of every older use may be
        superseded by records that are lost, and nothing tells which: those uses are dropped
        and, by a floor recorded at once, stay void for every later scan. Newer uses are kept.
        """
        st = self._st
        device, io, _s = st.dev_io()
        st.reset_index()
        found, unidentified = await scan_regions(io, st.pool, sb, device.size)
        st.next_seq = max(st.next_seq, sb.newest_seq + 1, sb.floor_seq)
        if sb.newest_seq and not any(r.index == sb.newest_index and r.seq >= sb.newest_seq
                                     for r in found):
            void = sum(r.seq < sb.newest_seq for r in found)
            log.error("%s: region %d (seq %d), the newest a flush made durable, is gone from "
                      "%s: the %d older regions cannot be ordered against what it held and are "
                      "dropped", st.name, sb.newest_index, sb.newest_seq, device.path, void)
            st.counters["regions_unordered"] += void
            found = [r for r in found if r.seq >= sb.newest_seq]
            newest = max(found, key=lambda r: r.seq, default=None)
            sb = replace(sb, floor_seq=sb.newest_seq,
                         newest_seq=newest.seq if newest is not None else 0,
                         newest_index=newest.index if newest is not None else 0)
        found, sb = self._void_before_lost_keys(found, unidentified, sb)
        for scanned in found:
            st.next_seq = max(st.next_seq, scanned.seq + 1)
            st.counters["checksum_failures"] += scanned.found.corrupt
            st.counters["bytes_read"] += scanned.found.used
            if not scanned.found.entries:
                # holds nothing (an empty use: a region kept free for the checkpoint, a head
                # that crashed before its first entry reached the media): it stays FREE
                continue
            region = st.regions[scanned.index]
            region.state, region.seq = RegionState.SEALED, scanned.seq
            # a damaged record's extent is unknown (its prefix may be what failed): nothing
            # is appended after it (`_resume`), or a resumed head could write over the record
            # that tombstones its key and bring an older one back
            region.used = (scanned.found.used if not scanned.found.corrupt
                           else st.config.region_size)
            region.header_written = True
            for entry in scanned.found.entries:
                if entry.damaged:
                    # what it held is lost, and it superseded the key's older records: a miss,
                    # never the older value (counted among the checksum failures already)
                    st.shadow(region, st.forget(entry.key))
                    st.damaged.add(entry.key)
                    continue
                st.damaged.discard(entry.key)  # a newer record: the damage is superseded
                if entry.tombstone:
                    st.shadow(region, st.forget(entry.key))
                    st.counters["tombstones_applied"] += 1
                else:
                    st.insert(entry.key, region, offset=entry.offset,
                              length=entry.length, meta=entry.meta, hits=0)
        for lost in unidentified:
            self._tombstone_unidentified(lost)
        return sb

    def _void_before_lost_keys(self, found: list[ScannedRegion],
                               unidentified: list[Unidentified], sb: Superblock
                               ) -> tuple[list[ScannedRegion], Superblock]:
        """A region whose header is lost holds a record of this log whose key no longer reads:
        it may supersede records of that key in any older use, and nothing tells which: those
        uses are dropped (as when the newest region is gone), by a floor recorded at once."""
        st = self._st
        cut = max((lost.used.lost_seq for lost in unidentified), default=0)
        if cut <= sb.floor_seq:
            return found, sb
        void = sum(r.seq < cut for r in found)
        log.error("%s: a region whose header is damaged holds a record of this log (seq %d) "
                  "whose key is unreadable: the %d older regions cannot be ordered against "
                  "it and are dropped", st.name, cut, void)
        st.counters["regions_unordered"] += void
        return [r for r in found if r.seq >= cut], replace(sb, floor_seq=cut)

    def _tombstone_unidentified(self, lost: Unidentified) -> None:
        """A region whose header is lost (a flipped bit, a zeroed block): its records cannot be
        ordered against the rest of the log by the region, only by their own use, and each
        may supersede an older record of its key (an overwrite, a tombstone): a key whose
        record found elsewhere is older than the newest record naming it here is taken as
        tombstoned (a miss, never a value an overwrite or delete replaced). Such a region stays
        out of use, shadowing those records' regions, so that a later scan finds it again until
        they are reclaimed; one that supersedes nothing found (what a reclaimed region's older
        records, under a checkpoint written over its header, are) stays free, unreported."""
        st = self._st
        region = st.regions[lost.index]
        st.next_seq = max(st.next_seq, lost.used.newest_seq + 1)  # no use of it is reissued
        forgotten = 0
        for key, seq in lost.used.keys.items():
            found = st.index.get(key)
            if found is not None and st.regions[found.region].seq < seq:
                st.shadow(region, st.forget(key))
                st.damaged.add(key)
                forgotten += 1
        if not forgotten:
            return
        region.state, region.seq = RegionState.SEALED, lost.used.newest_seq
        region.used, region.header_written = st.config.region_size, True
        st.counters["regions_unidentified"] += 1
        log.error("%s: region %d's header is damaged; %d keys whose newer records it holds are "
                  "dropped", st.name, lost.index, forgotten)
