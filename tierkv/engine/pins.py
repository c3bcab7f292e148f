"""Pin handles: zero-copy access to an L1-resident object that holds it in place."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

import torch

from tierkv.formats.value import DTYPES, ObjectMeta, ValueKind
from tierkv.keys import Key, encode_key
from tierkv.tiers.base import PinToken

if TYPE_CHECKING:
    from tierkv.engine.engine import Engine


class PinHandle:
    """A live pin. `value` aliases the gpu tier's memory: a tensor of the stored dtype and shape
    (a flat ``uint8`` tensor for bytes values). Writing to it changes the cached object."""

    __slots__ = ("key", "meta", "value")

    def __init__(self, key: Key, meta: ObjectMeta, value: torch.Tensor) -> None:
        self.key = key
        self.meta = meta
        self.value = value


class PinContext:
    """What `Engine.pin` returns: ``async with kv.pin(key) as handle: ...``."""

    def __init__(self, engine: Engine, key: Key) -> None:
        self._engine = engine
        self._key = key
        self._token: PinToken | None = None

    async def __aenter__(self) -> PinHandle:
        if self._token is not None:
            raise RuntimeError("a pin context is entered once")
        token, flat, meta = await self._engine._pin_acquire(self._key)
        self._token = token
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
            self._engine._pin_release(encode_key(self._key), self._token)

