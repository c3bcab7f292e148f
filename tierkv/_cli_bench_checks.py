"""What `tierkv bench` refuses before anything runs: options the run would ignore, a --workdir
or --json it could not use, a --json naming its own input, a --size no tier can hold. Each is a
`ConfigError` naming the option, found before a run of minutes rather than after it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tierkv.config import Config, NvmeTierConfig
from tierkv.config.machine import media_identity
from tierkv.errors import ConfigError

#: the options only a trace replay reads, and their defaults
TRACE_OPTIONS = {"capacity": "2%,5%,10%,25%", "policy": "tierkv", "block_size": "16KiB"}

#: the workload's options (`--device engine`, `--faults`), and their defaults
WORKLOAD_OPTIONS: dict[str, int] = {"size": 256 << 10, "count": 2048, "concurrency": 8}


def check_combination(args: argparse.Namespace) -> None:
    """Refuse an option the run would ignore, then fill in the defaults of those it reads:
    ignored, it left figures taken for what was not measured (``--policy lru`` without
    ``--trace`` ran the engine bench under LRU++; ``--faults`` beside ``--trace`` injected
    nothing)."""
    if args.trace is None:
        for option in TRACE_OPTIONS:
            if getattr(args, option) is not None:
                raise ConfigError(f"--{option.replace('_', '-')}: only a --trace replay takes it")
    else:
        for option, given in (("--faults", args.faults is not None),
                              ("--url", args.url is not None),
                              ("--device", args.device != "engine")):
            if given:
                raise ConfigError(f"{option}: a --trace replay runs alone and takes no {option}")
    if args.seed is not None and args.faults is None:
        raise ConfigError("--seed: only a --faults soak takes it")
    workload = args.trace is None and (args.device == "engine" or args.faults is not None)
    for option, size in WORKLOAD_OPTIONS.items():
        if getattr(args, option) is None:
            setattr(args, option, size)
        elif not workload:
            raise ConfigError(f"--{option}: only the workload of --device engine and a "
                              "--faults soak take it")
    for option, default in TRACE_OPTIONS.items():
        if getattr(args, option) is None:
            setattr(args, option, default)
    if args.seed is None:
        args.seed = 0


def check_workdir(workdir: Path) -> None:
    if not workdir.is_dir():
        raise ConfigError(f"--workdir: {workdir} is not a directory")
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise ConfigError(f"--workdir: {workdir} is not writable")


def check_writable(path: Path) -> None:
    """Refuse a --json path the results could not be written to, before a run of minutes."""
    if path.is_dir():
        raise ConfigError(f"--json: {path} is a directory")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise ConfigError(f"--json: {path} is not writable")
    else:
        directory = path.parent
        if not directory.is_dir():
            raise ConfigError(f"--json: directory {directory} does not exist")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError(f"--json: {path} cannot be created: {directory} is not writable")
    # and tried: permission bits say yes to root where the file system says no (/proc, /sys,
    # a read-only mount), which surfaced only after the whole run
    created = not path.exists()
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ConfigError(f"--json: cannot write {path}: {exc.strerror or exc}") from None
    if created:
        path.unlink(missing_ok=True)


def refuse_inputs(args: argparse.Namespace) -> None:
    """Refuse a --json path that names the run's own config or trace, under any name: the
    results were written over the file the run was asked to read."""
    target = media_identity(args.json)
    for option in ("config", "trace"):
        given = getattr(args, option)
        if given is not None and media_identity(given) == target:
            raise ConfigError(f"--json: {args.json} is the --{option} file {given}; it would be "
                              "overwritten")


def check_size(size: int, config: Config) -> None:
    """`ConfigError` now if no configured tier could hold an object of `--size` bytes (at
    most a gpu tier's or a pool's capacity, an nvme region): found at the workload, the last
    case, it cost every case before it, and their figures were lost."""
    largest = max((tier.region_size if isinstance(tier, NvmeTierConfig) else tier.capacity,
                   tier.name) for tier in config.tiers)
    if size > largest[0]:
        raise ConfigError(f"--size: no tier of the config can hold an object of {size} bytes "
                          f"(the largest any could is under {largest[0]}, in tier "
                          f"{largest[1]!r})")
