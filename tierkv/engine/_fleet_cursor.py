"""This engine's saved position in the fleet's invalidation log, beside the objects it describes.

Separate because it is a record's bytes and their reading, apart from when `Shared` saves it.
The position is the cursor (the order of the last entry applied here) and the epoch of the log
it was read in (`Fleet.reaches`); a save of the cursor alone (8 bytes, an older engine's) is
read as of an unknown epoch.
"""

from __future__ import annotations

import struct

from tierkv.engine._own import read_own
from tierkv.engine._state import EngineState
from tierkv.keys import FLEET_CURSOR_KEY

_CURSOR = struct.Struct("<Q8s")
_CURSOR_ALONE = struct.Struct("<Q")


def encode_cursor(cursor: int, epoch: bytes) -> bytes:
    return _CURSOR.pack(cursor, epoch)


async def saved_cursor(st: EngineState) -> tuple[int, bytes | None] | None:
    """The newest saved (cursor, epoch of its log), if any was saved."""
    copies: list[tuple[int, tuple[int, bytes | None]]] = []
    for meta, payload in await read_own(st, FLEET_CURSOR_KEY):
        if meta.nbytes == _CURSOR.size:
            cursor, epoch = _CURSOR.unpack(payload)
            copies.append((meta.generation, (int(cursor), bytes(epoch))))
        elif meta.nbytes == _CURSOR_ALONE.size:
            copies.append((meta.generation, (int(_CURSOR_ALONE.unpack(payload)[0]), None)))
    return max(copies)[1] if copies else None  # the newest copy's
