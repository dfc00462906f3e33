"""The object model: a training state <-> a flat table of typed nodes.

No pickle.  Every value is one node, a JSON array whose first element is its
kind (spec/FORMAT.md, "Object tree").  Children always come before their
parent and each node has exactly one parent, so the table is a tree by
construction: no cycles, no shared subtrees that expand exponentially, no
orphans.  Tensor bytes live in storages; tensors that share a storage in the
saved state point to the same storage record and share it again on load.
"""

from __future__ import annotations

import base64
import binascii
import collections
import re
import reprlib
import struct
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CorruptError, LimitError, UnsupportedError, UnsupportedObjectError
from ..gcpause import pausing
from . import devices, dtypes
from .layout import Limits

_INT_RE = re.compile(r"-?(?:0|[1-9a-f][0-9a-f]*)")
_FLOAT_RE = re.compile(r"[0-9a-f]{16}")
_DOUBLE = struct.Struct("<d")

#: kinds whose values may be dict keys (a tuple only when its elements are keys too: key_problem)
_KEY_KINDS = frozenset({"none", "bool", "int", "float", "str", "tuple"})
_CONTAINER_KINDS = frozenset({"list", "tuple", "dict", "odict"})
#: every kind, interned: validation replaces each node's kind string with one of these,
#: so the table does not keep one string object per node
_KINDS = {
    k: k
    for k in (
        "none",
        "bool",
        "int",
        "float",
        "complex",
        "str",
        "bytes",
        "list",
        "tuple",
        "dict",
        "odict",
        "dtype",
        "device",
        "size",
        "tensor",
        "ndarray",
        "npscalar",
    )
}
_TENSOR_FIELDS = ("dtype", "shape", "stride", "offset", "storage", "requires_grad", "param", "conj")
_ARRAY_FIELDS = ("dtype", "shape", "order", "storage")
#: longest base64 text of a bytes value within the limit
_MAX_B64 = 4 * -(-Limits.MAX_STRING_BYTES // 3)

# ---------------------------------------------------------------------------
# rendering values and key paths for messages: bounded, and never raising

#: characters of one dict key in a key path
KEY_CHARS = 120
#: characters of a whole key path; longer ones keep their start and end
PATH_CHARS = 400
_PATH_HEAD = 120


class _Repr(reprlib.Repr):
    """reprlib with a bound on ints: repr() of an int of more than 4300 digits raises."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxstring = self.maxother = max(limit, 8)

    def repr_int(self, x: int, level: int) -> str:
        return _int_text(x)


def _int_text(x: int) -> str:
    if x.bit_length() <= 256:
        return repr(x)
    return f"<int of {(x.bit_length() + 3) // 4} hex digits>"


def short_repr(value: object, limit: int = 80) -> str:
    """repr(value) in at most `limit` characters; never raises, never renders a huge value whole."""
    try:
        text = _Repr(limit).repr(value)
    except Exception:  # a __repr__ that raises, or recursion in one
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def key_text(key: object) -> str:
    """One dict key as a key path shows it: repr, cut to KEY_CHARS."""
    t = type(key)
    if t is str and len(key) <= KEY_CHARS:  # type: ignore[arg-type]
        text = repr(key)
        if len(text) <= KEY_CHARS:
            return text
    elif t is int:
        return _int_text(key)  # type: ignore[arg-type]
    return short_repr(key, KEY_CHARS)


def extend_path(path: str, segment: str) -> str:
    """path + segment, cut in the middle when longer than PATH_CHARS."""
    out = path + segment
    if len(out) <= PATH_CHARS:
        return out
    return out[:_PATH_HEAD] + "..." + out[len(out) - (PATH_CHARS - _PATH_HEAD - 3) :]


def render_key(parent: str, key: object) -> str:
    return extend_path(parent, f"[{key_text(key)}]")


# ---------------------------------------------------------------------------
# encoding


@dataclass
class StoragePlan:
    """One storage to write: its bytes, where they came from, how to filter them."""

    nbytes: int
    device: str
    width: int
    source: torch.UntypedStorage | np.ndarray
    key: str


@dataclass
class Encoded:
    nodes: list[list[Any]] = field(default_factory=list)
    storages: list[StoragePlan] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)


def _float_hex(x: float) -> str:
    return _DOUBLE.pack(x).hex()


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def utf8_length(text: str) -> int:
    """Bytes of `text` in UTF-8 (lone surrogates, which JSON can carry, count as 3)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _str_over_limit(text: str) -> bool:
    return len(text) > Limits.MAX_STRING_BYTES // 4 and utf8_length(text) > Limits.MAX_STRING_BYTES


#: Where a value sits in the state, rendered only when a message needs it.  A path is
#: None (the root) or (parent path, segment, the container holding the value); the
#: segment is an int (list or tuple position), (key,) (the value under a dict key),
#: (key, None) (a dict key itself) or "._metadata".
_Path = Any


class _Encoder:
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
            return self._emit(["float", _float_hex(obj)], path)
        if t is str:
            if _str_over_limit(obj):
                raise self._limit(path, f"a string of more than {Limits.MAX_STRING_BYTES} bytes in UTF-8")
            return self._emit(["str", obj], path)
        if t is tuple:
            ids = [self.add(v, (path, i, obj), depth + 1, as_key) for i, v in enumerate(obj)]
            return self._emit(["tuple", ids], path)
        if as_key:
            raise self._fail(path, obj, "dict keys must be str, int, float, bool, None or tuples of those")
        if t is complex:
            return self._emit(["complex", _float_hex(obj.real), _float_hex(obj.imag)], path)
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
            if not devices.valid_location(text):
                raise self._fail(path, obj, "not a device the format can name")
            return self._emit(["device", text], path)
        if t is torch.Tensor or t is torch.nn.Parameter:
            return self._tensor(obj, path)
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
        if not devices.valid_location(device):
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
    with torch.no_grad():
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
        if _str_over_limit(v):
            raise LimitError(
                f"metadata[{key_text(k)}] is longer than {Limits.MAX_STRING_BYTES} bytes in UTF-8"
            )


# ---------------------------------------------------------------------------
# decoding: validation of the node table, then materialisation of subtrees


@dataclass
class StorageRecord:
    nbytes: int
    device: str
    first_chunk: int
    n_chunks: int
    kind: str = ""  # "tensor" or "ndarray" once referenced
    node: int = -1  # the first tensor or array node that uses it (names it in messages)
    tree: Tree | None = field(default=None, repr=False, compare=False)
    _key: str | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> str:
        """The key path of the first tensor using this storage, rendered on first use."""
        if self._key is None:
            self._key = "" if self.tree is None or self.node < 0 else self.tree.key_path(self.node)
        return self._key


@dataclass
class Tree:
    nodes: list[list[Any]]
    root: int
    storages: list[StorageRecord]
    #: each node's parent (-1 for the root) and its place there: the position in a list or
    #: tuple; 2*e for the key and 2*e+1 for the value of dict entry e; -1 for `_metadata`
    parent: array[int] = field(repr=False)
    slot: array[int] = field(repr=False)
    root_name: str = "state"

    def children(self, i: int) -> list[int]:
        """Node ids that node i refers to, in order (dict entries key then value, then _metadata)."""
        node = self.nodes[i]
        kind = node[0]
        if kind == "list" or kind == "tuple":
            return list(node[1])
        if kind == "dict" or kind == "odict":
            out = [j for pair in node[1] for j in pair]
            if kind == "odict" and node[2] is not None:
                out.append(node[2])
            return out
        return []

    def segment(self, i: int) -> str:
        """How node i is named under its parent: "[3]", "['w']", "['w'] (key)", "._metadata"."""
        p, s = self.parent[i], self.slot[i]
        if p < 0:
            return ""
        pnode = self.nodes[p]
        if pnode[0] == "list" or pnode[0] == "tuple":
            return f"[{s}]"
        if s < 0:
            return "._metadata"
        key = f"[{node_text(self.nodes, pnode[1][s // 2][0], KEY_CHARS)}]"
        return key if s % 2 else key + " (key)"

    def depth_of(self, i: int) -> int:
        """How many containers lie above node i (0 for the root)."""
        n = 0
        while self.parent[i] >= 0:
            i = self.parent[i]
            n += 1
        return n

    def key_path(self, i: int) -> str:
        """The key path of node i ("state['model']['w']"), at most PATH_CHARS characters."""
        segments = []
        while self.parent[i] >= 0:
            segments.append(self.segment(i))
            i = self.parent[i]
        text = self.root_name
        for seg in reversed(segments):
            text = extend_path(text, seg)
        return text


def node_text(nodes: list[list[Any]], j: int, limit: int) -> str:
    """A validated key node (scalars and tuples of them) as repr shows its value, cut to `limit`."""
    node = nodes[j]
    kind = node[0]
    if kind == "str":
        return key_text(node[1]) if limit >= KEY_CHARS else short_repr(node[1], limit)
    if kind == "int":
        digits = len(node[1]) - node[1].startswith("-")
        text = repr(int(node[1], 16)) if digits <= 64 else f"<int of {digits} hex digits>"
    elif kind == "float":
        text = repr(_unfloat(node[1]))
    elif kind == "none":
        text = "None"
    elif kind == "bool":
        text = repr(node[1])
    elif kind == "tuple":
        parts: list[str] = []
        used = 2
        for k in node[1]:
            if used > limit:
                parts.append("...")
                break
            parts.append(node_text(nodes, k, limit - used))
            used += len(parts[-1]) + 2
        text = "(" + ", ".join(parts) + ("," if len(node[1]) == 1 else "") + ")"
    else:
        text = f"<{kind}>"
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


class _Check:
    """Validation helpers that raise CorruptError naming the node."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, msg: str, limit: bool = False) -> CorruptError | LimitError:
        cls = LimitError if limit else CorruptError
        return cls(f"index: {msg}", path=self.path)

    def unsupported(self, msg: str) -> UnsupportedError:
        return UnsupportedError(f"index: {msg}", path=self.path)

    def bounded_int(self, v: object, what: str, hi: int) -> int:
        """A non-negative int; above `hi` is a limit error, not corruption."""
        if type(v) is not int or v < 0:
            raise self.fail(f"{what} is {short_repr(v, 40)}, expected a non-negative integer")
        if v > hi:
            raise self.fail(f"{what} is {v}, above the limit {hi}", limit=True)
        return v

    def int_(self, v: object, what: str, lo: int = 0, hi: int | None = None) -> int:
        if type(v) is not int or v < lo or (hi is not None and v > hi):
            raise self.fail(f"{what} is {short_repr(v, 40)}, expected an integer in [{lo}, {hi}]")
        return v

    def str_(self, v: object, what: str) -> str:
        if type(v) is not str:
            raise self.fail(f"{what} is not a string")
        if _str_over_limit(v):
            raise self.fail(f"{what} is longer than {Limits.MAX_STRING_BYTES} bytes", limit=True)
        return v

    def list_(self, v: object, what: str) -> list[Any]:
        if type(v) is not list:
            raise self.fail(f"{what} is not a list")
        return v


def validate_tree(nodes_raw: object, storages: list[StorageRecord], path: str) -> Tree:
    """Check every node of the table; return the tree with each node's parent."""
    c = _Check(path)
    nodes = c.list_(nodes_raw, "nodes")
    if not nodes:
        raise c.fail("the node table is empty")
    if len(nodes) > Limits.MAX_NODES:
        raise c.fail(f"{len(nodes)} nodes exceed the limit of {Limits.MAX_NODES}", limit=True)
    # compact tables (4, 4 and 2 bytes a node): the memory per node is mostly json's
    parent = array("i", [-1]) * len(nodes)
    slot = array("i", [0]) * len(nodes)
    depth = array("H", [0]) * len(nodes)

    def child(i: int, j: object, s: int) -> int:
        if type(j) is not int or not 0 <= j < i:
            raise c.fail(
                f"node {i} refers to node {short_repr(j, 40)}; children must come before their parent"
            )
        if parent[j] != -1:
            raise c.fail(f"node {j} has two parents ({parent[j]} and {i})")
        parent[j] = i
        slot[j] = s
        return depth[j]

    for i, node in enumerate(nodes):
        if type(node) is not list or not node or type(node[0]) is not str:
            raise c.fail(f"node {i} is not a [kind, ...] array")
        kind = _KINDS.get(node[0])
        if kind is None:
            raise c.unsupported(f"node {i} has unknown kind {short_repr(node[0], 40)}")
        node[0] = kind
        deepest = -1  # deepest child
        n = len(node)
        if kind == "none":
            ok = n == 1
        elif kind == "bool":
            ok = n == 2 and type(node[1]) is bool
        elif kind == "int":
            ok = n == 2 and type(node[1]) is str
            if ok and len(node[1]) - node[1].startswith("-") > Limits.MAX_STRING_BYTES:
                raise c.fail(
                    f"node {i} is an int of more than {Limits.MAX_STRING_BYTES} hex digits", limit=True
                )
            ok = ok and _INT_RE.fullmatch(node[1]) is not None and node[1] != "-0"
        elif kind == "float":
            ok = n == 2 and type(node[1]) is str and _FLOAT_RE.fullmatch(node[1]) is not None
        elif kind == "complex":
            ok = n == 3 and all(type(x) is str and _FLOAT_RE.fullmatch(x) for x in node[1:])
        elif kind == "str":
            ok = n == 2 and c.str_(node[1], f"node {i}") is not None
        elif kind == "bytes":
            ok = n == 2 and type(node[1]) is str
            if ok and len(node[1]) > _MAX_B64:
                raise c.fail(f"node {i} holds more than {Limits.MAX_STRING_BYTES} bytes", limit=True)
            ok = ok and _b64decode(c, i, node[1]) is not None
        elif kind in ("list", "tuple"):
            ok = n == 2 and type(node[1]) is list
            if ok:
                for s, j in enumerate(node[1]):
                    deepest = max(deepest, child(i, j, s))
        elif kind in ("dict", "odict"):
            ok = (n == 2 if kind == "dict" else n == 3) and type(node[1]) is list
            if ok:
                for e, pair in enumerate(node[1]):
                    if type(pair) is not list or len(pair) != 2:
                        raise c.fail(f"node {i} has an entry that is not a [key, value] pair")
                    deepest = max(deepest, child(i, pair[0], 2 * e), child(i, pair[1], 2 * e + 1))
                    _check_key(c, nodes, i, pair[0])
                if kind == "odict" and node[2] is not None:
                    deepest = max(deepest, child(i, node[2], -1))
                    if nodes[node[2]][0] not in ("dict", "odict"):
                        raise c.fail(f"node {i} uses a {nodes[node[2]][0]} node as its _metadata")
                _check_keys(c, nodes, i, node[1])
        elif kind == "dtype":
            ok = n == 2 and type(node[1]) is str and node[1] in dtypes.TORCH_DTYPES
            if not ok and n == 2 and type(node[1]) is str:
                raise c.unsupported(f"node {i} has dtype {short_repr(node[1], 40)}, unknown to this reader")
        elif kind == "device":
            ok = n == 2 and devices.valid_location(node[1])
            if ok:
                try:
                    named = str(torch.device(node[1]))
                except RuntimeError as e:
                    raise c.fail(f"node {i} names device {node[1]!r}, unknown to torch") from e
                if named != node[1]:
                    raise c.fail(f"node {i} names device {node[1]!r}, which torch reads as {named!r}")
        elif kind == "size":
            ok = (
                n == 2
                and type(node[1]) is list
                and len(node[1]) <= Limits.MAX_RANK
                and all(
                    type(d) is str
                    and len(d) <= 16
                    and _INT_RE.fullmatch(d)
                    and not d.startswith("-")
                    and int(d, 16) <= Limits.MAX_SIZE_DIM
                    for d in node[1]
                )
            )
        elif kind == "tensor":
            ok = n == 2 and _check_tensor(c, i, node[1], storages)
        elif kind == "ndarray":
            ok = n == 2 and _check_ndarray(c, i, node[1], storages)
        else:  # npscalar
            ok = n == 3 and type(node[1]) is str and type(node[2]) is str and len(node[2]) <= 32
            dt = dtypes.numpy_dtype(node[1]) if ok else None
            if ok and dt is None:  # as for an ndarray of that dtype
                raise c.unsupported(
                    f"node {i} has numpy dtype {short_repr(node[1], 40)}, unknown to this reader"
                )
            if ok:
                raw = _b64decode(c, i, node[2])
                assert dt is not None
                if len(raw) != dt.itemsize:
                    raise c.fail(f"node {i} holds {len(raw)} bytes for a {dt.itemsize}-byte scalar")
        if not ok:
            raise c.fail(f"node {i} ({kind}) is malformed")
        if deepest >= 0:
            if deepest >= Limits.MAX_DEPTH:
                raise c.fail(f"nesting deeper than {Limits.MAX_DEPTH} levels", limit=True)
            depth[i] = deepest + 1
    root = len(nodes) - 1
    if parent.count(-1) != 1:
        orphan = parent.index(-1)
        raise c.fail(f"node {orphan} is not part of the tree")
    for sid, rec in enumerate(storages):
        if not rec.kind:
            raise c.fail(f"storage {sid} is not used by any tensor or array")
    tree = Tree(nodes, root, storages, parent, slot)
    for rec in storages:
        rec.tree = tree
    return tree


def key_problem(nodes: list[list[Any]], j: int) -> str | None:
    """Why node j cannot be a dict key, or None: the one rule (spec section 6) every path that
    reads keys relies on.  A key is a none, bool, int, float or str node, or a tuple whose
    elements are keys, however deep.  Each node has one parent, so over a whole table this
    visits every node at most once."""
    stack = [j]
    while stack:
        node = nodes[stack.pop()]
        if node[0] not in _KEY_KINDS:
            return (
                f"a dict key contains a {node[0]} node "
                "(keys are none, bool, int, float, str or tuples of those)"
            )
        if node[0] == "tuple":
            stack.extend(node[1])
    return None


def _check_key(c: _Check, nodes: list[list[Any]], i: int, j: int) -> None:
    problem = key_problem(nodes, j)
    if problem is not None:
        raise c.fail(f"node {i}: {problem}")


def _check_keys(c: _Check, nodes: list[list[Any]], i: int, pairs: list[list[int]]) -> None:
    """No two keys of dict node i are equal (as Python compares them), and at most
    MAX_KEY_COLLISIONS share a hash, so the checks here and the dict built on load take
    time linear in the number of keys even when they are chosen to collide."""
    if len(pairs) < 2:
        return
    seen: set[object] = set()
    counts: dict[int, int] | None = {} if len(pairs) > Limits.MAX_KEY_COLLISIONS else None
    for pair in pairs:
        key = _key_value(c, nodes, pair[0])
        if counts is not None:
            h = hash(key)
            n = counts.get(h, 0) + 1
            if n > Limits.MAX_KEY_COLLISIONS:
                raise c.fail(
                    f"node {i} has more than {Limits.MAX_KEY_COLLISIONS} keys with the same hash ({h})",
                    limit=True,
                )
            counts[h] = n
        if key in seen:
            raise c.fail(f"node {i} has the key {node_text(nodes, pair[0], 80)} twice")
        seen.add(key)


def _b64decode(c: _Check, i: int, text: str) -> bytes:
    """Strict, canonical base64 (so every value has exactly one encoding)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise c.fail(f"node {i} has invalid base64") from e
    if base64.b64encode(raw).decode("ascii") != text:
        raise c.fail(f"node {i} has non-canonical base64")
    if len(raw) > Limits.MAX_STRING_BYTES:
        raise c.fail(f"node {i} holds more than {Limits.MAX_STRING_BYTES} bytes", limit=True)
    return raw


def _key_value(c: _Check, nodes: list[list[Any]], j: int) -> object:
    """The value of an already-validated dict-key node (scalars and tuples of them)."""
    node = nodes[j]
    kind = node[0]
    if kind == "none":
        return None
    if kind in ("bool", "str"):
        return node[1]
    if kind == "int":
        return int(node[1], 16)
    if kind == "float":
        return _unfloat(node[1])
    if kind == "tuple":
        return tuple(_key_value(c, nodes, k) for k in node[1])
    raise c.fail(f"a dict key contains a {kind} node")  # validate_tree refused it already: for safety


def _shape(c: _Check, i: int, v: object, what: str) -> list[int]:
    dims = c.list_(v, f"node {i} {what}")
    if len(dims) > Limits.MAX_RANK:
        raise c.fail(f"node {i} has rank {len(dims)}, above the limit {Limits.MAX_RANK}", limit=True)
    for d in dims:
        c.bounded_int(d, f"node {i} {what} entry", Limits.MAX_NUMEL)
    return dims


def _numel(c: _Check, i: int, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    if n > Limits.MAX_NUMEL:
        raise c.fail(f"node {i} has {n} elements, above the limit {Limits.MAX_NUMEL}", limit=True)
    return n


def _fields(c: _Check, i: int, meta: object, names: tuple[str, ...]) -> dict[str, Any]:
    # member order carries no meaning (spec section 5): JSON libraries that ignore it must work
    if type(meta) is not dict or meta.keys() != set(names):
        raise c.fail(f"node {i} must have exactly the fields {', '.join(names)}")
    return meta


def _use_storage(c: _Check, i: int, sid: object, storages: list[StorageRecord], kind: str) -> StorageRecord:
    sid = c.int_(sid, f"node {i} storage", 0, len(storages) - 1)
    rec = storages[sid]
    if rec.kind and (kind == "ndarray" or rec.kind != kind):
        raise c.fail(f"storage {sid} is used by node {i} and by another {rec.kind}")
    rec.kind = kind
    if rec.node < 0:
        rec.node = i
    return rec


def _check_tensor(c: _Check, i: int, meta: object, storages: list[StorageRecord]) -> bool:
    m = _fields(c, i, meta, _TENSOR_FIELDS)
    name = m["dtype"]
    if type(name) is not str:
        raise c.fail(f"node {i} has dtype {short_repr(name, 40)}, not a string")
    if name not in dtypes.TORCH_DTYPES:
        raise c.unsupported(f"node {i} has dtype {short_repr(name, 40)}, unknown to this reader")
    shape = _shape(c, i, m["shape"], "shape")
    stride = _shape(c, i, m["stride"], "stride")
    if len(stride) != len(shape):
        raise c.fail(f"node {i} has {len(shape)} dimensions but {len(stride)} strides")
    offset = c.bounded_int(m["offset"], f"node {i} offset", Limits.MAX_STORAGE_BYTES)
    rec = _use_storage(c, i, m["storage"], storages, "tensor")
    for f in ("requires_grad", "param", "conj"):
        if type(m[f]) is not bool:
            raise c.fail(f"node {i} field {f} is not a boolean")
    dt = dtypes.TORCH_DTYPES[name]
    if m["requires_grad"] and not (dt.is_floating_point or dt.is_complex):
        raise c.fail(f"node {i} asks for requires_grad on a {name} tensor")
    if m["conj"] and not dt.is_complex:
        raise c.fail(f"node {i} is a conjugate view of a {name} tensor")
    itemsize = dtypes.torch_itemsize(name)
    numel = _numel(c, i, shape)
    extent = offset + (sum((d - 1) * s for d, s in zip(shape, stride)) + 1 if numel else 0)
    if extent * itemsize > rec.nbytes:
        raise c.fail(f"node {i} reaches byte {extent * itemsize} of a storage of {rec.nbytes} bytes")
    return True


def _check_ndarray(c: _Check, i: int, meta: object, storages: list[StorageRecord]) -> bool:
    m = _fields(c, i, meta, _ARRAY_FIELDS)
    if type(m["dtype"]) is not str:
        raise c.fail(f"node {i} has numpy dtype {short_repr(m['dtype'], 40)}, not a string")
    dt = dtypes.numpy_dtype(m["dtype"])
    if dt is None:
        raise c.unsupported(f"node {i} has numpy dtype {short_repr(m['dtype'], 40)}, unknown to this reader")
    shape = _shape(c, i, m["shape"], "shape")
    if m["order"] not in ("C", "F"):
        raise c.fail(f"node {i} has order {short_repr(m['order'], 12)}")
    rec = _use_storage(c, i, m["storage"], storages, "ndarray")
    if _numel(c, i, shape) * dt.itemsize != rec.nbytes:
        raise c.fail(
            f"node {i} needs {_numel(c, i, shape) * dt.itemsize} bytes, its storage has {rec.nbytes}"
        )
    return True


def iter_paths(tree: Tree, top: int, top_path: str) -> Iterator[tuple[str, int]]:
    """Every node under `top` with its key path (at most PATH_CHARS characters), parents before
    children; a dict's `_metadata` before its entries; dict keys are not listed.  Lazy: holds
    one path per level, never one per node."""
    yield top_path, top
    stack = [(top_path, _named_children(tree, top))]
    while stack:
        path, kids = stack[-1]
        nxt = next(kids, None)
        if nxt is None:
            stack.pop()
            continue
        seg, j = nxt
        sub = extend_path(path, seg)
        yield sub, j
        if tree.nodes[j][0] in _CONTAINER_KINDS:
            stack.append((sub, _named_children(tree, j)))


def _named_children(tree: Tree, i: int) -> Iterator[tuple[str, int]]:
    node = tree.nodes[i]
    kind = node[0]
    if kind == "list" or kind == "tuple":
        for n, j in enumerate(node[1]):
            yield f"[{n}]", j
    elif kind == "dict" or kind == "odict":
        if kind == "odict" and node[2] is not None:
            yield "._metadata", node[2]
        for k, v in node[1]:
            yield f"[{node_text(tree.nodes, k, KEY_CHARS)}]", v


def storages_under(tree: Tree, top: int) -> list[int]:
    """Storage ids the subtree at `top` needs, in file order."""
    out = set()
    stack = [top]
    while stack:
        i = stack.pop()
        node = tree.nodes[i]
        if node[0] in ("tensor", "ndarray"):
            out.add(node[1]["storage"])
        elif node[0] in _CONTAINER_KINDS:
            stack.extend(tree.children(i))
    return sorted(out)


def _unfloat(s: str) -> float:
    value: float = _DOUBLE.unpack(bytes.fromhex(s))[0]
    return value


def decode_key(tree: Tree, node: int, path: str) -> object:
    """The value of a validated dict key (keys are scalars and tuples of them, never tensors)."""
    return _key_value(_Check(path), tree.nodes, node)


@pausing
def decode(tree: Tree, top: int, storage: Callable[[int], torch.UntypedStorage], path: str) -> object:
    """Build the objects of the subtree at `top`; `storage(sid)` gives loaded storages."""
    c = _Check(path)
    nodes = tree.nodes

    def build(i: int) -> object:
        node = nodes[i]
        kind = node[0]
        if kind == "none":
            return None
        if kind == "bool":
            return node[1]
        if kind == "int":
            return int(node[1], 16)
        if kind == "float":
            return _unfloat(node[1])
        if kind == "complex":
            return complex(_unfloat(node[1]), _unfloat(node[2]))
        if kind == "str":
            return node[1]
        if kind == "bytes":
            return base64.b64decode(node[1])
        if kind == "list":
            return [build(j) for j in node[1]]
        if kind == "tuple":
            return tuple(build(j) for j in node[1])
        if kind in ("dict", "odict"):
            d: dict[Any, Any] = {} if kind == "dict" else collections.OrderedDict()
            for k, v in node[1]:  # keys validated: hashable and distinct
                d[build(k)] = build(v)
            if kind == "odict" and node[2] is not None:
                d._metadata = build(node[2])  # type: ignore[attr-defined]
            return d
        if kind == "dtype":
            return dtypes.TORCH_DTYPES[node[1]]
        if kind == "device":
            return torch.device(node[1])
        if kind == "size":
            return torch.Size(int(d, 16) for d in node[1])
        if kind == "tensor":
            return _build_tensor(node[1], storage)
        if kind == "ndarray":
            return _build_ndarray(node[1], storage)
        if kind == "npscalar":
            return np.frombuffer(base64.b64decode(node[2]), dtype=np.dtype(node[1]))[0]
        raise c.fail(f"node {i} has unknown kind {kind!r}")  # validated before; kept for safety

    with torch.no_grad():
        return build(top)


def _build_tensor(m: dict[str, Any], storage: Callable[[int], torch.UntypedStorage]) -> torch.Tensor:
    st = storage(m["storage"])
    dt = dtypes.TORCH_DTYPES[m["dtype"]]
    t = torch.empty(0, dtype=dt, device=st.device).set_(st, m["offset"], m["shape"], m["stride"])
    if m["conj"]:
        t = t.conj()
    if m["param"]:
        return torch.nn.Parameter(t, requires_grad=m["requires_grad"])
    if m["requires_grad"]:
        t.requires_grad_(True)
    return t


def _build_ndarray(m: dict[str, Any], storage: Callable[[int], torch.UntypedStorage]) -> np.ndarray:
    st = storage(m["storage"])
    dt = dtypes.numpy_dtype(m["dtype"])
    assert dt is not None  # validated
    flat = torch.empty(0, dtype=torch.uint8).set_(st).numpy()
    return flat.view(dt).reshape(m["shape"], order=m["order"])
