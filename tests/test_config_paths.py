"""Where the paths of a config are: a relative path in a config file is beside that file,
wherever the process was started; in a mapping or text given without a file it is relative
to the current directory."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from tierkv import ConfigError, load_config, load_config_text
from tierkv.config import NvmeTierConfig, PmemTierConfig, RedisTierConfig

PERSISTENT = """
[[tiers]]
name = "l2"
kind = "pmem"
capacity = "8MiB"
path = "{pmem}"

[[tiers]]
name = "l3"
kind = "nvme"
capacity = "5MiB"
region_size = "1MiB"
direct = false
backend = "threads"
path = "{nvme}"
"""


def _paths(source: str | Path) -> list[Path]:
    config = load_config(source)
    return [tier.path for tier in config.tiers
            if isinstance(tier, PmemTierConfig | NvmeTierConfig)]


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory: another one than the config file's."""
    directory = tmp_path / "elsewhere"
    directory.mkdir()
    monkeypatch.chdir(directory)
    return directory


def test_relative_paths_in_a_config_file_are_beside_the_file(
    tmp_path: Path, elsewhere: Path
) -> None:
    # they were taken in the current directory: a service started elsewhere opened (or, with
    # format = true, formatted) another pool and log than the one its config names
    etc = tmp_path / "etc"
    (etc / "logs").mkdir(parents=True)
    config = etc / "tierkv.toml"
    config.write_text(PERSISTENT.format(pmem="pool", nvme="logs/../logs/tierkv.log"))
    assert _paths(config) == [etc / "pool", etc / "logs" / ".." / "logs" / "tierkv.log"]
    assert list(elsewhere.iterdir()) == []


def test_a_config_file_named_relative_gives_absolute_paths(
    tmp_path: Path, elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the config's paths do not move with a chdir made after it was loaded
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "tierkv.toml").write_text(PERSISTENT.format(pmem="l2.pool",
                                                                     nvme="l3.log"))
    monkeypatch.chdir(tmp_path)
    paths = _paths("etc/tierkv.toml")
    assert paths == [tmp_path / "etc" / "l2.pool", tmp_path / "etc" / "l3.log"]
    assert all(path.is_absolute() for path in paths)


def test_a_config_file_through_a_symlink_is_read_where_the_link_is(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "tierkv.toml").write_text(PERSISTENT.format(pmem="l2.pool",
                                                                      nvme="l3.log"))
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "tierkv.toml").symlink_to(tmp_path / "real" / "tierkv.toml")
    assert _paths(tmp_path / "etc" / "tierkv.toml") == [tmp_path / "etc" / "l2.pool",
                                                        tmp_path / "etc" / "l3.log"]


def test_absolute_and_home_paths_in_a_config_file_stay_as_written(
    tmp_path: Path, elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "tierkv.toml").write_text(PERSISTENT.format(pmem="~/l2.pool",
                                                       nvme=tmp_path / "l3.log"))
    assert _paths(etc / "tierkv.toml") == [home / "l2.pool", tmp_path / "l3.log"]


def test_a_mapping_or_text_keeps_relative_paths_in_the_current_directory(
    elsewhere: Path
) -> None:
    text = PERSISTENT.format(pmem="l2.pool", nvme="l3.log")
    assert _paths_of_text(text) == [Path("l2.pool"), Path("l3.log")]
    (elsewhere / "sub").mkdir()
    text = PERSISTENT.format(pmem="sub/l2.pool", nvme="sub/l3.log")
    assert _paths_of_text(text) == [Path("sub/l2.pool"), Path("sub/l3.log")]


def _paths_of_text(text: str) -> list[Path]:
    config = load_config_text(text)
    return [tier.path for tier in config.tiers
            if isinstance(tier, PmemTierConfig | NvmeTierConfig)]


REDIS = """
[[tiers]]
name = "l1"
kind = "gpu"
device = "cpu"
capacity = "4MiB"
slot_size = "64KiB"

[[tiers]]
name = "shared"
kind = "redis"
capacity = "64MiB"
url = "{url}"
"""


def _redis_url(source: str | Path, text: bool = False) -> str:
    config = load_config_text(str(source)) if text else load_config(source)
    tier = config.tiers[1]
    assert isinstance(tier, RedisTierConfig) and tier.url is not None
    return tier.url


def test_relative_tls_files_of_a_redis_url_in_a_config_file_are_beside_the_file(
    tmp_path: Path, elsewhere: Path
) -> None:
    # redis-py hands them to the ssl module, which opened them in the current directory
    pytest.importorskip("redis")
    etc = tmp_path / "a b+c%41"  # characters a query quotes, read back as they are
    etc.mkdir()
    url = ("rediss://:pw%40x@cache.internal:6380/0?ssl_ca_certs=tls/ca.pem"
           f"&ssl_certfile={tmp_path}/client.pem&ssl_keyfile=client%20key.pem"
           "&ssl_cert_reqs=required")
    (etc / "tierkv.toml").write_text(REDIS.format(url=url))
    loaded = _redis_url(etc / "tierkv.toml")
    query = parse_qs(urlsplit(loaded).query)
    assert query["ssl_ca_certs"] == [str(etc / "tls" / "ca.pem")]
    assert query["ssl_certfile"] == [f"{tmp_path}/client.pem"]
    assert query["ssl_keyfile"] == [str(etc / "client key.pem")]
    assert query["ssl_cert_reqs"] == ["required"]
    assert loaded.startswith("rediss://:pw%40x@cache.internal:6380/0?")
    # without a file: as written, relative to the current directory
    assert _redis_url(REDIS.format(url=url), text=True) == url


@pytest.mark.parametrize("source", [None, 5, b"devices.toml"])
def test_a_config_of_another_type_is_named(source: object) -> None:
    with pytest.raises(TypeError, match=f"not {type(source).__name__}"):
        load_config(source)  # type: ignore[arg-type]


@pytest.mark.parametrize("tier", ["pmem", "nvme"])
def test_a_path_ending_in_a_slash_is_refused(tmp_path: Path, tier: str) -> None:
    """"log/" names a directory; it made or used a file named "log" (Path drops the slash)."""
    names = {"pmem": "l2.pool", "nvme": "l3.log"}
    names[tier] = "new/"
    config = tmp_path / "tierkv.toml"
    config.write_text(PERSISTENT.format(**names))
    index = 0 if tier == "pmem" else 1
    with pytest.raises(ConfigError, match=rf"tiers\[{index}\]\.path.*ends with '/'"):
        load_config(config)
    assert not (tmp_path / "new").exists()
