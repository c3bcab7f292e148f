"""Two persistent tiers on one file or device are refused at load: each would overwrite what
the other wrote, or format it away at open. However the second names the first's media, the
`ConfigError` names both key paths."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tierkv import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def document(first: Path, second: Path, first_kind: str = "pmem") -> dict[str, Any]:
    """A gpu tier, then a `first_kind` tier on `first` and an nvme tier on `second`."""
    nvme = {"kind": "nvme", "capacity": "5MiB", "region_size": "1MiB", "direct": False,
            "backend": "threads"}
    media = {"kind": "pmem", "capacity": "8MiB"} if first_kind == "pmem" else dict(nvme)
    return {"tiers": [{"name": "l1", "kind": "gpu", "device": "cpu", "capacity": "4MiB",
                       "slot_size": "64KiB"},
                      {**media, "name": "l2", "path": str(first)},
                      {**nvme, "name": "l3", "path": str(second)}]}


def refused(doc: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    message = str(info.value)
    assert message.startswith("tiers[2].path: ") and "tiers[1].path" in message, message


def _as_written(media: Path) -> Path:
    return media


def _another_spelling(media: Path) -> Path:
    (media.parent / "sub").mkdir()
    return media.parent / "sub" / ".." / media.name


def _relative(media: Path) -> Path:
    os.chdir(media.parent)  # undone by the test's monkeypatch.chdir
    return Path(media.name)


def _symlink(media: Path) -> Path:
    media.write_bytes(b"")
    (media.parent / "link").symlink_to(media)
    return media.parent / "link"


def _symlink_to_a_file_not_made_yet(media: Path) -> Path:
    (media.parent / "link").symlink_to(media)
    return media.parent / "link"


def _hard_link(media: Path) -> Path:
    media.write_bytes(b"")
    (media.parent / "link").hardlink_to(media)
    return media.parent / "link"


def _symlinked_directory(media: Path) -> Path:
    (media.parent.parent / "alias").symlink_to(media.parent)
    return media.parent.parent / "alias" / media.name


SPELLINGS: dict[str, Callable[[Path], Path]] = {
    "as-written": _as_written,
    "another-spelling": _another_spelling,
    "relative": _relative,
    "symlink": _symlink,
    "symlink-to-a-file-not-made-yet": _symlink_to_a_file_not_made_yet,
    "hard-link": _hard_link,
    "symlinked-directory": _symlinked_directory,
}


@pytest.mark.parametrize("first_kind", ["pmem", "nvme"])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_a_second_tier_on_the_first_ones_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str, first_kind: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "media").mkdir()
    media = tmp_path / "media" / "l2"
    refused(document(media, SPELLINGS[spelling](media), first_kind))


def test_tiers_on_files_beside_each_other_are_accepted(tmp_path: Path) -> None:
    (tmp_path / "l2").write_bytes(b"")
    (tmp_path / "alias").symlink_to(tmp_path)
    config = load_config(document(tmp_path / "l2", tmp_path / "alias" / "l3", "nvme"))
    assert [tier.name for tier in config.tiers] == ["l1", "l2", "l3"]


def _block_device() -> os.stat_result | None:
    for node in sorted(Path("/dev").iterdir()):
        try:
            found = node.stat()
        except OSError:
            continue
        if stat.S_ISBLK(found.st_mode):
            return found
    return None


def test_two_device_nodes_of_one_block_device_are_refused(tmp_path: Path) -> None:
    # a second node made for a device (a container's own /dev) is another inode: both nvme
    # tiers wrote one device's sectors
    device = _block_device()
    if device is None:
        pytest.skip("this machine shows no block device in /dev")
    nodes = [tmp_path / "disk-a", tmp_path / "disk-b"]
    try:
        for node in nodes:
            os.mknod(node, stat.S_IFBLK | 0o600, device.st_rdev)
    except PermissionError:
        pytest.skip("device nodes cannot be made here (needs CAP_MKNOD)")
    refused(document(nodes[0], nodes[1], "nvme"))


CHILD = """
import sys
from pathlib import Path
from tests.test_config_media import document
from tierkv import ConfigError, load_config
try:
    load_config(document(Path(sys.argv[1]), Path(sys.argv[2])))
except ConfigError as exc:
    print(exc)
else:
    print("accepted")
"""


def test_a_file_not_made_yet_under_a_bind_mount_of_its_directory_is_refused(
    tmp_path: Path
) -> None:
    # neither file exists yet, and the two paths resolve apart: both opens made one file
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    (tmp_path / "real").mkdir()
    (tmp_path / "bound").mkdir()
    # in a mount namespace of its own, so that the mount goes with the child however it ends
    script = 'mount --bind "$1" "$2" || exit 77; shift 2; exec "$@"'
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         str(tmp_path / "real"), str(tmp_path / "bound"), sys.executable, "-c", CHILD,
         str(tmp_path / "real" / "l2"), str(tmp_path / "bound" / "l2")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode == 77 or done.stderr.startswith("unshare:"):
        pytest.skip(f"no mount namespace with a bind mount here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert message.startswith("tiers[2].path: ") and "tiers[1].path" in message, done
