"""L2: the pmem tier, a libpmemobj pool (real persistent memory, or a file that emulates it)."""

from tierkv.tiers.pmem.tier import PmemTier, probe

__all__ = ["PmemTier", "probe"]
