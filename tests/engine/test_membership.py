"""A persistent tier that sat out a session of its hierarchy (taken out of the config for a
while, then put back with its media) is refused at open, or cleared with ``format = true``:
back in the hierarchy, its older values won over what was put meanwhile, and keys deleted
meanwhile came back. A tier that took part in every session, or a new one, is taken as it is;
one whose record is damaged is refused as damaged."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

import tierkv
from tests._media import flip_payload_bytes
from tests.engine._configs import hierarchy_config
from tests.tiers import test_nvme_conformance, test_pmem_conformance
from tierkv.config import load_config
from tierkv.errors import DeviceError
from tierkv.formats.membership import Membership, decode_membership, encode_membership
from tierkv.keys import MEMBERSHIP_KEY, encode_key
from tierkv.testing.faults import FaultPlan, open_with_faults
from tierkv.tiers.registry import make_tier

pytestmark = pytest.mark.pmem

#: a session without the pool, run in a process of its own: a write-through overwrite and a
#: delete, acknowledged, then it waits to be killed
WITHOUT_POOL = """
import asyncio, json, sys
import tierkv

async def main():
    kv = await tierkv.open(json.loads(sys.argv[1]))
    await kv.put("k", b"v2" * 1000)
    await kv.delete("d")
    print("ACK", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def three(tmp_path: Path, **pmem: Any) -> dict[str, Any]:
    return hierarchy_config(tmp_path, ("gpu", "pmem", "nvme"), pmem=pmem)


def without_pmem(tmp_path: Path) -> dict[str, Any]:
    return hierarchy_config(tmp_path, ("gpu", "nvme"))


async def first_session(tmp_path: Path) -> None:
    """"k" = b"v1" and "d" on pmem and in the log (put, then demoted by a full gpu tier)."""
    async with tierkv.open(three(tmp_path)) as kv:
        await kv.put("k", b"v1" * 1000)
        await kv.put("d", b"gone" * 1000)
        await kv.flush()


async def session_without_pmem(tmp_path: Path) -> None:
    async with tierkv.open(without_pmem(tmp_path)) as kv:
        assert await kv.get("k") in (b"v1" * 1000, None)
        await kv.put("k", b"v2" * 1000)
        await kv.delete("d")


async def test_a_tier_that_sat_out_a_session_is_refused(tmp_path: Path) -> None:
    await first_session(tmp_path)
    await session_without_pmem(tmp_path)
    with pytest.raises(DeviceError, match=r"tier 'pmem' .*ran without it.*tierkv format"):
        await tierkv.open(three(tmp_path))
    async with tierkv.open(without_pmem(tmp_path)) as kv:  # nothing lost meanwhile
        assert await kv.get("k") == b"v2" * 1000
        assert await kv.get("d") is None


async def test_with_format_it_is_cleared_and_nothing_stale_is_served(tmp_path: Path) -> None:
    await first_session(tmp_path)
    await session_without_pmem(tmp_path)
    async with tierkv.open(three(tmp_path, format=True)) as kv:
        assert await kv.get("k") == b"v2" * 1000
        assert await kv.get("d") is None
        assert kv.stats()["tiers"]["pmem"]["objects"] <= 1  # its record, at most
    async with tierkv.open(three(tmp_path)) as kv:  # the next open finds every tier current
        assert await kv.get("k") == b"v2" * 1000
        assert await kv.get("d") is None


async def test_tiers_that_took_part_in_every_session_open_as_they_are(tmp_path: Path) -> None:
    await first_session(tmp_path)
    for _ in range(3):
        async with tierkv.open(three(tmp_path)) as kv:
            assert await kv.get("k") == b"v1" * 1000
            await kv.put(f"n{_}", os.urandom(3000))
    # a tier added later is new media: it holds nothing to be stale
    config = three(tmp_path)
    config["tiers"].insert(2, {**config["tiers"][1], "name": "pmem2",
                               "path": str(tmp_path / "second.pool")})
    async with tierkv.open(config) as kv:
        assert await kv.get("k") == b"v1" * 1000
    async with tierkv.open(three(tmp_path)) as kv:  # pmem2 left: the others took part
        assert await kv.get("k") == b"v1" * 1000


async def test_each_of_two_tiers_run_without_the_other_one_is_refused(tmp_path: Path) -> None:
    """The pool alone, then the log alone: each sat out the other's session. The first tier in
    the hierarchy's order is taken as current, the other refused (or cleared)."""
    await first_session(tmp_path)
    async with tierkv.open(hierarchy_config(tmp_path, ("gpu", "pmem"))) as kv:
        await kv.put("k", b"pool" * 1000)
    async with tierkv.open(without_pmem(tmp_path)) as kv:
        await kv.put("k", b"log" * 1000)
    with pytest.raises(DeviceError, match="tier 'nvme'"):
        await tierkv.open(three(tmp_path))
    config = three(tmp_path)
    config["tiers"][2]["format"] = True
    async with tierkv.open(config) as kv:
        assert await kv.get("k") == b"pool" * 1000


@pytest.mark.crash
async def test_a_session_killed_without_a_close_still_counts(tmp_path: Path) -> None:
    """The records are on media before the session serves anything: one ended by kill -9
    right after its acknowledged writes still makes the pool that sat it out stale."""
    await first_session(tmp_path)
    config = without_pmem(tmp_path)
    config["engine"]["write_policy"] = "write_through"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WITHOUT_POOL, json.dumps(config), stdout=asyncio.subprocess.PIPE)
    try:
        assert process.stdout is not None
        assert await asyncio.wait_for(process.stdout.readline(), 60) == b"ACK\n"
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    with pytest.raises(DeviceError, match="tier 'pmem'"):
        await tierkv.open(three(tmp_path))
    async with tierkv.open(without_pmem(tmp_path)) as kv:
        assert await kv.get("k") == b"v2" * 1000
        assert await kv.get("d") is None


def as_toml(config: dict[str, Any]) -> str:
    """A `hierarchy_config` mapping as a TOML file's text, for the `tierkv` command."""
    lines = ["[engine]", *(f"{k} = {json.dumps(v)}" for k, v in config["engine"].items())]
    for tier in config["tiers"]:
        lines += ["", "[[tiers]]", *(f"{k} = {json.dumps(v)}" for k, v in tier.items())]
    return "\n".join(lines) + "\n"


async def held(config: dict[str, Any], name: str) -> set[bytes]:
    """The keys (canonical) the tier `name` of `config` holds, opened alone as a tier."""
    tier = make_tier(next(tier for tier in load_config(config).tiers if tier.name == name))
    recovered = await tier.open()
    try:
        return {obj.key for obj in recovered if obj.key != MEMBERSHIP_KEY}
    finally:
        await tier.close()


#: where each persistent tier of `three` keeps its media, and its layout's payload finder
MEDIA = {"pmem": ("tierkv.pool", test_pmem_conformance.payload_offsets),
         "nvme": ("tierkv.log", test_nvme_conformance.payload_offsets)}


@pytest.mark.parametrize("damaged", ["pmem", "nvme"])
async def test_a_damaged_record_is_refused_as_such_and_format_recovers(
    tmp_path: Path, damaged: str
) -> None:
    """A flipped byte in one tier's record: the open is refused with a message that says the
    record is damaged (not that the tier sat a session out), names the tier and its path and
    how to clear it. Cleared as it says, that tier's objects are misses and every other is
    served byte for byte."""
    config = three(tmp_path)
    values = {f"k{i}": os.urandom(60_000) for i in range(150)}  # overflows the pool into the log
    async with tierkv.open(config) as kv:
        for key, value in values.items():
            await kv.put(key, value)
    other = next(tier for tier in MEDIA if tier != damaged)
    kept = await held(config, other)
    assert kept and {encode_key(key) for key in values} - kept  # each tier holds some
    name, offsets = MEDIA[damaged]
    flip_payload_bytes(tmp_path / name, MEMBERSHIP_KEY, offsets)
    with pytest.raises(DeviceError) as refused:
        await tierkv.open(config)
    said = str(refused.value)
    assert f"tier {damaged!r} ({tmp_path / name})" in said
    assert "record of the sessions it took part in is damaged" in said
    assert "ran without it since it last took part" not in said
    assert f"tierkv format --config FILE --tier {damaged} --yes" in said
    toml = tmp_path / "devices.toml"
    toml.write_text(as_toml(config))
    wipe = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tierkv.cli", "format", "--config", str(toml), "--tier", damaged,
        "--yes", stderr=asyncio.subprocess.PIPE)
    _out, said_by_format = await asyncio.wait_for(wipe.communicate(), 120)
    assert wipe.returncode == 0, said_by_format
    async with tierkv.open(config) as kv:
        for key, value in values.items():
            assert await kv.get(key) == (value if encode_key(key) in kept else None), key


def test_the_record_round_trips_and_is_strict() -> None:
    record = Membership(b"t" * 16, 7, b"s" * 16, frozenset({b"t" * 16, b"u" * 16}))
    data = encode_membership(record)
    assert decode_membership(data) == record
    for damaged in (data[:-1], data + b"\0", b"XXXX" + data[4:], data[:20]):
        with pytest.raises(tierkv.CorruptObjectError):
            decode_membership(damaged)


def shrinking(tmp_path: Path, pmem_capacity: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    return hierarchy_config(tmp_path, kinds, pmem={"capacity": pmem_capacity},
                            nvme={"capacity": "24MiB"})


async def test_a_pool_reopened_smaller_takes_its_record_and_a_session_without_it_counts(
        tmp_path: Path) -> None:
    """A pool reopened with a smaller capacity holds more than it may until objects move out,
    and refused this session's record: it kept its older one while the log's record listed it
    as a member. Then a session of the pool alone took the same number as that one, and with
    the log listed first the two read as one: both were taken, and what the pool-only session
    deleted came back from the log. The record is now written once the evictors made room."""
    async with tierkv.open(shrinking(tmp_path, "16MiB", ("pmem", "nvme"))) as kv:
        for i in range(200):
            await kv.put(f"k{i}", bytes([i]) * 60_000)
        await kv.settle()
    async with tierkv.open(shrinking(tmp_path, "8MiB", ("pmem", "nvme"))) as kv:
        await kv.settle()
        held = [i for i in range(200) if await kv.locate(f"k{i}") == "pmem"]
        assert held
    async with tierkv.open(shrinking(tmp_path, "8MiB", ("pmem",))) as kv:
        for i in held:
            assert await kv.delete(f"k{i}")
    log_first = shrinking(tmp_path, "8MiB", ("nvme", "pmem"))
    with pytest.raises(DeviceError, match="'nvme'"):  # it sat the pool-only session out
        await tierkv.open(log_first)


async def test_a_record_refused_at_open_is_written_by_a_later_flush(tmp_path: Path) -> None:
    """The log refuses every put while the engine opens (ENOSPC): the open goes on, and once
    the device takes writes again a flush writes this session's record. Left with its older
    one, the log could run a session alone under the same number as this one, and both tiers
    would be taken after it, serving what it deleted from the pool."""
    both = shrinking(tmp_path, "8MiB", ("pmem", "nvme"))
    async with tierkv.open(both) as kv:
        await kv.put("k", b"v" * 1000)
    plan = FaultPlan().add("nvme", "enospc", rate=1.0, ops=["put"])
    kv = await open_with_faults(both, plan)
    try:
        assert plan.fired["nvme:enospc"] >= 2  # at the open, and again once the evictors ran
        plan.enabled = False
        await kv.flush()
    finally:
        await kv.close()
    async with tierkv.open(shrinking(tmp_path, "8MiB", ("nvme",))) as kv:
        await kv.delete("k")
    with pytest.raises(DeviceError, match="'pmem'"):  # it sat the log-only session out
        await tierkv.open(both)


def write_through(tmp_path: Path, kinds: tuple[str, ...]) -> dict[str, Any]:
    config = hierarchy_config(tmp_path, kinds, write_policy="write_through",
                              pmem={"capacity": "16MiB"}, nvme={"capacity": "32MiB"})
    return config


async def test_a_session_no_tier_takes_the_record_of_is_refused(tmp_path: Path) -> None:
    """The log alone refuses every put (ENOSPC): no tier would record that the session ran, and
    with the log's older record matching the pool's, the next open of both took the pool as
    current and served what the log-only session deleted. Such an open is now refused."""
    async with tierkv.open(write_through(tmp_path, ("nvme", "pmem"))) as kv:
        await kv.put("k", b"old" * 1000)
    async with tierkv.open(write_through(tmp_path, ("pmem", "nvme"))) as kv:
        assert await kv.get("k") == b"old" * 1000  # a copy in the pool too
        await kv.settle()
    plan = FaultPlan().add("nvme", "enospc", rate=1.0, ops=["put"])
    with pytest.raises(DeviceError, match="no persistent tier took"):
        await open_with_faults(write_through(tmp_path, ("nvme",)), plan)
    async with tierkv.open(write_through(tmp_path, ("pmem", "nvme"))) as kv:
        assert await kv.get("k") == b"old" * 1000  # nothing was deleted


async def test_a_tier_refusing_its_record_for_a_session_is_refused_after_one_without_it(
        tmp_path: Path) -> None:
    """The pool refuses every put for a whole session with the log: it kept its older record
    while the log's listed it as a member; a later session of the pool alone took its number
    from that older record, the same as the log's, and after it both were taken and the log
    served what the pool-only session deleted. A member's older record must now be older than
    the latest session: one of the same number is another session, which the log sat out."""
    async with tierkv.open(write_through(tmp_path, ("nvme", "pmem"))) as kv:
        await kv.put("k", b"old" * 1000)
        await kv.put("other", b"kept" * 1000)
    async with tierkv.open(write_through(tmp_path, ("pmem", "nvme"))) as kv:
        assert await kv.get_many(["k", "other"]) == [b"old" * 1000, b"kept" * 1000]
        await kv.settle()  # copies in the pool too
    plan = FaultPlan().add("pmem", "eio", rate=1.0, ops=["put"])
    kv = await open_with_faults(write_through(tmp_path, ("pmem", "nvme")), plan)
    await kv.close()
    async with tierkv.open(write_through(tmp_path, ("pmem",))) as kv:
        await kv.delete("k")
    with pytest.raises(DeviceError, match="without it"):
        await tierkv.open(write_through(tmp_path, ("nvme", "pmem")))
    with pytest.raises(DeviceError, match="without it"):  # whichever is listed first
        await tierkv.open(write_through(tmp_path, ("pmem", "nvme")))


async def test_two_tiers_each_run_alone_are_not_both_taken(tmp_path: Path) -> None:
    """A lone persistent tier keeps no record: two run alone, then together, were both taken,
    and their copies of a key, numbered per tier, were settled by generation: the log's older
    value won over the pool's newer one."""
    async with tierkv.open(write_through(tmp_path, ("nvme",))) as kv:
        for key in ("x", "y"):
            await kv.put(key, b"filler" * 100)
        await kv.put("k", b"older" * 100)
    async with tierkv.open(write_through(tmp_path, ("pmem",))) as kv:
        await kv.put("k", b"newer" * 100)
    with pytest.raises(DeviceError, match="neither has a record"):
        await tierkv.open(write_through(tmp_path, ("pmem", "nvme")))


async def test_a_session_of_a_tier_left_empty_still_counts(tmp_path: Path) -> None:
    """As above, but the pool-only session deletes all the pool held: the pool, empty, is
    taken whatever it missed, and its session, of the same number as the log's, was not taken
    for the latest, so the log was taken too and served what that session deleted."""
    async with tierkv.open(write_through(tmp_path, ("nvme", "pmem"))) as kv:
        await kv.put("k", b"old" * 1000)
    async with tierkv.open(write_through(tmp_path, ("pmem", "nvme"))) as kv:
        assert await kv.get("k") == b"old" * 1000
        await kv.settle()  # a copy in the pool too
    plan = FaultPlan().add("pmem", "eio", rate=1.0, ops=["put"])
    kv = await open_with_faults(write_through(tmp_path, ("pmem", "nvme")), plan)
    await kv.close()
    async with tierkv.open(write_through(tmp_path, ("pmem",))) as kv:
        await kv.delete("k")  # the pool holds nothing now
    for order in (("nvme", "pmem"), ("pmem", "nvme")):
        with pytest.raises(DeviceError, match=r"'nvme'.*without it"):
            await tierkv.open(write_through(tmp_path, order))

