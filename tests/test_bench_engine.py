"""The engine-core benchmarks run and report each figure beside its baseline (quick, one repeat).

They measure; the figures themselves are recorded in docs/benchmarks.md, not asserted here.
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.bench import engine_core, spill_latency
from tierkv.config import Config
from tierkv.config.default import default_config, shm_or

pytestmark = pytest.mark.pmem


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Config]:
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=shm_or(tmp_path)) as pool_dir:
        yield default_config(Path(pool_dir), tmp_path)


async def test_bandwidth_rows_have_memcpy_baselines(config: Config) -> None:
    result, rows = await engine_core.bandwidth(config, quick=True, repeats=1)
    assert [row.target for row in rows] == [0.7, 0.7, 0.6, 0.6]
    for row in rows:
        assert row.measured > 0 and row.baseline and row.ratio is not None
        assert "memcpy" in row.baseline_name
    assert len(result["rows"]) == 4


async def test_sustained_spill_demotes_into_pmem(config: Config) -> None:
    result, rows = await engine_core.sustained_spill(config, quick=True, repeats=1)
    assert result["demoted"] > 0  # the gpu tier is half the bytes put: most went down
    assert rows[0].target == 0.4 and rows[0].ratio is not None


async def test_p99_compares_migrating_with_quiet(config: Config) -> None:
    result, rows = await engine_core.get_p99_under_migration(config, quick=True, repeats=1)
    assert result["demoted"] > 0 and result["samples_while_migrating"] > 0
    assert rows[0].baseline_name.startswith("p99 while demoted")


async def test_group_commit_shares_flushes(config: Config) -> None:
    result, rows = await engine_core.write_through_group_commit(config, quick=True, repeats=1)
    flushes = result["flushes"]
    assert flushes[False] == 256  # one per put
    assert flushes[True] < flushes[False]
    assert rows[0].baseline_name == "one flush per put"
    deletes = result["deletes_per_s"]
    assert deletes["write_through"] > 0 and deletes["write_back"] > 0
    assert rows[1].baseline_name == "write_back delete (not synced)"
    # fio (scripts/setup installs it) measures the device's ceiling beside it
    assert result["fio_writes_per_s"]["fdatasync every 1"] > 0
    assert result["fio_writes_per_s"]["fdatasync every 8"] > 0
    assert rows[2].baseline_name == "fdatasync every write"


async def test_put_latency_while_spilling_compares_the_linger_with_none(config: Config) -> None:
    result, rows = await spill_latency.put_latency_while_spilling(config, quick=True, repeats=1)
    assert result["linger_s"] == config.engine.demotion_linger
    for runs in result["runs"].values():
        (run,) = runs
        assert run["into_log"] > 1000  # 2000 puts of 16 KiB, 9 MiB above the log
        assert 0 < run["p99_ms"] <= run["max_ms"]
    assert list(result["runs"]) == ["linger", "no linger", "linger, heap frozen"]
    assert [row.baseline_name for row in rows] == [
        "demotion_linger 0", "demotion_linger 0",
        "longest full garbage collection in the same run", "heap not frozen"]
    assert all(row.ratio is not None for row in (rows[0], rows[1], rows[3]))
    assert gc.get_freeze_count() == 0  # the frozen variant hands the heap back
