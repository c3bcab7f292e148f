"""Each tier's circuit breaker, as the engine's calls into the tier see it.

Every call the engine makes into a tier goes through the tier's `Guard`, one of five ways:

- `read` (get, get_many, the shared tier's lookups): skipped while the breaker is open
  (`TierUnavailableError`, a `DeviceError`: the caller reads the next copy, or misses); a read
  slower than `[health] slow_operation` is cut off there — the caller goes on without it — and
  counts as failed. Cutting it off is cancelling it, which the Tier contract makes safe: the
  tier's own background work (a region read, a copy on a worker thread) finishes by itself and
  holds its buffers until it does.
- `write` (put, and the copies of moves): skipped while the breaker is open, so the write
  falls through to the next tier; cut off at `slow_operation` like a read, and failed: the put
  writes the next tier instead, a move leaves its source in place. Into a *deferred* tier (the
  nvme log, whose puts append to a buffer in memory that a flush or the write-behind writes
  out) a write counts nowhere, whether it returned or failed, and takes no probe slot while
  the breaker is half-open (it is skipped only while it is open): the flush that covers it
  gives the verdict. Counted as successes, appends outnumbered the failed flushes of a log
  whose every write failed, and its breaker never opened. What the cut-off write may
  still leave in the tier (its IO finishing in the background) is the key's to scrub: the
  caller marked the tier dirty before the call (`_keys`), and the tier orders the scrub's
  delete after the put it cancelled.
- `delete`: never skipped (a delete is what keeps an invalidated object from coming back), but
  cut off at `slow_operation`: one that fails or is cut off is the caller's to record
  (`_tombstones`: retried at each flush, recorded so that a reopen never brings it back).
- `insist` (a flush's copies, the engine's own records): made whatever the breaker says, cut
  off at `slow_operation` like a write: a flush must make what it covers durable or fail, and a
  breaker still open after its device healed must not turn it into a flush that returned with
  the objects only in memory.
- `settle` (flush, and the shared tier's deletes and invalidation notices, bounded by that
  tier's own timeout): never skipped, never cut off, only recorded: a flush is what makes an
  acknowledged object durable, and there is nothing to fall back to.

A cut-off measures the device, not the loop: what a stall of the loop itself took from a call
is given back to it, and a completion the loop took in with the deadline wins
(`tierkv._deadline`), so a loop held up for longer than `slow_operation` neither turns the reads
then in flight into misses nor counts them against the breaker.

The gpu tier's guard is *direct*: its reads, writes and deletes go straight to the tier. It does
no device IO (its calls are copies), so nothing it raises on them is a `DeviceError`, and its
breaker could never open; its books and a cut-off were a third of an L1 hit's time.

A failure is a `DeviceError` of the tier (or a cut-off call); other errors (a full tier, a
closed engine, a cancelled caller) say nothing about the device. A state change is logged by
the breaker, counted here, and handed to the listener (the engine tells the scheduler, so that
no put or move is planned into an open tier). An open breaker turns half-open only when asked
after its cool-down: `poll` asks (the engine's health task calls it every second), and the
calls then admitted are its probes.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from tierkv._deadline import CutOffs
from tierkv.config import HealthConfig
from tierkv.errors import DeviceError, TierUnavailableError
from tierkv.health import BreakerState, CircuitBreaker
from tierkv.health.breaker import BreakerSnapshot, Permit

P = ParamSpec("P")
T = TypeVar("T")
#: called on the loop after a tier's breaker changed state: (tier index, new state)
Changed = Callable[[int, BreakerState], None]


class Guard:
    __slots__ = ("_changed", "_clock", "_cut_offs", "_deferred", "_direct", "_index", "breaker",
                 "name", "transitions")

    def __init__(self, index: int, name: str, health: HealthConfig, changed: Changed, *,
                 direct: bool = False, deferred: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._index = index
        #: a write, returned or failed, is no verdict on the device (the module docstring)
        self._deferred = deferred
        #: reads, writes and deletes go straight to the tier, past the breaker and uncut: a tier
        #: that does no device IO (the gpu slot pool, whose calls are copies) raises no
        #: `DeviceError` there, which is all a breaker counts, and on an L1 hit of a few µs the
        #: breaker's books and a cut-off were a third of the get
        self._direct = direct
        self.name = name
        self._changed = changed
        self._clock = clock
        self._cut_offs = CutOffs(health.slow_operation)
        #: state changes by the state entered
        self.transitions: dict[str, int] = {state.value: 0 for state in BreakerState}
        self.breaker = CircuitBreaker.from_config(health, name=name, on_change=self._on_change)

    def _on_change(self, old: BreakerState, new: BreakerState, now: float) -> None:
        self.transitions[new.value] += 1
        self._changed(self._index, new)

    def poll(self) -> BreakerState:
        """The breaker's state now (an open one past its cool-down turns half-open here)."""
        return self.breaker.state(self._clock())

    async def read(self, call: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        if self._direct:
            return await call(*args, **kwargs)
        return await self._cut_off(self._admit(), "a read", "read elsewhere", call, *args,
                                   **kwargs)

    async def write(self, call: Callable[P, Awaitable[T]], *args: P.args,
                    **kwargs: P.kwargs) -> T:
        if self._direct:
            return await call(*args, **kwargs)
        if self._deferred:  # no verdict either way, and no probe slot taken (the flush's)
            if self.poll() is BreakerState.OPEN:
                raise self._unavailable()
            return await self._cut_off(None, "a write", "write elsewhere", call, *args,
                                       **kwargs)
        return await self._cut_off(self._admit(), "a write", "write elsewhere", call, *args,
                                   **kwargs)

    async def delete(self, call: Callable[P, Awaitable[T]], *args: P.args,
                     **kwargs: P.kwargs) -> T:
        """A delete: made whatever the breaker says, cut off at `slow_operation` like a read
        (the caller records a delete that failed or was cut off: `_tombstones`)."""
        if self._direct:
            return await call(*args, **kwargs)
        return await self._cut_off(self._allow(made_anyway=True), "a delete",
                                   "it is retried", call, *args, **kwargs)

    async def insist(self, call: Callable[P, Awaitable[T]], *args: P.args,
                     **kwargs: P.kwargs) -> T:
        """A write a barrier needs (a flush's copy of an object no persistent tier holds): made
        whatever the breaker says, cut off at `slow_operation` like a write. The breaker routes
        foreground calls away from a failing device; a flush has nowhere else to go, and one
        that passed over a healed device still in its cool-down returned with nothing durable."""
        return await self._cut_off(self._allow(made_anyway=True), "a write",
                                   "the flush fails", call, *args, **kwargs)

    async def settle(self, call: Callable[P, Awaitable[T]], *args: P.args,
                     **kwargs: P.kwargs) -> T:
        """A call that must be made whatever the breaker says, and waited for (a flush); its
        outcome is recorded when the breaker admits a call now (it is not a probe otherwise)."""
        permit = self.breaker.allow(self._clock(), made_anyway=True)
        try:
            result = await call(*args, **kwargs)
        except BaseException as exc:
            if permit is not None:
                self._report(permit, exc)
            raise
        if permit is not None:
            self.breaker.success(permit, self._clock())
        return result

    async def _cut_off(self, permit: Permit | None, what: str, then: str,
                       call: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """`call`, cut off at `slow_operation`; its outcome recorded when `permit` is one."""
        breaker = self.breaker
        try:
            with self._cut_offs():
                result = await call(*args, **kwargs)
        except TimeoutError:
            if permit is not None:
                breaker.failure(permit, self._clock(), slow=True)
            raise DeviceError(f"tier {self.name!r} did not answer {what} within "
                              f"{self._cut_offs.seconds:g}s; {then}") from None
        except BaseException as exc:
            if permit is not None:
                self._report(permit, exc)
            raise
        if permit is not None:
            # a call that was not cut off was not slow: the cut-off discounts the loop's own
            # stalls, which the breaker's clock cannot
            breaker.success(permit, self._clock(), slow=False)
        return result

    def _allow(self, *, made_anyway: bool = False) -> Permit | None:
        """The breaker's permit for a call `_cut_off` makes: one it cuts off and reports itself,
        so the breaker's clock does not expire it (a stall of the loop is given back).
        `made_anyway`: made without a permit too (`Breaker.allow`)."""
        return self.breaker.allow(self._clock(), bounded=True, made_anyway=made_anyway)

    def _admit(self) -> Permit:
        permit = self._allow()
        if permit is None:
            raise self._unavailable()
        return permit

    def _unavailable(self) -> TierUnavailableError:
        return TierUnavailableError(f"tier {self.name!r} is unavailable (its circuit breaker "
                                    "is open)")

    def _report(self, permit: Permit, exc: BaseException) -> None:
        if isinstance(exc, DeviceError):
            self.breaker.failure(permit, self._clock())
        else:  # not the device's doing: cancelled, full, closed
            self.breaker.cancel(permit)

    def snapshot(self) -> BreakerSnapshot:
        """The breaker's state and counters now (`Engine.metrics`)."""
        return self.breaker.snapshot(self._clock())

    def stats(self) -> dict[str, Any]:
        snapshot = self.breaker.snapshot(self._clock())
        return {"breaker": snapshot.state.value, "breaker_opened": snapshot.opened,
                "breaker_rejected": snapshot.rejected, "breaker_failures": snapshot.failures,
                "breaker_slow": snapshot.slow}
