"""The dtypes ckptfmt stores, by their stable names in the format.

Names are the format's, not torch's repr: a file written by one torch version
must load with another, so the table maps names to torch attributes and skips
those a given torch lacks.

The names, item sizes and kinds need neither torch nor numpy: the index and the
object tree are checked with them alone (verify, inspect and sign build no tensor
and import neither).  The torch dtypes (TORCH_DTYPES, TORCH_NAMES) are built when
first asked for, and numpy is imported by the functions that return its dtypes.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

# name in the file -> (torch attribute, itemsize, shuffle width)
# The shuffle width is the size of the unit whose bytes are grouped by the
# byte-shuffle filter: the component size for complex types, 1 for byte-sized
# types (those are never shuffled).
_TORCH_TABLE: dict[str, tuple[str, int, int]] = {
    "float64": ("float64", 8, 8),
    "float32": ("float32", 4, 4),
    "float16": ("float16", 2, 2),
    "bfloat16": ("bfloat16", 2, 2),
    "float8_e4m3fn": ("float8_e4m3fn", 1, 1),
    "float8_e4m3fnuz": ("float8_e4m3fnuz", 1, 1),
    "float8_e5m2": ("float8_e5m2", 1, 1),
    "float8_e5m2fnuz": ("float8_e5m2fnuz", 1, 1),
    "float8_e8m0fnu": ("float8_e8m0fnu", 1, 1),
    "float4_e2m1fn_x2": ("float4_e2m1fn_x2", 1, 1),
    "complex32": ("complex32", 4, 2),
    "complex64": ("complex64", 8, 4),
    "complex128": ("complex128", 16, 8),
    "bool": ("bool", 1, 1),
    "int8": ("int8", 1, 1),
    "int16": ("int16", 2, 2),
    "int32": ("int32", 4, 4),
    "int64": ("int64", 8, 8),
    "uint8": ("uint8", 1, 1),
    "uint16": ("uint16", 2, 2),
    "uint32": ("uint32", 4, 4),
    "uint64": ("uint64", 8, 8),
}

#: name -> itemsize of every tensor dtype of the format (one lookup checks a name and sizes it)
TENSOR_ITEMSIZES: dict[str, int] = {key: size for key, (_, size, _) in _TORCH_TABLE.items()}

if TYPE_CHECKING:
    #: name -> torch dtype, for the names the installed torch has (built on first use: __getattr__)
    TORCH_DTYPES: dict[str, torch.dtype]
    #: torch dtype -> name
    TORCH_NAMES: dict[torch.dtype, str]


def __getattr__(name: str) -> Any:
    """TORCH_DTYPES and TORCH_NAMES, built (and torch imported) the first time one is asked for."""
    if name not in ("TORCH_DTYPES", "TORCH_NAMES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    by_name: dict[str, torch.dtype] = {}
    for key, (attr, _, _) in _TORCH_TABLE.items():
        dt = getattr(torch, attr, None)
        if isinstance(dt, torch.dtype):
            by_name[key] = dt
    globals().update(TORCH_DTYPES=by_name, TORCH_NAMES={dt: key for key, dt in by_name.items()})
    return globals()[name]


def is_tensor_dtype(name: str) -> bool:
    """Whether `name` is one of the format's tensor dtypes (spec section 6)."""
    return name in _TORCH_TABLE


def is_floating_point(name: str) -> bool:
    """Whether a tensor dtype is a floating-point one (as torch's dtype.is_floating_point)."""
    return name.startswith(("float", "bfloat"))


def is_complex(name: str) -> bool:
    """Whether a tensor dtype is a complex one (as torch's dtype.is_complex)."""
    return name.startswith("complex")


def torch_itemsize(name: str) -> int:
    return _TORCH_TABLE[name][1]


def torch_shuffle_width(name: str) -> int:
    return _TORCH_TABLE[name][2]


# numpy: only fixed-size numeric and bool dtypes; the name is numpy's dtype.str
# ("<f4", "|b1", ">i8"), so byte order travels with the data.  Only the canonical
# spelling is a name (spec section 6): "|" exactly for one-byte types, "<" or ">" for
# the others, no leading zero in the size.  numpy reads "|i4" as the machine's own byte
# order, so a file naming it would load differently on a big-endian machine.
_NUMPY_SIZES = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "c": (8, 16)}
_NUMPY_RE = re.compile(r"[<>|]([biufc])(\d{1,2})")


def numpy_name(dtype: np.dtype) -> str | None:
    """The format's name for a numpy dtype, or None when it cannot be stored."""
    if dtype.fields is not None or dtype.subdtype is not None:
        return None
    m = _NUMPY_RE.fullmatch(dtype.str)
    if m is None or int(m.group(2)) not in _NUMPY_SIZES[m.group(1)]:
        return None
    return dtype.str


def numpy_itemsize(name: str) -> int | None:
    """The item size of a numpy dtype name read from a file, or None when the name is not
    valid: of the grammar, a size numpy has for its kind, and spelled as numpy's dtype.str
    spells it ("|" exactly for one-byte types, no leading zero).  Needs no numpy."""
    m = _NUMPY_RE.fullmatch(name)
    if m is None or m.group(2).startswith("0"):
        return None
    size = int(m.group(2))
    if size not in _NUMPY_SIZES[m.group(1)] or (name[0] == "|") != (size == 1):
        return None
    return size


def numpy_dtype(name: str) -> np.dtype | None:
    """The numpy dtype of a name read from a file, or None when it is not valid."""
    import numpy as np

    if numpy_itemsize(name) is None:
        return None
    dt = np.dtype(name)
    return dt if dt.str == name else None


def numpy_shuffle_width(dtype: np.dtype) -> int:
    return dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize


def numpy_stored_width(name: str) -> int:
    """numpy_shuffle_width of a valid numpy dtype name, without numpy."""
    size = numpy_itemsize(name) or 1
    return size // 2 if name[1] == "c" else size
