"""The documentation against the code: the README's configuration table names every key the
schema has and no other, with the defaults and choices the loader really has; the README's API
example runs as written; examples/shared.toml loads. (examples/devices.toml: `test_config.py`.)
"""

from __future__ import annotations

import dataclasses
import enum
import re
import textwrap
import tomllib
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from tierkv import load_config
from tierkv.config import (
    Config,
    EngineConfig,
    GpuTierConfig,
    HealthConfig,
    NvmeTierConfig,
    PmemTierConfig,
    RedisTierConfig,
    SchedulerConfig,
)

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SECTIONS: dict[str, type[Any]] = {
    "engine": EngineConfig, "scheduler": SchedulerConfig, "health": HealthConfig}
KINDS: dict[str, type[Any]] = {
    "gpu": GpuTierConfig, "pmem": PmemTierConfig, "nvme": NvmeTierConfig,
    "redis": RedisTierConfig}


class Row(NamedTuple):
    """One key of the README's configuration table: its scope (a section, or a tier kind),
    name, choices (the quoted words of its type column; empty if it is not a choice) and
    default (a TOML value as written; None: required or no default)."""

    scope: str
    key: str
    choices: frozenset[str]
    default: str | None


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def _choices(cell: str) -> frozenset[str]:
    """The words of a type such as ``"a"` \\| `"b"```, or none if it is anything else."""
    parts = [part.strip() for part in cell.split("\\|")]
    words = [re.fullmatch(r'`"([^"`]*)"`', part) for part in parts]
    if len(parts) < 2 or not all(words):
        return frozenset()
    return frozenset(match.group(1) for match in words if match)


def readme_rows() -> Iterator[Row]:
    section = README.split("## Configuration (TOML)", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    assert lines, "the README has no configuration table"
    for line in lines:
        key_cell, type_cell, default_cell, meaning = _cells(line)
        keys = re.findall(r"`([^`]+)`", key_cell)
        if keys == ["health.*"]:
            # "`failure_rate` (0.6) of the calls of the last `window` ("60s", ...) ..."
            for key, default in re.findall(r"`(\w+)` \(([^,)]+)", meaning):
                yield Row("health", key, frozenset(), default)
            continue
        defaults = re.findall(r"`([^`]+)`", default_cell)
        if len(defaults) == 1:
            defaults *= len(keys)
        assert not defaults or len(defaults) == len(keys), line
        kinds = [kind.strip() for kind in key_cell.split("`", 1)[0].split(",") if kind.strip()]
        for position, key in enumerate(keys):
            default = defaults[position] if defaults else None
            scope, dot, name = key.rpartition(".")
            if not dot:  # "gpu, pmem `free_low`": the kinds named before it
                scopes = kinds
            elif scope == "tiers[i]":
                scopes = list(KINDS)
            else:
                scopes = [scope]
            for each in scopes:
                yield Row(each, name, _choices(type_cell), default)


ROWS = list(readme_rows())


def _base(tmp_path: Path, kind: str | None) -> dict[str, Any]:
    """A config that loads here: one tier of `kind` (a redis tier after a gpu tier)."""
    tiers: dict[str, dict[str, Any]] = {
        # room for one slot of the default size
        "gpu": {"name": "gpu", "kind": "gpu", "device": "cpu", "capacity": "4MiB",
                "slot_size": "64KiB"},
        "pmem": {"name": "pmem", "kind": "pmem", "capacity": "8MiB",
                 "path": str(tmp_path / "tierkv.pool")},
        # room for the default region size
        "nvme": {"name": "nvme", "kind": "nvme", "capacity": "80MiB",
                 "path": str(tmp_path / "tierkv.log")},
        "redis": {"name": "redis", "kind": "redis", "capacity": "1MiB",
                  "url": "redis://127.0.0.1:6379/0"},
    }
    chosen = ["gpu", "redis"] if kind == "redis" else [kind or "gpu"]
    return {"tiers": [tiers[each] for each in chosen]}


def _record(config: Config, scope: str) -> Any:
    """The record `scope` configures: a section, or the (last) tier of that kind."""
    if scope in SECTIONS:
        return getattr(config, scope)
    return config.tiers[-1]


def test_the_readme_table_names_every_key_of_the_schema_and_no_other() -> None:
    documented: dict[str, set[str]] = {}
    for row in ROWS:
        documented.setdefault(row.scope, set()).add(row.key)
    schemas = {**SECTIONS, **KINDS}
    assert set(documented) == set(schemas)
    for scope, schema in schemas.items():
        assert documented[scope] == {field.name for field in dataclasses.fields(schema)}, scope


@pytest.mark.parametrize("row", [row for row in ROWS if row.default is not None],
                         ids=lambda row: f"{row.scope}.{row.key}")
def test_a_readme_default_is_the_loaders(tmp_path: Path, row: Row) -> None:
    """The key set to its documented default loads as the key left out does."""
    assert row.default is not None
    value = tomllib.loads(f"value = {row.default}")["value"]
    scope = None if row.scope in SECTIONS else row.scope
    left_out, document = _base(tmp_path, scope), _base(tmp_path, scope)
    if row.scope in SECTIONS:
        document[row.scope] = {row.key: value}
    else:
        left_out["tiers"][-1].pop(row.key, None)
        document["tiers"][-1][row.key] = value
    implied = load_config(left_out)
    assert _record(load_config(document), row.scope) == _record(implied, row.scope)


@pytest.mark.parametrize("row", [row for row in ROWS if row.choices],
                         ids=lambda row: f"{row.scope}.{row.key}")
def test_a_readme_choice_is_the_schemas(tmp_path: Path, row: Row) -> None:
    record = _record(load_config(_base(tmp_path, None if row.scope in SECTIONS
                                       else row.scope)), row.scope)
    chosen = getattr(record, row.key)
    if not isinstance(chosen, enum.Enum):  # a string with a pattern among its words: cuda:N
        assert isinstance(chosen, str) and chosen in row.choices, (row, chosen)
        return
    assert row.choices == {member.value for member in type(chosen)}


def test_the_shared_example_loads(tmp_path: Path) -> None:
    """examples/shared.toml with its paths under `tmp_path` and its capacities this machine's."""
    document = tomllib.loads((ROOT / "examples" / "shared.toml").read_text())
    local = _base(tmp_path, "gpu")["tiers"][0]
    for tier, path in zip(document["tiers"][1:3], ("tierkv.pool", "tierkv.log"), strict=True):
        assert tier["path"].startswith("/mnt/")
        tier["path"] = str(tmp_path / path)
    document["tiers"][0]["capacity"] = local["capacity"]
    document["tiers"][1]["capacity"] = "8MiB"
    document["tiers"][2]["capacity"] = "80MiB"
    config = load_config(document)
    assert [tier.kind.value for tier in config.tiers] == ["gpu", "pmem", "nvme", "redis"]
    assert isinstance(shared := config.tiers[-1], RedisTierConfig)
    assert shared.key_prefix == "tierkv:prod:" and shared.ttl == shared.retention == 86400


def _readme_python() -> str:
    [block] = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
    return str(block)


async def test_the_readme_api_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The README's example, as written, on a gpu → pmem → nvme config in devices.toml; the
    names it leaves to the reader (`token_ids`, `kv_tensor`, `attention`) given values."""
    base = {"tiers": [_base(tmp_path, kind)["tiers"][0] for kind in ("gpu", "pmem", "nvme")]}
    base["tiers"][0]["capacity"] = "8MiB"
    lines = ["[[tiers]]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in tier.items())
             for tier in base["tiers"]]
    (tmp_path / "devices.toml").write_text("\n".join(lines))
    monkeypatch.chdir(tmp_path)
    attended: list[torch.Tensor] = []
    names: dict[str, Any] = {"token_ids": list(range(1024)), "kv_tensor": torch.ones(4, 1024),
                             "attention": attended.append}
    source = "async def readme():\n" + textwrap.indent(_readme_python(), "    ")
    exec(compile(source, "README.md", "exec"), names)
    readme: Callable[[], Awaitable[None]] = names["readme"]
    await readme()
    assert len(attended) == 1 and torch.equal(attended[0], names["kv_tensor"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "gpu"  # locate
    assert printed[1].startswith("{'engine': ")  # stats


def _toml(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)
