"""Media damage a crash cannot produce: the newest regions' headers destroyed, the log cut short.

Each test takes a crash image (the media as a kill would leave it: flushed, no checkpoint) or a
cleanly closed log, damages it, reopens it and checks what is served byte for byte. The
guarantee (`tierkv.tiers.nvme.tier`, Recovery): when the region use the superblock names as the
newest a flush made durable is gone, the scan drops every older region, since what it held may
supersede their records (a deleted key must not come back, an overwritten one not with its old
value), and records that decision so that later scans agree; a log cut short opens with what is
left, the regions past its end empty.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.tiers._nvme_support import (
    REGION,
    flip_byte,
    key,
    meta_of,
    nvme_config,
    payload_for,
    per_region,
    walk_records,
)
from tierkv.formats.nvme_layout import (
    SUPERBLOCK_SIZE,
    TOMBSTONE,
    Superblock,
    decode_region_header,
    decode_superblock,
    encode_superblock,
)
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.tier import NvmeTier

#: 5000-byte payloads take 5120-byte packed entries: 204 fill a 1 MiB region (its first block is
#: the header)
SIZE = 5000
PER_REGION = per_region(SIZE)
NEW = b"the new value" * 100


def old_value(i: int) -> bytes:
    return payload_for(i, SIZE)


async def put(tier: NvmeTier, i: int, data: bytes) -> None:
    await tier.put(key(i), meta_of(data), memoryview(data))


def crash_image(directory: Path) -> Path:
    """The tier's media as a crash at this moment leaves it (the tier stays open)."""
    image = directory / "image.log"
    shutil.copyfile(directory / "tier.log", image)
    return image


def region_seqs(media: Path) -> dict[int, int]:
    """Region index -> seq of every valid region header on `media`."""
    data = media.read_bytes()
    sb = decode_superblock(data[:SUPERBLOCK_SIZE])
    seqs = {}
    for index in range(sb.region_count):
        at = sb.region_offset(index)
        seq = decode_region_header(data[at : at + sb.alignment], sb.uuid, index)
        if seq is not None:
            seqs[index] = seq
    return seqs


def destroy_header(media: Path, index: int) -> None:
    with media.open("r+b") as f:
        f.seek(SUPERBLOCK_SIZE + index * REGION)
        f.write(bytes(4096))


async def served(tier: NvmeTier, i: int) -> bytes | None:
    got = await tier.get(key(i))
    return None if got is None else payload_bytes(got[1])


async def superseding_log(directory: Path, regions: int, filled: int | None = None,
                          after: int = 0) -> tuple[NvmeTier, set[int], set[int]]:
    """Fill `filled` regions (`regions - 2` by default) with keys 0.., then delete some of the
    first region's keys and overwrite others in the newest region, put `after` regions of
    further keys, and flush. Returns the open tier, the deleted keys and the overwritten
    ones."""
    filled = regions - 2 if filled is None else filled
    tier = NvmeTier(nvme_config(directory, regions=regions, reinsert_hits=0))
    await tier.open()
    for i in range(PER_REGION * filled):
        await put(tier, i, old_value(i))
    deleted, overwritten = set(range(0, 40, 2)), set(range(1, 40, 2))
    for i in sorted(deleted):
        assert await tier.delete(key(i))
    for i in sorted(overwritten):
        await put(tier, i, NEW)
    for i in range(PER_REGION * filled, PER_REGION * (filled + after)):
        await put(tier, i, old_value(i))
    await tier.flush()
    return tier, deleted, overwritten


async def check_nothing_stale(tier: NvmeTier, deleted: set[int], overwritten: set[int],
                              count: int) -> None:
    for i in range(count):
        got = await served(tier, i)
        if i in deleted:
            assert got is None, f"deleted key {i} came back"
        elif i in overwritten:
            assert got in (None, NEW), f"overwritten key {i} came back with its old value"
        else:
            assert got in (None, old_value(i))


async def test_destroyed_newest_headers_serve_nothing_stale(tmp_path: Path) -> None:
    tier, deleted, overwritten = await superseding_log(tmp_path, regions=8)
    image = crash_image(tmp_path)
    await tier.close()
    seqs = region_seqs(image)
    newest = sorted(seqs, key=seqs.__getitem__)[-2:]  # the head and the region before it
    for index in newest:
        destroy_header(image, index)
    count = PER_REGION * 6

    again = NvmeTier(nvme_config(tmp_path, regions=8, name=image.name))
    await again.open()
    try:
        assert again.stats()["recovered_from"] == "scan"
        await check_nothing_stale(again, deleted, overwritten, count)
        assert again.stats()["regions_unordered"] > 0
        # the tier goes on: what it stores now survives the next crash, and the regions it
        # dropped stay dropped although their headers are intact on the media
        for i in range(count, count + 50):
            await put(again, i, old_value(i))
        await again.flush()
        second = tmp_path / "second.log"
        shutil.copyfile(image, second)
    finally:
        await again.close()
    third = NvmeTier(nvme_config(tmp_path, regions=8, name=second.name))
    recovered = await third.open()
    try:
        assert third.stats()["recovered_from"] == "scan"
        await check_nothing_stale(third, deleted, overwritten, count)
        assert {key(i) for i in range(count, count + 50)} <= {r.key for r in recovered}
        for i in range(count, count + 50):
            assert await served(third, i) == old_value(i)
    finally:
        await third.close()


async def test_cut_off_newest_history_opens_and_serves_nothing_stale(tmp_path: Path) -> None:
    tier, deleted, overwritten = await superseding_log(tmp_path, regions=8)
    image = crash_image(tmp_path)
    await tier.close()
    os.truncate(image, SUPERBLOCK_SIZE + 4 * REGION)  # the newest regions were 4 and 5

    again = NvmeTier(nvme_config(tmp_path, regions=8, name=image.name))
    await again.open()
    try:
        await check_nothing_stale(again, deleted, overwritten, PER_REGION * 6)
        for i in range(10):  # the regions past the end are free again
            await put(again, 10_000 + i, old_value(i))
        await again.flush()
        for i in range(10):
            assert await served(again, 10_000 + i) == old_value(i)
    finally:
        await again.close()


async def test_truncated_log_opens_with_what_is_intact(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=9, reinsert_hits=0))
    await tier.open()
    # nine regions, one kept free for the checkpoint (the last: regions are taken lowest
    # first): twelve regions' worth over eight for data, the log wraps around
    total = PER_REGION * 12
    live = set(range(total))
    for i in range(total):
        live.difference_update(int(k.rsplit(b"-", 1)[1])
                               for k in await tier.put(key(i), meta_of(old_value(i)),
                                                       memoryview(old_value(i))))
    await tier.flush()
    image = crash_image(tmp_path)
    await tier.close()
    seqs = region_seqs(image)
    assert max(seqs, key=seqs.__getitem__) < 4  # the newest regions lie in the first half
    os.truncate(image, SUPERBLOCK_SIZE + 4 * REGION)

    again = NvmeTier(nvme_config(tmp_path, regions=9, name=image.name))
    recovered = {r.key for r in await again.open()}
    try:
        assert again.stats()["recovered_from"] == "scan"
        assert again.stats()["regions_unordered"] == 0
        kept = set(range(total - 4 * PER_REGION + 1, total))  # what the first half holds
        assert {key(i) for i in kept} <= recovered
        for i in range(total):
            got = await served(again, i)
            if i in kept:
                assert got == old_value(i), i
            else:
                assert got in (None, old_value(i))  # past the end: a miss
        await put(again, 10_000, b"after")  # into a region past the old end
    finally:
        await again.close()
    third = NvmeTier(nvme_config(tmp_path, regions=9, name=image.name))
    await third.open()
    try:
        assert third.stats()["recovered_from"] == "checkpoint"
        assert await served(third, 10_000) == b"after"
        for i in sorted(kept):
            assert await served(third, i) == old_value(i)
    finally:
        await third.close()


async def test_checkpoint_past_a_truncated_end_falls_back_to_a_scan(tmp_path: Path) -> None:
    config = nvme_config(tmp_path, regions=8)
    tier = NvmeTier(config)
    await tier.open()
    count = PER_REGION * 2 + 50  # regions 0-2; the checkpoint goes to region 3
    for i in range(count):
        await put(tier, i, old_value(i))
    await tier.close()
    sb = decode_superblock(config.path.read_bytes()[:SUPERBLOCK_SIZE])
    assert sb.checkpoint_regions == (3,)
    os.truncate(config.path, SUPERBLOCK_SIZE + 3 * REGION)

    again = NvmeTier(config)
    recovered = await again.open()
    try:
        assert again.stats()["recovered_from"] == "scan"
        assert {r.key for r in recovered} == {key(i) for i in range(count)}
        for i in range(count):
            assert await served(again, i) == old_value(i)
    finally:
        await again.close()


def test_superblock_history_round_trips_and_defaults_to_nothing() -> None:
    sb = Superblock(REGION, SUPERBLOCK_SIZE + 8 * REGION, 8, os.urandom(16), 4096,
                    newest_seq=41, newest_index=5, floor_seq=17)
    assert decode_superblock(encode_superblock(sb)) == sb
    # a superblock from before the history record: the bytes it would use are zeros
    plain = Superblock(REGION, SUPERBLOCK_SIZE + 8 * REGION, 8, os.urandom(16), 4096)
    decoded = decode_superblock(encode_superblock(plain))
    assert (decoded.newest_seq, decoded.newest_index, decoded.floor_seq) == (0, 0, 0)


#: where a flipped bit damages a prefix without hiding whose record it is: flags, reserved,
#: region seq, body length and checksum (its magic left whole: then it is no record at all)
PREFIX_FIELDS = (4, 6, 8, 16, 24)


async def test_a_damaged_newest_record_never_brings_back_an_older_one(tmp_path: Path) -> None:
    """A flipped bit in the newest record of a key (a tombstone's prefix, an overwrite's
    payload) must not let a scan serve the older value that record superseded: the key is a
    miss, the damage counted."""
    tier, deleted, overwritten = await superseding_log(tmp_path, regions=8)
    image = crash_image(tmp_path)
    await tier.close()
    newest = {}
    for record in walk_records(image.read_bytes()):
        if record.key is not None:
            newest[record.key] = record  # the walk goes in index order; each key once here
    for n, i in enumerate(sorted(deleted)):
        record = newest[key(i)]
        assert record.flags == TOMBSTONE
        flip_byte(image, record.at + PREFIX_FIELDS[n % len(PREFIX_FIELDS)], 0x01)
    media = image.read_bytes()
    for i in overwritten:
        record = newest[key(i)]
        flip_byte(image, media.index(NEW, record.at, record.at + record.length) + 7)
    again = NvmeTier(nvme_config(tmp_path, regions=8, name=image.name))
    await again.open()
    try:
        assert again.stats()["recovered_from"] == "scan"
        await check_nothing_stale(again, deleted, overwritten, PER_REGION * 6)
        assert again.stats()["checksum_failures"] >= len(deleted)
    finally:
        await again.close()


async def test_a_damaged_header_of_an_older_region_brings_back_nothing_it_superseded(
        tmp_path: Path) -> None:
    """The header of a region that is not the newest destroyed (zeroed, or one bit flipped):
    the scan cannot order its records, and skipped the region, so the values its overwrites
    replaced and the keys its tombstones deleted came back. Each key its records name is
    now a miss where its record found is older, and later scans agree until the region is
    reclaimed."""
    for damage in ("zero", "flip"):
        directory = tmp_path / damage
        directory.mkdir()
        # regions of further keys after the superseding one: it is not the newest
        tier, deleted, overwritten = await superseding_log(directory, regions=10, filled=4,
                                                           after=2)
        image = crash_image(directory)
        await tier.close()
        records = walk_records(image.read_bytes())
        superseding = {record.region for record in records if record.flags == TOMBSTONE}
        assert len(superseding) == 1
        index = superseding.pop()
        # the keys put after the superseding ones whose records lie in later regions
        later = [i for i in range(PER_REGION * 4, PER_REGION * 6)
                 if any(r.key == key(i) and r.region != index for r in records)]
        assert len(later) > PER_REGION
        assert index != max(region_seqs(image).items(), key=lambda item: item[1])[0]
        if damage == "zero":
            destroy_header(image, index)
        else:
            flip_byte(image, SUPERBLOCK_SIZE + index * REGION + 20, 0x04)
        for _reopen in range(2):  # the second: a scan of what the first left, the region kept
            again = NvmeTier(nvme_config(directory, regions=10, name=image.name))
            await again.open()
            try:
                assert again.stats()["recovered_from"] == "scan"
                await check_nothing_stale(again, deleted, overwritten, PER_REGION * 6)
                assert again.stats()["regions_unidentified"] == 1
                for i in later:  # newer than the damage
                    assert await served(again, i) == old_value(i)
            finally:
                snapshot = directory / "snapshot.log"
                shutil.copyfile(image, snapshot)  # as a crash leaves it: no checkpoint
                await again.close()
                shutil.copyfile(snapshot, image)
