"""`tierkv bench --device pmem` (quick): every size at both depths beside its memcpy baseline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierkv.bench.pmem import DEPTH, SIZES, TARGET, run_pmem_bench

pytestmark = pytest.mark.pmem


async def test_quick_bench_reports_every_case(tmp_path: Path) -> None:
    result = await run_pmem_bench(tmp_path, quick=True)
    rows = {row["case"]: row for row in result["rows"]}
    for size in SIZES:
        label = f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"
        for op in ("put", "get"):
            concurrent = rows[f"{op} {label} QD{DEPTH}"]
            single = rows[f"{op} {label} QD1"]
            for row in (concurrent, single):
                assert row["unit"] == "GB/s" and row["measured"] > 0 and row["baseline"] > 0
            assert concurrent["target"] == TARGET  # judged with requests in flight
            assert single["target"] is None  # reported beside it
    assert rows["put 4KiB p50 (lower is better)"]["measured"] > 0
    assert result["copy_path"].startswith("native")
    assert not any(entry.is_file() for entry in os.scandir(tmp_path))  # the pool is deleted
