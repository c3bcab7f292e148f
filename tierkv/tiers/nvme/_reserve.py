"""The FREE regions the NVMe log keeps back so that `close()` can always write its checkpoint.

The checkpoint goes into FREE regions (`_checkpoint`), and a log that filled up has none unless
it kept them: `CheckpointReserve` says how many it keeps. Its size is bounded from above from
what the index holds now, without encoding it: per entry a fixed part (every number at the
widest encoding the log's geometry allows, the key's length header at its widest) plus the
entry's key bytes plus the msgpack bytes of its dtype, shape and parents (`meta_weight`, which
`NvmeIndex` sums per interned shape as entries come and go), plus per region its record and its
shadows, plus the checkpoint's header. The fixed parts are measured once from
`nvme_layout.encode_checkpoint` itself, so they follow the format; `meta_weight` packs the same
three fields the way the checkpoint does (msgpack arrays encode element by element), which a
test checks against the encoder.

The log keeps the regions that bound needs (`needed`) FREE at every step (`RegionLog`): a
rotation takes a FREE region for the head only if as many stay FREE after it, else it
reclaims a victim; a put whose entry would make the bound outgrow the FREE regions first
reclaims a victim into FREE (`RegionLog.make_room`). The reservation is all or nothing: when
the bound needs more than `MAX_CHECKPOINT_REGIONS` (the superblock lists no more) or would
leave fewer than `MIN_DATA_REGIONS` regions for data, no region is kept and close skips the
checkpoint when no region is free (the next open scans), as a log too small for it must.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgpack

from tierkv.formats.header import MAX_KEY
from tierkv.formats.nvme_layout import (
    MAX_CHECKPOINT_REGIONS,
    Checkpoint,
    CheckpointEntry,
    CheckpointRegion,
    encode_checkpoint,
)
from tierkv.formats.value import ValueKind
from tierkv.tiers.nvme._index import NvmeIndex
from tierkv.tiers.nvme._regions import Region, RegionState

#: regions a reservation must leave for data: the head and one region a rotation can reclaim
MIN_DATA_REGIONS = 2

_U64 = (1 << 64) - 1
_HITS = 0xFFFF  # the index saturates hits there
#: an msgpack array's header grows from one byte (fixarray) to five (array32)
_ARRAY_GROWTH = 4


def meta_weight(dtype: str, shape: tuple[int, ...], parents: tuple[bytes, ...]) -> int:
    """Bytes an entry's dtype, shape and parents take in its checkpoint record."""
    return len(msgpack.packb([dtype, list(shape), list(parents)], use_bin_type=True)) - 1


def _encoded(regions: tuple[CheckpointRegion, ...] = (),
             entries: tuple[CheckpointEntry, ...] = ()) -> int:
    return len(encode_checkpoint(Checkpoint(bytes(16), _U64, regions, list(entries))))


def _uint_bytes(value: int) -> int:
    return len(msgpack.packb(value))


class CheckpointReserve:
    """How many FREE regions the log keeps for its checkpoint, and the counts deciding it.

    `free` is the number of FREE regions, kept exact by the log at every change (`tally`
    recounts at each rotation and at open); `held` the regions kept back as of the last
    rotation or reclaim (`hold`; never more than `free`), which the tier's `capacity` and
    `room()` leave out;
    `regions_bytes` the regions' part of the bound, recounted by `tally` with room for the
    head's shadows to grow, and raised by `LogState.inherit` for the other regions'.
    `waived`: a reclaim found no victim for the reservation (every sealed region waits for
    another); not tried again before the next rotation. Owned by the `LogState`; no IO.
    """

    __slots__ = ("_entry", "_fixed", "_limit", "_region", "_shadow", "free", "held",
                 "region_count", "region_size", "regions_bytes", "waived")

    def __init__(self, region_size: int, region_count: int) -> None:
        self.region_size = region_size
        self.region_count = region_count
        last, empty = max(region_count - 1, 0), _encoded()
        plain = meta_weight("", (), ())
        kind = int(max(ValueKind))
        probe = CheckpointEntry(b"k", last, region_size, region_size, _HITS, kind, "", (),
                                region_size, _U64, ())
        short_key = len(msgpack.packb(b"k", use_bin_type=True))
        widest_key = len(msgpack.packb(bytes(MAX_KEY), use_bin_type=True)) - MAX_KEY
        #: per entry besides its key bytes and its `meta_weight`
        self._entry = _encoded(entries=(probe,)) - empty - short_key - plain + widest_key
        #: per region besides its shadows; each shadow
        self._region = (_encoded((CheckpointRegion(last, _U64, region_size, _U64, ()),))
                        - empty + _ARRAY_GROWTH)
        self._shadow = _uint_bytes(last)
        self._fixed = empty + 2 * _ARRAY_GROWTH
        self._limit = min(MAX_CHECKPOINT_REGIONS, region_count - MIN_DATA_REGIONS)
        self.free = region_count
        self.held = 0
        self.regions_bytes = 0
        self.waived = False

    # -- the bound -------------------------------------------------------------------------------
    def entry_bytes(self, key_length: int, weight: int) -> int:
        """At most what one entry (its key's length, its `meta_weight`) adds to the checkpoint."""
        return self._entry + key_length + weight

    def shadow_bytes(self) -> int:
        """What one more shadow of a region adds to the checkpoint."""
        return self._shadow

    def bound(self, index: NvmeIndex) -> int:
        """At least the bytes of the checkpoint of `index` and the log's regions now."""
        return (self._fixed + len(index) * self._entry + index.key_bytes + index.meta_bytes
                + self.regions_bytes)

    def needed(self, nbytes: int) -> int:
        """FREE regions a checkpoint of `nbytes` takes; 0 when the log keeps none for it."""
        regions = -(-nbytes // self.region_size)
        return regions if regions <= self._limit else 0

    def short(self, index: NvmeIndex, grows: int) -> bool:
        """Whether the FREE regions would not hold the checkpoint once it `grows` more bytes
        (and a reclaim may yet make room: not `waived`)."""
        return not self.waived and self.needed(self.bound(index) + grows) > self.free

    # -- bookkeeping -----------------------------------------------------------------------------
    def tally(self, regions: Iterable[Region], made: int) -> None:
        """Recount FREE regions and the regions' part of the bound from the region table
        (`made` regions of `region_count` exist; the rest are FREE)."""
        free = self.region_count - made
        records = shadows = 0
        for region in regions:
            if region.state is RegionState.FREE:
                free += 1
            else:
                records += 1
                shadows += len(region.shadows)
        self.free = free
        # one record more than counted, for a head about to be opened, and room for the
        # head's shadows: it may come to shadow every other region before the next tally
        self.regions_bytes = ((records + 1) * self._region
                              + (shadows + self.region_count) * self._shadow)
        self.waived = False

    def hold(self, index: NvmeIndex, keep: int = 0) -> None:
        """Record the regions kept back, for `capacity`: what `index` needs now or `keep`
        (what the last rotation kept, with the entries of a full head: a log that reclaims
        rather than take a region keeps it at every rotation), at most the FREE ones."""
        self.held = min(max(self.needed(self.bound(index)), keep), self.free)
