"""The PMem tier's bytes on media: pool recognition, the root record, object records, space.

**Pool.** A libpmemobj pool whose layout name is `LAYOUT_NAME`. A file is recognised *without
PMDK* (`inspect_pool`) from its first bytes: PMDK's pool header starts with the signature
``PMEMOBJ\\0`` and the layout name sits NUL-terminated at offset 4096 (PMDK 1.12). This check runs
before PMDK ever sees a file, because ``pmemobj_open`` with a wrong layout name rewrites parts of
the pool header even though it fails. It recognises, it does not validate: damage to what PMDK
reads at open is found by opening the pool in a probe process first (`tiers.pmem._probe`),
since PMDK follows some of it unchecked. A file of size 0 is *new* (`PoolFile.EMPTY`: what
`tierkv format` leaves, created like an absent one); a zero-filled file is not a pool. The first
`HEADER_AREA` bytes hold both headers: zeroing them is how a device (which cannot be truncated)
is made new again, and PMDK creates a pool over a device only where they are zero.

**Root object.** ``magic "TKVPROOT" | version u32 | reserved u32 | xxh3-64 of the first 16 bytes``
(24 bytes). A zeroed root is a pool whose creation was interrupted before the root was written.

**Object record.** One pmemobj allocation of type `OBJECT_TYPE_NUM` per cached object::

    prefix: magic "TKPO" | version u16 | reserved u16 | sequence u64 | xxh3-64 of prefix[0:16]
    object header (formats/header.py: it carries the key, meta and payload checksum)
    payload

The sequence is a pool-wide write counter: when a crash leaves two records of one key (a new one
allocated, the old one not yet freed), recovery keeps the higher (generation, sequence).

**Space.** The tier allocates through its own allocation classes (`SIZE_CLASSES`): unit sizes on
a grid of four steps per doubling, from 256 B up to 8 MiB; from 16 KiB on every unit has
`UNIT_HEADROOM` added so that a power-of-two payload plus its record header fits the class of its
size instead of the next one; and the power-of-two payloads from 4 KiB to 64 KiB (what KV blocks
of most models are) have a *snug* class each, with only `SNUG_HEADROOM` for the record's prefix
and header, since 1 KiB is 6 % of a 16 KiB block (a record whose header is longer, a key with
many parents, takes the grid's class). Larger records are PMDK "huge" allocations rounded to 256 KiB
chunks. The footprint of a record is its whole unit (PMDK's 16-byte allocation header included).
The pool file is `pool_size_for(capacity)`: capacity + PMDK's fixed metadata (4 MiB, plus 1 MiB
per 16 GiB zone) + one run of every class (a class holds on to one partly used run even when
empty) + 1/64 of the capacity for run tails. The inverse, `capacity_for`, bounds what an existing
pool can hold.
"""

from __future__ import annotations

import bisect
import enum
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from tierkv.errors import CorruptObjectError
from tierkv.formats.header import (
    SIZED_HEADER,
    ObjectHeader,
    checksum,
    decode_header,
    header_length,
)

LAYOUT_NAME = "tierkv.pmem.v1"
LAYOUT_VERSION = 1
OBJECT_TYPE_NUM = 0x544B5631  # "TKV1"

POOL_SIGNATURE = b"PMEMOBJ\x00"
LAYOUT_OFFSET = 4096
MAX_LAYOUT = 1024
#: PMDK's pool header and pmemobj's (with the layout name), rounded up to a page
HEADER_AREA = 8 << 10

ROOT_MAGIC = b"TKVPROOT"
ROOT = struct.Struct("<8sII")
ROOT_SIZE = ROOT.size + 8

RECORD_MAGIC = b"TKPO"
RECORD_PREFIX = struct.Struct("<4sHHQ")
PREFIX_SIZE = RECORD_PREFIX.size + 8

CHUNK = 256 << 10
ALLOC_HEADER = 16  # PMDK's compact allocation header, inside every unit
ZONE = 16 << 30
FIXED_METADATA = 4 << 20
ZONE_METADATA = 1 << 20
UNIT_HEADROOM = 1 << 10
#: payload sizes with a class of their own (above 64 KiB the grid's headroom costs under 1 %)
SNUG_PAYLOADS = tuple(1 << shift for shift in range(12, 17))
#: record bytes besides the payload that the tier assumes when it sizes an object before its
#: header exists: the prefix and a typical object header (a 32-byte key with one parent: 133);
#: the engine counts a larger header's excess in the object's size (`header_excess`)
HEADER_ALLOWANCE = PREFIX_SIZE + SIZED_HEADER
#: what a snug class leaves beside its payload: PMDK's allocation header and `HEADER_ALLOWANCE`,
#: rounded to a cache line
SNUG_HEADROOM = -(-(HEADER_ALLOWANCE + ALLOC_HEADER) // 64) * 64
_GRID_MIN = 256
_GRID_MAX = 8 << 20
_RUN_TARGET = 1 << 20


class PoolFile(enum.Enum):
    """What `inspect_pool` found at a path."""

    ABSENT = "absent"
    EMPTY = "empty file"
    TIERKV = "tierkv pool"
    OTHER_LAYOUT = "pmemobj pool of another layout"
    ZEROED = "zero-filled file, no pool header"
    NOT_A_POOL = "not a pmemobj pool"
    DEVICE = "device (recognised by PMDK at open)"


@dataclass(frozen=True, slots=True)
class PoolInspection:
    kind: PoolFile
    size: int
    layout: str = ""


def inspect_pool(path: Path) -> PoolInspection:
    """Classify the file at `path` by reading its first bytes; never writes."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return PoolInspection(PoolFile.ABSENT, 0)
    if not path.is_file():
        return PoolInspection(PoolFile.DEVICE, 0)
    if st.st_size == 0:
        return PoolInspection(PoolFile.EMPTY, 0)
    with path.open("rb") as f:
        head = f.read(LAYOUT_OFFSET + MAX_LAYOUT)
    if not any(head):
        return PoolInspection(PoolFile.ZEROED, st.st_size)
    if not head.startswith(POOL_SIGNATURE) or len(head) < LAYOUT_OFFSET + MAX_LAYOUT:
        return PoolInspection(PoolFile.NOT_A_POOL, st.st_size)
    layout = head[LAYOUT_OFFSET:].split(b"\x00", 1)[0].decode(errors="replace")
    kind = PoolFile.TIERKV if layout == LAYOUT_NAME else PoolFile.OTHER_LAYOUT
    return PoolInspection(kind, st.st_size, layout)


# -- root ----------------------------------------------------------------------------------------
def encode_root() -> bytes:
    body = ROOT.pack(ROOT_MAGIC, LAYOUT_VERSION, 0)
    return body + struct.pack("<Q", checksum(body))


def check_root(raw: bytes) -> bool:
    """True for a valid root, False for a zeroed one (creation interrupted); else corrupt."""
    if raw == bytes(len(raw)):
        return False
    magic, version, _reserved = ROOT.unpack_from(raw)
    (stored,) = struct.unpack_from("<Q", raw, ROOT.size)
    if magic != ROOT_MAGIC or stored != checksum(raw[: ROOT.size]):
        raise CorruptObjectError("pool root is not a tierkv root record")
    if version != LAYOUT_VERSION:
        raise CorruptObjectError(f"pool layout version {version} is not {LAYOUT_VERSION}")
    return True


# -- records -------------------------------------------------------------------------------------
def encode_prefix(sequence: int) -> bytes:
    body = RECORD_PREFIX.pack(RECORD_MAGIC, LAYOUT_VERSION, 0, sequence)
    return body + struct.pack("<Q", checksum(body))


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """A decoded record: its header and where its payload lies inside the allocation."""

    sequence: int
    header: ObjectHeader
    payload_offset: int

    @property
    def record_size(self) -> int:
        return self.payload_offset + self.header.payload_length


def decode_record(view: memoryview) -> RecordInfo:
    """Prefix and header of the record at the start of `view` (the whole allocation).

    Checks everything except the payload checksum (`formats.header.verify_payload` does that).
    """
    if len(view) < PREFIX_SIZE:
        raise CorruptObjectError("allocation too small for a record prefix")
    magic, version, _reserved, sequence = RECORD_PREFIX.unpack_from(view)
    (stored,) = struct.unpack_from("<Q", view, RECORD_PREFIX.size)
    if magic != RECORD_MAGIC or stored != checksum(view[: RECORD_PREFIX.size]):
        raise CorruptObjectError("bad record prefix")
    if version != LAYOUT_VERSION:
        raise CorruptObjectError(f"record version {version} is not {LAYOUT_VERSION}")
    header_view = view[PREFIX_SIZE:]
    header_length(header_view)  # magic/version/size before the body is touched
    header, length = decode_header(header_view)
    info = RecordInfo(sequence, header, PREFIX_SIZE + length)
    if info.record_size > len(view):
        raise CorruptObjectError("record is longer than its allocation")
    return info


# -- space ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SizeClass:
    """One allocation class registered with PMDK at open: runs of `units_per_run` units."""

    unit: int
    units_per_run: int

    @property
    def run_bytes(self) -> int:
        return _run_bytes(self.unit, self.units_per_run)


def _round_up(value: int, granule: int) -> int:
    return -(-value // granule) * granule


def _run_metadata(units: int) -> int:
    # PMDK's run header (16 B) and allocation bitmap, with a cache line of alignment slack
    return 16 + _round_up(units, 64) // 8 + 64


def _run_bytes(unit: int, units: int) -> int:
    return _round_up(unit * units + _run_metadata(units), CHUNK)


def _fitted(base: int) -> SizeClass:
    """The class for units of at least `base` bytes: the unit count whose run wastes least per
    unit, the unit then grown to fill the run."""
    limit = _RUN_TARGET if base < CHUNK else 4 * _RUN_TARGET
    count = _least_wasteful(base, range(1, max(1, limit // base) + 1))
    room = _run_bytes(base, count) - _run_metadata(count)
    return SizeClass(room // count // 64 * 64, count)


def _snug(unit: int) -> SizeClass:
    """A class of exactly `unit`-byte units: the fewest per run (a run of up to 8 MiB) that
    waste at most 1/64 of each on the run's rounding to chunks, else the least wasteful."""
    counts = range(1, max(1, 8 * _RUN_TARGET // unit) + 1)
    snug = [n for n in counts if _run_bytes(unit, n) <= n * unit * 65 // 64]
    count = snug[0] if snug else _least_wasteful(unit, counts)
    return SizeClass(unit, count)


def _least_wasteful(unit: int, counts: range) -> int:
    """The unit count among `counts` whose run takes fewest bytes per unit (the fewer on a tie)."""
    return min(counts, key=lambda n: (_run_bytes(unit, n) / n, n))


def _build_classes() -> tuple[SizeClass, ...]:
    grid: list[SizeClass] = []
    step = 0
    while True:
        base = _round_up(int(_GRID_MIN * 2 ** (step / 4)), 64)
        step += 1
        if base >= 16 << 10:
            base += UNIT_HEADROOM
        if base > _GRID_MAX + UNIT_HEADROOM:
            break
        cls = _fitted(base)
        if not grid or cls.unit > grid[-1].unit:
            grid.append(cls)
    snug = [_snug(payload + SNUG_HEADROOM) for payload in SNUG_PAYLOADS]
    units = {cls.unit for cls in grid}
    return tuple(sorted(grid + [cls for cls in snug if cls.unit not in units],
                        key=lambda cls: cls.unit))


SIZE_CLASSES = _build_classes()
_UNITS = [cls.unit for cls in SIZE_CLASSES]


def class_index(record_size: int) -> int | None:
    """The index in `SIZE_CLASSES` of the class a record of `record_size` bytes is allocated
    from; ``None``: a huge allocation."""
    index = bisect.bisect_left(_UNITS, record_size + ALLOC_HEADER)
    return index if index < len(_UNITS) else None


def size_class(record_size: int) -> SizeClass | None:
    """The class a record of `record_size` bytes is allocated from; ``None``: a huge allocation."""
    index = class_index(record_size)
    return None if index is None else SIZE_CLASSES[index]


def record_footprint(record_size: int) -> int:
    """Bytes of pool a record of `record_size` bytes occupies (its unit, or its chunks)."""
    cls = size_class(record_size)
    if cls is not None:
        return cls.unit
    return _round_up(record_size + ALLOC_HEADER, CHUNK)


def _metadata(capacity: int) -> int:
    pinned = sum(cls.run_bytes for cls in SIZE_CLASSES)
    zones = max(1, math.ceil(capacity / ZONE))
    return FIXED_METADATA + zones * ZONE_METADATA + pinned + capacity // 64


def pool_size_for(capacity: int) -> int:
    """The pool file size created for a tier of `capacity` bytes (see the module docstring)."""
    return _round_up(capacity + _metadata(capacity), 1 << 20)


def capacity_for(pool_size: int) -> int:
    """The largest capacity whose `pool_size_for` fits in a pool of `pool_size` bytes."""
    low, high = 0, pool_size
    while low < high:
        mid = (low + high + 1) // 2
        if pool_size_for(mid) <= pool_size:
            low = mid
        else:
            high = mid - 1
    return low

