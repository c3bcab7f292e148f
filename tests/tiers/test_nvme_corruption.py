"""Bytes flipped on the media: the damaged entry is a counted miss, every other entry intact,
whether the index comes from a checkpoint (checked at `get`) or from a scan (checked at open)."""

from __future__ import annotations

import enum
import shutil
from pathlib import Path

import pytest

from tests.tiers._nvme_support import find_unique, flip_byte, key, meta_of, nvme_config, payload_for
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.tier import NvmeTier


class Where(enum.Enum):
    HEADER = "header"
    PAYLOAD = "payload"
    PREFIX = "prefix"


VICTIM = 7


async def _write(path_dir: Path, *, clean: bool) -> tuple[Path, dict[bytes, bytes]]:
    """Store 300 objects (several regions); returns the media (clean close or crash image)."""
    tier = NvmeTier(nvme_config(path_dir))
    await tier.open()
    datas = {key(i): payload_for(i, 3000 + i) for i in range(300)}
    for k, v in datas.items():
        await tier.put(k, meta_of(v), memoryview(v))
    if clean:
        await tier.close()
        return path_dir / "tier.log", datas
    await tier.flush()
    image = path_dir / "image.log"
    shutil.copyfile(path_dir / "tier.log", image)
    await tier.close()
    return image, datas


def _damage(media: Path, where: Where) -> None:
    # in an entry the key is msgpack bin data right after the header's 20-byte prefix and the
    # body's array marker, and is followed by the value kind (1); the checkpoint differs there
    name = key(VICTIM)
    key_at = find_unique(media, b"\xc4" + bytes([len(name)]) + name + b"\x01")
    entry_at = key_at - 1 - 20 - 32
    if where is Where.HEADER:
        flip_byte(media, key_at + 5)
    elif where is Where.PREFIX:
        flip_byte(media, entry_at + 10)
    else:
        flip_byte(media, find_unique(media, payload_for(VICTIM, 3000 + VICTIM)) + 1500)


@pytest.mark.parametrize("where", list(Where))
@pytest.mark.parametrize("clean", [True, False], ids=["checkpoint", "scan"])
async def test_flipped_byte_is_a_counted_miss(tmp_path: Path, where: Where, clean: bool) -> None:
    media, datas = await _write(tmp_path, clean=clean)
    _damage(media, where)
    tier = NvmeTier(nvme_config(tmp_path, name=media.name))
    recovered = await tier.open()
    try:
        assert tier.stats()["recovered_from"] == ("checkpoint" if clean else "scan")
        if not clean:
            assert key(VICTIM) not in {r.key for r in recovered}
            assert tier.stats()["checksum_failures"] == 1
        assert await tier.get(key(VICTIM)) is None
        assert tier.stats()["checksum_failures"] == 1
        assert not await tier.contains(key(VICTIM))
        for k, v in datas.items():
            if k != key(VICTIM):
                got = await tier.get(k)
                assert got is not None, k
                assert payload_bytes(got[1]) == v
        assert tier.stats()["checksum_failures"] == 1
    finally:
        await tier.close()
