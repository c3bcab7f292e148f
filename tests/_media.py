"""Bit rot by hand: the media hooks' one way of damaging what a tier wrote."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def flip_payload_bytes(path: Path, key: bytes,
                       payload_offsets: Callable[[bytes, bytes], list[int]]) -> None:
    """Flip the bits of one byte of the payload of every record of `key` in the file at
    `path`, found by `payload_offsets(media, key)` (the tier's layout)."""
    media = path.read_bytes()
    offsets = payload_offsets(media, key)
    assert offsets, f"no record of {key!r} in {path}"
    with path.open("r+b") as f:
        for offset in offsets:
            f.seek(offset)
            f.write(bytes([media[offset] ^ 0xFF]))
