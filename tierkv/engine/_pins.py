"""Pins: zero-copy access to an object resident in the first (gpu) tier, held in place.

`Pins.acquire` holds the key, brings the object into the first tier if it is only below (a
copy, waiting for room like a put), and takes a pin on the tier's allocation; the engine never
moves or evicts a pinned key, and the gpu tier keeps a pinned allocation alive even if its key
is deleted or overwritten meanwhile. `PinContext` is what `Engine.pin` returns.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import torch

from tierkv.engine._call import Call
from tierkv.engine._copies import CopyOps
from tierkv.engine._state import EngineState
from tierkv.errors import ObjectNotFound, TierFullError, TierKVError
from tierkv.formats.value import DTYPES, ObjectMeta, ValueKind
from tierkv.keys import Key, encode_key
from tierkv.tiers.base import PinToken, ZeroCopyPinning


class Pins:
    __slots__ = ("_copies", "_st")

    def __init__(self, state: EngineState, copies: CopyOps) -> None:
        self._st = state
        self._copies = copies

    def _first(self) -> ZeroCopyPinning:
        first = self._st.pinning[0]
        if first is None:
            raise TierKVError("pin needs a gpu tier first in the hierarchy")
        return first

    async def acquire(self, key: Key, raw: bytes) -> tuple[PinToken, torch.Tensor, ObjectMeta]:
        """Pin `key` (`raw`: its encoding, which `release` is given back)."""
        st = self._st
        first = self._first()
        async with st.keys.hold(raw) as claim:
            st.check_open()
            entry = st.index.get(raw)
            if entry is None or not entry.locations:
                raise ObjectNotFound(key)
            if entry.locations[0] != 0:
                got = await self._copies.read(entry, entry.locations[0])
                if got is None or entry.detached:
                    raise ObjectNotFound(key)
                if not await self._copies.store_in(entry, got[1], 0, claim, wait=True):
                    raise TierFullError("no room in the gpu tier to pin the object")
                if entry.detached:
                    raise ObjectNotFound(key)
            token, flat = first.acquire_pin(raw)
            st.pins[raw] = st.pins.get(raw, 0) + 1
            st.scheduler.accessed(0, raw, st.now())
            return token, flat, entry.meta

    def release(self, raw: bytes, token: PinToken) -> None:
        self._first().release_pin(token)
        pins = self._st.pins
        remaining = pins[raw] - 1
        if remaining:
            pins[raw] = remaining
        else:
            del pins[raw]


class PinHandle:
    """A live pin. `value` aliases the gpu tier's memory: a tensor of the stored dtype and shape
    (a flat ``uint8`` tensor for bytes values). Writing to it changes the cached object."""

    __slots__ = ("key", "meta", "value")

    def __init__(self, key: Key, meta: ObjectMeta, value: torch.Tensor) -> None:
        self.key = key
        self.meta = meta
        self.value = value


class PinContext:
    """What `Engine.pin` returns: ``async with kv.pin(key) as handle: ...``. Taking the pin
    is a public call (`call`: the engine's `_call`): refused from another event loop, whose
    thread would otherwise copy into the gpu tier and change the index beside the engine's
    own, and waited for by `close`."""

    def __init__(self, pins: Pins, key: Key, call: Callable[[], Call]) -> None:
        self._pins = pins
        self._key = key
        self._call = call
        self._token: PinToken | None = None
        #: the key as encoded when the pin was taken: released under it, whatever the caller
        #: does to a mutable key meanwhile (encoded again, a changed bytearray leaked the pin)
        self._raw = b""

    async def __aenter__(self) -> PinHandle:
        if self._token is not None:
            raise RuntimeError("a pin context is entered once")
        async with self._call():
            raw = encode_key(self._key)
            token, flat, meta = await self._pins.acquire(self._key, raw)
        self._token, self._raw = token, raw
        if meta.kind is ValueKind.BYTES:
            value = flat
        else:
            value = flat.view(DTYPES[meta.dtype]).reshape(meta.shape)
        return PinHandle(self._key, meta, value)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._token is not None:
            self._pins.release(self._raw, self._token)
