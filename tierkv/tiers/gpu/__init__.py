"""L1: the gpu tier, a preallocated torch slot pool on a CUDA device or the CPU."""

from tierkv.tiers.gpu.tier import GpuTier, describe_device, resolve_device

__all__ = ["GpuTier", "describe_device", "resolve_device"]
