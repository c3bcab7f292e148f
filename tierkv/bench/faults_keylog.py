"""What the fault soak knows of each key, and how it judges an answer: values that say which key
and version they are (`encode`, `decode`), each key's log of the versions it may hold now and
after a reopen (`_KeyLog`), and `_check`, which counts what a get answered (a hit, a miss,
stale, corrupt, or lost) in the run's tallies (`_Run`).

Apart from the driver (`tierkv.bench.faults`) because this is the soak's oracle: the rules of its
docstring's "Rounds" and "Goals" kept as state, with no IO and no engine of its own.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tierkv.bench.common import Progress
from tierkv.testing.faults import FaultPlan

MIN_VALUE = 64
#: the prefix of a value: its version and a digest of its key
_HEADER = struct.Struct("<QQ")


def _digest(key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def encode(key: bytes, version: int, size: int) -> bytes:
    """The value of `key` at `version`: `size` bytes that say which they are."""
    body = hashlib.shake_128(b"%s/%d/%d" % (key, version, size)).digest(size - _HEADER.size)
    return _HEADER.pack(version, _digest(key)) + body


def decode(key: bytes, data: bytes) -> int | None:
    """The version of `key` that `data` is, or None: not a value of `key` (corrupt)."""
    if len(data) < MIN_VALUE:
        return None
    version, digest = _HEADER.unpack_from(data)
    if digest != _digest(key) or data != encode(key, version, len(data)):
        return None
    return int(version)


@dataclass(slots=True)
class _KeyLog:
    """What one key may hold now, what a reopen may bring back, and whether its value is
    durable."""

    name: bytes
    #: the versions a get may return now (a miss is always allowed)
    now: set[int] = field(default_factory=set)
    #: the versions a reopen may bring back: those it might hold at the last close that
    #: returned, and every version put since
    recoverable: set[int] = field(default_factory=set)
    #: the last attempt was a put that returned
    acked: bool = False
    #: its value must survive: a write-through put returned, or the engine served it just
    #: before the epoch's last close (write-back: a put that returned may still be lost to a
    #: failing device until a flush or close covers it, and a flushed object leaves the media
    #: again when a promotion out of the pool moves it up)
    durable: bool = False
    #: a reopen happened since the last attempt
    reopened: bool = False
    #: the fastest tier the epoch's last read before its close found the key in (diagnostics:
    #: where a lost object was last seen)
    held_in: str | None = None

    def attempted(self, version: int, *, acked: bool, cancelled: bool, durable: bool) -> None:
        """A put of `version` (0: a delete) ended: returned (`acked` for a put; `durable`:
        under write-through), failed (the key holds the new value or none), or was cancelled (it
        may not have started: the old value may stay, as `tests/engine/test_cancellation.py`
        models it)."""
        if self.reopened:
            self.now = set(self.recoverable)
        new = {version} if version else set()
        self.now = self.now | new if cancelled else new
        self.recoverable |= new
        self.acked, self.durable, self.reopened = acked, acked and durable, False

    def closed(self) -> None:
        """A close returned: what the key may hold is all a reopen may bring back."""
        if self.reopened:
            self.now = set(self.recoverable)
            self.reopened = False
        self.recoverable = set(self.now)

    def allowed(self) -> set[int]:
        return self.recoverable if self.reopened else self.now


@dataclass
class _Run:
    plan: FaultPlan
    operations: int
    clients: int
    size: int
    rounds: int
    working_set: int
    log_bytes: int
    #: whether a close makes anything durable (the hierarchy has a persistent tier)
    persistent: bool
    #: whether a put that returned is durable already
    write_through: bool
    progress: Progress
    counts: Counter[str] = field(default_factory=Counter)
    transitions: Counter[str] = field(default_factory=Counter)
    #: durable objects lost, by the tier they were held in before the epoch's last close
    lost_from: Counter[str] = field(default_factory=Counter)
    #: the recovery figures of each epoch's last reopen (`faults._recovery`)
    final_opens: list[dict[str, Any]] = field(default_factory=list)
    #: corruption the tiers caught (checksums failed)
    detected: int = 0
    version: int = 0
    left: int = 0

    def next_version(self) -> int:
        self.version += 1
        return self.version


def _check(run: _Run, log: _KeyLog, got: object, *, final: bool = False) -> int | None:
    """Count what a get of `log`'s key answered; the version it served if that was right."""
    counts = run.counts
    counts["gets_checked"] += 1
    if got is None:
        counts["misses"] += 1
        if final and log.durable:
            counts["lost"] += 1
            run.lost_from[log.held_in or "missed before the close"] += 1
        return None
    version = decode(log.name, bytes(got)) if isinstance(got, bytes) else None
    if version is None:
        counts["served_corrupt"] += 1
    elif version not in log.allowed():
        counts["served_stale_after_reopen" if log.reopened else "served_stale"] += 1
    else:
        counts["hits"] += 1
        return version
    return None
