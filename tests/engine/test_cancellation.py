"""Randomised cancellation over every tier combination, checked against a model.

Each round starts a few tasks that put, get, get_many, put_many, delete and invalidate keys of
a small key space (64 B up to ~700 KB, some larger than an L1 slot, some larger than all of
L1; a fifth of them tensors), and every third round a `flush()`. Tasks are cancelled at random
moments: by ``task.cancel()`` after a random delay or a random number of loop iterations, and by
``asyncio.wait_for(op, tiny_timeout)`` around single operations. After each round one plain
put must complete within `PUT_LIMIT` seconds (a hang is reported as such).

The model keeps, per key, every value the key may hold now: the value of the last put that
returned, widened by each put or delete that was started and did not complete (old value, new
value or nothing). Writes of one key are serialised by the test (a lock per key, held until the
engine call has unwound, also when it was cancelled), so the model needs no reordering; gets run
concurrently with everything. Checked during the run: a get returns nothing (a miss is always
allowed: the cache may drop) or a value that the key could hold at some moment of the get —
never another key's bytes, never mixed bytes, never a value that a returned delete or a
returned overwrite removed before the get started; a delete never reports removing a key that is
surely absent; no call swallows a cancellation of its task or raises `CancelledError` when its
task was not cancelled; no call fails (the tiers have room).

At the end of an epoch: `close()`, reopen, and every key's value must be one the model allows;
every object acknowledged before the last flush that returned and not touched since must be
there byte for byte (under write_through every put that returned, unless superseded; after a
clean close, every put that returned and was not superseded, under either policy).
Nothing may be dropped legitimately, by construction: the last tier always has room —
a pmem pool (freed object by object) holds twice the key space's largest footprint and more,
and an nvme log (which consumes space with every write, overwrites and tombstones included, and
whose region reclaim drops live entries) gets a write budget, charged conservatively per put and
delete, below its region area; an epoch ends when the budget runs out, and a new epoch starts on
fresh media while time remains. Only a gpu-only hierarchy, whose last tier is volatile, may
drop and keeps nothing across the reopen.

Knobs: ``TIERKV_CANCEL_SECONDS`` (default 2) seconds of rounds per case;
``TIERKV_CANCEL_SEED`` the base seed (each case and epoch derives its own from it). A seed fixes
the plan of operations and cancellations; timing still varies between runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import random
import shutil
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config

SECONDS = float(os.environ.get("TIERKV_CANCEL_SECONDS", "2"))
BASE_SEED = os.environ.get("TIERKV_CANCEL_SEED", "tierkv-cancel-1")
#: at least this many rounds per epoch, however slow the machine
MIN_ROUNDS = 8
#: seconds a round's tasks may take to finish (cancelled or not) before it counts as a hang
ROUND_LIMIT = 30.0
#: seconds the plain put after each round, and each call of the final check, may take
PUT_LIMIT = 15.0
#: seconds `close()` and reopening may take
CLOSE_LIMIT = 60.0
NVME_REGION = 1 * MiB
NVME_SUPERBLOCK = 4 * KiB
ABSENT = -1  # the "version" of no value

T = TypeVar("T")


# -- the key space -------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeySpace:
    """Per key, the range its values' sizes are drawn from."""

    name: str
    ranges: tuple[tuple[int, int], ...]

    def largest_total(self) -> int:
        return sum(high for _low, high in self.ranges)


def _space(name: str, *groups: tuple[int, int, int]) -> KeySpace:
    return KeySpace(name, tuple((low, high) for count, low, high in groups for _ in range(count)))


#: gpu only: nothing larger than the 256 KiB pool, some larger than a 64 KiB slot
GPU_SPACE = _space("gpu", (6, 64, 48 * KiB), (4, 64 * KiB + 1, 200 * KiB))
#: fits an 8 MiB pool many times over (worst footprint about 3 MiB): for pmem as the last tier
SMALL_SPACE = _space("small", (8, 64, 60 * KiB), (4, 70 * KiB, 250 * KiB),
                     (2, 300 * KiB, 700_000))
#: about 16 MB at the largest, twice an 8 MiB pool: pmem in the middle demotes to nvme
BIG_SPACE = _space("big", (10, 64, 60 * KiB), (8, 70 * KiB, 250 * KiB),
                   (20, 300 * KiB, 700_000))
#: sizes at the edges of slots and blocks, drawn now and then where a key's range holds them
EDGE_SIZES = (64, 4095, 4096, 4097, 64 * KiB - 1, 64 * KiB, 64 * KiB + 1, 128 * KiB,
              256 * KiB, 1 * MiB - 1)


def pick_size(rng: random.Random, space: KeySpace, index: int) -> int:
    low, high = space.ranges[index]
    if rng.random() < 0.1:
        edges = [s for s in EDGE_SIZES if low <= s <= high]
        if edges:
            return rng.choice(edges)
    return rng.randint(low, high)


# -- values --------------------------------------------------------------------------------------
MAGIC = b"TKV!"
HEAD = struct.Struct("<4sIIQ")  # magic, key index, version, size


def make_value(index: int, version: int, size: int) -> bytes:
    """A value that names its key and version; the rest is seeded by both."""
    head = HEAD.pack(MAGIC, index, version, size)
    return head + random.Random(index * 1_000_003 + version).randbytes(size - len(head))


class Failures:
    """Defects found, with the context to reproduce them; the test fails on any."""

    def __init__(self, context: str) -> None:
        self.context = context
        self.found: list[str] = []
        #: per epoch with defects, its engine counters (diagnostics: never asserted)
        self.epoch_stats: dict[str, Callable[[], str]] = {}

    def add(self, message: str) -> None:
        self.found.append(message)

    def raise_if_any(self) -> None:
        if self.found:
            shown = "\n  ".join(self.found[:25])
            more = f"\n  ... and {len(self.found) - 25} more" if len(self.found) > 25 else ""
            stats = "".join(f"\n  engine counters at the end of {seed!r}: {get() or 'n/a'}"
                            for seed, get in self.epoch_stats.items())
            pytest.fail(f"{self.context}: {len(self.found)} defect(s):\n  {shown}{more}{stats}",
                        pytrace=False)


class Hang(Exception):
    """An engine call did not complete in its time limit."""


# -- the model -----------------------------------------------------------------------------------
class Outcome(enum.Enum):
    OK = "ok"
    TIMEOUT = "timed out"
    CANCELLED = "cancelled"
    ERROR = "raised"


@dataclass
class KeyModel:
    index: int
    name: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: versions (ABSENT included) the key may hold now; includes the write in flight
    possible: set[int] = field(default_factory=lambda: {ABSENT})
    #: versions of the puts started on the key, in order
    started: list[int] = field(default_factory=list)
    #: size and tensor-ness of each version
    versions: dict[int, tuple[int, bool]] = field(default_factory=dict)
    #: writes (puts and deletes) started on the key
    seq: int = 0
    #: (version, seq) of the last returned flush that covered the key's acknowledged value
    flushed: tuple[int, int] | None = None
    #: (version, seq) of the last put that returned
    acked: tuple[int, int] | None = None
    #: the last writes of the key and how they ended
    history: deque[str] = field(default_factory=lambda: deque(maxlen=8))

    def definite(self) -> int | None:
        """The version the key surely holds (nothing in flight, nothing ambiguous), else None."""
        if len(self.possible) == 1:
            (only,) = self.possible
            return only
        return None

    def begin_put(self, version: int) -> None:
        self.possible.add(version)
        self.started.append(version)
        self.seq += 1

    def end_put(self, version: int, outcome: Outcome, note: str) -> None:
        if outcome is Outcome.OK:
            self.possible = {version}
            self.acked = (version, self.seq)
        else:
            self.possible |= {version, ABSENT}
        size, tensor = self.versions[version]
        self.history.append(f"{note} v{version} ({size} B{', tensor' if tensor else ''}) "
                            f"{outcome.value}")

    def begin_delete(self) -> None:
        self.possible.add(ABSENT)
        self.seq += 1

    def end_delete(self, outcome: Outcome, note: str) -> None:
        if outcome is Outcome.OK:
            self.possible = {ABSENT}
        self.history.append(f"{note} {outcome.value}")

    def story(self) -> str:
        """The key's last writes, for a defect's message."""
        return "; ".join(self.history)


#: counters worth showing beside a defect, where `stats()` has them (never asserted: the
#: engine's statistics are not part of what this test relies on)
DIAGNOSTIC_COUNTERS = ("drops", "corrupt_reads", "device_errors", "regions_reclaimed",
                       "entries_dropped", "checksum_failures", "regions_used", "regions_free")


def diagnostics(kv: tierkv.Engine) -> str:
    """A line of the engine's and tiers' counters that tell a loss from a legitimate drop."""
    try:
        stats = kv.stats()
        parts = [f"{k}={v}" for k, v in stats.get("engine", {}).items()
                 if k in DIAGNOSTIC_COUNTERS]
        for name, tier in stats.get("tiers", {}).items():
            parts += [f"{name}.{k}={v}" for k, v in tier.items() if k in DIAGNOSTIC_COUNTERS]
        return ", ".join(parts)
    except Exception as exc:  # diagnostics only
        return f"stats() failed: {exc!r}"


def show(versions: set[int]) -> str:
    return ", ".join("absent" if v == ABSENT else f"v{v}" for v in sorted(versions))


def await_chain(task: asyncio.Task[Any]) -> str:
    """The innermost coroutines a task is suspended in (following awaited tasks too)."""
    parts: list[str] = []
    obj: Any = task.get_coro()
    while obj is not None and len(parts) < 60:
        if isinstance(obj, asyncio.Task):
            obj = obj.get_coro()
            continue
        code = getattr(obj, "cr_code", None) or getattr(obj, "gi_code", None)
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
        if code is None:
            parts.append(type(obj).__name__)
            break
        parts.append(f"{code.co_qualname}:{frame.f_lineno if frame is not None else '?'}")
        obj = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
    return " > ".join(parts[-7:])


# -- hierarchies ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    kinds: tuple[str, ...]
    space: KeySpace
    nvme_capacity: int = 0

    @property
    def id(self) -> str:
        return "-".join(self.kinds)

    def config(self, directory: Path, policy: str) -> dict[str, Any]:
        return hierarchy_config(
            directory, self.kinds, write_policy=policy,
            # below other tiers the pool takes a value of 512 KiB or more now and then, which
            # it copies on the native workers (`host_copies`), where a cancelled put's slots
            # come back only when the worker is done
            gpu={"capacity": (256 * KiB if self.kinds == ("gpu",) else 1 * MiB),
                 "slot_size": 64 * KiB, "ttl": "200ms", "host_copies": "workers"},
            pmem={"capacity": 8 * MiB},
            nvme={"capacity": self.nvme_capacity, "region_size": NVME_REGION},
        )

    def write_budget(self) -> int | None:
        """Bytes of log the run may charge (None: the last tier is not a log)."""
        if self.kinds[-1] != "nvme":
            return None
        regions = (self.nvme_capacity - NVME_SUPERBLOCK) // NVME_REGION
        return (regions - 3) * NVME_REGION


def log_charge(size: int) -> int:
    """Log space a put may consume, conservatively: its entry (header allowance, 4 KiB
    alignment) twice over — a region is sealed when the next entry does not fit, so the space
    it wastes is less than that entry — and a tombstone for the copy it replaces, twice too."""
    entry = -(-(size + 1024) // (4 * KiB)) * (4 * KiB)
    return 2 * entry + 2 * 4 * KiB


DELETE_CHARGE = 2 * 4 * KiB

CASES = [
    Case(("gpu",), GPU_SPACE),
    Case(("pmem",), SMALL_SPACE),
    Case(("nvme",), SMALL_SPACE, 128 * MiB),
    Case(("gpu", "pmem"), SMALL_SPACE),
    Case(("gpu", "nvme"), SMALL_SPACE, 128 * MiB),
    Case(("pmem", "nvme"), BIG_SPACE, 256 * MiB),
    Case(("gpu", "pmem", "nvme"), BIG_SPACE, 256 * MiB),
]


def case_params() -> list[Any]:
    params: list[Any] = []
    for case in CASES:
        marks = [pytest.mark.pmem] if "pmem" in case.kinds else []
        # write_through changes nothing where no tier persists
        policies = ["write_back"] if case.kinds == ("gpu",) else ["write_back", "write_through"]
        for policy in policies:
            params.append(pytest.param(case, policy, marks=marks, id=f"{case.id}-{policy}"))
    return params


# -- one epoch: an engine on fresh media, rounds until time or budget run out, then the check ----
class CancellationRun:
    def __init__(self, case: Case, policy: str, directory: Path, seed: str,
                 failures: Failures) -> None:
        self.case = case
        self.policy = policy
        self.directory = directory
        self.seed = seed
        self.rng = random.Random(seed)
        self.failures = failures
        self.space = case.space
        self.keys = [KeyModel(i, f"k{i}") for i in range(len(case.space.ranges))]
        #: bytes of log writes left to charge; None: the last tier is no log
        self.budget = case.write_budget()
        self.out_of_budget = False
        self.kv: tierkv.Engine | None = None
        self.round = 0
        self.counts: dict[str, int] = {}
        self.cache: dict[tuple[int, int], bytes] = {}
        #: counters of the engine at the end of the epoch, for defect messages
        self.last_stats = ""
        #: the engine call each task is in, and since when
        self.inflight: dict[asyncio.Task[Any], tuple[str, float]] = {}

    # -- bookkeeping -----------------------------------------------------------------------------
    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def defect(self, message: str) -> None:
        self.failures.add(f"[seed {self.seed!r}, round {self.round}] {message}")
        self.failures.epoch_stats[self.seed] = lambda: self.last_stats

    def key_defect(self, km: KeyModel, message: str) -> None:
        self.defect(f"{message} [last writes of {km.name}: {km.story() or 'none'}]")

    def charge(self, nbytes: int, *, force: bool = False) -> bool:
        """Take `nbytes` of the log's write budget; False (and the epoch ends) if it is spent.
        The budget keeps regions in reserve for the plain puts that `force` it."""
        if self.budget is None:
            return True
        if nbytes > self.budget and not force:
            self.out_of_budget = True
            return False
        self.budget -= nbytes  # the reserve (see `Case.write_budget`) covers a forced charge
        return True

    def value_bytes(self, index: int, version: int) -> bytes:
        key = (index, version)
        data = self.cache.get(key)
        if data is None:
            size, _tensor = self.keys[index].versions[version]
            data = make_value(index, version, size)
            if len(self.cache) > 64:
                self.cache.clear()
            self.cache[key] = data
        return data

    def new_value(self, rng: random.Random, km: KeyModel) -> tuple[int, bytes | torch.Tensor]:
        size = pick_size(rng, self.space, km.index)
        version = len(km.versions)
        as_tensor = rng.random() < 0.2
        km.versions[version] = (size, as_tensor)
        data = self.value_bytes(km.index, version)
        if as_tensor:
            return version, torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return version, data

    def check(self, km: KeyModel, got: object, allowed: set[int], what: str) -> None:
        """A value returned for `km` must be whole, its own, and one it may hold."""
        if got is None:
            return
        problem = self.problem(km, got, allowed)
        if problem is not None:
            self.key_defect(km, f"{what} {km.name}: {problem}")

    def problem(self, km: KeyModel, got: object, allowed: set[int]) -> str | None:
        if isinstance(got, torch.Tensor):
            if got.dtype != torch.uint8 or got.dim() != 1:
                return f"a tensor of {got.dtype} {tuple(got.shape)} for a 1-d uint8 value"
            data = got.cpu().contiguous().numpy().tobytes()
        elif isinstance(got, bytes):
            data = got
        else:
            return f"returned a {type(got).__name__}"
        if len(data) < HEAD.size or data[:4] != MAGIC:
            return f"{len(data)} bytes that are no value the test put"
        _magic, index, version, size = HEAD.unpack_from(data)
        if index != km.index:
            return f"returned the bytes of another key, k{index} (version {version})"
        if version not in km.versions:
            return f"bytes naming version {version}, never put"
        if version not in allowed:
            return (f"returned version {version}, which a returned delete or overwrite had "
                    f"removed (allowed: {show(allowed)})")
        expected_size, as_tensor = km.versions[version]
        if len(data) != expected_size or size != expected_size or (
            data != self.value_bytes(km.index, version)
        ):
            return (f"version {version} with wrong or mixed bytes ({len(data)} bytes, "
                    f"{expected_size} expected)")
        if as_tensor != isinstance(got, torch.Tensor):
            return (f"version {version} put as {'a tensor' if as_tensor else 'bytes'} came "
                    f"back as {type(got).__name__}")
        return None

    # -- calling the engine ----------------------------------------------------------------------
    def waiting(self, what: str, keys: list[KeyModel]) -> None:
        """Note that this task waits for the test's locks of `keys` (for a hang's report)."""
        task = asyncio.current_task()
        if task is not None:
            names = ", ".join(km.name for km in keys)
            self.inflight[task] = (f"{what} waiting for the test's lock of {names} (held by "
                                   f"another call)", time.monotonic())

    async def call(self, what: str, make: Callable[[], Awaitable[T]], limit: float | None,
                   keys: str = "") -> tuple[Outcome, T | None]:
        """Await one engine call, possibly under ``wait_for``; CANCELLED means this task was
        cancelled (the caller records it, then `settle` re-raises)."""
        task = asyncio.current_task()
        call = f"{what}({keys})"
        if task is not None:
            self.inflight[task] = (call + (f" under wait_for({limit:.4f})"
                                           if limit is not None else ""), time.monotonic())
        try:
            if limit is None:
                result = await make()
            else:
                result = await asyncio.wait_for(make(), limit)
        except TimeoutError:
            self.count(f"{what} timed out")
            return Outcome.TIMEOUT, None
        except asyncio.CancelledError:
            if task is not None and not task.cancelling():
                self.defect(f"{call} raised CancelledError though nothing cancelled its task")
            self.count(f"{what} cancelled")
            return Outcome.CANCELLED, None
        except Exception as exc:
            self.defect(f"{call} raised {exc!r}")
            return Outcome.ERROR, None
        finally:
            if task is not None:
                self.inflight.pop(task, None)
        if task is not None and task.cancelling() and limit is None:
            # (under wait_for, Python 3.11 itself drops a cancellation that meets completion)
            self.defect(f"{call} swallowed the cancellation of its task and returned")
        self.count(f"{what} ok")
        return Outcome.OK, result

    @staticmethod
    def settle(outcome: Outcome) -> None:
        """After the model is updated: end a cancelled task as cancelled."""
        task = asyncio.current_task()
        if outcome is Outcome.CANCELLED or (task is not None and task.cancelling()):
            raise asyncio.CancelledError

    def pick_limit(self, rng: random.Random) -> float | None:
        draw = rng.random()
        if draw < 0.7:
            return None
        if draw < 0.75:
            return 0.0
        if draw < 0.9:
            return rng.uniform(0.0, 0.002)
        return rng.uniform(0.002, 0.03)

    @property
    def engine(self) -> tierkv.Engine:
        assert self.kv is not None
        return self.kv

    # -- operations ------------------------------------------------------------------------------
    async def op_put(self, rng: random.Random, limit: float | None) -> None:
        km = rng.choice(self.keys)
        version, value = self.new_value(rng, km)
        if not self.charge(log_charge(km.versions[version][0])):
            return await self.op_get(rng, limit)
        self.waiting("put", [km])
        async with km.lock:
            km.begin_put(version)
            outcome, _ = await self.call("put", lambda: self.engine.put(km.name, value), limit,
                                         km.name)
            km.end_put(version, outcome, f"r{self.round} put")
        self.settle(outcome)

    async def op_put_many(self, rng: random.Random, limit: float | None) -> None:
        chosen = sorted(rng.sample(self.keys, rng.randint(2, 3)), key=lambda k: k.index)
        items = [(km, *self.new_value(rng, km)) for km in chosen]
        if not self.charge(sum(log_charge(km.versions[v][0]) for km, v, _ in items)):
            return await self.op_get(rng, limit)
        self.waiting("put_many", chosen)
        async with contextlib.AsyncExitStack() as stack:
            for km in chosen:  # always in key order: no deadlock between tasks
                await stack.enter_async_context(km.lock)
            for km, version, _ in items:
                km.begin_put(version)
            pairs = [(km.name, value) for km, _, value in items]
            outcome, _ = await self.call("put_many", lambda: self.engine.put_many(pairs),
                                         limit, ", ".join(km.name for km in chosen))
            for km, version, _ in items:
                km.end_put(version, outcome, f"r{self.round} put_many")
        self.settle(outcome)

    async def op_delete(self, rng: random.Random, limit: float | None,
                        invalidate: bool = False) -> None:
        km = rng.choice(self.keys)
        if not self.charge(DELETE_CHARGE):
            return await self.op_get(rng, limit)
        what = "invalidate" if invalidate else "delete"
        engine = self.engine
        self.waiting(what, [km])
        async with km.lock:
            surely_absent = km.possible == {ABSENT}
            km.begin_delete()
            outcome, result = await self.call(
                what, (lambda: engine.invalidate(km.name)) if invalidate
                else (lambda: engine.delete(km.name)), limit, km.name)
            km.end_delete(outcome, f"r{self.round} {what}")
        if outcome is Outcome.OK:
            if result not in (0, 1, False, True):
                self.defect(f"{what} {km.name} returned {result!r}")
            elif result and surely_absent:
                self.key_defect(km, f"{what} {km.name} reported removing a key that was "
                                    f"surely absent")
        self.settle(outcome)

    async def op_get(self, rng: random.Random, limit: float | None) -> None:
        km = rng.choice(self.keys)
        allowed, mark = set(km.possible), len(km.started)
        outcome, got = await self.call("get", lambda: self.engine.get(km.name), limit,
                                       km.name)
        if outcome is Outcome.OK:
            self.check(km, got, allowed | set(km.started[mark:]), "get")
            if got is None and allowed == km.possible and len(allowed) == 1 and (
                ABSENT not in allowed
            ):
                self.count("miss of a present key")
        self.settle(outcome)

    async def op_get_many(self, rng: random.Random, limit: float | None) -> None:
        chosen = rng.sample(self.keys, rng.randint(2, 4))
        before = [(set(km.possible), len(km.started)) for km in chosen]
        names = [km.name for km in chosen]
        outcome, got = await self.call("get_many", lambda: self.engine.get_many(names),
                                       limit, ", ".join(names))
        if outcome is Outcome.OK:
            if got is None or len(got) != len(chosen):
                self.defect(f"get_many of {len(chosen)} keys returned {got!r:.80}")
            else:
                for km, (allowed, mark), value in zip(chosen, before, got, strict=True):
                    self.check(km, value, allowed | set(km.started[mark:]), "get_many")
        self.settle(outcome)

    async def op_flush(self, limit: float | None) -> None:
        covered = [(km, v, km.seq) for km in self.keys
                   if (v := km.definite()) is not None and v != ABSENT]
        outcome, _ = await self.call("flush", self.engine.flush, limit)
        if outcome is Outcome.OK:
            for km, version, seq in covered:
                km.flushed = (version, seq)
        self.settle(outcome)

    OPS = ("put", "get", "get_many", "put_many", "delete", "invalidate")
    WEIGHTS = (40, 30, 8, 6, 10, 6)

    async def worker(self, rng: random.Random, count: int) -> None:
        for _ in range(count):
            op = rng.choices(self.OPS, self.WEIGHTS)[0]
            limit = self.pick_limit(rng)
            if op == "put":
                await self.op_put(rng, limit)
            elif op == "get":
                await self.op_get(rng, limit)
            elif op == "get_many":
                await self.op_get_many(rng, limit)
            elif op == "put_many":
                await self.op_put_many(rng, limit)
            else:
                await self.op_delete(rng, limit, invalidate=op == "invalidate")
            if rng.random() < 0.3:
                await asyncio.sleep(0)

    # -- rounds ----------------------------------------------------------------------------------
    async def cancel_after_steps(self, task: asyncio.Task[None], steps: int) -> None:
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()

    async def one_round(self) -> None:
        rng = self.rng
        loop = asyncio.get_running_loop()
        tasks = [
            asyncio.create_task(self.worker(random.Random(rng.random()), rng.randint(1, 5)))
            for _ in range(rng.randint(2, 6))
        ]
        if self.round % 3 == 2:
            tasks.append(asyncio.create_task(self.op_flush(
                rng.choice([None, None, 0.0, rng.uniform(0.0, 0.005)]))))
        timers: list[asyncio.TimerHandle] = []
        cancellers: list[asyncio.Task[None]] = []
        for task in tasks:
            draw = rng.random()
            if draw < 0.25:
                delay = rng.choice([0.0, rng.uniform(0.0, 0.002), rng.uniform(0.002, 0.03)])
                timers.append(loop.call_later(delay, task.cancel))
            elif draw < 0.5:
                cancellers.append(asyncio.create_task(
                    self.cancel_after_steps(task, rng.randrange(0, 60))))
        try:
            _done, pending = await asyncio.wait(tasks, timeout=ROUND_LIMIT)
        finally:
            for timer in timers:
                timer.cancel()
            for canceller in cancellers:
                canceller.cancel()
            await asyncio.gather(*cancellers, return_exceptions=True)
        if pending:
            stuck = "; ".join(self.describe(task) for task in pending)
            for task in pending:
                task.cancel()
            _done, still = await asyncio.wait(pending, timeout=5)
            raise Hang(f"HANG: {len(pending)} of {len(tasks)} tasks of a round still running "
                       f"after {ROUND_LIMIT:.0f}s ({len(still)} still after cancelling them "
                       f"again): {stuck}")
        for task in tasks:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc  # a bug of the test itself
        await self.plain_put()

    def describe(self, task: asyncio.Task[Any]) -> str:
        """Where a stuck task is: its engine call, for how long, and its innermost awaits."""
        what, since = self.inflight.get(task, ("between calls", time.monotonic()))
        return f"{what} for {time.monotonic() - since:.1f}s at {await_chain(task)}"

    async def plain_put(self) -> None:
        """One put, not cancelled, must complete in time after every round."""
        km = self.rng.choice(self.keys)
        version, value = self.new_value(self.rng, km)
        self.charge(log_charge(km.versions[version][0]), force=True)
        async with km.lock:
            km.begin_put(version)
            try:
                await asyncio.wait_for(self.engine.put(km.name, value), PUT_LIMIT)
            except TimeoutError:
                km.end_put(version, Outcome.TIMEOUT, f"r{self.round} plain put")
                raise Hang(f"HANG: a plain put of {km.name} after the round did not complete "
                           f"within {PUT_LIMIT:.0f}s") from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                km.end_put(version, Outcome.ERROR, f"r{self.round} plain put")
                self.defect(f"the plain put of {km.name} after the round raised CancelledError "
                            f"though nothing cancelled it")
                return
            except Exception as exc:
                km.end_put(version, Outcome.ERROR, f"r{self.round} plain put")
                self.defect(f"the plain put after the round raised {exc!r}")
                return
            km.end_put(version, Outcome.OK, f"r{self.round} plain put")

    # -- the epoch -------------------------------------------------------------------------------
    async def run(self, deadline: float) -> None:
        config = self.case.config(self.directory, self.policy)
        self.kv = await asyncio.wait_for(tierkv.open(config), CLOSE_LIMIT)
        try:
            while not self.out_of_budget and (
                self.round < MIN_ROUNDS or time.monotonic() < deadline
            ):
                await self.one_round()
                self.round += 1
        except Hang as hang:
            self.defect(str(hang))
            await self.close()  # if the engine still can; no final check after a hang
            return
        except BaseException:
            await self.close()
            raise
        await self.close()
        await self.check_after_reopen(config)

    async def close(self) -> None:
        kv, self.kv = self.kv, None
        if kv is None:
            return
        self.last_stats = diagnostics(kv)
        try:
            await asyncio.wait_for(kv.close(), CLOSE_LIMIT)
        except TimeoutError:
            self.defect(f"HANG: close() did not return within {CLOSE_LIMIT:.0f}s")
        except Exception as exc:
            self.defect(f"close() raised {exc!r}")

    async def check_after_reopen(self, config: dict[str, Any]) -> None:
        kv = await asyncio.wait_for(tierkv.open(config), CLOSE_LIMIT)
        try:
            for km in self.keys:
                try:
                    got = await asyncio.wait_for(kv.get(km.name), PUT_LIMIT)
                except TimeoutError:
                    self.defect(f"HANG: get of {km.name} after reopen")
                    return
                except Exception as exc:
                    self.defect(f"get of {km.name} after reopen raised {exc!r}")
                    continue
                self.check(km, got, km.possible, "after reopen, get")
                if got is None:
                    self.check_present(km)
        finally:
            await asyncio.wait_for(kv.close(), CLOSE_LIMIT)

    def check_present(self, km: KeyModel) -> None:
        """A key that reopened empty: a defect if the model says it must be there."""
        if self.case.kinds == ("gpu",):
            return  # a volatile hierarchy keeps nothing across a reopen
        if km.flushed is not None and km.flushed[1] == km.seq:
            version = km.flushed[0]
            why = "acknowledged before a flush that returned"
        elif km.acked is not None and km.acked[1] == km.seq:
            version = km.acked[0]
            why = ("a write_through put that returned" if self.policy == "write_through"
                   else "a put that returned before the clean close")
        else:
            return  # deleted, never put, or ambiguous: absence is allowed
        self.key_defect(km, f"LOST after reopen: {km.name} version {version} "
                            f"({km.versions[version][0]} bytes), {why}, not written since")

    def summary(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        return (f"{self.case.id} {self.policy} seed {self.seed!r}: {self.round} rounds"
                f"{' (write budget spent)' if self.out_of_budget else ''}; {counts}")


@pytest.mark.parametrize(("case", "policy"), case_params())
async def test_random_cancellation_keeps_every_acknowledged_object(
    tmp_path: Path, case: Case, policy: str
) -> None:
    context = (f"{case.id} {policy} (TIERKV_CANCEL_SEED={BASE_SEED!r}, "
               f"TIERKV_CANCEL_SECONDS={SECONDS})")
    failures = Failures(context)
    deadline = time.monotonic() + SECONDS
    epoch = 0
    while True:
        directory = tmp_path / f"epoch{epoch}"
        directory.mkdir()
        run = CancellationRun(case, policy, directory, f"{BASE_SEED}-{case.id}-{policy}-{epoch}",
                              failures)
        await run.run(deadline)
        print(run.summary())
        failures.raise_if_any()
        shutil.rmtree(directory)
        epoch += 1
        if time.monotonic() >= deadline:
            break


def test_key_spaces_fit_the_last_tiers() -> None:
    """The premise of the durability check: no last tier is ever full."""
    # a pool as the last tier: the key space's largest footprint (whole 256 KiB chunks for
    # large objects, allocation classes for small ones), twice (an overwrite holds old and new)
    def footprint(size: int) -> int:
        return 64 * KiB if size <= 60 * KiB else -(-(size + 4 * KiB) // (256 * KiB)) * 256 * KiB

    for case in CASES:
        if case.kinds[-1] == "pmem":
            worst = sum(footprint(high) for _low, high in case.space.ranges)
            assert 2 * worst < 8 * MiB, case.id
        if case.kinds[-1] == "nvme":
            budget = case.write_budget()
            assert budget is not None
            assert budget > 4 * case.space.largest_total(), case.id
    assert max(high for _low, high in GPU_SPACE.ranges) <= 256 * KiB  # each fits in L1 alone
