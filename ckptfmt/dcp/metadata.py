"""DCP's global ``Metadata`` as plain ckptfmt values, and back, validating everything.

The commit record of a DCP checkpoint (layout ``"dcp"``) carries this value in its
``dcp`` member (spec/FORMAT.md, "Multi-file checkpoints")::

    {"version": "1.0.0" | None,          # DCP's metadata version (its key-flattening rules)
     "world_size": 4,                    # ranks that saved
     "tensors": {"keys": [fqn, ...],     # n tensors, in columns:
                 "dtypes": ["bfloat16", ...],       # the dtype names they use
                 "props": int64 array [n, 4],       # dtype index, requires_grad, ndim, chunk rows
                 "sizes": int64 array [sum ndim],   # each tensor's size, one after another
                 "chunks": int64 array [...]},      # each tensor's chunk rows, one after another
     "bytes": {fqn: [file, key]},
     "planner_data": {fqn: ("model", "layer", "weight"), ...} | None,
     "storage_meta": {"checkpoint_id": str | None, "save_id": str | None, "modules": [str]} | None}

A chunk row is one saved chunk: its offsets in the global tensor (ndim values), its
sizes (ndim values), the index of the part file in the record's ``files`` list and
the item's key in that file's root dict.  Columns, not an entry per tensor: a state
has thousands of tensors, and every rank parses this record on every load.  Reading
checks every field's type and range, that each tensor's chunks lie inside it and
tile it exactly (no overlap, no hole: a hole would leave part of a loaded tensor
unwritten without an error), and raises CorruptError naming the key; a damaged or
hostile record never surfaces as a KeyError, an IndexError or a crash.

The arrays are read as their stored bytes (format/arrays.py) and every check is plain
Python (`check_value`, which ``verify`` runs without torch or numpy); `to_metadata` then
builds torch's Metadata for a load from the checked values (`from_value` does both).
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, CorruptError, LimitError, UnsupportedError, UnsupportedObjectError
from ..format import dtypes
from ..format.arrays import INT64, StoredArray
from ..format.layout import Limits
from ..gcpause import pausing

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

#: DCP's metadata version written by this torch's own FileSystemWriter (filesystem.CURRENT_DCP_VERSION)
DCP_VERSION = "1.0.0"
_FIELDS = ("version", "world_size", "tensors", "bytes", "planner_data", "storage_meta")
_TENSOR_FIELDS = ("keys", "dtypes", "props", "sizes", "chunks")
_STORAGE_META_FIELDS = ("checkpoint_id", "save_id", "modules")
#: items one file may hold, and ranks one record may name (the record's own part limit)
MAX_KEY = (1 << 31) - 1
MAX_WORLD = 1 << 24
#: chunk rows one tensor may have
MAX_ROWS = 1 << 24
#: chunk rows one record may have in all (a limit error past it): 4096 ranks' shards of 1024
#: tensors; checking that many takes tens of seconds and GiBs of Python ints on one core
MAX_RECORD_ROWS = 1 << 22
#: chunk pairs of one tensor that may need comparing (their extents meet along the sweep's
#: dimension) before the check gives up with a LimitError
_MAX_PAIRS = 1 << 22
#: an empty chunk at a saved chunk's offsets would hide where that chunk lives
_SAME_OFFSETS = "two chunks have the same offsets"
#: keys in a planner_data path: the saved structure nests no deeper than an object tree may
MAX_PATH = Limits.MAX_DEPTH - 1
#: list elements the planner data may describe, in all: an object tree holds at most this many nodes
MAX_LIST_SLOTS = Limits.MAX_NODES

#: an item of the record as plain values: its key and, for a tensor's chunk, the chunk's
#: offsets (None for a non-tensor value); DCP's MetadataIndex(fqn, offsets) for a load
ItemKey = tuple[str, "tuple[int, ...] | None"]


@dataclass(frozen=True)
class Location:
    """Where a saved item lives: a part file of the checkpoint, and the item in it.

    For a multi-file checkpoint `key` is the item's key in the part's root dict; for
    a single ckptfmt file loaded as a DCP checkpoint it is the item's node in the
    file's object tree.  `sizes` is the shape of the saved chunk (None for non-tensors).
    """

    file: str
    key: int
    sizes: tuple[int, ...] | None = None
    dtype: str | None = None  # the dtype name the record gives (None for non-tensors)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the record, checked: its chunks tile it exactly."""

    fqn: str
    dtype: str
    requires_grad: bool
    size: tuple[int, ...]
    offsets: list[tuple[int, ...]]  # each chunk's offsets; its sizes are its Location's


@dataclass
class CheckedRecord:
    """A record's ``dcp`` member with every check a load makes passed, as plain values (no
    torch): what ``verify`` needs, and what `to_metadata` turns into DCP's Metadata for a load."""

    version: str | None
    world_size: int
    tensors: list[TensorEntry] = field(default_factory=list)
    values: list[str] = field(default_factory=list)  # the keys of non-tensor items
    planner_data: dict[str, tuple[str | int, ...]] | None = None
    storage_meta: dict[str, Any] | None = None
    where: dict[ItemKey, Location] = field(default_factory=dict)

    def items(self) -> list[tuple[str, Location]]:
        """Every saved item: its key and where it lies (a tensor once per chunk)."""
        return [(key[0], loc) for key, loc in self.where.items()]


# -- Metadata -> value ----------------------------------------------------------------------


@pausing
def to_value(
    md: Metadata, where: dict[MetadataIndex, tuple[int, int]], world_size: int, fail_path: str
) -> dict[str, Any]:
    """The record's ``dcp`` member for `md`; `where` maps each saved item to (file index, key)."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    columns = _TensorColumns()
    byte_items: dict[str, list[int]] = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, TensorStorageMetadata):
            columns.add(fqn, sm, where, fail_path)
        elif isinstance(sm, BytesStorageMetadata):
            loc = where.get(MetadataIndex(fqn))
            if loc is None:
                raise CheckpointError("no rank reported writing this value", path=fail_path, key=fqn)
            byte_items[fqn] = [loc[0], loc[1]]
        else:
            raise UnsupportedObjectError(f"unknown DCP storage metadata {type(sm).__name__}", key=fqn)
    return {
        "version": md.version if isinstance(md.version, str) else DCP_VERSION,
        "world_size": world_size,
        "tensors": columns.value(),
        "bytes": byte_items,
        "planner_data": md.planner_data,
        "storage_meta": _storage_meta_value(md.storage_meta),
    }


class _TensorColumns:
    """The ``tensors`` member, built a tensor at a time."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.dtypes: dict[str, int] = {}
        self.props: list[int] = []
        self.sizes: list[int] = []
        self.chunks: list[int] = []

    def add(
        self, fqn: str, sm: TensorStorageMetadata, where: dict[MetadataIndex, tuple[int, int]], fail_path: str
    ) -> None:
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        name = dtypes.TORCH_NAMES.get(sm.properties.dtype)
        if name is None:
            raise UnsupportedObjectError(f"dtype {sm.properties.dtype} is not supported by ckptfmt", key=fqn)
        if sm.properties.layout != torch.strided:
            raise UnsupportedObjectError(f"layout {sm.properties.layout} is not supported", key=fqn)
        for ch in sm.chunks:
            loc = where.get(MetadataIndex(fqn, ch.offsets))
            if loc is None:
                raise CheckpointError(
                    f"no rank reported writing the chunk at offsets {list(ch.offsets)}",
                    path=fail_path,
                    key=fqn,
                )
            self.chunks += [*ch.offsets, *ch.sizes, *loc]
        index = self.dtypes.setdefault(name, len(self.dtypes))
        self.keys.append(fqn)
        self.props += [index, int(bool(sm.properties.requires_grad)), len(sm.size), len(sm.chunks)]
        self.sizes += [int(d) for d in sm.size]

    def value(self) -> dict[str, Any]:
        return {
            "keys": self.keys,
            "dtypes": list(self.dtypes),
            "props": StoredArray.of_ints(self.props, (len(self.keys), 4)),
            "sizes": StoredArray.of_ints(self.sizes),
            "chunks": StoredArray.of_ints(self.chunks),
        }


def _storage_meta_value(sm: StorageMeta | None) -> dict[str, Any] | None:
    if sm is None:
        return None
    cid = sm.checkpoint_id
    return {
        "checkpoint_id": None if cid is None else str(cid),
        "save_id": sm.save_id if isinstance(sm.save_id, str) else None,
        "modules": [m for m in sm.modules if isinstance(m, str)],
    }


# -- value -> checked plain values -> Metadata ---------------------------------------------------


class _Fail:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, msg: str, key: str | None = None, limit: bool = False) -> CheckpointError:
        cls = LimitError if limit else CorruptError
        return cls(f"DCP metadata: {msg}", path=self.path, key=key)


def _exact(
    fail: _Fail, v: object, fields: tuple[str, ...], what: str, key: str | None = None
) -> dict[str, Any]:
    if type(v) is not dict or set(v) != set(fields):
        raise fail(f"{what} must be a dict with exactly " + ", ".join(fields), key)
    return v


def _int(fail: _Fail, v: object, what: str, lo: int, hi: int, key: str | None = None) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise fail(f"{what} must be an int in [{lo}, {hi}], not {str(v)[:40]}", key)
    return v


def from_value(value: object, files: list[str], path: str) -> tuple[Metadata, dict[MetadataIndex, Location]]:
    """DCP's Metadata from a record's ``dcp`` member, and where each item lies (by file name):
    `check_value`'s checks, then `to_metadata`."""
    return to_metadata(check_value(value, files, path))


@pausing
def check_value(value: object, files: list[str], path: str) -> CheckedRecord:
    """A record's ``dcp`` member checked as a load checks it (CorruptError, LimitError or
    UnsupportedError naming the key), without torch: the one check that loads and verify make."""
    fail = _Fail(path)
    d = _exact(fail, value, _FIELDS, "the dcp member")
    version = d["version"]
    if version is not None and type(version) is not str:
        raise fail("version must be a str or None")
    out = CheckedRecord(version, _int(fail, d["world_size"], "world_size", 1, MAX_WORLD))
    tensors = d["tensors"]
    byte_items = d["bytes"]
    if type(tensors) is not dict or type(byte_items) is not dict:
        raise fail("tensors and bytes must be dicts")
    _check_tensors(fail, tensors, files, out)
    tensor_keys = [t.fqn for t in out.tensors]
    seen = set(tensor_keys)
    for fqn, loc in byte_items.items():
        if type(fqn) is not str:
            raise fail("a value key is not a str")
        if fqn in seen:
            raise fail("the key is both a tensor and a value", fqn)
        if type(loc) is not list or len(loc) != 2:
            raise fail("a value's location must be [file, key]", fqn)
        f = _int(fail, loc[0], "file index", 0, len(files) - 1, fqn)
        k = _int(fail, loc[1], "item key", 0, MAX_KEY, fqn)
        out.values.append(fqn)
        out.where[(fqn, None)] = Location(files[f], k)
    out.planner_data = d["planner_data"]
    _check_planner_data(fail, out.planner_data, [*tensor_keys, *out.values])
    out.storage_meta = _check_storage_meta(fail, d["storage_meta"])
    return out


@pausing
def to_metadata(checked: CheckedRecord) -> tuple[Metadata, dict[MetadataIndex, Location]]:
    """DCP's Metadata of a checked record, and where each item lies (what a load needs)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    where: dict[MetadataIndex, Location] = {}
    for t in checked.tensors:
        chunks = []
        for offsets in t.offsets:
            loc = checked.where[(t.fqn, offsets)]
            o = torch.Size(offsets)
            chunks.append(ChunkStorageMetadata(offsets=o, sizes=torch.Size(loc.sizes or ())))
            where[MetadataIndex(t.fqn, o)] = loc
        dtype = dtypes.TORCH_DTYPES.get(t.dtype)
        if dtype is None:  # a name of the format this torch lacks
            raise UnsupportedError(f"DCP metadata: dtype {t.dtype!r} is unknown to this torch", key=t.fqn)
        props = TensorProperties(dtype=dtype, requires_grad=t.requires_grad)
        sdm[t.fqn] = TensorStorageMetadata(properties=props, size=torch.Size(t.size), chunks=chunks)
    for fqn in checked.values:
        sdm[fqn] = BytesStorageMetadata()
        where[MetadataIndex(fqn)] = checked.where[(fqn, None)]
    sm = checked.storage_meta
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=checked.planner_data,
        storage_data=None,
        storage_meta=None if sm is None else StorageMeta(**sm),
        version=checked.version,
    )
    return md, where


def _int64_column(fail: _Fail, v: object, ndim: int, what: str) -> StoredArray:
    if type(v) is not StoredArray or v.dtype != INT64 or v.ndim != ndim:
        raise fail(f"{what} must be an int64 array of {ndim} dimension{'s' if ndim > 1 else ''}")
    return v


@dataclass(frozen=True)
class _Shape:
    """One tensor's props and sizes, checked: what its chunk rows are checked against."""

    fqn: str
    dtype: str
    requires_grad: bool
    size: list[int]
    numel: int
    rows: int


def _check_tensors(fail: _Fail, value: object, files: list[str], out: CheckedRecord) -> None:
    """Every tensor's entry (into `out.tensors`) and its chunks' locations (into `out.where`).
    Each column's length is checked against what the columns before it say before its
    values are read: a hostile record cannot make this build more ints than its keys and
    chunk rows call for (MAX_RECORD_ROWS)."""
    t = _exact(fail, value, _TENSOR_FIELDS, "the tensors member")
    keys, names = t["keys"], t["dtypes"]
    if type(keys) is not list or any(type(k) is not str for k in keys):
        raise fail("tensors.keys must be a list of str")
    if len(set(keys)) != len(keys):
        raise fail("tensors.keys has a key twice")
    if type(names) is not list or any(type(n) is not str for n in names):
        raise fail("tensors.dtypes must be a list of str")
    shapes = _check_shapes(fail, keys, names, t["props"], t["sizes"])
    widths = [2 * len(s.size) + 2 for s in shapes]
    rows = sum(s.rows for s in shapes)
    if rows > MAX_RECORD_ROWS:
        raise fail(f"tensors.props calls for {rows} chunk rows, more than {MAX_RECORD_ROWS}", limit=True)
    chunks_flat = _ints_of(
        fail, t["chunks"], sum(s.rows * w for s, w in zip(shapes, widths)), "tensors.chunks"
    )
    row_at = 0
    for shape, width in zip(shapes, widths):
        fqn, size, ndim = shape.fqn, shape.size, len(shape.size)
        flat = chunks_flat[row_at : row_at + shape.rows * width]
        row_at += shape.rows * width
        table = [flat[r : r + width] for r in range(0, len(flat), width)]
        check_rows(fail, fqn, table, size, shape.numel, len(files))
        offsets = []
        for row in table:
            o = tuple(row[:ndim])
            offsets.append(o)
            out.where[(fqn, o)] = Location(
                files[row[2 * ndim]], row[2 * ndim + 1], tuple(row[ndim : 2 * ndim]), shape.dtype
            )
        out.tensors.append(TensorEntry(fqn, shape.dtype, shape.requires_grad, tuple(size), offsets))


def _check_shapes(
    fail: _Fail, keys: list[str], names: list[str], props: object, sizes: object
) -> list[_Shape]:
    """Each tensor's props and sizes checked: the props column is as long as the keys, the
    sizes column as the tensors' ndims call for, each read only once its length is right."""
    props_column = _int64_column(fail, props, 2, "tensors.props")
    if props_column.shape != (len(keys), 4):
        raise fail(f"tensors.props must have shape [{len(keys)}, 4]")
    flat_props = props_column.ints()
    for i, fqn in enumerate(keys):
        ndim, n_rows = flat_props[4 * i + 2 : 4 * i + 4]
        _int(fail, ndim, "ndim", 0, Limits.MAX_RANK, fqn)
        _int(fail, n_rows, "the number of chunk rows", 1, MAX_ROWS, fqn)
    sizes_flat = _ints_of(fail, sizes, sum(flat_props[2::4]), "tensors.sizes")
    out: list[_Shape] = []
    size_at = 0
    for i, fqn in enumerate(keys):
        dt, grad, ndim, n_rows = flat_props[4 * i : 4 * i + 4]
        if not 0 <= dt < len(names):
            raise fail(f"dtype index {dt} is not in tensors.dtypes", fqn)
        name = names[dt]
        if not dtypes.is_tensor_dtype(name):
            raise UnsupportedError(f"DCP metadata: dtype {name[:40]!r} is unknown to this reader", key=fqn)
        if grad not in (0, 1):
            raise fail("requires_grad must be 0 or 1", fqn)
        size = sizes_flat[size_at : size_at + ndim]
        size_at += ndim
        for d in size:
            _int(fail, d, "a size", 0, Limits.MAX_NUMEL, fqn)
        numel = math.prod(size)
        if numel > Limits.MAX_NUMEL:
            raise fail(f"{numel} elements exceed the limit {Limits.MAX_NUMEL}", fqn, limit=True)
        if n_rows > math.prod(d + 1 for d in size):  # rows at distinct offsets inside the tensor
            raise fail(f"{n_rows} chunk rows cannot lie at distinct offsets inside the tensor", fqn)
        out.append(_Shape(fqn, name, bool(grad), size, numel, n_rows))
    return out


def _ints_of(fail: _Fail, v: object, length: int, what: str) -> list[int]:
    """The values of the 1-D int64 column `what`, once it is found to hold exactly `length`."""
    column = _int64_column(fail, v, 1, what)
    if column.shape[0] != length:
        raise fail(f"{what} holds {column.shape[0]} values, tensors.props calls for {length}")
    return column.ints()


def check_rows(
    fail: _Fail, fqn: str, table: list[list[int]], size: list[int], numel: int, n_files: int
) -> None:
    """A tensor's chunk rows: each inside the tensor, naming a file and key that can exist, and
    together tiling the tensor exactly (no overlap, no hole), at different offsets.  Column by
    column (map and zip run in C: a record of 10^5 chunks is checked on every load)."""
    ndim = len(size)
    if not table or min(map(min, table)) < 0:
        raise fail("chunks must be at least one row of non-negative ints", fqn)
    cols = list(zip(*table))
    offs, sizes = cols[:ndim], cols[ndim : 2 * ndim]
    ends = [list(map(operator.add, o, z)) for o, z in zip(offs, sizes)]
    if any(max(e) > n for e, n in zip(ends, size)):
        raise fail("a chunk lies outside the tensor", fqn)
    if max(cols[2 * ndim]) >= n_files or max(cols[2 * ndim + 1]) > MAX_KEY:
        raise fail("a chunk names a file or key that does not exist", fqn)
    volumes = list(map(math.prod, zip(*sizes))) if ndim else [1] * len(table)
    total = sum(volumes)
    if total != numel:
        raise fail(f"the chunks hold {total} elements, the tensor has {numel}", fqn)
    boxes = [box for box, v in zip(zip(zip(*offs), zip(*ends)), volumes) if v]
    if len(boxes) > 1 and ndim == 0:  # several non-empty chunks of a 0-d tensor
        raise fail("chunks overlap", fqn)
    _check_disjoint(fail, fqn, boxes)
    if ndim and len(set(zip(*offs))) != len(table):
        raise fail(_SAME_OFFSETS, fqn)


def _check_disjoint(fail: _Fail, fqn: str, boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
    """No two boxes (start, end) share an element.  With their volumes adding up to the
    tensor's and each inside it, disjoint means they tile it exactly.

    A sweep along the dimension with the most distinct starts: sorted by their start there,
    a box can only meet the boxes that start before it ends, so only those pairs are compared
    (for row or column shards, each box's neighbour).  The pairs are counted first (a binary
    search per box) and a LimitError stops a hostile record whose boxes pile up where the
    sweep cannot tell them apart: comparing every pair of millions of one-element chunks
    would take hours."""
    n = len(boxes)
    if n < 2 or not boxes[0][0]:
        return
    ndim = len(boxes[0][0])
    axis = max(range(ndim), key=lambda d: len({b[0][d] for b in boxes}))
    boxes = sorted(boxes, key=lambda b: b[0][axis])
    starts = [b[0][axis] for b in boxes]
    reach = [bisect.bisect_left(starts, b[1][axis]) for b in boxes]  # boxes starting before it ends
    pairs = sum(max(r - i - 1, 0) for i, r in enumerate(reach))
    if pairs > _MAX_PAIRS:
        raise fail(
            f"{n} chunks overlap along every dimension too often to check ({pairs} pairs, "
            f"limit {_MAX_PAIRS})",
            fqn,
            limit=True,
        )
    for i, (a_off, a_end) in enumerate(boxes):
        for b_off, b_end in boxes[i + 1 : reach[i]]:
            if all(a_off[d] < b_end[d] and b_off[d] < a_end[d] for d in range(ndim)):
                raise fail(f"chunks at offsets {list(a_off)} and {list(b_off)} overlap", fqn)


def _check_planner_data(fail: _Fail, pd: object, keys: list[str]) -> None:
    """DCP's default planners keep {flattened key: the path of keys it came from} here; consolidate
    rebuilds the saved structure from it, so every path is checked before anything is built."""
    if pd is None:
        return
    if type(pd) is not dict:
        raise fail("planner_data must be a dict or None")
    for k, v in pd.items():
        if type(k) is not str or not _valid_path(v):
            raise fail(
                f"planner_data must map each key to a tuple of 1 to {MAX_PATH} keys: a str, then str "
                f"or int in [0, {MAX_LIST_SLOTS})",
                str(k)[:80],
            )
    _check_paths(fail, [(k, pd.get(k, (k,))) for k in keys])


def _valid_path(v: object) -> bool:
    return (
        type(v) is tuple
        and 0 < len(v) <= MAX_PATH
        and type(v[0]) is str
        and all(type(p) is str or (type(p) is int and 0 <= p < MAX_LIST_SLOTS) for p in v)
    )


class _Container:
    """A dict or list that unflattening the planner data would build (its kind: the key type)."""

    __slots__ = ("children", "kind", "length")

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.children: dict[str | int, _Container | None] = {}  # None: a leaf
        self.length = 0  # a list's length: its highest index + 1


def _check_paths(fail: _Fail, paths: list[tuple[str, tuple[str | int, ...]]]) -> None:
    """The paths (each key's, or (key,) where the planner data has none) spell their keys and
    describe one tree: no key where another key's container is, no container that is both a dict
    and a list, and lists of at most MAX_LIST_SLOTS elements in all (DCP's unflattening fills gaps
    with None).  A path that spelled another key would put the tensor where DCP's load, which
    flattens the rebuilt structure again, looks for that other key."""
    root = _Container(str)
    slots = 0
    for fqn, path in paths:
        if ".".join(map(str, path)) != fqn:  # DCP flattens a path into its key exactly so
            raise fail("planner_data's path does not spell the key (its parts joined by '.')", fqn)
        node = root
        for depth, part in enumerate(path):
            if type(part) is not node.kind:
                raise fail("planner_data puts a list index and a dict key into one container", fqn)
            if type(part) is int and part >= node.length:
                slots += part + 1 - node.length
                node.length = part + 1
                if slots > MAX_LIST_SLOTS:
                    raise fail(
                        f"planner_data's lists hold more than {MAX_LIST_SLOTS} elements", fqn, limit=True
                    )
            last = depth == len(path) - 1
            if part not in node.children:
                node.children[part] = None if last else _Container(type(path[depth + 1]))
            elif last or node.children[part] is None:
                raise fail("planner_data puts two keys in one place, or one inside the other", fqn)
            child = node.children[part]
            if child is not None:
                node = child


def _check_storage_meta(fail: _Fail, v: object) -> dict[str, Any] | None:
    """The storage_meta member, checked: the keyword arguments of DCP's StorageMeta."""
    if v is None:
        return None
    d = _exact(fail, v, _STORAGE_META_FIELDS, "storage_meta")
    for f in ("checkpoint_id", "save_id"):
        if d[f] is not None and type(d[f]) is not str:
            raise fail(f"storage_meta.{f} must be a str or None")
    if type(d["modules"]) is not list or any(type(m) is not str for m in d["modules"]):
        raise fail("storage_meta.modules must be a list of str")
    return {"checkpoint_id": d["checkpoint_id"], "save_id": d["save_id"], "modules": list(d["modules"])}
