"""The TOML device configuration (`tierkv.config`, `tierkv._units`) and examples/devices.toml.

`ConfigError`'s message starting with the key path is the documented contract of the config loader,
so the error tests below check that prefix (and only that) besides the exception type.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import Config, ConfigError, load_config, load_config_text
from tierkv._platform import cuda_available
from tierkv._units import format_size, parse_duration, parse_size
from tierkv.config import (
    MIN_PMEM_POOL,
    NVME_SUPERBLOCK,
    EngineConfig,
    EvictionPolicy,
    GpuTierConfig,
    HealthConfig,
    NvmeBackend,
    NvmeTierConfig,
    PmemTierConfig,
    RegionEviction,
    SchedulerConfig,
    TierKind,
    WritePolicy,
)
from tierkv.config.default import default_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "devices.toml"
MiB = 1 << 20
GiB = 1 << 30

FULL_TOML = """
[engine]
write_policy = "write_through"

[[tiers]]
name = "l1"
kind = "gpu"
device = "cpu"
capacity = "64MiB"
slot_size = "256KiB"
ttl = "1500ms"

[[tiers]]
name = "l2"
kind = "pmem"
path = "{pmem}"
capacity = "1GiB"
format = true

[[tiers]]
name = "l3"
kind = "nvme"
path = "{nvme}"
capacity = "2GiB"
region_size = "8MiB"
queue_depth = 64
direct = false
backend = "threads"
eviction = "lru"
reinsert_hits = 0
format = true

[scheduler]
policy = "lru"

[health]
failure_rate = 0.5
window = "30s"
slow_operation = 0.25
cooldown = "2min"
close_after = 5
entropy_alert_bits = 2
"""


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, Path]:
    return {"pmem": tmp_path / "l2.pool", "nvme": tmp_path / "l3.log"}


@pytest.fixture
def text(paths: dict[str, Path]) -> str:
    return FULL_TOML.format(**paths)


@pytest.fixture
def doc(text: str) -> dict[str, Any]:
    return tomllib.loads(text)


def _check_full(config: Config, paths: dict[str, Path]) -> None:
    assert config.engine == EngineConfig(WritePolicy.WRITE_THROUGH)
    gpu, pmem, nvme = config.tiers
    assert gpu == GpuTierConfig("l1", 64 * MiB, "cpu", 256 << 10, 1.5)
    assert pmem == PmemTierConfig("l2", GiB, paths["pmem"], format=True)
    assert nvme == NvmeTierConfig(
        "l3",
        2 * GiB,
        paths["nvme"],
        region_size=8 * MiB,
        queue_depth=64,
        direct=False,
        backend=NvmeBackend.THREADS,
        eviction=RegionEviction.LRU,
        reinsert_hits=0,
        format=True,
    )
    assert [t.kind for t in config.tiers] == [TierKind.GPU, TierKind.PMEM, TierKind.NVME]
    assert isinstance(pmem.path, Path) and isinstance(nvme.path, Path)
    assert config.scheduler == SchedulerConfig(EvictionPolicy.LRU)
    assert config.health == HealthConfig(0.5, 30.0, 0.25, 120.0, 5, 2.0)
    for value in (config.health.entropy_alert_bits, config.health.slow_operation, gpu.ttl):
        assert type(value) is float
    assert type(gpu.capacity) is int and type(nvme.queue_depth) is int


def test_full_config_from_text(text: str, paths: dict[str, Path]) -> None:
    _check_full(load_config_text(text), paths)


def test_full_config_from_a_path(tmp_path: Path, text: str, paths: dict[str, Path]) -> None:
    file = tmp_path / "devices.toml"
    file.write_text(text)
    _check_full(load_config(file), paths)
    _check_full(load_config(str(file)), paths)


def test_full_config_from_a_dict(doc: dict[str, Any], paths: dict[str, Path]) -> None:
    _check_full(load_config(doc), paths)


def test_a_config_is_returned_as_is(text: str) -> None:
    config = load_config_text(text)
    assert load_config(config) is config


def test_config_is_immutable(text: str) -> None:
    config = load_config_text(text)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.engine = EngineConfig()  # type: ignore[misc]


def test_defaults_of_a_minimal_config(paths: dict[str, Path]) -> None:
    config = load_config(
        {
            "tiers": [
                {"name": "g", "kind": "gpu", "capacity": 4 * MiB},
                {"name": "n", "kind": "nvme", "capacity": "1GiB", "path": str(paths["nvme"])},
            ]
        }
    )
    assert config.engine == EngineConfig()
    assert config.scheduler == SchedulerConfig()
    assert config.health == HealthConfig()
    assert config.tiers[0] == GpuTierConfig("g", 4 * MiB)
    assert config.tiers[1] == NvmeTierConfig("n", GiB, paths["nvme"])


def test_existing_writable_files_are_accepted(paths: dict[str, Path], doc: dict[str, Any]) -> None:
    paths["pmem"].write_bytes(b"")
    paths["nvme"].write_bytes(b"")
    assert load_config(doc).tiers[1].kind is TierKind.PMEM


@pytest.mark.parametrize("tier", [1, 2])
def test_paths_in_directories_that_do_not_exist_are_refused(
    tmp_path: Path, doc: dict[str, Any], tier: int
) -> None:
    # the open creates no directory: such a path passed here and failed only at open
    doc["tiers"][tier]["path"] = str(tmp_path / "new" / "deeper" / "media")
    _fails(doc, f"tiers[{tier}].path")
    assert not (tmp_path / "new").exists()  # validation creates nothing


def test_boundary_capacities_are_accepted(doc: dict[str, Any]) -> None:
    doc["tiers"][0]["capacity"] = doc["tiers"][0]["slot_size"] = "1MiB"
    doc["tiers"][1]["capacity"] = MIN_PMEM_POOL
    doc["tiers"][2]["capacity"] = NVME_SUPERBLOCK + 8 * MiB
    capacities = [t.capacity for t in load_config(doc).tiers]
    assert capacities == [MiB, MIN_PMEM_POOL, NVME_SUPERBLOCK + 8 * MiB]


def _fails(source: dict[str, Any] | str, key_path: str) -> None:
    with pytest.raises(ConfigError) as info:
        if isinstance(source, str):
            load_config_text(source)
        else:
            load_config(source)
    assert str(info.value).startswith(f"{key_path}: "), str(info.value)


# Each case: (key path the error must name, edit applied to the valid full document).
Edit = tuple[str, Any]
CASES: dict[str, tuple[str, list[Edit]]] = {
    # unknown keys
    "unknown-top-level": ("bogus", [("bogus", 1)]),
    "unknown-engine": ("engine.bogus", [("engine.bogus", 1)]),
    "unknown-tier": ("tiers[1].bogus", [("tiers.1.bogus", 1)]),
    "nvme-key-in-pmem": ("tiers[1].region_size", [("tiers.1.region_size", "8MiB")]),
    "path-in-gpu": ("tiers[0].path", [("tiers.0.path", "/tmp/x")]),
    "unknown-scheduler": ("scheduler.bogus", [("scheduler.bogus", 1)]),
    "unknown-health": ("health.bogus", [("health.bogus", 1)]),
    # wrong types
    "str-for-int": ("tiers[2].queue_depth", [("tiers.2.queue_depth", "64")]),
    "str-for-int-health": ("health.close_after", [("health.close_after", "3")]),
    "float-for-int": ("tiers[2].reinsert_hits", [("tiers.2.reinsert_hits", 2.0)]),
    "bool-for-int": ("tiers[2].queue_depth", [("tiers.2.queue_depth", True)]),
    "int-for-bool": ("tiers[2].direct", [("tiers.2.direct", 1)]),
    "str-for-bool": ("tiers[1].format", [("tiers.1.format", "true")]),
    "list-for-table-engine": ("engine", [("engine", ["write_back"])]),
    "list-for-table-health": ("health", [("health", [])]),
    "int-for-table-scheduler": ("scheduler", [("scheduler", 1)]),
    "list-for-tier": ("tiers[1]", [("tiers.1", ["pmem"])]),
    "table-for-tiers": ("tiers", [("tiers", {"name": "x"})]),
    "no-tiers": ("tiers", [("tiers", [])]),
    "int-for-name": ("tiers[0].name", [("tiers.0.name", 1)]),
    "empty-name": ("tiers[0].name", [("tiers.0.name", "")]),
    "float-capacity": ("tiers[0].capacity", [("tiers.0.capacity", 1.5e9)]),
    "bool-capacity": ("tiers[0].capacity", [("tiers.0.capacity", True)]),
    "list-capacity": ("tiers[2].capacity", [("tiers.2.capacity", ["1GiB"])]),
    "str-for-number": ("health.failure_rate", [("health.failure_rate", "0.5")]),
    "bool-for-number": ("health.entropy_alert_bits", [("health.entropy_alert_bits", True)]),
    "int-for-path": ("tiers[2].path", [("tiers.2.path", 7)]),
    "list-for-device": ("tiers[0].device", [("tiers.0.device", ["cpu"])]),
    # missing keys
    "missing-tiers": ("tiers", [("tiers", None)]),
    "missing-name": ("tiers[1].name", [("tiers.1.name", None)]),
    "missing-kind": ("tiers[1].kind", [("tiers.1.kind", None)]),
    "missing-capacity": ("tiers[0].capacity", [("tiers.0.capacity", None)]),
    "missing-pmem-path": ("tiers[1].path", [("tiers.1.path", None)]),
    "missing-nvme-path": ("tiers[2].path", [("tiers.2.path", None)]),
    # hierarchy
    "duplicate-name": ("tiers[2].name", [("tiers.2.name", "l1")]),
    "gpu-not-first": (
        "tiers[2].kind",
        [("tiers.2", {"name": "g2", "kind": "gpu", "capacity": "4MiB", "device": "cpu"})],
    ),
    # bad sizes
    "size-unknown-unit": ("tiers[0].capacity", [("tiers.0.capacity", "12XB")]),
    "size-negative": ("tiers[0].capacity", [("tiers.0.capacity", "-1MiB")]),
    "size-fraction-of-byte": ("tiers[0].slot_size", [("tiers.0.slot_size", "1.5B")]),
    "size-decimal-units": ("tiers[1].capacity", [("tiers.1.capacity", "1GB")]),
    "size-lowercase-unit": ("tiers[1].capacity", [("tiers.1.capacity", "1gib")]),
    "size-empty": ("tiers[2].capacity", [("tiers.2.capacity", "")]),
    "size-zero": ("tiers[2].region_size", [("tiers.2.region_size", 0)]),
    "size-negative-int": ("tiers[2].capacity", [("tiers.2.capacity", -1)]),
    "size-zero-str": ("tiers[0].slot_size", [("tiers.0.slot_size", "0KiB")]),
    "size-fullwidth-digits": ("tiers[0].capacity", [("tiers.0.capacity", "\uff13\uff12MiB")]),
    "size-arabic-indic-digits": ("tiers[2].region_size",
                                 [("tiers.2.region_size", "\u0668MiB")]),
    "size-no-break-space": ("tiers[1].capacity", [("tiers.1.capacity", "1\u00a0GiB")]),
    # bad durations
    "duration-unknown-unit": ("tiers[0].ttl", [("tiers.0.ttl", "5sec")]),
    "duration-no-unit": ("health.window", [("health.window", "60")]),
    "duration-negative": ("health.cooldown", [("health.cooldown", "-1s")]),
    "duration-zero": ("health.slow_operation", [("health.slow_operation", "0ms")]),
    "duration-zero-number": ("health.window", [("health.window", 0)]),
    "duration-nan": ("health.window", [("health.window", math.nan)]),
    "duration-inf": ("tiers[0].ttl", [("tiers.0.ttl", math.inf)]),
    "duration-bool": ("tiers[0].ttl", [("tiers.0.ttl", True)]),
    "duration-word": ("health.cooldown", [("health.cooldown", "forever")]),
    "duration-fullwidth-digits": ("tiers[0].ttl", [("tiers.0.ttl", "\uff15s")]),
    # bad enums
    "enum-write-policy": ("engine.write_policy", [("engine.write_policy", "sometimes")]),
    "enum-write-policy-int": ("engine.write_policy", [("engine.write_policy", 1)]),
    "enum-write-policy-list": ("engine.write_policy", [("engine.write_policy", ["write_back"])]),
    "enum-kind": ("tiers[1].kind", [("tiers.1.kind", "tape")]),
    "enum-kind-case": ("tiers[1].kind", [("tiers.1.kind", "PMEM")]),
    "enum-backend": ("tiers[2].backend", [("tiers.2.backend", "spdk")]),
    "enum-eviction": ("tiers[2].eviction", [("tiers.2.eviction", "random")]),
    "enum-policy": ("scheduler.policy", [("scheduler.policy", "mru")]),
    # out of range numbers
    "queue-depth-zero": ("tiers[2].queue_depth", [("tiers.2.queue_depth", 0)]),
    "queue-depth-huge": ("tiers[2].queue_depth", [("tiers.2.queue_depth", 4097)]),
    "reinsert-negative": ("tiers[2].reinsert_hits", [("tiers.2.reinsert_hits", -1)]),
    "sq-poll-too-short": ("tiers[2].sq_poll", [("tiers.2.sq_poll", "0.5ms"),
                                               ("tiers.2.backend", "io_uring")]),
    "sq-poll-too-long": ("tiers[2].sq_poll", [("tiers.2.sq_poll", "11s"),
                                              ("tiers.2.backend", "io_uring")]),
    "sq-poll-bool": ("tiers[2].sq_poll", [("tiers.2.sq_poll", True)]),
    "sq-poll-word": ("tiers[2].sq_poll", [("tiers.2.sq_poll", "on")]),
    "sq-poll-with-threads": ("tiers[2].sq_poll", [("tiers.2.sq_poll", "2ms")]),
    "failure-rate-above-1": ("health.failure_rate", [("health.failure_rate", 1.5)]),
    "failure-rate-nan": ("health.failure_rate", [("health.failure_rate", math.nan)]),
    "close-after-zero": ("health.close_after", [("health.close_after", 0)]),
    "entropy-too-high": ("health.entropy_alert_bits", [("health.entropy_alert_bits", 65)]),
    # impossible values
    "capacity-below-one-slot": ("tiers[0].capacity", [("tiers.0.capacity", "255KiB")]),
    "slot-above-capacity": ("tiers[0].capacity", [("tiers.0.slot_size", "128MiB")]),
    "device-unknown": ("tiers[0].device", [("tiers.0.device", "gpu0")]),
    "device-bad-index": ("tiers[0].device", [("tiers.0.device", "cuda:x")]),
    "device-negative-index": ("tiers[0].device", [("tiers.0.device", "cuda:-1")]),
    "device-empty": ("tiers[0].device", [("tiers.0.device", "")]),
    "region-not-4k-multiple": ("tiers[2].region_size", [("tiers.2.region_size", 8 * MiB + 512)]),
    "region-below-1mib": ("tiers[2].region_size", [("tiers.2.region_size", "512KiB")]),
    "nvme-capacity-one-region": ("tiers[2].capacity", [("tiers.2.capacity", "8MiB")]),
    "nvme-capacity-below-region": ("tiers[2].capacity", [("tiers.2.capacity", "4MiB")]),
    "pmem-below-minimum": ("tiers[1].capacity", [("tiers.1.capacity", MIN_PMEM_POOL - 1)]),
    "pmem-tiny": ("tiers[1].capacity", [("tiers.1.capacity", "4KiB")]),
}


def _apply(doc: dict[str, Any], edits: list[Edit]) -> dict[str, Any]:
    """A copy of `doc` with each dotted path set to its value (removed where the value is None)."""
    result = copy.deepcopy(doc)
    for dotted, value in edits:
        *parents, last = dotted.split(".")
        node: Any = result
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last)] = value
        elif value is None:
            del node[last]
        else:
            node[last] = value
    return result


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_error_names_the_key_path(case: str, doc: dict[str, Any]) -> None:
    key_path, edits = CASES[case]
    _fails(_apply(doc, edits), key_path)


def test_errors_are_value_errors_too(doc: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        load_config(_apply(doc, [("tiers.0.capacity", "12XB")]))


def test_two_gpu_tiers_are_refused(doc: dict[str, Any]) -> None:
    doc["tiers"].insert(1, {"name": "g2", "kind": "gpu", "capacity": "1GiB", "device": "cpu"})
    _fails(doc, "tiers[1].kind")


def test_same_path_twice(doc: dict[str, Any], paths: dict[str, Path]) -> None:
    _fails(_apply(doc, [("tiers.2.path", str(paths["pmem"]))]), "tiers[2].path")


def test_same_path_twice_under_another_spelling(
    doc: dict[str, Any], paths: dict[str, Path]
) -> None:
    other = paths["pmem"].parent / "sub" / ".." / paths["pmem"].name
    _fails(_apply(doc, [("tiers.2.path", str(other))]), "tiers[2].path")


def test_same_file_through_a_hard_link(
    doc: dict[str, Any], paths: dict[str, Path]
) -> None:
    # resolve() leaves a hard link as it is: two tiers on one file passed
    paths["pmem"].write_bytes(b"")
    link = paths["pmem"].parent / "link"
    link.hardlink_to(paths["pmem"])
    _fails(_apply(doc, [("tiers.2.path", str(link))]), "tiers[2].path")


def test_path_under_a_regular_file(tmp_path: Path, doc: dict[str, Any]) -> None:
    # A directory cannot be made under a file whoever we are; chmod would not stop root.
    (tmp_path / "afile").write_bytes(b"x")
    _fails(_apply(doc, [("tiers.1.path", str(tmp_path / "afile" / "pool"))]), "tiers[1].path")
    deeper = tmp_path / "afile" / "sub" / "log"
    _fails(_apply(doc, [("tiers.2.path", str(deeper))]), "tiers[2].path")


def test_path_with_a_nul_byte(tmp_path: Path, doc: dict[str, Any]) -> None:
    _fails(_apply(doc, [("tiers.1.path", f"{tmp_path}/a\x00b")]), "tiers[1].path")


def test_path_under_the_home_of_no_such_user(doc: dict[str, Any]) -> None:
    # Path.expanduser raised RuntimeError ("Could not determine home directory"): a traceback
    _fails(_apply(doc, [("tiers.1.path", "~no-such-user-of-tierkv/pool")]), "tiers[1].path")


def test_path_that_is_a_symlink_loop(tmp_path: Path, doc: dict[str, Any]) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    _fails(_apply(doc, [("tiers.1.path", str(loop))]), "tiers[1].path")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_path_under_a_read_only_directory(tmp_path: Path, doc: dict[str, Any]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        _fails(_apply(doc, [("tiers.1.path", str(locked / "pool"))]), "tiers[1].path")
    finally:
        locked.chmod(0o700)


def test_path_that_is_a_directory(tmp_path: Path, doc: dict[str, Any]) -> None:
    (tmp_path / "adir").mkdir()
    _fails(_apply(doc, [("tiers.2.path", str(tmp_path / "adir"))]), "tiers[2].path")
    _fails(_apply(doc, [("tiers.1.path", str(tmp_path))]), "tiers[1].path")


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA; the cases need one without")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_device_on_a_machine_without_cuda(device: str, doc: dict[str, Any]) -> None:
    _fails(_apply(doc, [("tiers.0.device", device)]), "tiers[0].device")


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_devices_that_exist_everywhere(device: str, doc: dict[str, Any]) -> None:
    tier = load_config(_apply(doc, [("tiers.0.device", device)])).tiers[0]
    assert isinstance(tier, GpuTierConfig)
    assert tier.device == device


@pytest.mark.parametrize("device", ["cuda:\uff11", "cuda:", "cuda:\u00b2", "cuda: 1", "cuda:+1"])
def test_a_cuda_index_is_ascii_digits(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    # str.isdigit let a full-width 1 through as cuda:1, and "cuda:" was read as cuda:0
    import torch

    from tierkv.config._table import Table
    from tierkv.config.machine import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ConfigError) as info:
        check_device(Table({}, "tiers[0]"), device)
    assert str(info.value).startswith("tiers[0].device: ")
    assert check_device(Table({}, "tiers[0]"), "cuda:3") == "cuda:3"


def test_invalid_toml_syntax(tmp_path: Path) -> None:
    bad = '[engine]\nwrite_policy = "write_back\n'
    with pytest.raises(ConfigError) as info:
        load_config_text(bad, origin="inline")
    assert str(info.value).startswith("inline: ")
    file = tmp_path / "bad.toml"
    file.write_text("[[tiers]\nname = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value).startswith(f"{file}: ")


HUGE = int("9" * 400)  # beyond a float's range


@pytest.mark.parametrize(("dotted", "value", "key_path"), [
    ("scheduler.alpha", HUGE, "scheduler.alpha"),
    ("scheduler.beta", -HUGE, "scheduler.beta"),
    ("tiers.0.free_low", HUGE, "tiers[0].free_low"),
    ("tiers.1.free_high", HUGE, "tiers[1].free_high"),
    ("engine.space_timeout", HUGE, "engine.space_timeout"),
    ("engine.space_timeout", "9" * 400 + "s", "engine.space_timeout"),
    ("health.window", HUGE, "health.window"),
    ("tiers.0.capacity", HUGE, "tiers[0].capacity"),
    ("tiers.0.capacity", "9" * 400 + "TiB", "tiers[0].capacity"),
    ("tiers.0.capacity", 1 << 63, "tiers[0].capacity"),
    ("tiers.2.region_size", HUGE, "tiers[2].region_size"),
    ("tiers.2.queue_depth", 10 ** 6000, "tiers[2].queue_depth"),
], ids=lambda value: value if isinstance(value, str) and len(value) < 40 else "")
def test_numbers_beyond_any_range_are_config_errors(
    doc: dict[str, Any], dotted: str, value: Any, key_path: str
) -> None:
    # each of these raised OverflowError (float(), math.isfinite, format_size) or, printing an
    # integer of 6000 digits, ValueError
    _fails(_apply(doc, [(dotted, value)]), key_path)


@pytest.mark.parametrize("text", [
    "a = " + "[" * 100_000 + "]" * 100_000,
    "a = " + "{b=" * 100_000 + "1" + "}" * 100_000,
    "a = " + "9" * 6000,  # more digits than Python converts to an int
], ids=["arrays", "inline-tables", "long-integer"])
def test_toml_python_cannot_hold_is_a_syntax_error(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(text, origin="inline")
    assert str(info.value).startswith("inline: not valid TOML: ")


def test_the_default_config_takes_any_directory_name(tmp_path: Path) -> None:
    # the directories were pasted into the TOML text: a quote broke it, a backslash changed it
    odd = tmp_path / 'a"b\\n\\'
    (odd / "pmem").mkdir(parents=True)
    (odd / "nvme").mkdir()
    config = default_config(odd / "pmem", odd / "nvme")
    paths = [tier.path for tier in config.tiers
             if isinstance(tier, PmemTierConfig | NvmeTierConfig)]
    assert paths == [odd / "pmem" / "tierkv.pool", odd / "nvme" / "tierkv.log"]


def test_duplicate_toml_key_is_a_syntax_error() -> None:
    with pytest.raises(ConfigError):
        load_config_text('[engine]\nwrite_policy = "write_back"\nwrite_policy = "write_back"\n')


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(info.value).startswith(f"{missing}: ")


def test_config_path_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(info.value).startswith(f"{tmp_path}: ")


def test_config_file_that_is_not_utf8(tmp_path: Path) -> None:
    file = tmp_path / "latin1.toml"
    file.write_bytes(b"# caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value).startswith(f"{file}: ")


# -- examples/devices.toml -------------------------------------------------------------------------


def _example_text(tmp_path: Path) -> str:
    text = EXAMPLE.read_text()
    assert '"/mnt/' in text
    for mount in ("pmem0", "nvme0"):  # the file systems the example's paths are on
        (tmp_path / "mnt" / mount).mkdir(parents=True, exist_ok=True)
    return text.replace('"/mnt/', f'"{tmp_path}/mnt/')


@pytest.fixture
def server_sized(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's capacities are a server's (64 GiB of pmem, 1 TiB of nvme): let this machine
    report the memory and free disk space of one, so that the loader's fit checks pass as they
    would there."""
    real_statvfs, real_sysconf = os.statvfs, os.sysconf

    def statvfs(path: Any) -> os.statvfs_result:
        fields = list(real_statvfs(path))
        fields[2] = fields[3] = fields[4] = (16 << 40) // fields[1]  # blocks, free, available
        return os.statvfs_result(fields)

    def sysconf(name: str | int) -> int:
        if name == "SC_PHYS_PAGES":
            return (1 << 40) // real_sysconf("SC_PAGE_SIZE")
        return real_sysconf(name)

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(os, "sysconf", sysconf)


@pytest.mark.usefixtures("server_sized")
def test_example_loads(tmp_path: Path) -> None:
    config = load_config_text(_example_text(tmp_path))
    assert [t.kind for t in config.tiers] == [TierKind.GPU, TierKind.PMEM, TierKind.NVME]
    for tier in config.tiers:
        if isinstance(tier, PmemTierConfig | NvmeTierConfig):
            assert tier.path.is_relative_to(tmp_path / "mnt")


def test_example_sets_every_key_of_the_schema(tmp_path: Path) -> None:
    document = tomllib.loads(_example_text(tmp_path))
    assert set(document) == {f.name for f in dataclasses.fields(Config)}
    sections = {"engine": EngineConfig, "scheduler": SchedulerConfig, "health": HealthConfig}
    for section, schema in sections.items():
        assert set(document[section]) == {f.name for f in dataclasses.fields(schema)}, section
    tier_schemas = {"gpu": GpuTierConfig, "pmem": PmemTierConfig, "nvme": NvmeTierConfig}
    assert sorted(t["kind"] for t in document["tiers"]) == sorted(tier_schemas)
    for tier in document["tiers"]:
        expected = {f.name for f in dataclasses.fields(tier_schemas[tier["kind"]])}
        assert set(tier) == expected, tier["kind"]


@pytest.mark.usefixtures("server_sized")
def test_example_optional_values_are_the_defaults(tmp_path: Path) -> None:
    # The example's header says every optional value shown is its default.
    config = load_config_text(_example_text(tmp_path))
    assert config.engine == EngineConfig()
    assert config.scheduler == SchedulerConfig()
    assert config.health == HealthConfig()
    for tier in config.tiers:
        for field in dataclasses.fields(tier):
            if field.init and field.default is not dataclasses.MISSING:
                assert getattr(tier, field.name) == field.default, (tier.name, field.name)


def test_example_comments_every_key() -> None:
    lines = EXAMPLE.read_text().splitlines()
    assignment = re.compile(r"^\s*([A-Za-z_]+)\s*=")
    for number, line in enumerate(lines):
        match = assignment.match(line)
        if match:
            previous = lines[number - 1].strip()
            assert previous.startswith("#"), f"line {number + 1}: {match.group(1)} has no comment"


# -- tierkv._units ---------------------------------------------------------------------------------

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("1B", 1),
        ("4KiB", 4096),
        ("512MiB", 512 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5KiB", 512),
        ("1.0B", 1),
        ("2TiB", 2 << 40),
        (" 4 KiB ", 4096),
        ("007MiB", 7 * MiB),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected
    assert type(parse_size(text)) is int


@pytest.mark.parametrize(
    "text",
    [
        "",
        "MiB",
        "12XB",
        "-1MiB",
        "1.5B",
        "0.1KiB",
        "4kib",
        "4KB",
        "1e3",
        "1,024",
        "0x10",
        "1 2MiB",
        ".5KiB",
        "5.KiB",
        "inf",
        "nan",
        "4 KiB B",
        "\uff13\uff12MiB",  # full-width digits
        "\u0664KiB",  # an Arabic-Indic digit
        "\U0001d7f8MiB",  # a mathematical monospace digit
        "1\u2003MiB",  # an em space
    ],
)
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=2**53), st.sampled_from(sorted(UNITS)))
def test_parse_size_of_whole_numbers(count: int, unit: str) -> None:
    assert parse_size(str(count)) == count
    if count * UNITS[unit] <= 2**53:
        assert parse_size(f"{count}{unit}") == count * UNITS[unit]


def test_parse_size_is_exact_for_large_integers() -> None:
    assert parse_size(str(2**53 + 1)) == 2**53 + 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("800ms", 0.8),
        ("5s", 5.0),
        ("1.5min", 90.0),
        ("2min", 120.0),
        ("1h", 3600.0),
        ("0ms", 0.0),
        (" 250 ms ", 0.25),
    ],
)
def test_parse_duration(text: str, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)
    assert type(parse_duration(text)) is float


@pytest.mark.parametrize(
    "text", ["", "5", "s", "5sec", "-1s", "5S", "1e3ms", "5 m", "fast", "1.5.0s", "5ms5",
             "\uff15s", "\u0665ms"]
)
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, "0B"),
        (1, "1B"),
        (1023, "1023B"),
        (1024, "1KiB"),
        (1536, "1.5KiB"),
        (2 * MiB, "2MiB"),
        (64 * GiB, "64GiB"),
        (1 << 40, "1TiB"),
        (1234567, "1.177MiB"),
    ],
)
def test_format_size(nbytes: float, expected: str) -> None:
    assert format_size(nbytes) == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=1023), st.sampled_from(sorted(UNITS)))
def test_format_size_round_trips_through_parse_size(count: int, unit: str) -> None:
    nbytes = count * UNITS[unit]
    assert parse_size(format_size(nbytes)) == nbytes


def test_sq_poll_is_a_duration_or_off(doc: dict[str, Any]) -> None:
    def sq_poll() -> float | None:
        tier = load_config(doc).tiers[2]
        assert isinstance(tier, NvmeTierConfig)
        return tier.sq_poll

    nvme = doc["tiers"][2]
    nvme["backend"] = "io_uring"
    nvme["sq_poll"] = "2ms"
    assert sq_poll() == pytest.approx(0.002)
    nvme["sq_poll"] = "off"
    assert sq_poll() is None
    del nvme["sq_poll"]
    assert sq_poll() is None


def test_demotion_linger_may_be_zero_but_not_negative(doc: dict[str, Any]) -> None:
    # 0 means a demotion's flush starts at once; every other duration key must be positive
    assert load_config(_apply(doc, [("engine.demotion_linger", "0s")])
                       ).engine.demotion_linger == 0.0
    assert load_config(_apply(doc, [("engine.demotion_linger", "40ms")])
                       ).engine.demotion_linger == pytest.approx(0.04)
    assert load_config(doc).engine.demotion_linger == pytest.approx(0.025)
    _fails(_apply(doc, [("engine.demotion_linger", "-1ms")]), "engine.demotion_linger")
    _fails(_apply(doc, [("engine.space_timeout", "0s")]), "engine.space_timeout")
