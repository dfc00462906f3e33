"""Decoding: a checked `Tree` -> the objects it describes (the reader's last step).

validate.py has checked every node before anything here runs, so `decode` builds
without checking again: containers, scalars, dtypes, devices and sizes from their
nodes, tensors and arrays as views of the storages the caller loaded (`storage(sid)`),
sharing a storage wherever the saved state shared one.  `decode_key` gives one dict
key's value, for callers that match keys before building anything.

A tree of plain values (a commit record, a resume fingerprint) is built without torch
or numpy: each is imported by the first node that needs it.  `decode_raw` builds any
subtree without either: tensors and arrays become `RawArray`s whose elements are read as
bytes when asked for, and numpy scalars, dtypes, devices and sizes `RawValue`s, so that
checks made on decoded values (a manager's RNG states) run where neither is installed.
`decode_plain` is `decode_raw` with every array's bytes read at once into a `StoredArray`
(arrays.py): what a commit record holds, a value that compares equal to its copy and is
written back byte for byte.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..gcpause import pausing
from . import dtypes
from .frozen import Frozen
from .tree import Tree, float_value
from .validate import Check, key_value

if TYPE_CHECKING:
    import numpy as np
    import torch


def decode_key(tree: Tree, node: int, path: str) -> object:
    """The value of a validated dict key (keys are scalars and tuples of them, never tensors)."""
    return key_value(Check(path), tree.nodes, node)


@pausing
def decode(
    tree: Tree,
    top: int,
    storage: Callable[[int], torch.UntypedStorage],
    path: str,
    made: dict[int, torch.Tensor] | None = None,
) -> object:
    """Build the objects of the subtree at `top`; `storage(sid)` gives loaded storages.
    `made`: tensors the caller built already with their node's layout (a storage's `whole`), by
    node: their requires_grad and Parameter are applied here, as to any other."""
    # storages come loaded, so torch is imported wherever a tensor is built; a tree of plain
    # values is built without it
    torch = sys.modules.get("torch")
    with torch.no_grad() if torch is not None else contextlib.nullcontext():
        return _Builder(tree.nodes, storage, path, made).build(top)


class _Builder:
    """Builds decoded objects node by node.  A method, not a nested function that calls itself:
    such a closure is a reference cycle (function -> cell -> function) holding the whole tree
    and every storage, which only a collection of the whole heap would free."""

    def __init__(
        self,
        nodes: list[Any],
        storage: Callable[[int], torch.UntypedStorage],
        path: str,
        made: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.nodes = nodes
        self.storage = storage
        self.path = path
        self.made = made or {}

    def build(self, i: int) -> object:
        node = self.nodes[i]
        kind = node[0]
        # the commonest kinds first (the order only saves comparisons)
        if kind == "tensor":
            t = self.made.pop(i, None)
            if t is not None:
                return _finish_tensor(t, node[1])
            return _build_tensor(node[1], self.storage)
        if kind == "str":
            return node[1]
        if kind == "none":
            return None
        if kind == "bool":
            return node[1]
        if kind == "int":
            return int(node[1], 16)
        if kind == "float":
            return float_value(node[1])
        if kind == "complex":
            return complex(float_value(node[1]), float_value(node[2]))
        if kind == "bytes":
            return base64.b64decode(node[1])
        if kind == "list":
            return [self.build(j) for j in node[1]]
        if kind == "tuple":
            return tuple(self.build(j) for j in node[1])
        if kind in ("dict", "odict"):
            d: dict[Any, Any] = {} if kind == "dict" else collections.OrderedDict()
            nodes = self.nodes
            for k, v in node[1]:  # keys validated: hashable and distinct
                key = nodes[k]
                d[key[1] if key[0] == "str" else self.build(k)] = self.build(v)
            if kind == "odict" and node[2] is not None:
                d._metadata = self.build(node[2])  # type: ignore[attr-defined]
            return d
        if kind == "dtype":
            return dtypes.TORCH_DTYPES[node[1]]
        if kind == "device":
            return self.device(i, node[1])
        if kind == "size":
            import torch

            return torch.Size(int(d, 16) for d in node[1])
        if kind == "ndarray":
            return _build_ndarray(node[1], self.storage)
        if kind == "npscalar":
            import numpy as np

            return np.frombuffer(base64.b64decode(node[2]), dtype=np.dtype(node[1]))[0]
        # validated before; kept for safety
        raise Check(self.path).fail(f"node {i} has unknown kind {kind!r}")

    def device(self, i: int, text: str) -> torch.device:
        """The torch device of a device node: validation checked its grammar (locations.py);
        whether torch knows it, and reads it back as the same string, is asked here, where
        torch is (a backend's name exists only where its extension is loaded)."""
        import torch

        try:
            device = torch.device(text)
        except RuntimeError as e:
            raise Check(self.path).fail(f"node {i} names device {text!r}, unknown to torch") from e
        if str(device) != text:
            raise Check(self.path).fail(
                f"node {i} names device {text!r}, which torch reads as {str(device)!r}"
            )
        return device


class RawArray(Frozen):
    """A tensor or array node as `decode_raw` builds it: its validated fields (the meta of
    spec section 5) and the elements' bytes, read on demand."""

    __slots__ = ("kind", "dtype", "shape", "meta", "storage")
    # storage left out of repr (messages show a RawArray, and a bound method's repr holds an address)
    _shown = ("kind", "dtype", "shape", "meta")
    kind: str  # "tensor" or "ndarray"
    dtype: str  # the format's name: a tensor dtype name, or a numpy dtype.str such as "<u4"
    shape: tuple[int, ...]
    meta: dict[str, Any]
    storage: Callable[[int], bytes]  # storage id -> its bytes, read and checked

    def __init__(
        self,
        kind: str,
        dtype: str,
        shape: tuple[int, ...],
        meta: dict[str, Any],
        storage: Callable[[int], bytes],
    ) -> None:
        self._set(kind, dtype, shape, meta, storage)

    def vector_bytes(self) -> bytes:
        """The bytes of a 1-D array's elements in order (a tensor's offset and stride applied),
        as `.contiguous()` would hold them; the storage is read now."""
        if len(self.shape) != 1:
            raise ValueError(f"vector_bytes of a {len(self.shape)}-D {self.kind}")
        data = self.storage(self.meta["storage"])
        if self.kind == "ndarray":
            return data  # validated: its storage holds exactly its elements
        size = dtypes.TENSOR_ITEMSIZES[self.dtype]
        start, step = self.meta["offset"] * size, self.meta["stride"][0] * size
        if step == size:
            return data[start : start + self.shape[0] * size]
        return b"".join(data[start + i * step : start + i * step + size] for i in range(self.shape[0]))


class RawValue(Frozen):
    """A node whose value needs torch or numpy (npscalar, dtype, device, size), as stored."""

    __slots__ = ("kind", "fields")
    kind: str
    fields: tuple[Any, ...]

    def __init__(self, kind: str, fields: tuple[Any, ...]) -> None:
        self._set(kind, fields)


@pausing
def decode_raw(tree: Tree, top: int, storage: Callable[[int], bytes], path: str) -> object:
    """The subtree at `top` built without torch or numpy (see the module docstring)."""
    return _RawBuilder(tree.nodes, storage, path).build(top)  # type: ignore[arg-type]


class _RawBuilder(_Builder):
    def build(self, i: int) -> object:
        node = self.nodes[i]
        kind = node[0]
        if kind in ("tensor", "ndarray"):
            m = node[1]
            return RawArray(kind, m["dtype"], tuple(m["shape"]), m, self.storage)  # type: ignore[arg-type]
        if kind in ("npscalar", "dtype", "device", "size"):
            # a size's dims as a tuple: a dict key may be one of these, so it must hash
            return RawValue(kind, tuple(tuple(f) if type(f) is list else f for f in node[1:]))
        return super().build(i)  # containers and scalars, whose entries come back here


@pausing
def decode_plain(tree: Tree, top: int, storage: Callable[[int], bytes], path: str) -> object:
    """The subtree at `top` built without torch or numpy, ndarrays as `StoredArray`s whose
    bytes `storage` reads now (see the module docstring)."""
    return _PlainBuilder(tree.nodes, storage, path).build(top)  # type: ignore[arg-type]


class _PlainBuilder(_RawBuilder):
    def build(self, i: int) -> object:
        node = self.nodes[i]
        if node[0] == "ndarray":  # validated: a valid dtype name, its storage holds its elements
            from .arrays import StoredArray  # here: a load of tensors never needs it

            m = node[1]
            data = bytes(self.storage(m["storage"]))  # type: ignore[arg-type]
            return StoredArray(m["dtype"], tuple(m["shape"]), m["order"], data)
        return super().build(i)


def _build_tensor(m: dict[str, Any], storage: Callable[[int], torch.UntypedStorage]) -> torch.Tensor:
    import torch

    st = storage(m["storage"])
    dt = dtypes.TORCH_DTYPES[m["dtype"]]
    t = torch.empty(0, dtype=dt, device=st.device).set_(st, m["offset"], m["shape"], m["stride"])
    if m["conj"]:
        t = t.conj()
    return _finish_tensor(t, m)


def _finish_tensor(t: torch.Tensor, m: dict[str, Any]) -> torch.Tensor:
    """`t` as a Parameter, or requiring grad, as its meta says."""
    if m["param"]:
        import torch

        return torch.nn.Parameter(t, requires_grad=m["requires_grad"])
    if m["requires_grad"]:
        t.requires_grad_(True)
    return t


def _build_ndarray(m: dict[str, Any], storage: Callable[[int], torch.UntypedStorage]) -> np.ndarray:
    import torch

    st = storage(m["storage"])
    dt = dtypes.numpy_dtype(m["dtype"])
    assert dt is not None  # validated
    flat = torch.empty(0, dtype=torch.uint8).set_(st).numpy()
    return flat.view(dt).reshape(m["shape"], order=m["order"])
