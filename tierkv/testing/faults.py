"""Fault injection: tiers and block devices that fail on purpose, for tests and
`tierkv bench --faults SPEC`.

Two places to inject, as a real failure would arrive:

- `FaultyTier` wraps any tier and makes its calls fail as a failing device would make them
  fail: ``eio`` and ``enospc`` (a `DeviceError` with that errno, the call not made), ``latency``
  (the call waits first), ``hang`` (the call never answers; it ends only when cancelled).
- `FaultyBlockIO` wraps the nvme tier's block device (`NvmeTier.wrap_io`): ``flip`` flips one
  bit of what a read returns (the bytes on media as a bad sector would give them back: the
  tier's checksums must catch it), ``torn`` writes only the first part of a write and then
  fails it with EIO (as a write cut by a failing device), besides ``eio``, ``latency``, ``hang``.

A `FaultPlan` says which faults fire where, by rate (each call draws from a seeded generator)
or by schedule (the n-th call of that kind), and counts what fired. Its text form, for the CLI:
``TIER:FAULT=RATE[@ARG][;ops=OP|OP...]`` separated by commas, e.g. ``pmem:eio=0.05,
nvme:flip=0.01,nvme:latency=0.2@50ms,redis:hang=0.001;ops=get``; a fault applies to the tier
named (and, for ``flip``/``torn``, to its block device); ``ops`` (among get, put, delete,
flush; a device's reads are ``get`` and its writes ``put``) limits it to those calls. A
``latency`` needs its duration (``@50ms``). A ``hang`` holds the call until it is cancelled:
the engine cuts off reads and writes at ``[health] slow_operation`` (`tierkv.engine._guard`),
but waits for deletes and flushes (and a `close` for them), so give hangs ``;ops=get|put``
outside tests of that.
"""

from __future__ import annotations

import asyncio
import errno as errno_codes
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv._units import parse_duration
from tierkv.errors import ConfigError, DeviceError
from tierkv.formats.value import ObjectMeta, Payload
from tierkv.tiers.base import RecoveredObject, Tier

#: faults a tier wrapper injects; the last two only at a block device
TIER_FAULTS = ("eio", "enospc", "latency", "hang")
DEVICE_FAULTS = ("eio", "latency", "hang", "flip", "torn")
#: the calls a fault's `ops` may name
OPS = ("get", "put", "delete", "flush")


@dataclass(slots=True)
class Fault:
    """One fault: where (`tier`), what (`kind`), how often (`rate`, or the call numbers of
    `schedule`), on which calls (`ops`; empty: all), with `arg` (seconds for ``latency``)."""

    tier: str
    kind: str
    rate: float = 0.0
    schedule: frozenset[int] = frozenset()
    ops: frozenset[str] = frozenset()
    arg: float = 0.0
    calls: int = 0


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)
    seed: int = 0
    #: faults that fired: "tier:kind" → count
    fired: Counter[str] = field(default_factory=Counter)
    #: while False nothing fires (a test turns the devices healthy again)
    enabled: bool = True

    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def add(self, tier: str, kind: str, *, rate: float = 0.0, schedule: Sequence[int] = (),
            ops: Sequence[str] = (), arg: float = 0.0) -> FaultPlan:
        self.faults.append(Fault(tier, kind, rate, frozenset(schedule), frozenset(ops), arg))
        return self

    def draw(self, tier: str, op: str, kinds: Sequence[str]) -> Fault | None:
        """The fault that fires for this call of `op` into `tier`, if any (at most one)."""
        if not self.enabled:
            return None
        for fault in self.faults:
            if fault.tier != tier or fault.kind not in kinds or (fault.ops and op not in fault.ops):
                continue
            fault.calls += 1
            if fault.calls in fault.schedule or (fault.rate and self._rng.random() < fault.rate):
                self.fired[f"{tier}:{fault.kind}"] += 1
                return fault
        return None

    def rng(self) -> random.Random:
        return self._rng

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> FaultPlan:
        """A plan from its text form (see the module); `ConfigError` naming the bad part."""
        plan = cls(seed=seed)
        for part in filter(None, (p.strip() for p in spec.split(","))):
            fault_text, _, ops_text = part.partition(";")
            where, _, what = fault_text.partition(":")
            kind, _, value = what.partition("=")
            rate_text, _, arg_text = value.partition("@")
            if not where or kind not in {*TIER_FAULTS, *DEVICE_FAULTS}:
                known = ", ".join(sorted({*TIER_FAULTS, *DEVICE_FAULTS}))
                raise ConfigError(f"--faults: {part!r}: expected TIER:FAULT=RATE[@ARG] with a "
                                  f"fault among {known}")
            try:
                rate = float(rate_text)
                arg = parse_duration(arg_text) if arg_text else 0.0
            except ValueError:
                raise ConfigError(f"--faults: {part!r}: bad rate or argument") from None
            if not 0.0 <= rate <= 1.0:
                raise ConfigError(f"--faults: {part!r}: the rate must be between 0 and 1")
            if kind == "latency" and not arg_text:
                raise ConfigError(f"--faults: {part!r}: a latency needs its duration (@50ms)")
            ops: list[str] = []
            if ops_text:
                label, _, listed = ops_text.partition("=")
                ops = [op.strip() for op in listed.split("|")]
                if label.strip() != "ops" or not set(ops) <= set(OPS):
                    raise ConfigError(f"--faults: {part!r}: expected ;ops=OP[|OP...] with calls "
                                      f"among {', '.join(OPS)}")
            plan.add(where, kind, rate=rate, arg=arg, ops=ops)
        return plan


async def _misbehave(fault: Fault, what: str) -> None:
    """What a fired fault does to the call: wait, never answer, or fail it."""
    if fault.kind == "latency":
        await asyncio.sleep(fault.arg)
        return
    if fault.kind == "hang":
        await asyncio.Event().wait()  # ends only when the caller gives up (cancels)
    code = errno_codes.ENOSPC if fault.kind == "enospc" else errno_codes.EIO
    raise DeviceError(f"injected fault: {what}: {errno_codes.errorcode[code]}", errno=code)


class FaultyTier(Tier):
    """`inner`, with the plan's faults injected into its calls (see the module). Its name,
    kind and nature are the inner tier's; open, close and the space accounting are not faulted.
    Tiers the engine lends memory from (the gpu tier's pins) are not wrapped: wrap the others."""

    def __init__(self, inner: Tier, plan: FaultPlan) -> None:
        super().__init__(inner.name)
        self.inner = inner
        self.plan = plan
        self.queue_depth = inner.queue_depth

    def __getattr__(self, name: str) -> Any:  # the inner tier's own extras (the shared tier's)
        return getattr(self.inner, name)

    async def _fault(self, op: str) -> None:
        fault = self.plan.draw(self.name, op, TIER_FAULTS)
        if fault is not None:
            await _misbehave(fault, f"{self.name} {op}")

    async def _open(self) -> list[RecoveredObject]:
        return await self.inner.open()

    async def _close(self) -> None:
        await self.inner.close()

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def used(self) -> int:
        return self.inner.used

    def footprint(self, nbytes: int) -> int:
        return self.inner.footprint(nbytes)

    def fits(self, nbytes: int) -> bool:
        return self.inner.fits(nbytes)

    def can_ever_hold(self, nbytes: int) -> bool:
        return self.inner.can_ever_hold(nbytes)

    def room(self) -> int:
        return self.inner.room()

    def set_drop_listener(self, listener: Any) -> None:
        self.inner.set_drop_listener(listener)

    def set_space_listener(self, listener: Any) -> None:
        self.inner.set_space_listener(listener)

    def set_reclaim_worth(self, worth: Any) -> None:
        self.inner.set_reclaim_worth(worth)

    async def put(self, key: bytes, meta: ObjectMeta, payload: Payload) -> Sequence[bytes]:
        await self._fault("put")
        return await self.inner.put(key, meta, payload)

    async def get(self, key: bytes) -> tuple[ObjectMeta, Payload] | None:
        await self._fault("get")
        return await self.inner.get(key)

    async def get_many(self, keys: Sequence[bytes]) -> list[tuple[ObjectMeta, Payload] | None]:
        await self._fault("get")
        return await self.inner.get_many(keys)

    async def delete(self, key: bytes) -> bool:
        await self._fault("delete")
        return await self.inner.delete(key)

    async def contains(self, key: bytes) -> bool:
        return await self.inner.contains(key)

    def keys(self) -> Iterator[bytes]:
        return self.inner.keys()

    def on_media(self, key: bytes) -> bool:
        return self.inner.on_media(key)

    def forget(self, key: bytes) -> bool:
        return self.inner.forget(key)

    def damaged_at_open(self) -> frozenset[bytes]:
        return self.inner.damaged_at_open()

    async def flush(self) -> None:
        await self._fault("flush")
        await self.inner.flush()

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "faults_fired": {
            k: v for k, v in self.plan.fired.items() if k.startswith(f"{self.name}:")}}

    def describe(self) -> dict[str, str]:
        return self.inner.describe()


class FaultySharedTier(FaultyTier):
    """A shared (redis) tier, its own calls faulted too: its lookups (`fetch_many`) as gets
    and its batch deletes (`delete_many`) as deletes. The fleet's log is not faulted."""

    async def fetch_many(self, keys: Sequence[bytes]) -> Any:
        await self._fault("get")
        shared: Any = self.inner
        return await shared.fetch_many(keys)

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        await self._fault("delete")
        shared: Any = self.inner
        await shared.delete_many(keys)


def faulty(inner: Tier, plan: FaultPlan) -> Tier:
    """`inner` wrapped in a `FaultyTier` whose class attributes (kind, persistence, whether it
    reclaims space or is shared) are the inner tier's; an nvme tier's block device is wrapped
    in a `FaultyBlockIO` too."""
    if hasattr(inner, "wrap_io"):
        name = inner.name
        inner.wrap_io = lambda io: FaultyBlockIO(io, plan, name)
    cls = type(inner)
    base = FaultySharedTier if cls.shared else FaultyTier
    wrapper = type(f"Faulty{cls.__name__}", (base,), {
        "kind": cls.kind, "persistent": cls.persistent, "reclaims_space": cls.reclaims_space,
        "shared": cls.shared})
    tier: Tier = wrapper(inner, plan)
    return tier


class FaultyBlockIO:
    """An nvme block device with the plan's device faults (see the module)."""

    def __init__(self, inner: Any, plan: FaultPlan, tier: str) -> None:
        self.inner = inner
        self.plan = plan
        self.tier = tier
        self.name = inner.name

    async def read(self, buf: Any, offset: int, length: int) -> None:
        fault = self.plan.draw(self.tier, "get", ("eio", "latency", "hang", "flip"))
        if fault is not None and fault.kind != "flip":
            await _misbehave(fault, f"{self.tier} device read at {offset}")
        await self.inner.read(buf, offset, length)
        if fault is not None and fault.kind == "flip" and length:
            view = buf.view if hasattr(buf, "view") else memoryview(buf)
            bit = self.plan.rng().randrange(length * 8)
            view[bit // 8] ^= 1 << (bit % 8)

    async def write(self, buf: Any, offset: int, length: int, start: int = 0, *,
                    urgent: bool = False) -> None:
        fault = self.plan.draw(self.tier, "put", ("eio", "latency", "hang", "torn"))
        if fault is not None and fault.kind == "torn":
            part = (length // 2) & ~4095
            if part:
                await self.inner.write(buf, offset, part, start, urgent=urgent)
            raise DeviceError(f"injected fault: {self.tier} device write at {offset} torn "
                              f"after {part} of {length} bytes", errno=errno_codes.EIO)
        if fault is not None:
            await _misbehave(fault, f"{self.tier} device write at {offset}")
        await self.inner.write(buf, offset, length, start, urgent=urgent)

    async def sync(self) -> None:
        await self.inner.sync()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def open_with_faults(config: Any, plan: FaultPlan, *, clock: Any = None) -> Any:
    """An engine on `config` whose tiers (all but the gpu tiers, whose memory the engine lends
    out) inject `plan`'s faults; close it as any engine. `ConfigError` for a fault that could
    never fire: one naming no such tier (or a gpu tier), ``flip``/``torn`` on a tier other than
    nvme (only its block device is wrapped)."""
    import time

    from tierkv.config import GpuTierConfig, NvmeTierConfig, load_config
    from tierkv.engine.engine import Engine
    from tierkv.tiers.registry import make_tier

    loaded = load_config(config)
    wrapped = {tier.name: tier for tier in loaded.tiers if not isinstance(tier, GpuTierConfig)}
    for fault in plan.faults:
        target = wrapped.get(fault.tier)
        if target is None:
            raise ConfigError(f"faults: {fault.tier}:{fault.kind}: no tier of that name takes "
                              f"faults (those that do: {', '.join(wrapped) or 'none'})")
        if fault.kind not in TIER_FAULTS and not isinstance(target, NvmeTierConfig):
            raise ConfigError(f"faults: {fault.tier}:{fault.kind}: only an nvme tier's block "
                              "device flips bits or tears writes")
    tiers = [make_tier(tier) if isinstance(tier, GpuTierConfig) else faulty(make_tier(tier), plan)
             for tier in loaded.tiers]
    engine = Engine(loaded, tiers, clock or time.monotonic)
    await engine._start()
    return engine
