"""The object model: a training state as a flat table of typed nodes.

No pickle.  Every value is one node, a JSON array whose first element is its
kind (spec/FORMAT.md, "Object tree").  Children always come before their
parent and each node has exactly one parent, so the table is a tree by
construction: no cycles, no shared subtrees that expand exponentially, no
orphans.  Tensor bytes live in storages; tensors that share a storage in the
saved state point to the same storage record and share it again on load.

The model is used in two directions, each in its own module: encode.py turns a
state into nodes and storage plans (the writer's side), validate.py checks a
table read from a file and returns a `Tree`, and decode.py builds objects from a
checked `Tree` (the reader's side).  This module holds what both sides share:
the text form of float nodes, the string limit, the checked `Tree` with its
storage records, and the walks over it (key paths, subtrees, storages needed).
"""

from __future__ import annotations

import struct
import weakref
from array import array
from collections.abc import Iterator
from typing import Any

from .layout import Limits
from .render import KEY_CHARS, extend_path, key_text, short_repr

_DOUBLE = struct.Struct("<d")
_CONTAINER_KINDS = frozenset({"list", "tuple", "dict", "odict"})


def float_text(x: float) -> str:
    """A float node's text: the 8 bytes of the little-endian double, in hex (exact, NaNs kept)."""
    return _DOUBLE.pack(x).hex()


def float_value(s: str) -> float:
    """The float a float node's text (float_text) holds."""
    value: float = _DOUBLE.unpack(bytes.fromhex(s))[0]
    return value


def utf8_length(text: str) -> int:
    """Bytes of `text` in UTF-8 (lone surrogates, which JSON can carry, count as 3)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def over_string_limit(text: str) -> bool:
    """Whether `text` is longer in UTF-8 than any string a reader accepts (spec section 8)."""
    return len(text) > Limits.MAX_STRING_BYTES // 4 and utf8_length(text) > Limits.MAX_STRING_BYTES


class StorageRecord:
    """One storage of a file's index: its size, device and chunks, and which node first uses it.

    A plain class with slots, as is Tree: a file holds one record per storage (10^5 for a state
    of 10^5 small tensors), and a dataclass's generated methods cost a process's first load
    about a millisecond of import each."""

    __slots__ = ("nbytes", "device", "first_chunk", "n_chunks", "kind", "node", "whole", "_tree", "_key")

    def __init__(
        self, nbytes: int, device: str, first_chunk: int, n_chunks: int, kind: str = "", node: int = -1
    ) -> None:
        self.nbytes = nbytes
        self.device = device
        self.first_chunk = first_chunk
        self.n_chunks = n_chunks
        self.kind = kind  # "tensor" or "ndarray" once referenced
        self.node = node  # the first tensor or array node that uses it (names it in messages)
        #: that node is a tensor whose elements span exactly this storage's bytes from its start
        #: (offset 0, at least one element, not a conjugate view): a load of a small storage
        #: allocates (or maps) it as that tensor, in one call (files/reader.py)
        self.whole = False
        # weak: the tree holds its records, and a strong reference back would make every index a
        # reference cycle that outlives its file until a collection of the whole heap finds it
        self._tree: weakref.ref[Tree] | None = None
        self._key: str | None = None

    def _fields(self) -> tuple[int, str, int, int, str, int]:
        return (self.nbytes, self.device, self.first_chunk, self.n_chunks, self.kind, self.node)

    def __eq__(self, other: object) -> bool:
        if type(other) is not StorageRecord:
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        return (
            f"StorageRecord(nbytes={self.nbytes}, device={self.device!r}, first_chunk={self.first_chunk}, "
            f"n_chunks={self.n_chunks}, kind={self.kind!r}, node={self.node})"
        )

    @property
    def key(self) -> str:
        """The key path of the first tensor using this storage, rendered on first use."""
        if self._key is None:
            tree = self._tree() if self._tree is not None else None
            self._key = "" if tree is None or self.node < 0 else tree.key_path(self.node)
        return self._key


class Tree:
    """A checked node table (validate.validate_tree): every node's parent and place in it known."""

    __slots__ = ("nodes", "root", "storages", "parent", "slot", "root_name", "__weakref__")

    def __init__(
        self,
        nodes: list[list[Any]],
        root: int,
        storages: list[StorageRecord],
        parent: array[int],
        slot: array[int],
        root_name: str = "state",
    ) -> None:
        self.nodes = nodes
        self.root = root
        self.storages = storages
        #: each node's parent (-1 for the root) and its place there: the position in a list or
        #: tuple; 2*e for the key and 2*e+1 for the value of dict entry e; -1 for `_metadata`
        self.parent = parent
        self.slot = slot
        self.root_name = root_name

    def __repr__(self) -> str:
        return f"Tree({len(self.nodes)} nodes, root {self.root}, {len(self.storages)} storages)"

    def name_storage_keys(self) -> None:
        """Let each storage render its key (StorageRecord.key) from this tree, which holds it."""
        ref = weakref.ref(self)  # one for all
        for rec in self.storages:
            rec._tree = ref

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
        text = repr(float_value(node[1]))
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
