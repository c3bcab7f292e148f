"""The engine's index: for every key, its meta and which tiers hold a valid copy of it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tierkv.formats.value import ObjectMeta


@dataclass(slots=True, eq=False)
class IndexEntry:
    """One stored object. `locations` lists tier indices holding a copy, fastest first.

    `readers` counts gets in flight on this object; a copy is not removed from a tier while one
    may still be reading it (`drained` is set when the count falls back to zero).
    """

    meta: ObjectMeta
    locations: list[int] = field(default_factory=list)
    readers: int = 0
    drained: asyncio.Event | None = None

    @property
    def generation(self) -> int:
        return self.meta.generation

    def add_location(self, tier: int) -> None:
        if tier not in self.locations:
            self.locations.append(tier)
            self.locations.sort()

    def remove_location(self, tier: int) -> None:
        if tier in self.locations:
            self.locations.remove(tier)

    def start_read(self) -> None:
        self.readers += 1

    def end_read(self) -> None:
        self.readers -= 1
        if self.readers == 0 and self.drained is not None:
            self.drained.set()
            self.drained = None

    async def wait_for_readers(self) -> None:
        while self.readers:
            if self.drained is None:
                self.drained = asyncio.Event()
            await self.drained.wait()
