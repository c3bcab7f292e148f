"""The `tierkv` command: `info` (what each configured tier found), `bench` (measurements),
`format` (the deliberate wipe of persistent media) and `serve-metrics` (Prometheus exposition).

Errors a user can cause (a bad config, a missing device, a wipe not confirmed) print one line and
exit 2; a device failure exits 1; neither prints a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import shutil
import sys
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from tierkv._platform import cuda_available, io_uring_available, libpmemobj_available
from tierkv._units import format_size, parse_size
from tierkv.bench.common import Row
from tierkv.config import (
    Config,
    GpuTierConfig,
    NvmeTierConfig,
    PmemTierConfig,
    RedisTierConfig,
    TierConfig,
    load_config,
)
from tierkv.config.default import default_config, shm_or
from tierkv.errors import ConfigError, TierKVError
from tierkv.tiers import registry

if TYPE_CHECKING:
    from tierkv.testing.faults import FaultPlan

#: requests a ``--quick`` trace replay takes from the start of the trace
TRACE_QUICK_REQUESTS = 1000
#: operations a ``--quick`` fault soak runs at most
FAULTS_QUICK_OPERATIONS = 2000

console = Console()
if not console.is_terminal:
    console = Console(width=160)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="tierkv: %(levelname)s: %(message)s")
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"tierkv: config error: {exc}", file=sys.stderr)
        return 2
    except TierKVError as exc:
        print(f"tierkv: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="show the configured tiers and what was detected")
    info.add_argument("--config", type=Path, help="TOML device config (default: embedded)")
    info.set_defaults(func=_info)

    bench = commands.add_parser("bench", help="measure the engine or one tier beside a baseline")
    bench.add_argument("--config", type=Path, help="TOML device config (default: embedded)")
    bench.add_argument("--device", choices=("engine", "gpu", "pmem", "nvme", "scheduler",
                                            "invalidation", "recovery", "transformers",
                                            "redis"),
                       default="engine",
                       help="engine: L1 figures and a workload through the whole hierarchy; "
                            "gpu: the L1 figures only; pmem/nvme: that tier against memcpy/fio; "
                            "scheduler: policy bookkeeping per access at 1M objects beside LRU; "
                            "invalidation: a 100k-object subtree invalidated beside deletes; "
                            "recovery: reopening a full 1 GiB pool + 10 GiB log; "
                            "transformers: time to first token of a random-init Llama with "
                            "prefix KV reuse beside recompute (needs the transformers extra); "
                            "redis: the shared tier beside raw redis-py SET/GET on one server")
    bench.add_argument("--size", type=_size_arg, default=256 << 10,
                       help="object size of the workload (default 256KiB)")
    bench.add_argument("--count", type=int, default=2048, help="objects in the workload")
    bench.add_argument("--concurrency", type=int, default=8, help="tasks issuing requests")
    bench.add_argument("--quick", action="store_true", help="shorter runs (CI, smoke tests)")
    bench.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                       help="where the embedded config and device benchmarks put files on disk")
    bench.add_argument("--trace", type=Path, metavar="JSONL",
                       help="replay this Mooncake request trace (timestamp, hash_ids per "
                            "request) through the engine under prefix semantics, beside offline "
                            "LRU and Belady MIN, instead of the device benchmarks; --quick "
                            f"replays the first {TRACE_QUICK_REQUESTS} requests")
    bench.add_argument("--capacity", default="2%,5%,10%,25%", metavar="PCT[,PCT...]",
                       help="trace: capacities to replay at, in percent of the trace's distinct "
                            "blocks (default 2%%,5%%,10%%,25%%)")
    bench.add_argument("--policy", default="tierkv", metavar="lru|tierkv",
                       help="trace: the engine's policy: lru (plain LRU, every demotion "
                            "admitted) or tierkv (LRU++ and the config's admission; the default)")
    bench.add_argument("--block-size", default="16KiB", metavar="SIZE",
                       help="trace: bytes stored per trace block (default 16KiB)")
    bench.add_argument("--url", metavar="URL",
                       help="the redis server for --device redis (default: a private "
                            "redis-server)")
    bench.add_argument("--faults", metavar="SPEC",
                       help="--device engine: instead of the benchmarks, a soak of --count "
                            "operations by --concurrency clients (values up to --size) through "
                            "the config's hierarchy, resized, with these faults injected "
                            "(TIER:FAULT=RATE[@ARG][;ops=OP|OP...], e.g. pmem:eio=0.05,"
                            "nvme:flip=0.01,redis:hang=0.01;ops=get), cancellations and "
                            "reopens, checked against a log of acknowledged writes; --quick: "
                            f"{FAULTS_QUICK_OPERATIONS} operations")
    bench.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    bench.set_defaults(func=_bench)

    wipe = commands.add_parser(
        "format", help="wipe the media of persistent tiers so that they open empty")
    wipe.add_argument("--config", type=Path, required=True, help="TOML device config")
    wipe.add_argument("--tier", metavar="NAME",
                      help="wipe only this tier (default: every persistent tier of the config)")
    wipe.add_argument("--yes", action="store_true",
                      help="really wipe; without it nothing is touched")
    wipe.set_defaults(func=_format)

    serve = commands.add_parser(
        "serve-metrics", help="open the engine on a config and serve its Prometheus metrics")
    serve.add_argument("--config", type=Path, required=True, help="TOML device config")
    serve.add_argument("--port", type=int, default=9464,
                       help="TCP port of /metrics (default 9464; 0: a free one, printed)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1)")
    serve.set_defaults(func=_serve_metrics)
    return parser


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@contextlib.contextmanager
def _config_for(path: Path | None, workdir: Path) -> Iterator[Config]:
    """The config at `path`, or the embedded default with its files in fresh temporary dirs."""
    if path is not None:
        yield load_config(path)
        return
    if not workdir.is_dir():
        raise ConfigError(f"--workdir: {workdir} is not a directory")
    nvme_dir = Path(tempfile.mkdtemp(prefix="tierkv-", dir=workdir))
    pmem_dir = Path(tempfile.mkdtemp(prefix="tierkv-", dir=shm_or(workdir)))
    try:
        yield default_config(pmem_dir, nvme_dir)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
        shutil.rmtree(pmem_dir, ignore_errors=True)


# -- info ----------------------------------------------------------------------------------------
def _info(args: argparse.Namespace) -> int:
    with _config_for(args.config, Path(tempfile.gettempdir())) as config:
        console.print(f"[bold]tierkv[/bold] write policy: {config.engine.write_policy.value}")
        console.print(f"CUDA: {'available' if cuda_available() else 'not available'}")
        console.print(f"io_uring: {io_uring_available() or 'available'}")
        console.print(f"libpmemobj: {libpmemobj_available() or 'available'}")
        for index, tier in enumerate(config.tiers):
            console.print(f"\n[bold]tiers[{index}] {tier.name}[/bold] kind={tier.kind.value} "
                          f"capacity={format_size(tier.capacity)}")
            for name, value in _probe(tier).items():
                console.print(f"  {name}: {value}")
    return 0


def _probe(tier: TierConfig) -> dict[str, str]:
    if isinstance(tier, RedisTierConfig):
        from tierkv.tiers import redis

        return redis.probe(tier)
    if isinstance(tier, GpuTierConfig):
        from tierkv.tiers.gpu import describe_device

        return describe_device(tier)
    if isinstance(tier, PmemTierConfig):
        from tierkv.tiers import pmem

        return pmem.probe(tier)
    from tierkv.tiers import nvme

    return nvme.probe(tier)


# -- serve-metrics -------------------------------------------------------------------------------
def _serve_metrics(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; exit 0 once the engine is closed."""
    from tierkv.metrics.serve import serve_metrics

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        print(f"tierkv: serving metrics on http://{shown}:{port}/metrics", flush=True)

    asyncio.run(serve_metrics(load_config(args.config), args.host, args.port, ready=ready))
    return 0


# -- format --------------------------------------------------------------------------------------
def _format(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    targets = _wipe_targets(config, args.tier)
    if not args.yes:
        listed = ", ".join(f"{tier.name} ({tier.kind.value}, {tier.path})" for tier in targets)
        print(f"tierkv: format would wipe {listed}: everything they hold is lost; "
              "add --yes to wipe", file=sys.stderr)
        return 2
    for tier in targets:
        wiped = registry.wipe(tier)
        console.print(f"{tier.name} ({tier.kind.value}): {wiped}", markup=False, highlight=False,
                      soft_wrap=True)
    return 0


def _wipe_targets(config: Config, name: str | None) -> list[PmemTierConfig | NvmeTierConfig]:
    """The tier named `name`, or every persistent tier; `ConfigError` when there is none."""
    if name is None:
        targets = [tier for tier in config.tiers if registry.persistent(tier)]
        if not targets:
            raise ConfigError("no persistent tier in the config: nothing to wipe")
        return targets
    named = [tier for tier in config.tiers if tier.name == name]
    if not named:
        known = ", ".join(tier.name for tier in config.tiers)
        raise ConfigError(f"--tier {name}: no such tier (the config has {known})")
    if not registry.persistent(chosen := named[0]):
        raise ConfigError(f"--tier {name}: a {chosen.kind.value} tier keeps nothing on media")
    return [chosen]


# -- bench ---------------------------------------------------------------------------------------
class _Bar:
    """A rich progress bar with one line per benchmark phase."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._tasks: dict[str, TaskID] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        task = self._tasks.get(phase)
        if task is None:
            task = self._tasks[phase] = self._progress.add_task(phase, total=total)
        self._progress.update(task, completed=done, total=total)


def _bench(args: argparse.Namespace) -> int:
    # the trace and its options are checked before the config is loaded or anything runs
    trace = _trace_job(args) if args.trace is not None else None
    results: dict[str, Any] = {}
    rows: list[Row] = []
    progress = Progress(TextColumn("{task.description:<28}"), BarColumn(), TextColumn(
        "{task.completed}/{task.total}"), TimeElapsedColumn(), console=console, transient=True)
    with progress, _config_for(args.config, args.workdir) as config:
        bar = _Bar(progress)
        for name, job in _bench_jobs(args, config, trace):
            section, section_rows = asyncio.run(job(bar))
            results[name] = section
            rows.extend(section_rows)
    _print_rows(rows)
    for name, section in results.items():
        if "skipped" in section:
            console.print(f"skipped {name}: {section['skipped']}", markup=False, highlight=False)
    if args.json:
        document = {"results": results, "rows": [row.to_json() for row in rows]}
        args.json.write_text(json.dumps(document, indent=2, default=str))
        console.print(f"results written to {args.json}")
    return 0


Job = Callable[[_Bar], Coroutine[Any, Any, tuple[dict[str, Any], list[Row]]]]
TraceJob = Callable[[Config, _Bar], Coroutine[Any, Any, tuple[dict[str, Any], list[Row]]]]


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
        plan = FaultPlan.parse(args.faults)
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
        from tierkv.bench import engine_core

        for case in (engine_core.bandwidth, engine_core.sustained_spill,
                     engine_core.get_p99_under_migration, engine_core.write_through_group_commit):
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


async def _fault_soak(config: Config, plan: FaultPlan, args: argparse.Namespace, bar: _Bar
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


async def _scheduler_bench(quick: bool, bar: _Bar) -> tuple[dict[str, Any], list[Row]]:
    from tierkv.bench.scheduler import run_scheduler_bench

    return run_scheduler_bench(quick=quick, progress=bar)


async def _engine_case(case: Callable[..., Coroutine[Any, Any, tuple[dict[str, Any], list[Row]]]],
                       config: Config, quick: bool, bar: _Bar) -> tuple[dict[str, Any], list[Row]]:
    return await case(config, quick=quick, progress=bar)


async def _workload(
    config: Config, args: argparse.Namespace, bar: _Bar
) -> tuple[dict[str, Any], list[Row]]:
    from tierkv.bench.engine import workload
    from tierkv.engine import open as open_engine

    count = min(args.count, 512) if args.quick else args.count
    async with open_engine(config) as kv:
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

    async def job(config: Config, bar: _Bar) -> tuple[dict[str, Any], list[Row]]:
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
            percent = float(number) if number.isascii() else math.nan
        except ValueError:
            percent = math.nan
        if not (math.isfinite(percent) and 0 < percent <= 100):
            raise ConfigError(f"--capacity: {item.strip()!r} is not a percentage in (0, 100] "
                              "(expected a list such as 2%,5%,10%)")
        fractions.append(percent / 100)
    return tuple(fractions)


async def _device_bench(
    device: str, args: argparse.Namespace, bar: _Bar
) -> tuple[dict[str, Any], list[Row]]:
    workdir: Path = args.workdir
    if device == "pmem":
        from tierkv.bench.pmem import run_pmem_bench

        with tempfile.TemporaryDirectory(prefix="tierkv-", dir=shm_or(workdir)) as pool_dir:
            result = await run_pmem_bench(Path(pool_dir), quick=args.quick, progress=bar)
    else:
        from tierkv.bench.nvme import run_nvme_bench

        with tempfile.TemporaryDirectory(prefix="tierkv-", dir=workdir) as log_dir:
            result = await run_nvme_bench(Path(log_dir), quick=args.quick, progress=bar)
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
        baseline = f"{row.baseline:,.1f} ({row.baseline_name})" if row.baseline else ""
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


if __name__ == "__main__":
    sys.exit(main())
