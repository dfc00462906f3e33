"""Arrays held as their stored bytes: the ndarray nodes of a value that must be read and
written without numpy (a DCP commit record's ``dcp`` member, spec section 13.5).

A `StoredArray` is an ndarray node as the format stores it (spec section 5): the dtype's
name, the shape, the order and the bytes of the elements.  `decode_plain` builds one for
each ndarray node of a commit record and `encode` writes one back as the same node, so a
record read and written again (``ckptfmt sign`` of a DCP directory) keeps its arrays byte
for byte; and two reads of one record compare equal, which numpy arrays inside a record
never did (their ``==`` is elementwise).
"""

from __future__ import annotations

import array
import itertools
import sys
from dataclasses import dataclass, field

from . import dtypes

INT64 = "<i8"


@dataclass(frozen=True)
class StoredArray:
    """An ndarray's dtype name (numpy's ``dtype.str``), shape, order ("C" or "F") and bytes."""

    dtype: str
    shape: tuple[int, ...]
    order: str
    data: bytes = field(repr=False)

    def __post_init__(self) -> None:
        itemsize = dtypes.numpy_itemsize(self.dtype)
        numel = 1
        for d in self.shape:
            numel *= d
        if itemsize is None or self.order not in ("C", "F") or numel * itemsize != len(self.data):
            raise ValueError(
                f"a {self.dtype!r} array of shape {list(self.shape)} in order {self.order!r} "
                f"cannot hold {len(self.data)} bytes"
            )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of_ints(cls, values: list[int], shape: tuple[int, ...] | None = None) -> StoredArray:
        """An int64 array of `values` in C order (a 1-D one when `shape` is None); OverflowError
        for a value outside int64."""
        data = array.array("q", values)
        if sys.byteorder == "big":
            data.byteswap()
        return cls(INT64, (len(values),) if shape is None else shape, "C", data.tobytes())

    def ints(self) -> list[int]:
        """The elements of an int64 array as Python ints, in C order (row by row)."""
        if self.dtype != INT64:
            raise ValueError(f"ints() of a {self.dtype!r} array")
        values = array.array("q")
        values.frombytes(self.data)
        if sys.byteorder == "big":
            values.byteswap()
        flat = values.tolist()
        if self.order == "C" or self.ndim < 2:
            return flat
        # Fortran order: the element at index (i0, i1, ...) lies at i0 + s0 * (i1 + s1 * ...)
        strides = [1] * self.ndim
        for d in range(1, self.ndim):
            strides[d] = strides[d - 1] * self.shape[d - 1]
        return [
            flat[sum(i * s for i, s in zip(index, strides))]
            for index in itertools.product(*(range(n) for n in self.shape))
        ]
