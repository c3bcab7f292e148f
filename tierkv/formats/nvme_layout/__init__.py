"""On-media layout of the NVMe tier: superblock, regions, entries, index checkpoint.

Little endian throughout. The device (file or block device) is::

    superblock (SUPERBLOCK_SIZE bytes) | region 0 | region 1 | ... | region N-1

Superblock: ``magic "TKVNVME\\0" | version u32 | granularity u32 | region_size u64 | capacity u64 |
region_count u64 | uuid 16s | alignment u32 | checkpoint length u64 | checkpoint xxh3 u64 |
checkpoint region count u32 | region indices u32 (count of them) | ... | newest seq u64 | newest
index u32 | reserved u32 | floor seq u64 | xxh3 of all before it u64`` (the history record and
the checksum end the block). `granularity` is what entries are packed at (`ENTRY_GRANULARITY`
for a log this code formats; a power of two from `PREFIX.size` to `alignment`). Layout version 1
(before entries were packed: each aligned to `alignment`, this field zero) is refused
(`OlderLayoutError`), never read with the new rules. A checkpoint length of 0 means "no valid
checkpoint: scan". The history record (zeros in logs written before it existed: nothing
recorded) names the newest region use a flush made durable (its seq and index); a scan that does
not find that region, or a newer use of its index, knows the newest history is lost. Region uses
older than the floor seq are void: a scan ignores them (set when such a loss was found).

Region: its first `alignment` bytes hold the region header ``magic "TKVREGN\\0" | uuid 16s |
seq u64 | index u32 | reserved u32 | xxh3 u64``; `seq` grows by one each time a region is opened
for writing, so a scan orders regions by age. Entries follow back to back, each starting on a
`granularity` boundary::

    prefix (32 bytes) | object header (formats/header.py, holds the key) | payload | zero pad

Padding: the writer never writes a device block twice within a region use, so an entry a flush
made durable is never in a block a later (possibly torn) write rewrites. Every write of a region
buffer ends on an `alignment` boundary: where the entries end inside a block, a *padding* record
(flag `PADDING`, a prefix whose body is zeros and unchecked: nothing reads it) fills the block up
to its end (`write_padding`), and the next entry starts in a fresh block. A scan accepts a
padding record only when it ends on an `alignment` boundary. Padding costs space at flushes and
seals only (under a block each); at 16 KiB objects and no flushes 99.2 % of an entry is payload.

Prefix: ``magic "TKVE" | flags u16 | reserved u16 | region seq u64 | body length u64 | xxh3 u64``
where the body is object header + payload and the xxh3 covers the tier's uuid and the first 24
prefix bytes. An entry whose seq differs from its region's is stale data from an earlier use of
that region (the scan skips it), which is how a region rewritten in part is read safely. A
tombstone entry (flag `TOMBSTONE`) records a delete; its header has an empty payload. Flags are
`TOMBSTONE`, `PADDING` or none; anything else is damage.

Checkpoint: ``magic "TKVCKPT\\0" | length u64 | xxh3 u64 | msgpack body`` written into regions the
index does not use, listed in the superblock. The body is ``[version, uuid, next_seq, regions,
entries]`` with plain arrays only (see `Checkpoint`); decoding checks every type. Version 2 adds
each region's *shadows* (the older regions whose records it supersedes); a version 1 checkpoint
is refused, so the tier rebuilds by scanning, which recomputes them.

The tier assembles and parses these bytes only through this package: `write_region_header`,
`write_entry`, `write_padding`, `decode_entry` (one entry read back), `scan_entries` (a whole
region at a scan), `checkpoint_chunks` and `checkpoint_total`.

Each layout has a module of its own, since each is written and read at different moments:
`_superblock` (the first block, read before anything else at open), `_regions` (a region's
header block), `_entries` (prefixes, entries, padding records and the scan of a region) and
`_checkpoint` (the index checkpoint, written at close). This package re-exports their public
names, so importers name only `tierkv.formats.nvme_layout`.
"""

from tierkv.formats.nvme_layout._checkpoint import (
    CHECKPOINT_HEADER,
    CHECKPOINT_MAGIC,
    CHECKPOINT_VERSION,
    Checkpoint,
    CheckpointEntry,
    CheckpointRegion,
    checkpoint_chunks,
    checkpoint_total,
    decode_checkpoint,
    encode_checkpoint,
)
from tierkv.formats.nvme_layout._entries import (
    ENTRY_GRANULARITY,
    ENTRY_MAGIC,
    PADDING,
    PREFIX,
    TOMBSTONE,
    EntryPrefix,
    RegionEntries,
    ScannedEntry,
    UseKeys,
    align_up,
    decode_entry,
    decode_prefix,
    encode_prefix,
    entry_size,
    has_entry_magic,
    keys_of_any_use,
    padding_size,
    scan_entries,
    write_entry,
    write_padding,
)
from tierkv.formats.nvme_layout._regions import (
    REGION_MAGIC,
    decode_region_header,
    encode_region_header,
    write_region_header,
)
from tierkv.formats.nvme_layout._superblock import (
    LAYOUT_VERSION,
    MAX_CHECKPOINT_REGIONS,
    SUPERBLOCK_MAGIC,
    SUPERBLOCK_SIZE,
    BlankSuperblockError,
    ForeignFormatError,
    OlderLayoutError,
    Superblock,
    decode_superblock,
    encode_superblock,
    format_uuid,
    new_uuid,
    valid_granularity,
)

__all__ = [
    "CHECKPOINT_HEADER",
    "CHECKPOINT_MAGIC",
    "CHECKPOINT_VERSION",
    "ENTRY_GRANULARITY",
    "ENTRY_MAGIC",
    "LAYOUT_VERSION",
    "MAX_CHECKPOINT_REGIONS",
    "PADDING",
    "PREFIX",
    "REGION_MAGIC",
    "SUPERBLOCK_MAGIC",
    "SUPERBLOCK_SIZE",
    "TOMBSTONE",
    "BlankSuperblockError",
    "Checkpoint",
    "CheckpointEntry",
    "CheckpointRegion",
    "EntryPrefix",
    "ForeignFormatError",
    "OlderLayoutError",
    "RegionEntries",
    "ScannedEntry",
    "Superblock",
    "UseKeys",
    "align_up",
    "checkpoint_chunks",
    "checkpoint_total",
    "decode_checkpoint",
    "decode_entry",
    "decode_prefix",
    "decode_region_header",
    "decode_superblock",
    "encode_checkpoint",
    "encode_prefix",
    "encode_region_header",
    "encode_superblock",
    "entry_size",
    "format_uuid",
    "has_entry_magic",
    "keys_of_any_use",
    "new_uuid",
    "padding_size",
    "scan_entries",
    "valid_granularity",
    "write_entry",
    "write_padding",
    "write_region_header",
]
