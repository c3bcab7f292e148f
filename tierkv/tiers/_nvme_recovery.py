"""Opening the NVMe tier's media: validate or format the superblock, then recover the index.

Separate because it is the open-time decision: adopt an existing superblock (checked against the
config), refuse another format unless ``format = true``, or format; then load the checkpoint or
rebuild the index by scanning regions (`_nvme_scan`).
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
from tierkv.tiers._nvme_checkpoint import CheckpointIO
from tierkv.tiers._nvme_device import Device
from tierkv.tiers._nvme_index import NvmeIndex
from tierkv.tiers._nvme_regions import Region, RegionState
from tierkv.tiers._nvme_scan import scan_regions
from tierkv.tiers._nvme_state import log


class NvmeRecovery(CheckpointIO):
    """Superblock validation or formatting and index recovery at open; see `tierkv.tiers.nvme`."""

    async def _load_or_format(self, device: Device) -> None:
        io = self._io
        assert io is not None
        need = SUPERBLOCK_SIZE + self._region_count * self.config.region_size
        existing: Superblock | None = None
        if 0 < device.size < SUPERBLOCK_SIZE and not self.config.format:
            raise DeviceError(f"{device.path}: {device.size} bytes of another format (shorter "
                              "than a superblock); set format = true to overwrite it")
        if device.size >= SUPERBLOCK_SIZE and not device.created:
            buf = self._pool.acquire(SUPERBLOCK_SIZE)
            try:
                await io.read(buf, 0, SUPERBLOCK_SIZE)
                existing = decode_superblock(buf.view[:SUPERBLOCK_SIZE])
            except ForeignFormatError as exc:
                if not self._blank(buf.view[:SUPERBLOCK_SIZE]) and not self.config.format:
                    raise DeviceError(
                        f"{device.path}: holds another format ({exc}); set format = true to "
                        "overwrite it"
                    ) from exc
            except CorruptObjectError as exc:
                if not self.config.format:
                    raise DeviceError(f"{device.path}: damaged tierkv superblock: {exc}") from exc
            finally:
                self._pool.release(buf)
        if existing is not None and not self.config.format:
            if (existing.region_size, existing.region_count) != (
                self.config.region_size, self._region_count
            ):
                raise DeviceError(
                    f"{device.path}: formatted with region_size {existing.region_size} x "
                    f"{existing.region_count} regions, the config asks for "
                    f"{self.config.region_size} x {self._region_count}; set format = true to "
                    "reformat"
                )
            self._sb = existing
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
        if not device.block_device:
            try:
                os.ftruncate(device.fd, need)
                os.posix_fallocate(device.fd, 0, need)
            except OSError as exc:
                raise DeviceError(f"{device.path}: cannot size the file to {need} bytes: "
                                  f"{exc.strerror}") from exc
        sb = Superblock(self.config.region_size, self.config.capacity, self._region_count,
                        new_uuid(), device.alignment)
        # A reformatted device may hold regions of the old uuid; they are ignored by the scan.
        self._sb = sb
        await self._write_superblock(sb)
        self._recovered_from = "new"

    async def _recover(self, sb: Superblock) -> None:
        if sb.checkpoint_length:
            try:
                await self._load_checkpoint(sb)
            except CorruptObjectError as exc:
                log.warning("%s: checkpoint unusable (%s); scanning regions", self.name, exc)
                self._reset_index()
            else:
                self._recovered_from = "checkpoint"
                self._sb = sb.without_checkpoint()
                await self._write_superblock(self._sb)  # a crash from now on must scan
                return
        await self._scan(sb)
        self._recovered_from = "scan"
        if sb.checkpoint_length:
            self._sb = sb.without_checkpoint()
            await self._write_superblock(self._sb)

    def _reset_index(self) -> None:
        self._index = NvmeIndex(self._align)
        self._regions = [Region(i) for i in range(self._region_count)]
        self._live = 0

    async def _scan(self, sb: Superblock) -> None:
        _d, io, _s = self._dev_io()
        self._reset_index()
        for scanned in await scan_regions(io, self._pool, sb):
            region = self._regions[scanned.index]
            region.state, region.seq, region.used = RegionState.SEALED, scanned.seq, scanned.used
            self._next_seq = max(self._next_seq, scanned.seq + 1)
            self._counters["checksum_failures"] += scanned.corrupt
            for entry in scanned.entries:
                if entry.tombstone:
                    self._shadow(region, self._forget(entry.key))
                else:
                    self._insert(entry.key, region, offset=entry.offset,
                                 length=entry.length, meta=entry.meta, hits=0)
        self._counters["bytes_read"] += sum(r.used for r in self._regions)

