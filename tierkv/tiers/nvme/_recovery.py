"""Opening the NVMe tier's media: validate or format the superblock, then recover the index.

Separate because it is the open-time decision: adopt an existing superblock (checked against the
config), refuse another format unless ``format = true``, or format; then load the checkpoint or
rebuild the index by scanning regions (`_scan`). `NvmeRecovery` holds the tier's `LogState`
and the checkpoint layer (`CheckpointIO`) whose superblock writes and loads it uses.
"""

from __future__ import annotations

import os

from tierkv.errors import CorruptObjectError, DeviceError
from tierkv.formats.nvme_layout import (
    SUPERBLOCK_SIZE,
    ForeignFormatError,
    Superblock,
    decode_superblock,
    new_uuid,
)
from tierkv.tiers.nvme._checkpoint import CheckpointIO
from tierkv.tiers.nvme._device import Device
from tierkv.tiers.nvme._regions import RegionState
from tierkv.tiers.nvme._scan import scan_regions
from tierkv.tiers.nvme._state import LogState, log


class NvmeRecovery:
    """Superblock validation or formatting and index recovery at open; see `tierkv.tiers.nvme`."""

    __slots__ = ("_checkpoint", "_st")

    def __init__(self, state: LogState, checkpoint: CheckpointIO) -> None:
        self._st = state
        self._checkpoint = checkpoint

    async def load_or_format(self, device: Device) -> None:
        st = self._st
        io = st.io
        assert io is not None
        need = SUPERBLOCK_SIZE + st.region_count * st.config.region_size
        existing: Superblock | None = None
        if 0 < device.size < SUPERBLOCK_SIZE and not st.config.format:
            raise DeviceError(f"{device.path}: {device.size} bytes of another format (shorter "
                              "than a superblock); set format = true to overwrite it")
        if device.size >= SUPERBLOCK_SIZE and not device.created:
            buf = st.pool.acquire(SUPERBLOCK_SIZE)
            try:
                await io.read(buf, 0, SUPERBLOCK_SIZE)
                existing = decode_superblock(buf.view[:SUPERBLOCK_SIZE])
            except ForeignFormatError as exc:
                if not self._blank(buf.view[:SUPERBLOCK_SIZE]) and not st.config.format:
                    raise DeviceError(
                        f"{device.path}: holds another format ({exc}); set format = true to "
                        "overwrite it"
                    ) from exc
            except CorruptObjectError as exc:
                if not st.config.format:
                    raise DeviceError(f"{device.path}: damaged tierkv superblock: {exc}") from exc
            finally:
                st.pool.release(buf)
        if existing is not None and not st.config.format:
            if (existing.region_size, existing.region_count) != (
                st.config.region_size, st.region_count
            ):
                raise DeviceError(
                    f"{device.path}: formatted with region_size {existing.region_size} x "
                    f"{existing.region_count} regions, the config asks for "
                    f"{st.config.region_size} x {st.region_count}; set format = true to "
                    "reformat"
                )
            st.sb = existing
            await self._recover(existing)
            return
        if device.block_device and device.size < need:
            raise DeviceError(
                f"{device.path}: {device.size} bytes is smaller than the configured {need}"
            )
        await self._format(device, need)

    @staticmethod
    def _blank(view: memoryview) -> bool:
        return not any(view)

    async def _format(self, device: Device, need: int) -> None:
        st = self._st
        if not device.block_device:
            try:
                os.ftruncate(device.fd, need)
                os.posix_fallocate(device.fd, 0, need)
            except OSError as exc:
                raise DeviceError(f"{device.path}: cannot size the file to {need} bytes: "
                                  f"{exc.strerror}") from exc
        sb = Superblock(st.config.region_size, st.config.capacity, st.region_count,
                        new_uuid(), device.alignment)
        # A reformatted device may hold regions of the old uuid; they are ignored by the scan.
        st.sb = sb
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
        await self._scan(sb)
        st.recovered_from = "scan"
        if sb.checkpoint_length:
            st.sb = sb.without_checkpoint()
            await self._checkpoint.write_superblock(st.sb)

    async def _scan(self, sb: Superblock) -> None:
        st = self._st
        _d, io, _s = st.dev_io()
        st.reset_index()
        for scanned in await scan_regions(io, st.pool, sb):
            region = st.regions[scanned.index]
            region.state, region.seq, region.used = RegionState.SEALED, scanned.seq, scanned.used
            st.next_seq = max(st.next_seq, scanned.seq + 1)
            st.counters["checksum_failures"] += scanned.corrupt
            for entry in scanned.entries:
                if entry.tombstone:
                    st.shadow(region, st.forget(entry.key))
                else:
                    st.insert(entry.key, region, offset=entry.offset,
                              length=entry.length, meta=entry.meta, hits=0)
        st.counters["bytes_read"] += sum(r.used for r in st.regions)
