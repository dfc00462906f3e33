"""Validation: a node table read from a file -> a checked `Tree` (the reader's side of tree.py).

`validate_tree` checks every node once, in table order, before anything is built from
it (spec section 6): each kind's shape, children before their parent and one parent
each, dict keys that are keys (`key_problem`) and distinct with few hash collisions,
tensor and array metadata that stays inside its storage, every limit of spec section 8.
It returns the `Tree` that decode.py builds objects from without checking again.
`Check`, the helper that turns a failed check into CorruptError, LimitError or
UnsupportedError naming the file, is shared with the rest of the index's rules (index.py).
"""

from __future__ import annotations

import base64
import binascii
import re
from array import array
from typing import Any

from ..errors import CorruptError, LimitError, UnsupportedError
from . import dtypes, locations
from .layout import Limits
from .render import short_repr
from .tree import StorageRecord, Tree, float_value, node_text, over_string_limit

_INT_RE = re.compile(r"-?(?:0|[1-9a-f][0-9a-f]*)")
_FLOAT_RE = re.compile(r"[0-9a-f]{16}")
#: kinds whose values may be dict keys (a tuple only when its elements are keys too: key_problem)
_KEY_KINDS = frozenset({"none", "bool", "int", "float", "str", "tuple"})
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
_TENSOR_KEYS = frozenset(_TENSOR_FIELDS)
_N_TENSOR_FIELDS = len(_TENSOR_KEYS)
#: tensor dtypes that may require grad (floating point and complex), and the complex ones
_GRAD_DTYPES = frozenset(
    n for n in dtypes.TENSOR_ITEMSIZES if dtypes.is_floating_point(n) or dtypes.is_complex(n)
)
_COMPLEX_DTYPES = frozenset(n for n in dtypes.TENSOR_ITEMSIZES if dtypes.is_complex(n))
_TENSOR_ITEMSIZES = dtypes.TENSOR_ITEMSIZES
_ARRAY_FIELDS = ("dtype", "shape", "order", "storage")
#: longest base64 text of a bytes value within the limit
_MAX_B64 = 4 * -(-Limits.MAX_STRING_BYTES // 3)


class TextCount:
    """What the checks accepted of an index's JSON text, counted as they go: the members of its
    objects (as the dicts json built hold them) and the colons inside the strings they kept.
    Text without escapes holds exactly that many colons when no object repeats a member: a
    repeated member's colon is in the text and in no dict json built (index.py compares)."""

    __slots__ = ("members", "colons")

    def __init__(self) -> None:
        self.members = 0
        self.colons = 0

    def strings(self, *texts: str) -> None:
        """Count the colons of `texts`, strings of the JSON text the checks accepted."""
        for text in texts:
            if ":" in text:
                self.colons += text.count(":")


class Check:
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
        if len(v) > Limits.MAX_STRING_BYTES // 4 and over_string_limit(v):  # shorter: within it, unmeasured
            raise self.fail(f"{what} is longer than {Limits.MAX_STRING_BYTES} bytes", limit=True)
        return v

    def list_(self, v: object, what: str) -> list[Any]:
        if type(v) is not list:
            raise self.fail(f"{what} is not a list")
        return v


def validate_tree(
    nodes_raw: object, storages: list[StorageRecord], path: str, count: TextCount | None = None
) -> Tree:
    """Check every node of the table; return the tree with each node's parent.  `count`: the
    members of the node table's objects and the colons of its strings are added to it."""
    c = Check(path)
    nodes = c.list_(nodes_raw, "nodes")
    if not nodes:
        raise c.fail("the node table is empty")
    if len(nodes) > Limits.MAX_NODES:
        raise c.fail(f"{len(nodes)} nodes exceed the limit of {Limits.MAX_NODES}", limit=True)
    # compact tables (4, 4 and 2 bytes a node): the memory per node is mostly json's
    parent = array("i", [-1]) * len(nodes)
    slot = array("i", [0]) * len(nodes)
    depth = array("H", [0]) * len(nodes)
    short_str = Limits.MAX_STRING_BYTES // 4  # UTF-8 takes at most 4 bytes a character
    # for `count`: tensor nodes (8 members each), ndarray nodes (4 each), and the colons in the
    # strings that may hold one (keys, devices, numpy dtype names); every other string is
    # checked to be a name from a table, hex digits or base64, which hold none
    tensors = ndarrays = colons = 0

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
        # the commonest kinds first (the order only saves comparisons)
        if kind == "tensor":
            ok = n == 2 and _check_tensor(c, i, node[1], storages)
            tensors += 1
        elif kind == "str":
            text = node[1] if n == 2 else ""
            # a short string is within the limit unmeasured (Check.str_, which names the fault)
            ok = n == 2 and (
                (type(text) is str and len(text) <= short_str) or c.str_(text, f"node {i}") is not None
            )
            if ok and ":" in text:
                colons += text.count(":")
        elif kind == "none":
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
                    k, v = pair
                    if (
                        type(k) is int
                        and type(v) is int
                        and 0 <= k < i
                        and 0 <= v < i
                        and k != v
                        and parent[k] == -1
                        and parent[v] == -1
                    ):  # two sound children: `child`'s work without its calls
                        parent[k] = parent[v] = i
                        slot[k] = 2 * e
                        slot[v] = 2 * e + 1
                        dk, dv = depth[k], depth[v]
                        if dk > deepest or dv > deepest:  # rarely: most keys and values are leaves
                            deepest = max(dk, dv)
                    else:  # child raises, naming the fault
                        deepest = max(deepest, child(i, k, 2 * e), child(i, v, 2 * e + 1))
                    if nodes[k][0] != "str":  # a str node is a key
                        _check_key(c, nodes, i, k)
                if kind == "odict" and node[2] is not None:
                    deepest = max(deepest, child(i, node[2], -1))
                    if nodes[node[2]][0] not in ("dict", "odict"):
                        raise c.fail(f"node {i} uses a {nodes[node[2]][0]} node as its _metadata")
                _check_keys(c, nodes, i, node[1])
        elif kind == "dtype":
            ok = n == 2 and type(node[1]) is str and dtypes.is_tensor_dtype(node[1])
            if not ok and n == 2 and type(node[1]) is str:
                raise c.unsupported(f"node {i} has dtype {short_repr(node[1], 40)}, unknown to this reader")
        elif kind == "device":
            # whether torch knows the device is asked when it is built (decode.py): the
            # tree is checked without torch, and a backend's name is known only where it is
            # registered (spec section 6)
            ok = n == 2 and locations.valid_location(node[1])
            colons += node[1].count(":") if ok else 0
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
        elif kind == "ndarray":
            ok = n == 2 and _check_ndarray(c, i, node[1], storages)
            ndarrays += 1
            colons += node[1]["dtype"].count(":") if ok else 0
        else:  # npscalar
            ok = n == 3 and type(node[1]) is str and type(node[2]) is str and len(node[2]) <= 32
            size = dtypes.numpy_itemsize(node[1]) if ok else None
            if ok and size is None:  # as for an ndarray of that dtype
                raise c.unsupported(
                    f"node {i} has numpy dtype {short_repr(node[1], 40)}, unknown to this reader"
                )
            if ok:
                colons += node[1].count(":")
                raw = _b64decode(c, i, node[2])
                if len(raw) != size:
                    raise c.fail(f"node {i} holds {len(raw)} bytes for a {size}-byte scalar")
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
    if count is not None:
        count.members += _N_TENSOR_FIELDS * tensors + len(_ARRAY_FIELDS) * ndarrays
        count.colons += colons
    tree = Tree(nodes, root, storages, parent, slot)
    tree.name_storage_keys()
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


def _check_key(c: Check, nodes: list[list[Any]], i: int, j: int) -> None:
    problem = key_problem(nodes, j)
    if problem is not None:
        raise c.fail(f"node {i}: {problem}")


def _check_keys(c: Check, nodes: list[list[Any]], i: int, pairs: list[list[int]]) -> None:
    """No two keys of dict node i are equal (as Python compares them), and at most
    MAX_KEY_COLLISIONS share a hash, so the checks here and the dict built on load take
    time linear in the number of keys even when they are chosen to collide."""
    if len(pairs) < 2:
        return
    keys = [nodes[k][1] if nodes[k][0] == "str" else key_value(c, nodes, k) for k, _ in pairs]
    if len(set(map(hash, keys))) == len(keys):
        return  # no two keys share a hash, so none is equal to another either
    seen: set[object] = set()
    counts: dict[int, int] | None = {} if len(pairs) > Limits.MAX_KEY_COLLISIONS else None
    for pair, key in zip(pairs, keys):
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


def _b64decode(c: Check, i: int, text: str) -> bytes:
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


def key_value(c: Check, nodes: list[list[Any]], j: int) -> object:
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
        return float_value(node[1])
    if kind == "tuple":
        return tuple(key_value(c, nodes, k) for k in node[1])
    raise c.fail(f"a dict key contains a {kind} node")  # validate_tree refused it already: for safety


def _shape(c: Check, i: int, v: object, what: str) -> list[int]:
    dims = c.list_(v, f"node {i} {what}")
    if len(dims) > Limits.MAX_RANK:
        raise c.fail(f"node {i} has rank {len(dims)}, above the limit {Limits.MAX_RANK}", limit=True)
    for d in dims:
        if type(d) is not int or not 0 <= d <= Limits.MAX_NUMEL:
            c.bounded_int(d, f"node {i} {what} entry", Limits.MAX_NUMEL)  # raises, naming the entry
    return dims


def _numel(c: Check, i: int, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    if n > Limits.MAX_NUMEL:
        raise c.fail(f"node {i} has {n} elements, above the limit {Limits.MAX_NUMEL}", limit=True)
    return n


def _fields(c: Check, i: int, meta: object, names: tuple[str, ...]) -> dict[str, Any]:
    # member order carries no meaning (spec section 5): JSON libraries that ignore it must work
    if type(meta) is not dict or meta.keys() != set(names):
        raise c.fail(f"node {i} must have exactly the fields {', '.join(names)}")
    return meta


def _use_storage(c: Check, i: int, sid: object, storages: list[StorageRecord], kind: str) -> StorageRecord:
    if type(sid) is not int or not 0 <= sid < len(storages):
        sid = c.int_(sid, f"node {i} storage", 0, len(storages) - 1)  # raises
    rec = storages[sid]
    if rec.kind and (kind == "ndarray" or rec.kind != kind):
        raise c.fail(f"storage {sid} is used by node {i} and by another {rec.kind}")
    rec.kind = kind
    if rec.node < 0:
        rec.node = i
    return rec


def _check_tensor(c: Check, i: int, meta: object, storages: list[StorageRecord]) -> bool:
    """Tensor node i's metadata is sound and stays inside its storage, which it claims.  One
    pass of plain comparisons accepts the common, sound node; anything it does not accept goes
    to `_tensor_problem`, which checks again field by field and raises naming the first fault."""
    if type(meta) is not dict or len(meta) != _N_TENSOR_FIELDS:
        return _tensor_problem(c, i, meta, storages)
    try:  # as many members as fields, and each field found: exactly the fields
        name, shape, stride, offset, sid = (
            meta["dtype"],
            meta["shape"],
            meta["stride"],
            meta["offset"],
            meta["storage"],
        )
        requires_grad, param, conj = meta["requires_grad"], meta["param"], meta["conj"]
    except KeyError:
        return _tensor_problem(c, i, meta, storages)
    itemsize = _TENSOR_ITEMSIZES.get(name) if type(name) is str else None
    max_numel = Limits.MAX_NUMEL
    if not (
        itemsize is not None
        and type(shape) is list
        and type(stride) is list
        and len(shape) == len(stride) <= Limits.MAX_RANK
        and type(offset) is int
        and 0 <= offset <= Limits.MAX_STORAGE_BYTES
        and type(sid) is int
        and 0 <= sid < len(storages)
        and type(requires_grad) is bool
        and type(param) is bool
        and type(conj) is bool
        and (not requires_grad or name in _GRAD_DTYPES)
        and (not conj or name in _COMPLEX_DTYPES)
    ):
        return _tensor_problem(c, i, meta, storages)
    numel = 1
    last = offset  # the element furthest into the storage
    for d, step in zip(shape, stride):
        if (
            type(d) is not int
            or type(step) is not int
            or not (0 <= d <= max_numel and 0 <= step <= max_numel)
        ):
            return _tensor_problem(c, i, meta, storages)
        numel *= d
        last += (d - 1) * step
    rec = storages[sid]
    extent = last + 1 if numel else offset
    if numel > max_numel or extent * itemsize > rec.nbytes or (rec.kind and rec.kind != "tensor"):
        return _tensor_problem(c, i, meta, storages)
    rec.kind = "tensor"
    if rec.node < 0:
        rec.node = i
        rec.whole = not offset and numel > 0 and not conj and extent * itemsize == rec.nbytes
    return True


def _tensor_problem(c: Check, i: int, meta: object, storages: list[StorageRecord]) -> bool:
    """`_check_tensor` field by field, in the order of its messages: raises naming the first fault."""
    if type(meta) is not dict or meta.keys() != _TENSOR_KEYS:
        _fields(c, i, meta, _TENSOR_FIELDS)  # raises
    m: dict[str, Any] = meta  # type: ignore[assignment]
    name = m["dtype"]
    if type(name) is not str:
        raise c.fail(f"node {i} has dtype {short_repr(name, 40)}, not a string")
    itemsize = dtypes.TENSOR_ITEMSIZES.get(name)
    if itemsize is None:
        raise c.unsupported(f"node {i} has dtype {short_repr(name, 40)}, unknown to this reader")
    shape = _shape(c, i, m["shape"], "shape")
    stride = _shape(c, i, m["stride"], "stride")
    if len(stride) != len(shape):
        raise c.fail(f"node {i} has {len(shape)} dimensions but {len(stride)} strides")
    offset = m["offset"]
    if type(offset) is not int or not 0 <= offset <= Limits.MAX_STORAGE_BYTES:
        c.bounded_int(offset, f"node {i} offset", Limits.MAX_STORAGE_BYTES)  # raises
    rec = _use_storage(c, i, m["storage"], storages, "tensor")
    requires_grad, conj = m["requires_grad"], m["conj"]
    if type(requires_grad) is not bool or type(m["param"]) is not bool or type(conj) is not bool:
        for f in ("requires_grad", "param", "conj"):
            if type(m[f]) is not bool:
                raise c.fail(f"node {i} field {f} is not a boolean")
    if requires_grad and not (dtypes.is_floating_point(name) or dtypes.is_complex(name)):
        raise c.fail(f"node {i} asks for requires_grad on a {name} tensor")
    if conj and not dtypes.is_complex(name):
        raise c.fail(f"node {i} is a conjugate view of a {name} tensor")
    numel = 1
    last = offset  # the element furthest into the storage
    for d, step in zip(shape, stride):
        numel *= d
        last += (d - 1) * step
    if numel > Limits.MAX_NUMEL:
        raise c.fail(f"node {i} has {numel} elements, above the limit {Limits.MAX_NUMEL}", limit=True)
    extent = last + 1 if numel else offset
    if extent * itemsize > rec.nbytes:
        raise c.fail(f"node {i} reaches byte {extent * itemsize} of a storage of {rec.nbytes} bytes")
    return True


def _check_ndarray(c: Check, i: int, meta: object, storages: list[StorageRecord]) -> bool:
    m = _fields(c, i, meta, _ARRAY_FIELDS)
    if type(m["dtype"]) is not str:
        raise c.fail(f"node {i} has numpy dtype {short_repr(m['dtype'], 40)}, not a string")
    itemsize = dtypes.numpy_itemsize(m["dtype"])
    if itemsize is None:
        raise c.unsupported(f"node {i} has numpy dtype {short_repr(m['dtype'], 40)}, unknown to this reader")
    shape = _shape(c, i, m["shape"], "shape")
    if m["order"] not in ("C", "F"):
        raise c.fail(f"node {i} has order {short_repr(m['order'], 12)}")
    rec = _use_storage(c, i, m["storage"], storages, "ndarray")
    if _numel(c, i, shape) * itemsize != rec.nbytes:
        raise c.fail(f"node {i} needs {_numel(c, i, shape) * itemsize} bytes, its storage has {rec.nbytes}")
    return True
