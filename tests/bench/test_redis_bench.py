"""`tierkv bench --device redis` at its --quick size: every row there with positive figures, the
cross-engine hit in one round trip, nothing left behind on a given server or as a process, and
one line (no traceback) for a server that does not answer."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tierkv.bench.redis import run_redis_bench
from tierkv.cli import main

pytestmark = pytest.mark.redis

THROUGHPUT = ("put 64KiB, 8 tasks (", "put 64KiB, 8 tasks, vs pipelined", "put 64KiB x4 at once",
              "get_many 64KiB x4", "put 1MiB, 8 tasks (", "put 1MiB, 8 tasks, vs pipelined",
              "put 1MiB x4 at once", "get_many 1MiB x4")
LATENCY = ("cross-engine hit 64KiB p50", "cross-engine hit 64KiB p99",
           "shared lookup 64KiB p50", "shared lookup 64KiB p99")


def _children_named(name: str) -> list[int]:
    """Pids of this process's children whose command is `name` (zombies included)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        command, _, rest = stat.partition(" (")[2].rpartition(") ")
        if command == name and int(rest.split()[1]) == os.getpid():
            found.append(int(entry.name))
    return found


def _check_rows(rows: list[dict[str, object]]) -> None:
    cases = [str(row["case"]) for row in rows]
    for prefix in THROUGHPUT + LATENCY:
        [row] = [row for row, case in zip(rows, cases, strict=True) if case.startswith(prefix)]
        assert isinstance(row["measured"], float) and row["measured"] > 0
        assert isinstance(row["baseline"], float) and row["baseline"] > 0
    [trips] = [row for row in rows if row["case"] == "round trips per cross-engine hit"]
    assert trips["measured"] == 1.0
    assert trips["meets_target"] is True


async def test_on_a_given_server_deletes_its_keys(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.set("users:own", b"kept")
        result, rows = await run_redis_bench(redis_url, quick=True)
        _check_rows([row.to_json() for row in rows])
        assert result["private_server"] is False
        assert result["cross_engine"]["adopted"] == result["cross_engine"]["hits"]
        # the user's key stays; none of the bench's does
        assert await client.keys("*") == [b"users:own"]
    finally:
        await client.aclose()


def test_cli_with_a_private_server(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    before = _children_named("redis-server")  # the session's server, if a test started it
    assert main(["bench", "--device", "redis", "--quick", "--workdir", str(tmp_path),
                 "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["results"]["redis"]["private_server"] is True
    _check_rows(document["rows"])
    assert _children_named("redis-server") == before


def test_cli_unreachable_url_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port nothing listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["bench", "--device", "redis", "--url", f"redis://127.0.0.1:{port}/0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tierkv: error: ") and err.count("\n") == 1
    assert "Traceback" not in err
