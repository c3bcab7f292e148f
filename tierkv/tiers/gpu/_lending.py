"""Tensors that lend slot memory out and keep it reserved for as long as any of them lives.

A pin hands the caller a tensor over the slots of one object. Releasing the pin must not let the
slots be reused while the caller (or anything it made from that tensor: a reshape, a slice)
still holds a view of them, or the view would read, and write, whatever object takes the slots
next — another tenant's KV block. So the view is not a slice of the pool tensor (whose storage
every slot shares) but a tensor over its own *owner* object: torch keeps the object that a
tensor's memory came from alive for as long as any tensor uses that memory (`torch.from_numpy`
holds the array; `torch.as_tensor` over ``__cuda_array_interface__`` holds the producer), so a
`weakref.finalize` on the owner says exactly when the last view is gone. The engine's own copies
out of host slots take a memoryview over the same owner instead (`lend_host`): no tensor made.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class _DeviceBytes:
    """A range of `storage` described by ``__cuda_array_interface__`` (owner of a view). It
    holds `storage`: the interface is a bare pointer, and a view that outlives the tier must
    not read memory the allocator has handed to someone else."""

    def __init__(self, storage: torch.Tensor, offset: int, nbytes: int) -> None:
        self.storage = storage
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (storage.data_ptr() + offset, False),
            "version": 2,
        }


def lend(host: memoryview | None, storage: torch.Tensor, offset: int, nbytes: int,
         returned: Callable[[], None]) -> torch.Tensor:
    """A flat ``uint8`` tensor over ``[offset, offset + nbytes)`` of the pool: of `host` (the
    pool's memory on the CPU) or, on a CUDA device, of `storage`. `returned` is called once the
    last tensor using that memory is gone (on whatever thread drops it)."""
    if host is not None:
        return torch.from_numpy(_host_owner(host, offset, nbytes, returned))
    owner = _DeviceBytes(storage, offset, nbytes)
    view = torch.as_tensor(owner, device=storage.device)
    weakref.finalize(owner, returned)
    return view


def lend_host(host: memoryview, offset: int, nbytes: int,
              returned: Callable[[], None]) -> memoryview:
    """`lend` of host memory without the tensor: a byte view (a memoryview holds the array it
    views, and so does every view sliced from it), for the engine's own copies."""
    return _host_owner(host, offset, nbytes, returned).data


def _host_owner(host: memoryview, offset: int, nbytes: int,
                returned: Callable[[], None]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    owner = np.frombuffer(host, dtype=np.uint8, count=nbytes, offset=offset)
    weakref.finalize(owner, returned)
    return owner
