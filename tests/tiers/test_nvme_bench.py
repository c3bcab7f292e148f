"""The NVMe bench's pairing: the median pair's figures, the ratio range, and the round order."""

from __future__ import annotations

import asyncio
import functools
import shutil
from pathlib import Path

import pytest

from tierkv.bench.nvme import (
    FioJob,
    KiB,
    MiB,
    _fill_count,
    _fio,
    _fio_fill,
    _median_pair,
    _Pair,
    _pair_row,
    _Plan,
    _Round,
    _round,
    _tier_run,
    _with_files,
    run_nvme_bench,
)
from tierkv.errors import ConfigError


def test_row_is_the_median_pair_not_the_medians_of_each_side() -> None:
    # ratios 0.5, 2.0, 1.0, 0.8, 1.5: the median 1.0 is pair 2; median tier (300) and median
    # fio (300) come from other pairs and would give 1.0 too, so the figures tell them apart
    pairs = [_Pair(100, 200, True), _Pair(600, 300, False), _Pair(250, 250, True),
             _Pair(320, 400, False), _Pair(300, 200, True)]
    row, detail = _pair_row("seq write 1MiB QD32", "MB/s", pairs, 0.9)
    assert _median_pair(pairs) == 2
    assert (row.measured, row.baseline) == (250, 250)
    assert row.ratio == 1.0
    assert row.case == "seq write 1MiB QD32 (median of 5 pairs, 0.50\u20132.00)"
    assert row.target == 0.9
    assert row.meets_target is True
    assert detail["pairs"] == 5
    assert detail["median_pair"] == 2
    assert (detail["min_ratio"], detail["max_ratio"]) == (0.5, 2.0)
    assert detail["ratios"] == [0.5, 2.0, 1.0, 0.8, 1.5]
    assert detail["fio_first"] == [True, False, True, False, True]


def test_even_pair_count_takes_the_lower_middle_pair() -> None:
    pairs = [_Pair(4, 2, True), _Pair(1, 1, False), _Pair(3, 1, True), _Pair(1, 2, False)]
    assert _median_pair(pairs) == 1
    row, _ = _pair_row("case", "IOPS", pairs, None)
    assert row.ratio == 1.0
    assert row.meets_target is None


async def test_pairs_below_one_are_refused(tmp_path: Path) -> None:
    directory = tmp_path / "bench"
    with pytest.raises(ConfigError):
        await run_nvme_bench(directory, quick=True, pairs=0)
    assert not directory.exists()  # refused before anything was made


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio: not installed")
async def test_rounds_flank_the_tier_run_and_alternate(tmp_path: Path) -> None:
    plan = _Plan(file_size=64 * MiB, region_size=8 * MiB, fio_seconds=1, files_cap=16, pairs=2)
    path = tmp_path / "bench.nvme"
    order: list[str] = []

    def recorded(name: str, job: FioJob) -> FioJob:
        def run() -> dict[str, float]:
            order.append(name)
            return job()
        return run

    async def tier() -> dict[str, float]:
        order.append("tier")
        return await _tier_run(path, 64 * KiB, plan, random_order=False, reads=True)

    _fio_fill(path, plan.file_size)
    write = recorded("fio write", functools.partial(
        _fio_fill, path, _fill_count(path, MiB, plan) * MiB))
    read = recorded("fio read", functools.partial(_fio, path, "read", MiB, plan.file_size, 1))
    even = await _round(0, tier, read, write)
    assert order == ["fio write", "tier", "fio read"]
    odd = await _round(1, tier, read, write)
    assert order[3:] == ["fio read", "tier", "fio write"]
    assert (even.write_fio_first, even.read_fio_first) == (True, False)
    assert (odd.write_fio_first, odd.read_fio_first) == (False, True)
    for r in (even, odd):
        assert r.fio_write is not None and r.fio_write["bytes_per_s"] > 0
        assert r.fio_read["bytes_per_s"] > 0
        assert r.tier["write_bytes_per_s"] > 0 and r.tier["read_bytes_per_s"] > 0
        assert r.tier["objects"] == _fill_count(path, 64 * KiB, plan)
    path.unlink()


async def test_files_run_beside_each_tier_round_alternating(tmp_path: Path) -> None:
    """The one-file-per-object baseline runs right after the round in even rounds and right
    before it in odd ones; its pair carries both sides' MB/s."""
    order: list[str] = []
    files_dir = tmp_path / "files"

    async def fake_round(n: int) -> _Round:
        order.append("round")
        await asyncio.sleep(0)
        tier = {"write_bytes_per_s": 2e6 * (n + 1), "read_bytes_per_s": 4e6, "objects": 8.0}
        return _Round(tier, None, {"bytes_per_s": 1.0, "iops": 1.0}, write_fio_first=False,
                      read_fio_first=False)

    async def watched(n: int) -> _Round:
        result = await fake_round(n)
        order.append("files" if files_dir.exists() else "no files yet")
        return result

    even = await _with_files(0, watched(0), files_dir, 4 * KiB, 8)
    assert order == ["round", "no files yet"] and not even.files_first
    odd = await _with_files(1, fake_round(1), files_dir, 4 * KiB, 8)
    assert odd.files_first and not files_dir.exists()  # made, read back and removed
    for pair, n in ((even, 0), (odd, 1)):
        assert pair.files["objects"] == 8
        write, read = pair.bytes_pair("write"), pair.bytes_pair("read")
        assert write.tier == 2.0 * (n + 1) and read.tier == 4.0
        assert write.fio == pair.files["write_bytes_per_s"] / 1e6 > 0
        assert read.fio == pair.files["read_bytes_per_s"] / 1e6 > 0
        assert write.fio_first is pair.files_first


@pytest.mark.uring
async def test_a_tier_run_after_another_on_the_same_file_starts_empty(tmp_path: Path) -> None:
    """Two tier runs of random-order puts with nothing between (an odd round's fio job only
    reads): the second found the first's valid log (`format = true` keeps it), its puts of the
    same keys made the log reclaim regions of live entries, and the bench's assert failed."""
    plan = _Plan(file_size=64 * MiB, region_size=8 * MiB, fio_seconds=1, files_cap=16, pairs=2)
    path = tmp_path / "bench.nvme"
    runs = [await _tier_run(path, 64 * KiB, plan, random_order=True, reads=True)
            for _ in range(2)]
    assert [run["objects"] for run in runs] == [_fill_count(path, 64 * KiB, plan)] * 2
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
