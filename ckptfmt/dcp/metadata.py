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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
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

from ..errors import CheckpointError, CorruptError, LimitError, UnsupportedError, UnsupportedObjectError
from ..format import dtypes
from ..format.layout import Limits
from ..gcpause import pausing

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
#: chunk pairs of one tensor that may need comparing (their extents meet along the sweep's
#: dimension) before the check gives up with a LimitError
_MAX_PAIRS = 1 << 22
#: an empty chunk at a saved chunk's offsets would hide where that chunk lives
_SAME_OFFSETS = "two chunks have the same offsets"
#: up to this many chunks a tensor's rows are checked in plain Python, above it with numpy
_FEW_CHUNKS = 16
#: keys in a planner_data path: the saved structure nests no deeper than an object tree may
MAX_PATH = Limits.MAX_DEPTH - 1
#: list elements the planner data may describe, in all: an object tree holds at most this many nodes
MAX_LIST_SLOTS = Limits.MAX_NODES


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


# -- Metadata -> value ----------------------------------------------------------------------


@pausing
def to_value(
    md: Metadata, where: dict[MetadataIndex, tuple[int, int]], world_size: int, fail_path: str
) -> dict[str, Any]:
    """The record's ``dcp`` member for `md`; `where` maps each saved item to (file index, key)."""
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
        self.props: list[list[int]] = []
        self.sizes: list[int] = []
        self.chunks: list[int] = []

    def add(
        self, fqn: str, sm: TensorStorageMetadata, where: dict[MetadataIndex, tuple[int, int]], fail_path: str
    ) -> None:
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
        self.props.append([index, int(bool(sm.properties.requires_grad)), len(sm.size), len(sm.chunks)])
        self.sizes += [int(d) for d in sm.size]

    def value(self) -> dict[str, Any]:
        return {
            "keys": self.keys,
            "dtypes": list(self.dtypes),
            "props": np.array(self.props, dtype=np.int64).reshape(len(self.props), 4),
            "sizes": np.array(self.sizes, dtype=np.int64),
            "chunks": np.array(self.chunks, dtype=np.int64),
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


# -- value -> Metadata ------------------------------------------------------------------------


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


@pausing
def from_value(value: object, files: list[str], path: str) -> tuple[Metadata, dict[MetadataIndex, Location]]:
    """DCP's Metadata from a record's ``dcp`` member, and where each item lies (by file name)."""
    fail = _Fail(path)
    d = _exact(fail, value, _FIELDS, "the dcp member")
    version = d["version"]
    if version is not None and type(version) is not str:
        raise fail("version must be a str or None")
    _int(fail, d["world_size"], "world_size", 1, MAX_WORLD)
    tensors = d["tensors"]
    byte_items = d["bytes"]
    if type(tensors) is not dict or type(byte_items) is not dict:
        raise fail("tensors and bytes must be dicts")
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    where: dict[MetadataIndex, Location] = {}
    _tensors_from_value(fail, tensors, files, sdm, where)
    for fqn, loc in byte_items.items():
        if type(fqn) is not str:
            raise fail("a value key is not a str")
        if fqn in sdm:
            raise fail("the key is both a tensor and a value", fqn)
        if type(loc) is not list or len(loc) != 2:
            raise fail("a value's location must be [file, key]", fqn)
        f = _int(fail, loc[0], "file index", 0, len(files) - 1, fqn)
        k = _int(fail, loc[1], "item key", 0, MAX_KEY, fqn)
        sdm[fqn] = BytesStorageMetadata()
        where[MetadataIndex(fqn)] = Location(files[f], k)
    planner_data = d["planner_data"]
    _check_planner_data(fail, planner_data, sdm)
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=planner_data,
        storage_data=None,
        storage_meta=_storage_meta_from_value(fail, d["storage_meta"]),
        version=version,
    )
    return md, where


def _int64_array(fail: _Fail, v: object, ndim: int, what: str) -> np.ndarray:
    if type(v) is not np.ndarray or v.dtype != np.dtype("<i8") or v.ndim != ndim:
        raise fail(f"{what} must be an int64 array of {ndim} dimension{'s' if ndim > 1 else ''}")
    return v


def _tensors_from_value(
    fail: _Fail,
    value: object,
    files: list[str],
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata],
    where: dict[MetadataIndex, Location],
) -> None:
    """Every tensor's TensorStorageMetadata (into `sdm`) and its chunks' locations (into `where`)."""
    t = _exact(fail, value, _TENSOR_FIELDS, "the tensors member")
    keys, names = t["keys"], t["dtypes"]
    if type(keys) is not list or any(type(k) is not str for k in keys):
        raise fail("tensors.keys must be a list of str")
    if len(set(keys)) != len(keys):
        raise fail("tensors.keys has a key twice")
    if type(names) is not list or any(type(n) is not str for n in names):
        raise fail("tensors.dtypes must be a list of str")
    props = _int64_array(fail, t["props"], 2, "tensors.props")
    if props.shape != (len(keys), 4):
        raise fail(f"tensors.props must have shape [{len(keys)}, 4]")
    sizes_flat = _int64_array(fail, t["sizes"], 1, "tensors.sizes").tolist()
    chunks_flat = _int64_array(fail, t["chunks"], 1, "tensors.chunks")
    size_at = row_at = 0
    for fqn, (dt, grad, ndim, n_rows) in zip(keys, props.tolist()):
        if not 0 <= dt < len(names):
            raise fail(f"dtype index {dt} is not in tensors.dtypes", fqn)
        name = names[dt]
        if name not in dtypes.TORCH_DTYPES:
            raise UnsupportedError(f"DCP metadata: dtype {name[:40]!r} is unknown to this reader", key=fqn)
        if grad not in (0, 1):
            raise fail("requires_grad must be 0 or 1", fqn)
        _int(fail, ndim, "ndim", 0, Limits.MAX_RANK, fqn)
        _int(fail, n_rows, "the number of chunk rows", 1, MAX_ROWS, fqn)
        size = sizes_flat[size_at : size_at + ndim]
        if len(size) != ndim:
            raise fail("tensors.sizes is shorter than the tensors' ndims", fqn)
        size_at += ndim
        for d in size:
            _int(fail, d, "a size", 0, Limits.MAX_NUMEL, fqn)
        numel = math.prod(size)
        if numel > Limits.MAX_NUMEL:
            raise fail(f"{numel} elements exceed the limit {Limits.MAX_NUMEL}", fqn, limit=True)
        width = 2 * ndim + 2
        rows = chunks_flat[row_at : row_at + n_rows * width]
        if len(rows) != n_rows * width:
            raise fail("tensors.chunks is shorter than the tensors' chunk rows", fqn)
        row_at += n_rows * width
        rows = rows.reshape(n_rows, width)
        table: list[list[int]] = rows.tolist()
        if n_rows <= _FEW_CHUNKS:
            _check_few_rows(fail, fqn, table, size, numel, len(files))
        else:
            _check_rows(fail, fqn, rows, size, numel, len(files))
        chunks = []
        for row in table:
            o, s = torch.Size(row[:ndim]), torch.Size(row[ndim : 2 * ndim])
            chunks.append(ChunkStorageMetadata(offsets=o, sizes=s))
            where[MetadataIndex(fqn, o)] = Location(files[row[2 * ndim]], row[2 * ndim + 1], tuple(s), name)
        props_ = TensorProperties(dtype=dtypes.TORCH_DTYPES[name], requires_grad=bool(grad))
        sdm[fqn] = TensorStorageMetadata(properties=props_, size=torch.Size(size), chunks=chunks)
    if size_at != len(sizes_flat) or row_at != len(chunks_flat):
        raise fail("tensors.sizes or tensors.chunks holds more than the tensors' sizes and chunk rows")


def _check_rows(fail: _Fail, fqn: str, rows: np.ndarray, size: list[int], numel: int, n_files: int) -> None:
    """A tensor's chunk rows: each inside the tensor, naming a file and key that can exist, and
    together tiling the tensor exactly (numpy, for many rows)."""
    ndim = len(size)
    if rows.shape[0] < 1 or (rows < 0).any():
        raise fail("chunks must be at least one row of non-negative ints", fqn)
    offs, sizes = rows[:, :ndim], rows[:, ndim : 2 * ndim]
    files_col, keys_col = rows[:, 2 * ndim], rows[:, 2 * ndim + 1]
    dims = np.array(size, dtype=np.int64)
    if ndim and ((sizes > dims).any() or (offs > dims - sizes).any()):
        raise fail("a chunk lies outside the tensor", fqn)
    if (files_col >= n_files).any() or (keys_col > MAX_KEY).any():
        raise fail("a chunk names a file or key that does not exist", fqn)
    _check_tiling(fail, fqn, offs, sizes, numel)
    if ndim and len(np.unique(offs, axis=0)) != len(offs):
        raise fail(_SAME_OFFSETS, fqn)


def _check_few_rows(
    fail: _Fail, fqn: str, table: list[list[int]], size: list[int], numel: int, n_files: int
) -> None:
    """_check_rows for a handful of rows, in plain Python: the same checks and errors, without
    a dozen numpy calls per tensor (a state has thousands of tensors of one to a few chunks)."""
    ndim = len(size)
    if not table or any(v < 0 for row in table for v in row):
        raise fail("chunks must be at least one row of non-negative ints", fqn)
    for row in table:
        for d in range(ndim):
            if row[ndim + d] > size[d] or row[d] > size[d] - row[ndim + d]:
                raise fail("a chunk lies outside the tensor", fqn)
    if any(row[2 * ndim] >= n_files or row[2 * ndim + 1] > MAX_KEY for row in table):
        raise fail("a chunk names a file or key that does not exist", fqn)
    volumes = [math.prod(row[ndim : 2 * ndim]) for row in table]
    total = sum(volumes)
    if total != numel:
        raise fail(f"the chunks hold {total} elements, the tensor has {numel}", fqn)
    boxes = [
        (row[:ndim], [o + z for o, z in zip(row[:ndim], row[ndim : 2 * ndim])])
        for row, v in zip(table, volumes)
        if v
    ]
    if len(boxes) > 1 and ndim == 0:
        raise fail("chunks overlap", fqn)
    for i, (a_off, a_end) in enumerate(boxes):
        for b_off, b_end in boxes[i + 1 :]:
            if all(a_off[d] < b_end[d] and b_off[d] < a_end[d] for d in range(ndim)):
                raise fail(f"chunks at offsets {a_off} and {b_off} overlap", fqn)
    if ndim and len({tuple(row[:ndim]) for row in table}) != len(table):
        raise fail(_SAME_OFFSETS, fqn)


def _check_tiling(fail: _Fail, fqn: str, offs: np.ndarray, sizes: np.ndarray, numel: int) -> None:
    """The chunks (inside the tensor, checked before) cover every element exactly once."""
    volumes = np.prod(sizes, axis=1, dtype=np.int64) if sizes.shape[1] else np.ones(len(sizes), np.int64)
    total = sum(volumes.tolist())  # Python ints: no overflow however many chunks
    if total != numel:
        raise fail(f"the chunks hold {total} elements, the tensor has {numel}", fqn)
    keep = volumes > 0
    offs, ends = offs[keep], offs[keep] + sizes[keep]
    n = len(offs)
    if n < 2 or offs.shape[1] == 0:
        if n > 1:  # several non-empty chunks of a 0-d tensor
            raise fail("chunks overlap", fqn)
        return
    # Sweep along the dimension with the most distinct offsets: sorted by their start there,
    # a chunk can only meet the chunks that start before it ends, so only those pairs are
    # compared (for row or column shards, each chunk's neighbour).  Comparing every pair
    # would take hours for a hostile tensor of millions of one-element chunks.
    axis = max(range(offs.shape[1]), key=lambda d: len(np.unique(offs[:, d])))
    order = np.argsort(offs[:, axis], kind="stable")
    offs, ends = offs[order], ends[order]
    reach = np.searchsorted(offs[:, axis], ends[:, axis], side="left")  # chunks starting before i ends
    counts = np.maximum(reach - np.arange(1, n + 1), 0)
    pairs = int(counts.sum())
    if pairs > _MAX_PAIRS:
        raise fail(
            f"{n} chunks overlap along every dimension too often to check ({pairs} pairs, "
            f"limit {_MAX_PAIRS})",
            fqn,
            limit=True,
        )
    if not pairs:
        return
    first = np.repeat(np.arange(n), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    second = first + 1 + (np.arange(pairs) - starts)
    hit = np.ones(pairs, dtype=bool)
    for d in range(offs.shape[1]):
        hit &= (offs[first, d] < ends[second, d]) & (offs[second, d] < ends[first, d])
    if hit.any():
        k = int(np.argmax(hit))
        raise fail(f"chunks at offsets {offs[first[k]].tolist()} and {offs[second[k]].tolist()} overlap", fqn)


def _check_planner_data(fail: _Fail, pd: object, keys: dict[str, Any]) -> None:
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


def _storage_meta_from_value(fail: _Fail, v: object) -> StorageMeta | None:
    if v is None:
        return None
    d = _exact(fail, v, _STORAGE_META_FIELDS, "storage_meta")
    for f in ("checkpoint_id", "save_id"):
        if d[f] is not None and type(d[f]) is not str:
            raise fail(f"storage_meta.{f} must be a str or None")
    if type(d["modules"]) is not list or any(type(m) is not str for m in d["modules"]):
        raise fail("storage_meta.modules must be a list of str")
    return StorageMeta(checkpoint_id=d["checkpoint_id"], save_id=d["save_id"], modules=list(d["modules"]))
