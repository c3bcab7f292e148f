"""The NVMe bench's pairing: a round (one tier run flanked by the fio jobs set against it), the
one-file-per-object run made next to it, and the row of the pair whose ratio is the median.

Apart from the runs because it is the method, not a measurement: it sets the figures of two
noisy sides beside each other, alternating which goes first so that drift in the host's cache
favours neither.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.bench.common import Row
from tierkv.bench.nvme_baselines import _FIO_NAME, FioJob, _files_run


@dataclass(frozen=True, slots=True)
class _Pair:
    """One tier figure beside the fio figure measured next to it (`fio_first`: fio ran first)."""

    tier: float
    fio: float
    fio_first: bool

    @property
    def ratio(self) -> float:
        return self.tier / self.fio


def _median_pair(pairs: Sequence[_Pair]) -> int:
    """Run-order index of the pair whose ratio is the median (the lower middle one if even)."""
    ranked = sorted(range(len(pairs)), key=lambda n: pairs[n].ratio)
    return ranked[(len(pairs) - 1) // 2]


def _pair_row(case: str, unit: str, pairs: Sequence[_Pair], target: float | None,
              baseline: str = _FIO_NAME) -> tuple[Row, dict[str, Any]]:
    """The row of the median pair (its tier and baseline figures), and the JSON of all the
    pairs (the baseline's figures under "fio", whatever it is: `baseline` names it)."""
    middle = pairs[_median_pair(pairs)]
    ratios = [pair.ratio for pair in pairs]
    low, high = min(ratios), max(ratios)
    row = Row(f"{case} (median of {len(pairs)} pairs, {low:.2f}\u2013{high:.2f})", unit,
              middle.tier, middle.fio, baseline, target)
    detail = {"case": case, "baseline": baseline, "pairs": len(pairs),
              "median_pair": _median_pair(pairs),
              "median_ratio": middle.ratio, "min_ratio": low, "max_ratio": high,
              "ratios": ratios, "tier": [pair.tier for pair in pairs],
              "fio": [pair.fio for pair in pairs],
              "fio_first": [pair.fio_first for pair in pairs]}
    return row, detail


@dataclass(frozen=True, slots=True)
class _Round:
    """One tier run (fill, then reads) with the fio jobs measured beside it."""

    tier: dict[str, float]
    fio_write: dict[str, float] | None
    fio_read: dict[str, float]
    #: whether fio ran before the tier's writes / before the tier's reads
    write_fio_first: bool
    read_fio_first: bool


async def _round(n: int, tier: Callable[[], Awaitable[dict[str, float]]],
                 fio_read: FioJob, fio_write: FioJob | None = None) -> _Round:
    """Round `n`: the fio jobs flank the tier run, each next to the tier phase it is set against.

    Even rounds run fio write, tier (write, read), fio read: fio first for writes, the tier first
    for reads. Odd rounds run the mirror image, so over the rounds each case alternates which
    side goes first and drift in the host's cache favours neither.
    """
    loop = asyncio.get_running_loop()
    first, last = (fio_write, fio_read) if n % 2 == 0 else (fio_read, fio_write)
    before = await loop.run_in_executor(None, first) if first is not None else None
    tier_result = await tier()
    after = await loop.run_in_executor(None, last) if last is not None else None
    write, read = (before, after) if n % 2 == 0 else (after, before)
    assert read is not None
    return _Round(tier_result, write, read, write_fio_first=n % 2 == 0,
                  read_fio_first=n % 2 == 1)


@dataclass(frozen=True, slots=True)
class _FilesPair:
    """A round and the one-file-per-object run made next to its tier run."""

    round: _Round
    files: dict[str, float]
    files_first: bool

    def bytes_pair(self, side: str) -> _Pair:
        """MB/s of the tier and of the files for `side` ("write" or "read")."""
        key = f"{side}_bytes_per_s"
        return _Pair(self.round.tier[key] / 1e6, self.files[key] / 1e6, self.files_first)


async def _with_files(n: int, round_run: Awaitable[_Round], directory: Path, size: int,
                      count: int) -> _FilesPair:
    """Round `n` and a one-file-per-object run of `count` objects in `directory`: after the
    round in even rounds, before it in odd ones, so neither side is always first."""
    if n % 2:
        files = await _files_run(directory, size, count)
        return _FilesPair(await round_run, files, files_first=True)
    done = await round_run
    return _FilesPair(done, await _files_run(directory, size, count), files_first=False)


def _bytes_pair(r: _Round, side: str) -> _Pair:
    """The MB/s pair of round `r` for `side` ("write" or "read")."""
    if side == "write":
        assert r.fio_write is not None
        return _Pair(r.tier["write_bytes_per_s"] / 1e6, r.fio_write["bytes_per_s"] / 1e6,
                     r.write_fio_first)
    return _Pair(r.tier["read_bytes_per_s"] / 1e6, r.fio_read["bytes_per_s"] / 1e6,
                 r.read_fio_first)
