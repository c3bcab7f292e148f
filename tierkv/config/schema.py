"""The configuration's schema: immutable records of the validated TOML, and its enumerations.

Nothing here reads a file or checks the machine (`tierkv.config.loading` does); tiers and the
engine import these records, and this module imports nothing of theirs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE


class TierKind(enum.Enum):
    GPU = "gpu"
    PMEM = "pmem"
    NVME = "nvme"
    REDIS = "redis"


MIN_PMEM_POOL = 8 << 20  # PMEMOBJ_MIN_POOL in PMDK 1.12
#: the nvme log's superblock, which precedes its regions
NVME_SUPERBLOCK = SUPERBLOCK_SIZE


#: default free-space watermarks of the tiers the engine evicts from (fractions of capacity)
DEFAULT_FREE_LOW = 0.05
DEFAULT_FREE_HIGH = 0.10
#: default pace of the moves no write waits for: 1 GiB/s (docs/benchmarks.md: L1 get p99
#: while they run)
DEFAULT_BACKGROUND_BANDWIDTH = 1 << 30
#: the highest free-space watermark a tier accepts
MAX_WATERMARK = 0.9


class WritePolicy(enum.Enum):
    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"


class HostCopies(enum.Enum):
    """Where the gpu tier on the CPU copies large objects (`tiers/gpu/_host_copies.py`)."""

    AUTO = "auto"  # on the native workers while the loop has other work meanwhile
    WORKERS = "workers"  # always on the native workers (where the library is built)
    INLINE = "inline"  # always on the event loop


class NvmeBackend(enum.Enum):
    AUTO = "auto"
    IO_URING = "io_uring"
    THREADS = "threads"


class RegionEviction(enum.Enum):
    FIFO = "fifo"
    LRU = "lru"


class EvictionPolicy(enum.Enum):
    #: plain least-recently-used order per tier, every demotion admitted (the baseline)
    LRU = "lru"
    #: LRU++ scores (decayed count x recency decay), prefix-aware victims, adaptive admission
    LRUPP = "lru++"


class Admission(enum.Enum):
    #: a frequency filter in front of each persistent tier whose strictness follows hit ratio
    ADAPTIVE = "adaptive"
    #: every object demoted into a tier is admitted
    PASS_ALL = "pass_all"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    #: seconds a put (or a move) waits for space in a full tier before `TierFullError`
    space_timeout: float = 10.0
    #: concurrent write-through puts share one flush of their persistent tier
    group_commit: bool = True
    #: seconds a demotion out of a persistent tier waits for others to share its target's flush
    #: before it drops its source copy; none while a put waits for that room
    demotion_linger: float = 0.025


@dataclass(frozen=True, slots=True)
class GpuTierConfig:
    name: str
    capacity: int
    device: str = "auto"
    slot_size: int = 2 << 20
    ttl: float = 5.0
    #: free-space watermarks, fractions of capacity: below `free_low` the background evictor
    #: moves objects out until `free_high` is free again
    free_low: float = DEFAULT_FREE_LOW
    free_high: float = DEFAULT_FREE_HIGH
    #: the tier's access profile for `select_tier`: seconds per small read and bytes per second;
    #: None: measured by a short probe when the engine opens
    latency: float | None = None
    bandwidth: int | None = None
    #: on the ``cpu`` device: where copies of 512 KiB and more run
    host_copies: HostCopies = HostCopies.AUTO
    kind: TierKind = field(default=TierKind.GPU, init=False)


@dataclass(frozen=True, slots=True)
class PmemTierConfig:
    name: str
    capacity: int
    path: Path
    format: bool = False
    #: copies in flight at once on the tier's copy threads
    queue_depth: int = 16
    free_low: float = DEFAULT_FREE_LOW
    free_high: float = DEFAULT_FREE_HIGH
    #: seconds an object may stay unread here before it moves down (None: no limit)
    ttl: float | None = None
    #: the tier's access profile for `select_tier`: seconds per small read and bytes per second;
    #: None: measured by a short probe when the engine opens
    latency: float | None = None
    bandwidth: int | None = None
    kind: TierKind = field(default=TierKind.PMEM, init=False)


@dataclass(frozen=True, slots=True)
class NvmeTierConfig:
    name: str
    capacity: int
    path: Path
    region_size: int = 64 << 20
    queue_depth: int = 32
    direct: bool = True
    backend: NvmeBackend = NvmeBackend.AUTO
    eviction: RegionEviction = RegionEviction.FIFO
    reinsert_hits: int = 2
    format: bool = False
    #: io_uring submission-queue polling: a kernel thread takes submissions without a syscall and
    #: sleeps after this many idle seconds; None: off (each submission is a syscall)
    sq_poll: float | None = None
    #: seconds an object may stay unread here before it leaves (None: no limit)
    ttl: float | None = None
    #: the tier's access profile for `select_tier`: seconds per small read and bytes per second;
    #: None: measured by a short probe when the engine opens
    latency: float | None = None
    bandwidth: int | None = None
    kind: TierKind = field(default=TierKind.NVME, init=False)


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """The shared tier on a Redis server (`url`) or a Redis Cluster (`cluster`); exactly one
    of the two. `url` may carry a user and password; it is kept out of reprs, logs and
    `tierkv info` (`display_url` shows it without them)."""

    name: str
    #: bytes this engine may place on the server (accounting is per engine)
    capacity: int
    url: str | None = field(default=None, repr=False)
    cluster: tuple[str, ...] = ()
    #: the environment variable holding the password (read when the tier opens)
    password_env: str | None = None
    key_prefix: str = "tierkv:"
    #: seconds the server keeps an object after its put (server-side expiry); None: no limit
    ttl: float | None = None
    pool_size: int = 16
    #: seconds any one call to the server may take before it counts as failed
    timeout: float = 1.0
    #: keys one pipelined round trip of `get_many` asks for at most
    batch: int = 256
    #: seconds of invalidations the shared log keeps for engines that were away
    retention: float = 86400.0
    latency: float | None = None
    bandwidth: int | None = None
    kind: TierKind = field(default=TierKind.REDIS, init=False)

    @property
    def display_url(self) -> str:
        """Where the tier connects, without credentials."""
        if self.url is None:
            return "cluster " + ",".join(self.cluster)
        return redact_url(self.url)


#: query parameters of a redis URL that carry secrets (redis-py reads them as credentials)
SECRET_URL_PARAMETERS = frozenset({"password", "ssl_password", "username"})


def redact_url(url: str) -> str:
    """`url` with any user and password removed, in its authority or its query."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, question, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    host = authority.rpartition("@")[2]
    if question:
        kept = [part for part in query.split("&")
                if part.partition("=")[0].lower() not in SECRET_URL_PARAMETERS]
        query = "&".join(kept)
        question = "?" if kept else ""
    return f"{scheme}://{host}{slash}{path}{question}{query}"


TierConfig = GpuTierConfig | PmemTierConfig | NvmeTierConfig | RedisTierConfig


def idle_ttl(tier: TierConfig) -> float | None:
    """Seconds an unread object may stay in `tier` before the engine moves it on (a redis
    tier's `ttl` is the server's expiry instead, which the engine does not run)."""
    return None if isinstance(tier, RedisTierConfig) else tier.ttl
#: bounds of `NvmeTierConfig.sq_poll` (the kernel takes whole milliseconds)
SQ_POLL_MIN = 0.001
SQ_POLL_MAX = 10.0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: EvictionPolicy = EvictionPolicy.LRUPP
    #: bytes per second all moves between tiers together may copy; None: unlimited
    migration_bandwidth: int | None = None
    #: bytes per second the moves no write waits for (expiry, promotion on hit) may copy, so
    #: that they never crowd out foreground calls; None: unlimited
    background_bandwidth: int | None = DEFAULT_BACKGROUND_BANDWIDTH
    #: background moves in flight at once
    migration_concurrency: int = 8
    #: victims an evictor takes from the policy at a time
    eviction_batch: int = 16
    #: a hit served from a lower tier copies the object up into the first tier (background)
    promote_on_hit: bool = True
    #: LRU++: an access decays the earlier access count by `alpha` before adding one
    alpha: float = 0.95
    #: LRU++: the score decays as exp(-beta * idle seconds)
    beta: float = 0.005
    #: who may enter the persistent tiers when something is demoted (`lru++` only)
    admission: Admission = Admission.PASS_ALL
    #: blocks after a read one of a known chain, warmed into the first tier in the background
    prefetch_depth: int = 4
    #: a promotion moves the object up (the lower copy goes), so the tiers' capacities add up;
    #: false keeps the lower copy (inclusive). Write-through engines always keep it.
    exclusive: bool = False


@dataclass(frozen=True, slots=True)
class HealthConfig:
    failure_rate: float = 0.6
    window: float = 60.0
    slow_operation: float = 0.8
    cooldown: float = 300.0
    close_after: int = 3
    entropy_alert_bits: float = 1.2


@dataclass(frozen=True, slots=True)
class Config:
    tiers: tuple[TierConfig, ...]
    engine: EngineConfig = EngineConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    health: HealthConfig = HealthConfig()


