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
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import dtypes
from .errors import CorruptError, LimitError, UnsupportedError, UnsupportedObjectError
from .format import Limits

_INT_RE = re.compile(r"-?(?:0|[1-9a-f][0-9a-f]*)")
_FLOAT_RE = re.compile(r"[0-9a-f]{16}")
_DEVICE_RE = re.compile(r"[a-z_][a-z0-9_]{0,31}(?::[0-9]{1,4})?")
_DOUBLE = struct.Struct("<d")

#: kinds whose values may be dict keys
_KEY_KINDS = frozenset({"none", "bool", "int", "float", "str", "tuple"})
_CONTAINER_KINDS = frozenset({"list", "tuple", "dict", "odict"})
_TENSOR_FIELDS = ("dtype", "shape", "stride", "offset", "storage", "requires_grad", "param", "conj")
_ARRAY_FIELDS = ("dtype", "shape", "order", "storage")


def render_key(parent: str, key: object) -> str:
    return f"{parent}[{key!r}]"


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


class _Encoder:
    def __init__(self) -> None:
        self.out = Encoded()
        self._storage_ids: dict[tuple[str, int, int], int] = {}

    def _emit(self, node: list[Any]) -> int:
        self.out.nodes.append(node)
        return len(self.out.nodes) - 1

    def _fail(self, path: str, obj: object, why: str = "") -> UnsupportedObjectError:
        text = repr(obj)
        if len(text) > 80:
            text = text[:77] + "..."
        return UnsupportedObjectError(f"{path}: cannot store {text}" + (f" ({why})" if why else ""))

    def add(self, obj: Any, path: str, depth: int, as_key: bool = False) -> int:
        if depth > Limits.MAX_DEPTH:
            raise UnsupportedObjectError(
                f"{path}: nesting deeper than {Limits.MAX_DEPTH} levels (is there a cycle?)"
            )
        t = type(obj)
        if obj is None:
            return self._emit(["none"])
        if t is bool:
            return self._emit(["bool", obj])
        if t is int:
            return self._emit(["int", format(obj, "x")])
        if t is float:
            return self._emit(["float", _float_hex(obj)])
        if t is str:
            return self._emit(["str", obj])
        if t is tuple:
            ids = [self.add(v, f"{path}[{i}]", depth + 1, as_key) for i, v in enumerate(obj)]
            return self._emit(["tuple", ids])
        if as_key:
            raise self._fail(path, obj, "dict keys must be str, int, float, bool, None or tuples of those")
        if t is complex:
            return self._emit(["complex", _float_hex(obj.real), _float_hex(obj.imag)])
        if t is bytes:
            return self._emit(["bytes", _b64(obj)])
        if t is list:
            ids = [self.add(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
            return self._emit(["list", ids])
        if t is dict or t is collections.OrderedDict:
            pairs = []
            for k, v in obj.items():
                kid = self.add(k, f"{path}[{k!r}] (key)", depth + 1, as_key=True)
                pairs.append([kid, self.add(v, render_key(path, k), depth + 1)])
            if t is dict:
                return self._emit(["dict", pairs])
            meta = getattr(obj, "_metadata", None)
            mid = None if meta is None else self.add(meta, f"{path}._metadata", depth + 1)
            if mid is not None and self.out.nodes[mid][0] not in ("dict", "odict"):
                raise self._fail(f"{path}._metadata", meta, "_metadata must be a dict")
            return self._emit(["odict", pairs, mid])
        if t is torch.Size:
            return self._emit(["size", [format(int(d), "x") for d in obj]])
        if t is torch.dtype:
            name = dtypes.TORCH_NAMES.get(obj)
            if name is None:
                raise self._fail(path, obj, "dtype not supported by the format")
            return self._emit(["dtype", name])
        if t is torch.device:
            return self._emit(["device", str(obj)])
        if t is torch.Tensor or t is torch.nn.Parameter:
            return self._tensor(obj, path)
        if t is np.ndarray:
            return self._ndarray(obj, path)
        if isinstance(obj, np.generic):
            name = dtypes.numpy_name(obj.dtype)
            if name is None:
                raise self._fail(path, obj, f"numpy dtype {obj.dtype} is not supported")
            return self._emit(["npscalar", name, _b64(obj.tobytes())])
        raise self._fail(path, obj)

    def _storage(self, key: tuple[str, int, int] | None, plan: StoragePlan) -> int:
        if key is not None and key in self._storage_ids:
            return self._storage_ids[key]
        self.out.storages.append(plan)
        sid = len(self.out.storages) - 1
        if key is not None:
            self._storage_ids[key] = sid
        if plan.device not in self.out.devices:
            self.out.devices.append(plan.device)
        return sid

    def _tensor(self, t: torch.Tensor, path: str) -> int:
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
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        device = str(t.device)
        key = (device, storage.data_ptr(), nbytes) if nbytes else None
        sid = self._storage(key, StoragePlan(nbytes, device, dtypes.torch_shuffle_width(name), storage, path))
        meta = {
            "dtype": name,
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
            "storage": sid,
            "requires_grad": bool(t.requires_grad),
            "param": type(t) is torch.nn.Parameter,
            "conj": bool(t.is_conj()),
        }
        return self._emit(["tensor", meta])

    def _ndarray(self, a: np.ndarray, path: str) -> int:
        name = dtypes.numpy_name(a.dtype)
        if name is None:
            raise self._fail(path, a, f"numpy dtype {a.dtype} is not supported")
        order = "F" if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous else "C"
        data = np.asfortranarray(a) if order == "F" else np.ascontiguousarray(a)
        sid = self._storage(
            None, StoragePlan(data.nbytes, "cpu", dtypes.numpy_shuffle_width(a.dtype), data, path)
        )
        return self._emit(
            ["ndarray", {"dtype": name, "shape": list(a.shape), "order": order, "storage": sid}]
        )


def encode(state: object) -> Encoded:
    """Turn a state into nodes and storages, or raise UnsupportedObjectError naming the path."""
    enc = _Encoder()
    with torch.no_grad():
        enc.add(state, "state", 0)
    return enc.out


# ---------------------------------------------------------------------------
# decoding: validation of the node table, then materialisation of subtrees


@dataclass
class StorageRecord:
    nbytes: int
    device: str
    first_chunk: int
    n_chunks: int
    key: str = ""
    kind: str = ""  # "tensor" or "ndarray" once referenced


@dataclass
class Tree:
    nodes: list[list[Any]]
    root: int
    children: list[tuple[int, ...]]
    storages: list[StorageRecord]


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
            raise self.fail(f"{what} is {v!r}, expected a non-negative integer")
        if v > hi:
            raise self.fail(f"{what} is {v}, above the limit {hi}", limit=True)
        return v

    def int_(self, v: object, what: str, lo: int = 0, hi: int | None = None) -> int:
        if type(v) is not int or v < lo or (hi is not None and v > hi):
            raise self.fail(f"{what} is {v!r}, expected an integer in [{lo}, {hi}]")
        return v

    def str_(self, v: object, what: str) -> str:
        if type(v) is not str:
            raise self.fail(f"{what} is not a string")
        if len(v) > Limits.MAX_STRING_BYTES:
            raise self.fail(f"{what} is longer than {Limits.MAX_STRING_BYTES}", limit=True)
        return v

    def list_(self, v: object, what: str) -> list[Any]:
        if type(v) is not list:
            raise self.fail(f"{what} is not a list")
        return v


def validate_tree(nodes_raw: object, storages: list[StorageRecord], path: str) -> Tree:
    """Check every node of the table; return the tree with each node's children."""
    c = _Check(path)
    nodes = c.list_(nodes_raw, "nodes")
    if not nodes:
        raise c.fail("the node table is empty")
    if len(nodes) > Limits.MAX_NODES:
        raise c.fail(f"{len(nodes)} nodes exceed the limit of {Limits.MAX_NODES}", limit=True)
    parent = [-1] * len(nodes)
    depth = [0] * len(nodes)
    children: list[tuple[int, ...]] = []

    def child(i: int, j: object, kinds: frozenset[str] | None = None) -> int:
        if type(j) is not int or not 0 <= j < i:
            raise c.fail(f"node {i} refers to node {j!r}; children must come before their parent")
        if parent[j] != -1:
            raise c.fail(f"node {j} has two parents ({parent[j]} and {i})")
        if kinds is not None and nodes[j][0] not in kinds:
            raise c.fail(f"node {i} uses a {nodes[j][0]} node as a dict key")
        parent[j] = i
        return j

    for i, node in enumerate(nodes):
        if type(node) is not list or not node or type(node[0]) is not str:
            raise c.fail(f"node {i} is not a [kind, ...] array")
        kind = node[0]
        kids: tuple[int, ...] = ()
        n = len(node)
        if kind == "none":
            ok = n == 1
        elif kind == "bool":
            ok = n == 2 and type(node[1]) is bool
        elif kind == "int":
            ok = (
                n == 2
                and type(node[1]) is str
                and len(node[1]) <= Limits.MAX_STRING_BYTES
                and _INT_RE.fullmatch(node[1]) is not None
                and node[1] != "-0"
            )
        elif kind == "float":
            ok = n == 2 and type(node[1]) is str and _FLOAT_RE.fullmatch(node[1]) is not None
        elif kind == "complex":
            ok = n == 3 and all(type(x) is str and _FLOAT_RE.fullmatch(x) for x in node[1:])
        elif kind == "str":
            ok = n == 2 and c.str_(node[1], f"node {i}") is not None
        elif kind == "bytes":
            ok = n == 2 and type(node[1]) is str
            if ok and len(node[1]) > Limits.MAX_STRING_BYTES * 4 // 3 + 4:
                raise c.fail(f"node {i} holds more than {Limits.MAX_STRING_BYTES} bytes", limit=True)
            ok = ok and _b64decode(c, i, node[1]) is not None
        elif kind in ("list", "tuple"):
            ok = n == 2 and type(node[1]) is list
            if ok:
                keykinds = None
                kids = tuple(child(i, j, keykinds) for j in node[1])
        elif kind in ("dict", "odict"):
            ok = (n == 2 if kind == "dict" else n == 3) and type(node[1]) is list
            if ok:
                ks = []
                for pair in node[1]:
                    if type(pair) is not list or len(pair) != 2:
                        raise c.fail(f"node {i} has an entry that is not a [key, value] pair")
                    ks.append(child(i, pair[0], _KEY_KINDS))
                    ks.append(child(i, pair[1]))
                if kind == "odict" and node[2] is not None:
                    ks.append(child(i, node[2], frozenset({"dict", "odict"})))
                kids = tuple(ks)
                seen: set[object] = set()
                for pair in node[1]:
                    key = _key_value(c, nodes, pair[0])
                    if key in seen:
                        raise c.fail(f"node {i} has the key {key!r} twice")
                    seen.add(key)
        elif kind == "dtype":
            ok = n == 2 and node[1] in dtypes.TORCH_DTYPES
            if not ok and n == 2 and type(node[1]) is str:
                raise c.unsupported(f"node {i} has dtype {node[1][:40]!r}, unknown to this reader")
        elif kind == "device":
            ok = n == 2 and type(node[1]) is str and _DEVICE_RE.fullmatch(node[1]) is not None
            if ok:
                try:
                    torch.device(node[1])
                except RuntimeError as e:
                    raise c.fail(f"node {i} names device {node[1]!r}, unknown to torch") from e
        elif kind == "size":
            ok = (
                n == 2
                and type(node[1]) is list
                and len(node[1]) <= Limits.MAX_RANK
                and all(
                    type(d) is str and len(d) <= 16 and _INT_RE.fullmatch(d) and not d.startswith("-")
                    for d in node[1]
                )
            )
        elif kind == "tensor":
            ok = n == 2 and _check_tensor(c, i, node[1], storages)
        elif kind == "ndarray":
            ok = n == 2 and _check_ndarray(c, i, node[1], storages)
        elif kind == "npscalar":
            dt = dtypes.numpy_dtype(node[1]) if n == 3 and type(node[1]) is str else None
            ok = dt is not None and type(node[2]) is str and len(node[2]) <= 32
            if ok:
                raw = _b64decode(c, i, node[2])
                assert dt is not None
                if len(raw) != dt.itemsize:
                    raise c.fail(f"node {i} holds {len(raw)} bytes for a {dt.itemsize}-byte scalar")
        else:
            raise c.unsupported(f"node {i} has unknown kind {kind[:40]!r}")
        if not ok:
            raise c.fail(f"node {i} ({kind}) is malformed")
        if kids:
            depth[i] = 1 + max(depth[k] for k in kids)
            if depth[i] > Limits.MAX_DEPTH:
                raise c.fail(f"nesting deeper than {Limits.MAX_DEPTH} levels", limit=True)
        children.append(kids)
    root = len(nodes) - 1
    for j in range(root):
        if parent[j] == -1:
            raise c.fail(f"node {j} is not part of the tree")
    for sid, rec in enumerate(storages):
        if not rec.kind:
            raise c.fail(f"storage {sid} is not used by any tensor or array")
    tree = Tree(nodes, root, children, storages)
    _name_storages(tree)
    return tree


def _b64decode(c: _Check, i: int, text: str) -> bytes:
    """Strict, canonical base64 (so every value has exactly one encoding)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise c.fail(f"node {i} has invalid base64") from e
    if base64.b64encode(raw).decode("ascii") != text:
        raise c.fail(f"node {i} has non-canonical base64")
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
    raise c.fail(f"a dict key contains a {kind} node, which is not hashable")


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
    if type(meta) is not dict or tuple(meta) != names:
        raise c.fail(f"node {i} must have exactly the fields {', '.join(names)}")
    return meta


def _use_storage(c: _Check, i: int, sid: object, storages: list[StorageRecord], kind: str) -> StorageRecord:
    sid = c.int_(sid, f"node {i} storage", 0, len(storages) - 1)
    rec = storages[sid]
    if rec.kind and (kind == "ndarray" or rec.kind != kind):
        raise c.fail(f"storage {sid} is used by node {i} and by another {rec.kind}")
    rec.kind = kind
    return rec


def _check_tensor(c: _Check, i: int, meta: object, storages: list[StorageRecord]) -> bool:
    m = _fields(c, i, meta, _TENSOR_FIELDS)
    name = m["dtype"]
    if name not in dtypes.TORCH_DTYPES:
        raise c.unsupported(f"node {i} has dtype {str(name)[:40]!r}, unknown to this reader")
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
    dt = dtypes.numpy_dtype(m["dtype"]) if type(m["dtype"]) is str else None
    if dt is None:
        raise c.unsupported(f"node {i} has numpy dtype {str(m['dtype'])[:40]!r}, unknown to this reader")
    shape = _shape(c, i, m["shape"], "shape")
    if m["order"] not in ("C", "F"):
        raise c.fail(f"node {i} has order {str(m['order'])[:8]!r}")
    rec = _use_storage(c, i, m["storage"], storages, "ndarray")
    if _numel(c, i, shape) * dt.itemsize != rec.nbytes:
        raise c.fail(
            f"node {i} needs {_numel(c, i, shape) * dt.itemsize} bytes, its storage has {rec.nbytes}"
        )
    return True


def _name_storages(tree: Tree) -> None:
    """Give each storage the key path of the first tensor that uses it (for messages)."""
    for path, i in iter_paths(tree, tree.root, "state"):
        node = tree.nodes[i]
        if node[0] in ("tensor", "ndarray"):
            rec = tree.storages[node[1]["storage"]]
            if not rec.key:
                rec.key = path


def iter_paths(tree: Tree, top: int, top_path: str) -> Iterator[tuple[str, int]]:
    """Every node under `top` with its key path, parents before children."""
    stack = [(top_path, top)]
    while stack:
        path, i = stack.pop()
        yield path, i
        node = tree.nodes[i]
        kind = node[0]
        if kind in ("list", "tuple"):
            stack.extend((f"{path}[{n}]", j) for n, j in reversed(list(enumerate(node[1]))))
        elif kind in ("dict", "odict"):
            for k, v in reversed(node[1]):
                stack.append((render_key(path, _key_repr(tree, k)), v))
            if kind == "odict" and node[2] is not None:
                stack.append((f"{path}._metadata", node[2]))


class _KeyText:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _key_repr(tree: Tree, k: int) -> object:
    node = tree.nodes[k]
    if node[0] == "str":
        return node[1]
    if node[0] == "int":
        return int(node[1], 16)
    return _KeyText(node[0])


def storages_under(tree: Tree, top: int) -> list[int]:
    """Storage ids the subtree at `top` needs, in file order."""
    out = set()
    stack = [top]
    while stack:
        i = stack.pop()
        node = tree.nodes[i]
        if node[0] in ("tensor", "ndarray"):
            out.add(node[1]["storage"])
        stack.extend(tree.children[i])
    return sorted(out)


def _unfloat(s: str) -> float:
    value: float = _DOUBLE.unpack(bytes.fromhex(s))[0]
    return value


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
