"""A persistent tier's record of the last session of its hierarchy it took part in.

The payload of an object the engine keeps for itself in each local persistent tier
(`tierkv.keys.MEMBERSHIP_KEY`; the tier's object header already checksums it). Strict on its own
too: a record that is not exactly this layout fails to decode.

    magic    4 bytes   b"TKMB"
    tier     16 bytes  this tier's id (random, drawn when its first record was written)
    seq      u64       the session's number: one more than the highest any tier held at its open
    session  16 bytes  the session's id (random)
    count    u16       tiers the session opened with
    members  count times 16 bytes, their ids
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tierkv.errors import CorruptObjectError

MAGIC = b"TKMB"
ID_SIZE = 16
_HEAD = struct.Struct(f"<4s{ID_SIZE}sQ{ID_SIZE}sH")
#: most members a record lists (a u16 count; a hierarchy has a handful of tiers)
MAX_MEMBERS = 0xFFFF


@dataclass(frozen=True, slots=True)
class Membership:
    tier: bytes
    seq: int
    session: bytes
    members: frozenset[bytes]


def encode_membership(record: Membership) -> bytes:
    ids = [record.tier, record.session, *record.members]
    if any(len(each) != ID_SIZE for each in ids):
        raise ValueError(f"a membership record's ids are {ID_SIZE} bytes")
    if len(record.members) > MAX_MEMBERS:
        raise ValueError(f"a membership record lists at most {MAX_MEMBERS} tiers")
    head = _HEAD.pack(MAGIC, record.tier, record.seq, record.session, len(record.members))
    return head + b"".join(sorted(record.members))


def decode_membership(data: bytes | bytearray | memoryview) -> Membership:
    """The record `data` holds; `CorruptObjectError` unless it is exactly one."""
    view = memoryview(data).cast("B")
    if len(view) < _HEAD.size:
        raise CorruptObjectError("membership record: shorter than its head")
    magic, tier, seq, session, count = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise CorruptObjectError("membership record: not a membership record (magic)")
    if len(view) != _HEAD.size + count * ID_SIZE:
        raise CorruptObjectError("membership record: its length is not its member count's")
    members = frozenset(bytes(view[offset:offset + ID_SIZE])
                        for offset in range(_HEAD.size, len(view), ID_SIZE))
    if len(members) != count:
        raise CorruptObjectError("membership record: a member listed twice")
    return Membership(tier, seq, session, members)
