"""A record on the shared (redis) tier: the object header every tier writes, then the payload.

The header is `tierkv.formats.header`'s, unchanged, with one field given a fleet-wide meaning:
its `generation` is the record's *write stamp*: the position in the fleet's invalidation log
up to which its writer had applied every invalidation (`tierkv.tiers.redis._fleet`).
Engine-local generations mean nothing to another engine; the stamp orders a record against
the invalidations the engines publish. A value that is not exactly one record of the key it is
stored under — truncated, foreign, planted by hand, written under another key — fails to decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.errors import CorruptObjectError
from tierkv.formats.header import (
    ObjectHeader,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)
from tierkv.formats.value import ObjectMeta, payload_view


@dataclass(frozen=True, slots=True)
class SharedRecord:
    """A decoded record: its meta (``generation`` is the write stamp) and payload bytes."""

    meta: ObjectMeta
    payload: memoryview
    checksum: int

    @property
    def stamp(self) -> int:
        return self.meta.generation


def encode_record(key: bytes, meta: ObjectMeta, payload: memoryview, stamp: int
                  ) -> tuple[bytes, int]:
    """The record of `payload` under `key`, stamped `stamp`, and the payload's checksum."""
    header, payload_checksum = encode_record_header(key, meta, payload, stamp)
    return header + payload, payload_checksum


def encode_record_header(key: bytes, meta: ObjectMeta, payload: memoryview, stamp: int
                         ) -> tuple[bytes, int]:
    """The header of `payload`'s record (what precedes the payload, whose bytes follow it
    unchanged), and the payload's checksum."""
    payload_checksum = checksum(payload)
    return (encode_header(ObjectHeader(key, meta.with_generation(stamp), payload_checksum)),
            payload_checksum)


def decode_record(key: bytes, value: bytes | bytearray | memoryview) -> SharedRecord:
    """The record stored under `key`; `CorruptObjectError` unless `value` is exactly one record
    of that key whose payload passes its checksum."""
    view = payload_view(value)
    header, length = decode_header(view)
    if header.key != key:
        raise CorruptObjectError("the record belongs to another key")
    payload = view[length:]
    verify_payload(header, payload)
    return SharedRecord(header.meta, payload, header.payload_checksum)
