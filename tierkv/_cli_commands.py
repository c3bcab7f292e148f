"""The `tierkv` command: `info` (what each configured tier found), `bench` (measurements),
`format` (the deliberate wipe of persistent media) and `serve-metrics` (Prometheus exposition).

Errors a user can cause (a bad config, a missing device, a wipe not confirmed) print one line and
exit 2; a device failure exits 1; neither prints a traceback. (`tierkv.cli` is the entry point:
it imports this module, which takes torch with it, with a signal already answered.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tierkv import _untracked as untracked
from tierkv._platform import cuda_available, io_uring_available, libpmemobj_available
from tierkv._units import format_size, parse_size
from tierkv.config import (
    Config,
    GpuTierConfig,
    NvmeTierConfig,
    PmemTierConfig,
    RedisTierConfig,
    TierConfig,
    load_config,
)
from tierkv.errors import ConfigError, TierKVError
from tierkv.tiers import registry

if TYPE_CHECKING:
    pass

from tierkv._cli_bench import FAULTS_QUICK_OPERATIONS, TRACE_QUICK_REQUESTS, run_bench
from tierkv._cli_common import config_for as _config_for
from tierkv._cli_common import console
from tierkv._cli_signals import Terminated, run, terminable


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="tierkv: %(levelname)s: %(message)s")
    try:
        with terminable():
            return int(args.func(args))
    except Terminated as exc:
        print(f"tierkv: {exc}; what the command set up was taken down", file=sys.stderr)
        return exc.exit_status
    except ConfigError as exc:
        print(f"tierkv: config error: {exc}", file=sys.stderr)
        return 2
    except TierKVError as exc:
        print(f"tierkv: error: {exc}", file=sys.stderr)
        return 1
    except MemoryError:
        # what an option or a config sized beyond the machine ends in (a bench --size of a
        # TiB), from any of the allocations sized by it: one line, as the other errors
        print("tierkv: error: out of memory (a --size, --count, --concurrency or capacity beyond "
              "this machine?)", file=sys.stderr)
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
    bench.add_argument("--size", type=_size_arg,
                       help="object size of the workload (default 256KiB)")
    bench.add_argument("--count", type=int, help="objects in the workload (default 2048)")
    bench.add_argument("--concurrency", type=int,
                       help="tasks issuing requests in the workload (default 8)")
    bench.add_argument("--quick", action="store_true", help="shorter runs (CI, smoke tests)")
    bench.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                       help="where the embedded config and device benchmarks put files on disk")
    bench.add_argument("--trace", type=Path, metavar="JSONL",
                       help="replay this Mooncake request trace (timestamp, hash_ids per "
                            "request) through the engine under prefix semantics, beside offline "
                            "LRU and Belady MIN, instead of the device benchmarks; --quick "
                            f"replays the first {TRACE_QUICK_REQUESTS} requests")
    bench.add_argument("--capacity", metavar="PCT[,PCT...]",
                       help="trace: capacities to replay at, in percent of the trace's distinct "
                            "blocks (default 2%%,5%%,10%%,25%%)")
    bench.add_argument("--policy", metavar="lru|tierkv",
                       help="trace: the engine's policy: lru (plain LRU, every demotion "
                            "admitted) or tierkv (LRU++ and the config's admission; the default)")
    bench.add_argument("--block-size", metavar="SIZE",
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
    bench.add_argument("--seed", type=int,
                       help="--faults: seeds the fault draws and the clients' choices "
                            "(default 0; the JSON records it: a soak that failed can be run "
                            "again under its seed, though background work's timing makes no "
                            "two runs identical)")
    bench.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    bench.set_defaults(func=run_bench)

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


# -- info ----------------------------------------------------------------------------------------
def _info(args: argparse.Namespace) -> int:
    with _config_for(args.config, Path(tempfile.gettempdir())) as config:
        console.print(f"[bold]tierkv[/bold] write policy: {config.engine.write_policy.value}")
        console.print(f"CUDA: {'available' if cuda_available() else 'not available'}")
        console.print(f"io_uring: {io_uring_available() or 'available'}")
        console.print(f"libpmemobj: {libpmemobj_available() or 'available'}")
        console.print(f"records out of the garbage collector's sight: {untracked.MECHANISM}")
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

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: {args.port} is outside 0..65535")

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        print(f"tierkv: serving metrics on http://{shown}:{port}/metrics", flush=True)

    # a signal sets `stop`: the server ends, the engine closes, and the command exits 0
    stop = asyncio.Event()
    run(serve_metrics(load_config(args.config), args.host, args.port, ready=ready, stop=stop),
        stop=stop)
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
    # every tier is taken (locked, checked) before any is wiped: one that cannot be refuses
    # them all, rather than leave the ones before it wiped under a message about it alone
    for tier, wiped in zip(targets, registry.wipe_all(targets), strict=True):
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
