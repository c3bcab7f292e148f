"""`tierkv bench`: the measurements the command runs, one job per case, and their report.

The jobs a run takes follow from `--device` (and `--trace`, `--faults`); each returns its
figures and the rows of the table printed at the end (`tierkv.bench.common.Row`).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from tierkv._cli_bench_checks import (
    check_combination,
    check_size,
    check_workdir,
    check_writable,
    refuse_inputs,
)
from tierkv._cli_signals import run
from tierkv._units import parse_size
from tierkv.bench._fio import fio_runs
from tierkv.bench.common import Row
from tierkv.config import Config, GpuTierConfig
from tierkv.config.default import shm_or
from tierkv.errors import ConfigError, TierKVError

if TYPE_CHECKING:
    from tierkv.testing.faults import FaultPlan

from tierkv._cli_common import config_for as _config_for
from tierkv._cli_common import console, refuse_tier_media, scratch_dir
from tierkv._cli_progress import Bar

#: requests a ``--quick`` trace replay takes from the start of the trace
TRACE_QUICK_REQUESTS = 1000
#: operations a ``--quick`` fault soak runs at most
FAULTS_QUICK_OPERATIONS = 2000

# -- bench ---------------------------------------------------------------------------------------
def run_bench(args: argparse.Namespace) -> int:
    # the options and the trace are checked before the config is loaded or anything runs
    check_combination(args)
    for option in ("count", "size", "concurrency"):
        if getattr(args, option) <= 0:
            raise ConfigError(f"--{option}: must be positive, got {getattr(args, option)}")
    check_workdir(args.workdir)
    if args.json is not None:
        check_writable(args.json)
        refuse_inputs(args)
    trace = _trace_job(args) if args.trace is not None else None
    results: dict[str, Any] = {}
    rows: list[Row] = []
    with _config_for(args.config, args.workdir) as config, Bar() as bar:
        if args.json is not None:  # the tiers are known only now, and no job has run yet
            refuse_tier_media("--json", args.json, config)
        for name, job in _bench_jobs(args, config, trace):
            section, section_rows = run(job(bar))
            results[name] = section
            rows.extend(section_rows)
    _print_rows(rows)
    for name, section in results.items():
        if "skipped" in section:
            console.print(f"skipped {name}: {section['skipped']}", markup=False, highlight=False)
    if args.json:
        document = {"results": results, "rows": [row.to_json() for row in rows]}
        # strict JSON: a figure with nothing to measure (NaN) or unbounded is null
        text = json.dumps(_finite(document), indent=2, default=str, allow_nan=False)
        try:
            args.json.write_text(text)
        except OSError as exc:  # checked before the run, yet gone since: keep the results
            fd, kept = tempfile.mkstemp(prefix="tierkv-bench-", suffix=".json")
            with open(fd, "w") as file:
                file.write(text)
            raise BenchResultsKept(f"--json: cannot write {args.json}: {exc.strerror or exc}; "
                                   f"the results are in {kept}") from None
        console.print(f"results written to {args.json}")
    return 0


class BenchResultsKept(TierKVError):
    """The results could not be written where --json said; they were kept elsewhere."""


def _finite(value: Any) -> Any:
    """`value` with every float that is NaN or infinite replaced by None, for strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


Job = Callable[[Bar], Coroutine[Any, Any, tuple[dict[str, Any], list[Row]]]]
TraceJob = Callable[[Config, Bar], Coroutine[Any, Any, tuple[dict[str, Any], list[Row]]]]


def _bench_jobs(args: argparse.Namespace, config: Config, trace: TraceJob | None = None
                ) -> list[tuple[str, Job]]:
    from tierkv.bench import engine as engine_bench

    quick = bool(args.quick)
    if trace is not None:  # a replay alone: it builds its own hierarchy per capacity point
        return [("trace", lambda bar: trace(config, bar))]
    if args.faults is not None:  # a soak alone: it resizes the hierarchy for its key space
        from tierkv.testing.faults import FaultPlan

        if args.device != "engine":
            raise ConfigError("--faults: faults are injected into --device engine only")
        plan = FaultPlan.parse(args.faults, seed=args.seed)
        return [("faults", lambda bar: _fault_soak(config, plan, args, bar))]
    if args.device == "gpu" and not isinstance(config.tiers[0], GpuTierConfig):
        raise ConfigError("--device gpu: the config has no gpu tier to measure")
    if args.url is not None and args.device != "redis":
        raise ConfigError("--url: only --device redis measures a redis server")
    jobs: list[tuple[str, Job]] = []
    if args.device in ("engine", "gpu"):
        jobs.append(("l1_get_4k", lambda bar: engine_bench.l1_get_latency(
            config, count=30_000 if quick else 200_000, progress=bar)))
        jobs.append(("l1_tensor_2m", lambda bar: engine_bench.l1_tensor_bandwidth(
            config, rounds=256 if quick else 1024, progress=bar)))
    if args.device == "engine":
        from tierkv.bench import engine_core, spill_latency

        check_size(args.size, config)  # the workload's, which runs last

        for case in (engine_core.bandwidth, engine_core.sustained_spill,
                     engine_core.get_p99_under_migration, engine_core.write_through_group_commit,
                     spill_latency.put_latency_while_spilling):
            jobs.append((case.__name__, functools.partial(_engine_case, case, config, quick)))
        jobs.append(("workload", lambda bar: _workload(config, args, bar)))
    if args.device == "nvme":
        jobs.append(("nvme", lambda bar: _device_bench("nvme", args, bar)))
    if args.device == "pmem":
        jobs.append(("pmem", lambda bar: _device_bench("pmem", args, bar)))
    if args.device in ("engine", "scheduler"):
        jobs.append(("scheduler", lambda bar: _scheduler_bench(quick, bar)))
    if args.device == "invalidation":
        from tierkv.bench.invalidation import run_invalidation_bench

        jobs.append(("invalidation", lambda bar: run_invalidation_bench(
            config, quick=quick, progress=bar)))
    if args.device == "recovery":
        from tierkv.bench.recovery import run_recovery_bench

        jobs.append(("recovery", lambda bar: run_recovery_bench(
            config, quick=quick, progress=bar)))
    if args.device == "transformers":
        from tierkv.bench.transformers import run_transformers_bench

        jobs.append(("transformers", lambda bar: run_transformers_bench(
            config, quick=quick, progress=bar)))
    if args.device == "redis":
        from tierkv.bench.redis import run_redis_bench

        jobs.append(("redis", lambda bar: run_redis_bench(args.url, quick=quick, progress=bar)))
    return jobs


async def _fault_soak(config: Config, plan: FaultPlan, args: argparse.Namespace, bar: Bar
                      ) -> tuple[dict[str, Any], list[Row]]:
    from tierkv.bench.faults import run_fault_soak

    operations = min(args.count, FAULTS_QUICK_OPERATIONS) if args.quick else args.count
    # every injected fault is logged where it lands (thousands of lines); the soak counts them
    quiet = logging.getLogger("tierkv")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        result, rows = await run_fault_soak(config, plan, operations=operations,
                                            clients=args.concurrency, size=args.size,
                                            progress=bar)
    finally:
        quiet.setLevel(level)
    result["faults"] = args.faults
    return result, rows


async def _scheduler_bench(quick: bool, bar: Bar) -> tuple[dict[str, Any], list[Row]]:
    from tierkv.bench.scheduler import run_scheduler_bench

    return run_scheduler_bench(quick=quick, progress=bar)


async def _engine_case(case: Callable[..., Coroutine[Any, Any, tuple[dict[str, Any], list[Row]]]],
                       config: Config, quick: bool, bar: Bar) -> tuple[dict[str, Any], list[Row]]:
    return await case(config, quick=quick, progress=bar)


async def _workload(
    config: Config, args: argparse.Namespace, bar: Bar
) -> tuple[dict[str, Any], list[Row]]:
    from tierkv.bench.engine import scratch_media, workload
    from tierkv.engine import open as open_engine

    count = min(args.count, 512) if args.quick else args.count
    with scratch_media(config) as scratch:
        async with open_engine(scratch) as kv:
            result, rows = await workload(
                kv, size=args.size, count=count, concurrency=args.concurrency, progress=bar
            )
            result["stats"] = kv.stats()
    return result, rows


def _trace_job(args: argparse.Namespace) -> TraceJob:
    """The trace replay of `args`, its options and trace read and checked now (`ConfigError`
    naming the option), so that a mistake costs no benchmark run."""
    from tierkv.bench.trace import read_trace
    from tierkv.bench.trace_config import ReplayPolicy

    capacities = _capacities(args.capacity)
    try:
        policy = ReplayPolicy(args.policy)
    except ValueError:
        allowed = ", ".join(member.value for member in ReplayPolicy)
        raise ConfigError(f"--policy: {args.policy!r} is not one of {allowed}") from None
    try:
        block_size = parse_size(args.block_size)
    except ValueError as exc:
        raise ConfigError(f"--block-size: {exc}") from None
    if block_size <= 0:
        raise ConfigError("--block-size: must be positive")
    try:
        requests = list(read_trace(args.trace, TRACE_QUICK_REQUESTS if args.quick else None))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--trace: {exc}") from None
    if not requests:
        raise ConfigError(f"--trace: {args.trace} holds no request")

    async def job(config: Config, bar: Bar) -> tuple[dict[str, Any], list[Row]]:
        from tierkv.bench.trace import replay

        result, rows = await replay(config, requests, capacities=capacities, policy=policy,
                                    block_size=block_size, progress=bar)
        result["trace"] = str(args.trace)
        return result, rows

    return job


def _capacities(text: str) -> tuple[float, ...]:
    """``2%,5%`` as fractions of the trace's distinct blocks, each in (0, 100] percent."""
    fractions = []
    for item in text.split(","):
        number = item.strip().removesuffix("%").strip()
        try:
            # float() takes "1_0" for 10 and " 5" for 5: only digits and one point pass
            percent = float(number) if re.fullmatch(r"[0-9]*\.?[0-9]+", number) else math.nan
        except ValueError:
            percent = math.nan
        if not (math.isfinite(percent) and 0 < percent <= 100):
            raise ConfigError(f"--capacity: {item.strip()!r} is not a percentage in (0, 100] "
                              "(expected a list such as 2%,5%,10%)")
        if percent / 100 in fractions:  # replayed twice, a report with the row twice
            raise ConfigError(f"--capacity: {item.strip()!r} is given twice")
        fractions.append(percent / 100)
    return tuple(fractions)


async def _device_bench(
    device: str, args: argparse.Namespace, bar: Bar
) -> tuple[dict[str, Any], list[Row]]:
    workdir: Path = args.workdir
    scratch = scratch_dir(shm_or(workdir) if device == "pmem" else workdir)
    try:
        # cut short, fio (run from a thread) stops before `scratch` goes: it went on writing
        with fio_runs():
            if device == "pmem":
                from tierkv.bench.pmem import run_pmem_bench

                result = await run_pmem_bench(scratch, quick=args.quick, progress=bar)
            else:
                from tierkv.bench.nvme import run_nvme_bench

                result = await run_nvme_bench(scratch, quick=args.quick, progress=bar)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result, [Row(**_row_fields(row)) for row in result.get("rows", [])]


def _row_fields(row: dict[str, Any]) -> dict[str, Any]:
    fields = ("case", "unit", "measured", "baseline", "baseline_name", "target", "at_most",
              "at_least")
    return {name: row[name] for name in fields if name in row}


def _print_rows(rows: list[Row]) -> None:
    table = Table(title="tierkv bench")
    for column in ("case", "measured", "baseline", "ratio", "goal", "met"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for row in rows:
        baseline = f"{row.baseline:,.1f} ({row.baseline_name})" if row.baseline is not None else ""
        ratio = f"{row.ratio:.2f}" if row.ratio is not None else ""
        goal = []
        if row.target is not None:
            goal.append(f"ratio ≥ {row.target:g}")
        if row.at_most is not None:
            goal.append(f"≤ {row.at_most:g}")
        if row.at_least is not None:
            goal.append(f"≥ {row.at_least:,g}")
        met = {True: "yes", False: "NO", None: ""}[row.meets_target]
        if row.unit == "ratio":
            measured = f"{row.measured:.3f}"
        else:
            measured = f"{row.measured:,.1f} {row.unit}"
        table.add_row(row.case, measured, baseline, ratio,
                      ", ".join(goal), met)
    console.print(table)
