"""Byte views of tensor storages and arrays, without copies.

The one place that knows the idiom: an empty uint8 tensor ``set_`` to a storage
covers all of its bytes, whatever the dtype it was made for, and its numpy
array exposes them as a memoryview of format "B".
"""

from __future__ import annotations

import numpy as np
import torch


def storage_as_uint8(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of `storage`'s bytes, on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # type: ignore[call-overload]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor (a staging slab)."""
    return t.numpy().data.cast("B")


def storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """A byte view of a CPU storage's memory (no copy)."""
    return tensor_bytes(storage_as_uint8(storage))


def array_bytes(a: np.ndarray) -> memoryview:
    """A byte view of a numpy array's memory, in storage order (no copy when contiguous)."""
    return a.reshape(-1, order="A").view(np.uint8).data.cast("B")
