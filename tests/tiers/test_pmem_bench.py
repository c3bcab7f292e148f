"""`tierkv bench --device pmem` (quick): every size at both depths beside its memcpy baseline."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from tierkv.bench.pmem import DEPTH, SIZES, TARGET, run_pmem_bench

pytestmark = pytest.mark.pmem


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One quick run for the module's tests, and the directory it ran in."""
    directory = tmp_path_factory.mktemp("pmem-bench")
    return asyncio.run(run_pmem_bench(directory, quick=True)), directory


def test_quick_bench_reports_every_case(quick_bench: tuple[dict[str, Any], Path]) -> None:
    result, directory = quick_bench
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
    assert not any(entry.is_file() for entry in os.scandir(directory))  # the pool is deleted


@pytest.mark.native
def test_quick_bench_runs_the_native_copies(quick_bench: tuple[dict[str, Any], Path]) -> None:
    result, _directory = quick_bench
    assert result["copy_path"].startswith("native")
