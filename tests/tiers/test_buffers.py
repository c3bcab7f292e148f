"""`BufferRecycler`: get results whose memory comes back once nothing refers to them; and
`address_of`, the address a copy in C is given."""

from __future__ import annotations

import ctypes
import gc
import tracemalloc

import numpy as np
import pytest

from tierkv.tiers._buffers import MIN_RECYCLED, BufferRecycler, address_of

SIZE = 256 << 10


def test_dropped_result_memory_is_reused() -> None:
    recycler = BufferRecycler(4 * SIZE)
    first = recycler.take(SIZE)
    address = first.ctypes.data
    del first
    second = recycler.take(SIZE)
    assert second.ctypes.data == address
    assert recycler.reused == 1


def test_memory_is_not_reused_while_a_derived_view_lives() -> None:
    recycler = BufferRecycler(4 * SIZE)
    result = recycler.take(SIZE)
    view = result.data  # what the tier hands out
    derived = np.frombuffer(view, dtype=np.float32)  # what a caller builds on it
    address = result.ctypes.data
    del result, view
    gc.collect()
    other = recycler.take(SIZE)
    assert other.ctypes.data != address
    other[:] = 0
    derived[:] = 1.0  # still its own memory: writing `other` did not touch it
    assert derived.sum() == SIZE // 4
    del derived
    assert recycler.take(SIZE).ctypes.data == address


def test_retention_is_bounded() -> None:
    recycler = BufferRecycler(2 * SIZE)
    results = [recycler.take(SIZE) for _ in range(4)]
    del results
    assert recycler.free_bytes == 2 * SIZE


def test_the_free_lists_do_not_grow_with_the_sizes_ever_seen() -> None:
    """A size whose last free buffer was taken, and whose buffer then came back to a full
    recycler, left an empty free list behind for good: one per distinct size of a long-running
    tier's results. Two phases of the same work on new sizes: the second must not grow."""
    filler = 3 * SIZE // 4
    recycler = BufferRecycler(SIZE)
    held = [recycler.take(filler)]

    def phase(sizes: range) -> int:
        for size in sizes:
            recycler.take(size)  # dropped at once: kept, the recycler had room
            result = recycler.take(size)  # that buffer again
            held.pop()  # the filler comes back first: no room left for `result`
            del result
            held.append(recycler.take(filler))
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        first = phase(range(MIN_RECYCLED, MIN_RECYCLED + 2000))
        second = phase(range(MIN_RECYCLED + 2000, MIN_RECYCLED + 4000))
    finally:
        tracemalloc.stop()
    assert second - first < 16 << 10  # an empty list per size: about 200 KiB


def test_small_results_are_plain_arrays() -> None:
    recycler = BufferRecycler(4 * SIZE)
    small = recycler.take(MIN_RECYCLED - 1)
    assert small.base is None and small.nbytes == MIN_RECYCLED - 1
    del small
    assert recycler.free_bytes == 0


def test_a_tensor_made_from_a_result_keeps_its_memory() -> None:
    """The engine decodes tensors with `torch.frombuffer`, which must hold the result alive."""
    import torch

    recycler = BufferRecycler(4 * SIZE)
    result = recycler.take(SIZE)
    address = result.ctypes.data
    tensor = torch.frombuffer(result.data, dtype=torch.uint8)
    del result
    gc.collect()
    assert recycler.take(SIZE).ctypes.data != address
    assert tensor.data_ptr() == address
    del tensor
    assert recycler.take(SIZE).ctypes.data == address


def test_address_of_is_where_the_bytes_are() -> None:
    """Read-only (a `bytes`' view) and writable buffers alike: the address reads the buffer's
    own bytes, an offset view's address is offset, an empty buffer's is 0, and a buffer that is
    not contiguous is refused rather than given an address a copy would misread."""
    data = bytes(range(256)) * 16
    view = memoryview(data)
    assert ctypes.string_at(address_of(view), len(data)) == data
    assert address_of(view[100:]) == address_of(view) + 100
    array = np.arange(4096, dtype=np.uint8)
    assert address_of(array) == array.ctypes.data
    assert ctypes.string_at(address_of(array[7:]), 4) == bytes([7, 8, 9, 10])
    assert address_of(memoryview(b"")) == 0
    assert address_of(np.empty(0, dtype=np.uint8)) == 0
    with pytest.raises(BufferError):
        address_of(array[::2])
    with pytest.raises(BufferError):
        address_of(view[::2])
