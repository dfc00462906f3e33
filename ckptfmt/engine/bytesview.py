"""Byte views of tensor storages and arrays, without copies.

The one place that knows the idiom: an empty uint8 tensor ``set_`` to a storage
covers all of its bytes, whatever the dtype it was made for (``set_`` to a dense
tensor's byte range covers its elements: `elements_as_uint8`), and a numpy array
made from its address exposes them as a memoryview of format "B".  The array is
built from the address, not with ``Tensor.numpy()``: that marks the storage as
not resizable for good, which would change the caller's tensors (FSDP, for one,
frees storages by resizing them to zero) and the tensors a load returns.
"""

from __future__ import annotations

import numpy as np
import torch


def storage_as_uint8(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of `storage`'s bytes, on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # type: ignore[call-overload]


def elements_as_uint8(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the bytes of a dense tensor's elements, on its device (no copy).

    It covers [data_ptr, data_ptr + nbytes) of the storage, whatever the order of the
    strides; the caller knows the tensor is dense (no gaps, no overlap)."""
    size = t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * size, (t.numel() * size,), (1,)
    )


class _Memory:
    """An address and length that numpy can wrap; holds the tensor that owns the memory."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, t: torch.Tensor) -> None:
        self.owner = t
        self.__array_interface__ = {
            "data": (t.data_ptr(), False),
            "shape": (t.numel(),),
            "typestr": "|u1",
            "version": 3,
        }


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor; it keeps the tensor alive."""
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 1:
        raise ValueError(f"byte view of a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}")
    if t.numel() == 0:
        return memoryview(bytearray())
    return np.asarray(_Memory(t)).data.cast("B")


def contiguous_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's elements, of any dtype (no copy)."""
    if not t.is_contiguous():
        raise ValueError(f"byte view of a non-contiguous tensor of shape {tuple(t.shape)}")
    return tensor_bytes(elements_as_uint8(t))


def storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """A byte view of a CPU storage's memory (no copy)."""
    return tensor_bytes(storage_as_uint8(storage))


def array_bytes(a: np.ndarray) -> memoryview:
    """A byte view of a numpy array's memory, in storage order (no copy when contiguous)."""
    return a.reshape(-1, order="A").view(np.uint8).data.cast("B")
