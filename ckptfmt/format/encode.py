"""Encoding: a training state -> nodes and storage plans (the writer's side of tree.py).

`encode` walks the state once, emitting each value as a node (children first) and each
distinct tensor storage or array as a `StoragePlan` that the chunk writer
(engine/chunkwrite.py) turns into chunks.  Everything a reader would refuse is refused
here first, naming the value's key path: what the format cannot store
(UnsupportedObjectError) and what exceeds a reader's limits (LimitError, spec section 8),
so a save fails before it writes a byte.  `check_chunks` and `check_metadata` check the
two limits that depend on how the file is written rather than on the state.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import LimitError, UnsupportedObjectError
from ..gcpause import pausing
from . import dtypes, locations
from .arrays import StoredArray
from .layout import Limits
from .render import extend_path, key_text, short_repr
from .tree import float_text, over_string_limit

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass
class StoragePlan:
    """One storage to write: its bytes, where they came from, how to filter them."""

    nbytes: int
    device: str
    width: int
    source: torch.UntypedStorage | np.ndarray | bytes  # bytes: a StoredArray's
    key: str


@dataclass
class Encoded:
    """A state encoded: its node table (root last), the storages to write, their devices."""

    nodes: list[list[Any]] = field(default_factory=list)
    storages: list[StoragePlan] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


#: Where a value sits in the state, rendered only when a message needs it.  A path is
#: None (the root) or (parent path, segment, the container holding the value); the
#: segment is an int (list or tuple position), (key,) (the value under a dict key),
#: (key, None) (a dict key itself) or "._metadata".
_Path = Any


class _Encoder:
    """One walk of a state into `out`; tensors that share a storage get one plan."""

    def __init__(self, root: str = "state") -> None:
        self.root = root
        self.out = Encoded()
        self._storage_ids: dict[tuple[str, int, int], int] = {}

    def where(self, path: _Path) -> str:
        segments = []
        while path is not None:
            segments.append(path[1])
            path = path[0]
        text = self.root
        for seg in reversed(segments):
            if type(seg) is int:
                text = extend_path(text, f"[{seg}]")
            elif type(seg) is tuple:
                text = extend_path(text, f"[{key_text(seg[0])}]" + (" (key)" if len(seg) == 2 else ""))
            else:
                text = extend_path(text, seg)
        return text

    def _fail(self, path: _Path, obj: object, why: str = "") -> UnsupportedObjectError:
        text = short_repr(obj, 80)
        return UnsupportedObjectError(
            f"{self.where(path)}: cannot store {text}" + (f" ({why})" if why else "")
        )

    def _limit(self, path: _Path, why: str) -> LimitError:
        return LimitError(f"{self.where(path)}: {why} (spec section 8: a reader would refuse the file)")

    def _emit(self, node: list[Any], path: _Path) -> int:
        nodes = self.out.nodes
        if len(nodes) >= Limits.MAX_NODES:
            raise self._limit(
                path, f"the state holds more than {Limits.MAX_NODES} values, the limit of nodes"
            )
        nodes.append(node)
        return len(nodes) - 1

    def _too_deep(self, obj: object, path: _Path) -> Exception:
        # a cycle: some container is its own ancestor (the deepest value may be a leaf)
        ancestors = [id(obj)]
        p = path
        while p is not None:
            ancestors.append(id(p[2]))
            p = p[0]
        if len(set(ancestors)) < len(ancestors):
            return UnsupportedObjectError(
                f"{self.where(path)}: nesting deeper than {Limits.MAX_DEPTH} levels: "
                "the object contains itself (a cycle)"
            )
        return self._limit(path, f"nesting deeper than {Limits.MAX_DEPTH} levels")

    def add(self, obj: Any, path: _Path, depth: int, as_key: bool = False) -> int:
        if depth > Limits.MAX_DEPTH:
            raise self._too_deep(obj, path)
        t = type(obj)
        if obj is None:
            return self._emit(["none"], path)
        if t is bool:
            return self._emit(["bool", obj], path)
        if t is int:
            if obj.bit_length() > 4 * Limits.MAX_STRING_BYTES:
                raise self._limit(path, f"an int of more than {Limits.MAX_STRING_BYTES} hex digits")
            return self._emit(["int", format(obj, "x")], path)
        if t is float:
            return self._emit(["float", float_text(obj)], path)
        if t is str:
            if over_string_limit(obj):
                raise self._limit(path, f"a string of more than {Limits.MAX_STRING_BYTES} bytes in UTF-8")
            return self._emit(["str", obj], path)
        if t is tuple:
            ids = [self.add(v, (path, i, obj), depth + 1, as_key) for i, v in enumerate(obj)]
            return self._emit(["tuple", ids], path)
        if as_key:
            raise self._fail(path, obj, "dict keys must be str, int, float, bool, None or tuples of those")
        if t is complex:
            return self._emit(["complex", float_text(obj.real), float_text(obj.imag)], path)
        if t is bytes:
            if len(obj) > Limits.MAX_STRING_BYTES:
                raise self._limit(path, f"a bytes value of more than {Limits.MAX_STRING_BYTES} bytes")
            return self._emit(["bytes", _b64(obj)], path)
        if t is list:
            ids = [self.add(v, (path, i, obj), depth + 1) for i, v in enumerate(obj)]
            return self._emit(["list", ids], path)
        if t is dict or t is collections.OrderedDict:
            pairs = []
            for k, v in obj.items():
                kid = self.add(k, (path, (k, None), obj), depth + 1, as_key=True)
                pairs.append([kid, self.add(v, (path, (k,), obj), depth + 1)])
            if len(obj) > Limits.MAX_KEY_COLLISIONS:
                self._check_collisions(obj, path)
            if t is dict:
                return self._emit(["dict", pairs], path)
            meta = getattr(obj, "_metadata", None)
            where = (path, "._metadata", obj)
            mid = None if meta is None else self.add(meta, where, depth + 1)
            if mid is not None and self.out.nodes[mid][0] not in ("dict", "odict"):
                raise self._fail(where, meta, "_metadata must be a dict")
            return self._emit(["odict", pairs, mid], path)
        if t is StoredArray:
            return self._stored_array(obj, path)
        return self._library_value(obj, t, path)

    def _stored_array(self, a: StoredArray, path: _Path) -> int:
        """An array as its stored bytes (a commit record read without numpy, written again)."""
        numel = len(a.data) // (dtypes.numpy_itemsize(a.dtype) or 1)
        self._check_shape(path, list(a.shape), numel, "an array")
        if len(a.data) > Limits.MAX_STORAGE_BYTES:
            raise self._limit(path, f"an array of {len(a.data)} bytes, above {Limits.MAX_STORAGE_BYTES}")
        width = dtypes.numpy_stored_width(a.dtype)
        sid = self._storage(None, StoragePlan(len(a.data), "cpu", width, a.data, ""), path)
        meta = {"dtype": a.dtype, "shape": list(a.shape), "order": a.order, "storage": sid}
        return self._emit(["ndarray", meta], path)

    def _library_value(self, obj: Any, t: type, path: _Path) -> int:
        """A value of torch or numpy: one exists only where its library was imported, so a
        state of plain values (a commit record) is encoded without either."""
        torch = sys.modules.get("torch")
        if torch is not None:
            if t is torch.Size:
                if len(obj) > Limits.MAX_RANK:
                    raise self._limit(path, f"a torch.Size of {len(obj)} dimensions, above {Limits.MAX_RANK}")
                if any(not 0 <= d <= Limits.MAX_SIZE_DIM for d in obj):
                    raise self._fail(path, obj, "torch.Size dimensions must be non-negative int64 values")
                return self._emit(["size", [format(int(d), "x") for d in obj]], path)
            if t is torch.dtype:
                name = dtypes.TORCH_NAMES.get(obj)
                if name is None:
                    raise self._fail(path, obj, "dtype not supported by the format")
                return self._emit(["dtype", name], path)
            if t is torch.device:
                text = str(obj)
                if not locations.valid_location(text):
                    raise self._fail(path, obj, "not a device the format can name")
                return self._emit(["device", text], path)
            if t is torch.Tensor or t is torch.nn.Parameter:
                return self._tensor(obj, path)
        np = sys.modules.get("numpy")
        if np is not None:
            if t is np.ndarray:
                return self._ndarray(obj, path)
            if isinstance(obj, np.generic):
                name = dtypes.numpy_name(obj.dtype)
                if name is None:
                    raise self._fail(path, obj, f"numpy dtype {obj.dtype} is not supported")
                return self._emit(["npscalar", name, _b64(obj.tobytes())], path)
        raise self._fail(path, obj)

    def _check_collisions(self, d: dict[Any, Any], path: _Path) -> None:
        """Refuse a dict whose keys share one hash too often (a reader would need quadratic time)."""
        counts: dict[int, int] = {}
        for k in d:
            h = hash(k)
            n = counts.get(h, 0) + 1
            if n > Limits.MAX_KEY_COLLISIONS:
                raise self._limit(
                    path, f"more than {Limits.MAX_KEY_COLLISIONS} keys of this dict have the same hash ({h})"
                )
            counts[h] = n

    def _storage(self, key: tuple[str, int, int] | None, plan: StoragePlan, path: _Path) -> int:
        if key is not None and key in self._storage_ids:
            return self._storage_ids[key]
        if len(self.out.storages) >= Limits.MAX_STORAGES:
            raise self._limit(path, f"more than {Limits.MAX_STORAGES} storages")
        if plan.nbytes > Limits.MAX_STORAGE_BYTES:
            raise self._limit(path, f"a storage of {plan.nbytes} bytes, above {Limits.MAX_STORAGE_BYTES}")
        plan.key = self.where(path)
        self.out.storages.append(plan)
        sid = len(self.out.storages) - 1
        if key is not None:
            self._storage_ids[key] = sid
        if plan.device not in self.out.devices:
            self.out.devices.append(plan.device)
        return sid

    def _check_shape(self, path: _Path, shape: list[int], numel: int, what: str) -> None:
        if len(shape) > Limits.MAX_RANK:
            raise self._limit(path, f"{what} of {len(shape)} dimensions, above {Limits.MAX_RANK}")
        if numel > Limits.MAX_NUMEL or any(d > Limits.MAX_NUMEL for d in shape):
            raise self._limit(
                path, f"{what} of shape {short_repr(shape, 60)}, above {Limits.MAX_NUMEL} elements"
            )

    def _tensor(self, t: torch.Tensor, path: _Path) -> int:
        import torch

        if t.layout != torch.strided or t.is_sparse:
            raise self._fail(path, t, f"layout {t.layout} is not supported; only dense tensors")
        if t.is_quantized:
            raise self._fail(path, t, "quantized tensors are not supported")
        if t.is_nested:
            raise self._fail(path, t, "nested tensors are not supported")
        if t.device.type == "meta":
            raise self._fail(path, t, "a meta tensor has no data to store")
        if t.is_neg():
            raise self._fail(path, t, "negative-bit views are not supported; call .resolve_neg()")
        name = dtypes.TORCH_NAMES.get(t.dtype)
        if name is None:
            raise self._fail(path, t, f"dtype {t.dtype} is not supported")
        shape, stride = list(t.shape), list(t.stride())
        numel = t.numel()
        self._check_shape(path, shape, numel, "a tensor")
        if any(s > Limits.MAX_NUMEL for s in stride):
            raise self._limit(path, f"a tensor stride above {Limits.MAX_NUMEL}; call .contiguous()")
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        offset = t.storage_offset()
        if numel == 0:
            # torch lets an empty view start past its storage (torch.zeros(0, 5)[:, 2:] has
            # offset 2 in 0 bytes), the format does not (spec section 6): the offset of a
            # tensor without elements means nothing, so it is clamped to the storage's end
            offset = min(offset, nbytes // dtypes.torch_itemsize(name))
        device = str(t.device)
        if not locations.valid_location(device):
            raise self._fail(path, t, f"device {device!r} cannot be named in the format")
        key = (device, storage.data_ptr(), nbytes) if nbytes else None
        sid = self._storage(
            key, StoragePlan(nbytes, device, dtypes.torch_shuffle_width(name), storage, ""), path
        )
        meta = {
            "dtype": name,
            "shape": shape,
            "stride": stride,
            "offset": offset,
            "storage": sid,
            "requires_grad": bool(t.requires_grad),
            "param": type(t) is torch.nn.Parameter,
            "conj": bool(t.is_conj()),
        }
        return self._emit(["tensor", meta], path)

    def _ndarray(self, a: np.ndarray, path: _Path) -> int:
        import numpy as np

        name = dtypes.numpy_name(a.dtype)
        if name is None:
            raise self._fail(path, a, f"numpy dtype {a.dtype} is not supported")
        # before the contiguous copy below: a broadcast view may claim more than any memory
        self._check_shape(path, list(a.shape), a.size, "an array")
        if a.size * a.dtype.itemsize > Limits.MAX_STORAGE_BYTES:
            raise self._limit(
                path, f"an array of {a.size * a.dtype.itemsize} bytes, above {Limits.MAX_STORAGE_BYTES}"
            )
        order = "F" if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous else "C"
        data = np.asfortranarray(a) if order == "F" else np.ascontiguousarray(a)
        sid = self._storage(
            None, StoragePlan(data.nbytes, "cpu", dtypes.numpy_shuffle_width(a.dtype), data, ""), path
        )
        return self._emit(
            ["ndarray", {"dtype": name, "shape": list(a.shape), "order": order, "storage": sid}], path
        )


@pausing
def encode(state: object) -> Encoded:
    """Turn a state into nodes and storages, or raise naming the path: UnsupportedObjectError for
    what the format cannot store, LimitError for what would exceed a reader's limits (spec
    section 8).  Checks every limit but the index length and the chunk count, which depend
    on how the file is written (writer.finish_file, check_chunks)."""
    enc = _Encoder()
    torch = sys.modules.get("torch")
    with torch.no_grad() if torch is not None else contextlib.nullcontext():
        enc.add(state, None, 0)
    return enc.out


def check_chunks(encoded: Encoded, chunk_size: int) -> None:
    """LimitError when the storages need more chunks than a reader accepts at this chunk size."""
    n = sum(-(-p.nbytes // chunk_size) for p in encoded.storages)
    if n > Limits.MAX_CHUNKS:
        raise LimitError(
            f"the storages need {n} chunks of {chunk_size} bytes, above the limit {Limits.MAX_CHUNKS}; "
            "use a larger chunk_size"
        )


def check_metadata(metadata: dict[str, str]) -> None:
    """LimitError when user metadata exceeds what a reader accepts (entries, value lengths)."""
    if len(metadata) > Limits.MAX_METADATA_ENTRIES:
        raise LimitError(
            f"metadata has {len(metadata)} entries, above the limit {Limits.MAX_METADATA_ENTRIES}"
        )
    for k, v in metadata.items():
        if over_string_limit(v):
            raise LimitError(
                f"metadata[{key_text(k)}] is longer than {Limits.MAX_STRING_BYTES} bytes in UTF-8"
            )
