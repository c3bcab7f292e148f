"""L3: the nvme tier, a log of fixed regions on a file or block device (O_DIRECT, io_uring)."""

from tierkv.tiers.nvme.tier import NvmeTier, probe

__all__ = ["NvmeTier", "probe"]
