"""L1: one preallocated tensor on a CUDA device (or the CPU) cut into fixed-size slots.

At open the tier allocates `capacity` bytes once, as a flat ``uint8`` tensor on the configured
device (``cpu`` memory is page-locked when CUDA exists so host↔device copies can be async). An
object occupies ⌈size / slot_size⌉ contiguous slots; nothing is allocated on the device on the
put/get path and the tier never holds more than its capacity.

Copies to and from a CUDA device run on a dedicated stream; the coroutine awaits a CUDA event that a
worker thread waits on, so the event loop never blocks on the device. Because every copy of this
tier is ordered on that one stream, a slot freed while a read of it is still queued cannot be
overwritten before the read completes. On ``cpu`` the copies are plain memcpys: inline for small
objects, on the native library's workers for large puts and large tensor gets
(`_host_copies`), where a put's slots are published only once its copy has ended and a get's
source slots stay reserved until its copy has.

Pins (`ZeroCopyPinning`): a pinned allocation is lent out as a tensor view of the slot memory; it is
not freed while any pin holds it, even when its key is deleted or overwritten meanwhile, nor while
any tensor over the view is alive after its pin was released (`_lending`): a view kept past its
pin keeps reading the object it was lent for, never the next one in those slots.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tierkv._platform import cuda_available, physical_memory
from tierkv.config import GpuTierConfig, TierKind
from tierkv.errors import DeviceError, TierFullError
from tierkv.formats.value import ObjectMeta, Payload, ValueKind, payload_view
from tierkv.tiers._buffers import MIN_RECYCLED, BufferRecycler, address_of
from tierkv.tiers.base import PinToken, RecoveredObject, Tier
from tierkv.tiers.gpu._host_copies import HostCopies
from tierkv.tiers.gpu._lending import lend, lend_host
from tierkv.tiers.gpu._slots import Allocation, SlotAllocator

#: memory of dropped tensor results kept for reuse on the CPU device (`_buffers`)
RETAINED_RESULTS = 64 << 20

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda:0" if cuda_available() else "cpu")
    return torch.device(name)


class GpuTier(Tier):
    """The L1 slot pool (see the module docstring)."""

    kind = TierKind.GPU
    persistent = False

    def __init__(self, config: GpuTierConfig) -> None:
        super().__init__(config.name)
        self.config = config
        self.device = resolve_device(config.device)
        self.slot_size = config.slot_size
        self._slot_count = config.capacity // config.slot_size
        self._allocator = SlotAllocator(self._slot_count)
        self._objects: dict[bytes, Allocation] = {}
        self._storage = torch.empty(0, dtype=torch.uint8)
        self._host: memoryview | None = None
        self._host_address = 0
        self._host_copies = HostCopies(config.host_copies)
        self._stream: Any = None
        self._waiter: ThreadPoolExecutor | None = None
        self._results = BufferRecycler(RETAINED_RESULTS)

    # -- lifecycle -------------------------------------------------------------------------------
    async def _open(self) -> list[RecoveredObject]:
        nbytes = self._slot_count * self.slot_size
        self._storage = self._allocate(nbytes)
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix=f"tierkv-{self.name}-events")
        else:
            array = self._storage.numpy()
            self._host = memoryview(array)  # type: ignore[arg-type]
            self._host_address = address_of(array)
            self._host_copies.start()
        log.info("tier %s: %d slots of %d bytes on %s", self.name, self._slot_count,
                 self.slot_size, self.device)
        return []

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """The slot pool; `DeviceError` when the device cannot hold it."""
        where = str(self.device)
        if self.device.type == "cpu":
            # the loader refuses this too, but a Config built in code skips the loader; past
            # physical memory the zeroing below would only end in the OOM killer
            memory = physical_memory()
            if nbytes > memory:
                raise DeviceError(f"tier {self.name!r}: cannot allocate {nbytes} bytes on cpu: "
                                  f"the machine has {memory} bytes of physical memory")
        try:
            if self.device.type == "cuda":
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            storage = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda_available())
            # pay the pool's page faults at open, not in puts: a put into never-touched slots
            # faulted and zeroed every page (~290 µs per 256 KiB put against ~15 µs of copy)
            storage.zero_()
            return storage
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            # torch's messages run over several lines (a C++ backtrace on some builds)
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise DeviceError(f"tier {self.name!r}: cannot allocate {nbytes} bytes on {where}: "
                              f"{reason}") from exc

    async def _close(self) -> None:
        await self._host_copies.close()
        if self._stream is not None:
            await self._wait(self._record())
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
        # not released: a view lent by a pin may outlive the tier, and keeps its memory alive
        self._host = None
        self._objects.clear()
        self._storage = torch.empty(0, dtype=torch.uint8)

    # -- space -----------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._slot_count * self.slot_size

    @property
    def used(self) -> int:
        return (self._slot_count - self._allocator.free) * self.slot_size

    def _slots_for(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.slot_size)

    def footprint(self, nbytes: int) -> int:
        return self._slots_for(nbytes) * self.slot_size

    def fits(self, nbytes: int) -> bool:
        return self._allocator.can_allocate(self._slots_for(nbytes))

    # -- data path -------------------------------------------------------------------------------
    async def put(self, key: bytes, meta: ObjectMeta, payload: Payload) -> Sequence[bytes]:
        self._check_open()
        count = self._slots_for(meta.nbytes)
        if count > self._slot_count:
            raise TierFullError(f"tier {self.name!r}: {meta.nbytes} bytes exceed its capacity")
        start = self._allocator.allocate(count)
        if start is None:
            raise TierFullError(f"tier {self.name!r}: no run of {count} free slots")
        allocation = Allocation(start, count, meta)
        offset = start * self.slot_size
        if self._host is not None and self._host_copies.offloads(meta.nbytes):
            await self._copy_in_host(allocation, offset, payload)
        else:
            try:
                if self._host is not None:
                    self._host[offset : offset + meta.nbytes] = payload_view(payload)
                else:
                    await self._copy_in(offset, meta.nbytes, payload)
            except BaseException:
                self._allocator.release(start, count)
                raise
        previous = self._objects.get(key)
        self._objects[key] = allocation
        if previous is not None:
            self._drop(previous)
        return ()

    async def get(self, key: bytes) -> tuple[ObjectMeta, Payload] | None:
        self._check_open()
        allocation = self._objects.get(key)
        if allocation is None:
            return None
        meta = allocation.meta
        offset = allocation.start * self.slot_size
        if self._host is not None:
            if meta.kind is ValueKind.BYTES:
                # inline at every size: a fresh `bytes` is memory never touched, and its page
                # faults plus the hand-off made 1 MiB gets slower on a worker (0.45-0.74 of
                # memcpy against 0.49-0.74 inline; a tensor's recycled buffer gained)
                return meta, bytes(self._host[offset : offset + meta.nbytes])
            if self._host_copies.offloads(meta.nbytes):
                return meta, await self._copy_out_host(allocation, offset)
            # a plain memcpy: torch's clone would fan out to its intra-op thread pool, whose
            # workers spin on a busy machine and turned a 2 MiB copy into milliseconds
            source = self._host[offset : offset + meta.nbytes]
            if meta.nbytes >= MIN_RECYCLED:  # a fresh multi-MiB result page-faults every get
                result = self._results.take(meta.nbytes)
                result.data[:] = source
                return meta, torch.from_numpy(result)
            out = torch.empty(meta.nbytes, dtype=torch.uint8)
            memoryview(out.numpy())[:] = source  # type: ignore[arg-type]
            return meta, out
        return meta, await self._copy_out(offset, meta)

    async def delete(self, key: bytes) -> bool:
        self._check_open()
        allocation = self._objects.pop(key, None)
        if allocation is None:
            return False
        self._drop(allocation)
        return True

    async def contains(self, key: bytes) -> bool:
        self._check_open()
        return key in self._objects

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._objects))

    def _drop(self, allocation: Allocation) -> None:
        allocation.detached = True
        self._free_if_unused(allocation)

    def _free_if_unused(self, allocation: Allocation) -> None:
        if (allocation.detached and not allocation.pins and not allocation.views
                and not allocation.freed and self._storage.numel()):
            allocation.freed = True
            self._allocator.release(allocation.start, allocation.count)
            self._space_freed()

    # -- pins ------------------------------------------------------------------------------------
    def acquire_pin(self, key: bytes) -> tuple[PinToken, torch.Tensor]:
        """The pin, and a tensor over the object's slots that keeps them reserved for as long
        as it or any tensor made from it lives, even past `release_pin` (`_lending`)."""
        allocation, offset, returned = self._pin(key)
        return allocation, lend(self._host, self._storage, offset, allocation.meta.nbytes,
                                returned)

    def lend_host(self, key: bytes) -> tuple[PinToken, memoryview] | None:
        if self._host is None:
            return None
        allocation, offset, returned = self._pin(key)
        return allocation, lend_host(self._host, offset, allocation.meta.nbytes, returned)

    def _pin(self, key: bytes) -> tuple[Allocation, int, Callable[[], None]]:
        """Pin `key`'s allocation with one view lent: its offset, and what to call once the
        last use of that view is gone (on any thread)."""
        self._check_open()
        allocation = self._objects[key]
        allocation.pins += 1
        allocation.views += 1
        loop, thread = asyncio.get_running_loop(), threading.get_ident()

        def returned() -> None:
            if threading.get_ident() == thread:
                self._view_returned(allocation)
            elif not loop.is_closed():
                loop.call_soon_threadsafe(self._view_returned, allocation)

        return allocation, allocation.start * self.slot_size, returned

    def _view_returned(self, allocation: Allocation) -> None:
        allocation.views -= 1
        self._after_caller()
        self._free_if_unused(allocation)

    def release_pin(self, token: PinToken) -> None:
        assert isinstance(token, Allocation), "a pin token comes from acquire_pin"
        token.pins -= 1
        self._after_caller()
        self._free_if_unused(token)

    def _after_caller(self) -> None:
        """On CUDA, order the tier's later copies after the work queued so far on the device's
        current stream: the kernels through which a pin's holder read or wrote the lent view
        run there, and no copy may read the object before they wrote it, nor fill its slots
        with the next object before they read it."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def is_pinned(self, key: bytes) -> bool:
        allocation = self._objects.get(key)
        return allocation is not None and allocation.pins > 0

    # -- large copies on the CPU ------------------------------------------------------------------
    async def _copy_in_host(self, allocation: Allocation, offset: int, payload: Payload) -> None:
        """Fill `allocation`'s new slots on a worker; a copy that fails or whose caller was
        cancelled gives them back when it ends (not before: the worker may still write)."""
        def ended(completed: bool) -> None:
            if not completed:
                self._allocator.release(allocation.start, allocation.count)
                self._space_freed()

        try:
            view = payload_view(payload)
            if view.nbytes != allocation.meta.nbytes:  # the worker would read past it
                raise ValueError(f"a payload of {view.nbytes} bytes for an object of "
                                 f"{allocation.meta.nbytes}")
            source = address_of(view)
        except BaseException:
            ended(False)  # nothing was submitted: the slots are free at once
            raise

        await self._host_copies.copy(self._host_address + offset, source,
                                     allocation.meta.nbytes, view, ended)

    async def _copy_out_host(self, allocation: Allocation, offset: int) -> torch.Tensor:
        """`allocation`'s tensor copied out on a worker into a recycled buffer; its slots stay
        reserved until the copy ends, even if its key is deleted meanwhile."""
        nbytes = allocation.meta.nbytes
        out = self._results.take(nbytes)
        allocation.views += 1
        await self._host_copies.copy(address_of(out), self._host_address + offset, nbytes, out,
                                     lambda completed: self._view_returned(allocation))
        return torch.from_numpy(out)

    # -- CUDA copies -----------------------------------------------------------------------------
    def _record(self) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event

    async def _wait(self, event: Any) -> None:
        if not event.query():
            await asyncio.get_running_loop().run_in_executor(self._waiter, event.synchronize)

    async def _copy_in(self, offset: int, nbytes: int, payload: Payload) -> None:
        if isinstance(payload, torch.Tensor):
            source = payload
        else:
            with warnings.catch_warnings():
                # the buffer is only read, and kept alive until the copy's event completes
                warnings.simplefilter("ignore", UserWarning)
                source = torch.frombuffer(payload_view(payload), dtype=torch.uint8) if nbytes else (
                    torch.empty(0, dtype=torch.uint8))
        if source.device.type == "cuda":
            # the caller's kernels that produce the source run on its current stream
            self._stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(self._stream):
            self._storage[offset : offset + nbytes].copy_(source, non_blocking=True)
            event = self._record()
        await self._wait(event)

    async def _copy_out(self, offset: int, meta: ObjectMeta) -> Payload:
        source = self._storage[offset : offset + meta.nbytes]
        with torch.cuda.stream(self._stream):
            if meta.kind is ValueKind.BYTES:
                out = torch.empty(meta.nbytes, dtype=torch.uint8, pin_memory=True)
            else:
                out = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
            out.copy_(source, non_blocking=True)
            event = self._record()
        await self._wait(event)
        if meta.kind is ValueKind.BYTES:
            return bytes(payload_view(out))
        # `out` came from the allocator's pool of the tier's stream, which alone would let the
        # next get take its memory as soon as the caller drops it, while kernels the caller
        # queued on its own stream may still read it
        out.record_stream(torch.cuda.current_stream(self.device))
        return out

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        pinned = sum(1 for a in self._objects.values() if a.pins)
        stats.update(device=str(self.device), slot_size=self.slot_size, slots=self._slot_count,
                     free_slots=self._allocator.free, objects=len(self._objects), pinned=pinned)
        if self._host is not None:
            stats.update(copy_path=self._host_copies.path)
        return stats

    def describe(self) -> dict[str, str]:
        return describe_device(self.config)


def describe_device(config: GpuTierConfig) -> dict[str, str]:
    """What `tierkv info` says about a gpu tier's device, without allocating anything."""
    device = resolve_device(config.device)
    facts = {"device": str(device), "slots": f"{config.capacity // config.slot_size} x "
             f"{config.slot_size} bytes"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts["cuda"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    else:
        facts["cuda"] = (
            "available (cpu slots are page-locked)" if cuda_available() else "not available"
        )
    return facts
