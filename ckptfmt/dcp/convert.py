"""Consolidation: a sharded DCP checkpoint -> one ckptfmt file with full tensors.

The source is a ckptfmt DCP directory (a ``COMMIT`` of layout "dcp") or a directory
in DCP's own FileSystemWriter format (``.metadata`` + ``__N_M.distcp``).  DCP's
format is pickle throughout; it is read without running code from the file:
``.metadata`` through an unpickler that only builds DCP's metadata classes, and
tensors and values through ``torch.load(weights_only=True)``.  The output nests
the values the way they were saved (DCP's flattened keys unflattened), so
``ckptfmt.load(out)["model"]`` is a plain model state dict, and ``cdcp.load`` can
load the file back into any sharding.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import stat
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner import LoadPlanner as _BaseLoadPlanner
from torch.futures import Future

from ..errors import CheckpointError, CorruptError, IncompleteError, LimitError, UnsupportedError
from ..fileio import is_url, open_regular, pread_exact
from ..files import multifile, places
from ..files import save as writer
from ..format import dtypes
from ..format import layout as fmt
from . import metadata as mdv
from .api import _LAST_SAVE, _mapped, _single_process_ok
from .planners import LoadPlanner
from .reader import Reader
from .sources import DCP_METADATA_NAME
from .values import ObjectBytes

#: DCP's .metadata is read into memory whole; unpickling it costs some tens of bytes per byte
MAX_DCP_METADATA_BYTES = 256 << 20


@dataclasses.dataclass
class ConsolidateReport:
    """What consolidate wrote."""

    source_format: str  # "ckptfmt-dcp" or "dcp-filesystem"
    tensors: int
    values: int
    tensor_bytes: int
    file_bytes: int


def consolidate(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    compression: str | None = None,
    level: int | None = None,
    chunk_size: int | None = None,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    decrypt_with: Any = None,
    encrypt_with: Any = None,
) -> ConsolidateReport:
    """Write the checkpoint in directory `src` as one ckptfmt file `out` with full tensors.

    The whole state is assembled in memory first (as ``dcp_to_torch_save`` does).  A
    smaller `chunk_size` lets a later sharded ``load`` of the file read closer to just
    each rank's slice (a chunk is the unit that is read and verified).  `src` and `out` may
    be object-store URLs (a ckptfmt DCP checkpoint under a prefix; the file as an object),
    with the client's settings in `storage_options`.  `decrypt_with`: the key of a save made
    with ``encrypt_with``; `encrypt_with`: the file is encrypted under this key (default
    `decrypt_with`: an encrypted checkpoint stays encrypted; a key service's unwrapping callable
    cannot encrypt, so pass its wrapping one), as files' ``consolidate`` does.
    """
    if encrypt_with is None and decrypt_with is not None:
        if callable(decrypt_with):
            raise ValueError(
                "consolidate: decrypt_with is a key service's unwrapping callable, which cannot "
                "encrypt the file written: pass its wrapping one as encrypt_with"
            )
        encrypt_with = decrypt_with
    source = places.normalized(src)
    target = places.normalized(out)
    _LAST_SAVE.wait_if_at(source)  # a background save of it still writing: its checkpoint, once committed
    if is_url(source):
        reader: Any = Reader(
            source, verify=verify, storage_options=storage_options, decrypt_with=decrypt_with
        )
        kind = "ckptfmt-dcp"
    elif not os.path.isdir(source):
        raise UnsupportedError("not a directory: consolidate reads a sharded DCP checkpoint", path=source)
    elif os.path.exists(os.path.join(source, multifile.COMMIT_NAME)):
        reader = Reader(source, verify=verify, decrypt_with=decrypt_with)
        kind = "ckptfmt-dcp"
    elif os.path.exists(os.path.join(source, DCP_METADATA_NAME)):
        reader = DCPFormatReader(source)
        kind = "dcp-filesystem"
    else:
        raise IncompleteError(
            "neither a ckptfmt commit record nor DCP's .metadata: not a complete DCP checkpoint", path=source
        )
    try:
        md = reader.read_metadata()
        state = load_full(reader, md, source, _ValuesPlanner(kind == "dcp-filesystem"))
    finally:
        if isinstance(reader, Reader):
            reader.close()
    tensors = [v for v in md.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata)]
    nbytes = tensor_bytes(md)
    writer.save(
        state,
        target,
        compression=compression,
        level=level,
        chunk_size=chunk_size,
        metadata={"consolidated_from": kind},
        storage_options=storage_options if is_url(target) else None,
        encrypt_with=encrypt_with,
    )
    return ConsolidateReport(
        kind,
        len(tensors),
        len(md.state_dict_metadata) - len(tensors),
        nbytes,
        _size_of(target, storage_options),
    )


def _size_of(path: str, storage_options: dict[str, Any] | None) -> int:
    """The length of the file (or object) just written."""
    if not is_url(path):
        return os.path.getsize(path)
    from ..storage.client import check_options
    from ..storage.download import head
    from ..storage.urls import parse_url

    return head(parse_url(path), check_options(storage_options))[0]


def tensor_bytes(md: Metadata) -> int:
    """Bytes of all of `md`'s tensors, whole (what a consolidation allocates)."""
    return sum(
        math.prod(v.size) * dtypes.torch_itemsize(dtypes.TORCH_NAMES[v.properties.dtype])
        for v in md.state_dict_metadata.values()
        if isinstance(v, TensorStorageMetadata)
    )


def load_full(
    reader: Reader | DCPFormatReader, md: Metadata, path: str, planner: LoadPlanner | None = None
) -> dict[str, Any]:
    """The whole state `md` (validated metadata `reader` read) describes, full tensors, in this
    process.  Every item is checked against the files first, and the tensors' bytes against what
    the files hold: a record that declares a 4 TiB tensor over a few bytes is refused before
    anything is allocated.  Every error is a CheckpointError (DCP's own are mapped)."""
    problems, held = reader.check_items(set(md.state_dict_metadata))
    if problems:
        raise problems[0]
    need = tensor_bytes(md)
    if need > held:
        raise LimitError(
            f"the metadata declares {need} bytes of tensors, the files hold {held}: not allocating them",
            path=path,
        )
    state = skeleton(md, path)
    try:
        with _single_process_ok():
            dcp.load(state, storage_reader=reader, planner=planner or LoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        mapped = _mapped("load", path, e)
        if isinstance(mapped, CheckpointError):
            raise mapped from e
        raise CheckpointError(f"load failed: {type(e).__name__}: {str(e)[:300]}", path=path) from e
    return state


def skeleton(md: Metadata, path: str | None = None) -> dict[str, Any]:
    """The saved state's structure with an empty full-size tensor for each tensor (DCP's keys
    unflattened through the metadata's planner_data, which metadata.from_value checked), ready
    for ``dcp.load`` to fill."""
    state: dict[str, Any] = {}
    pd = md.planner_data
    for k, v in md.state_dict_metadata.items():
        value: Any = v  # a value's placeholder is its BytesStorageMetadata, as in DCP
        if isinstance(v, TensorStorageMetadata):
            value = _empty(v, path, k)
        if isinstance(pd, dict) and k in pd:
            set_element(state, pd[k], value)
        else:
            state[k] = value
    return state


def _empty(sm: TensorStorageMetadata, path: str | None, key: str) -> torch.Tensor:
    try:
        return torch.empty(sm.size, dtype=sm.properties.dtype)
    except (RuntimeError, MemoryError) as e:
        raise LimitError(
            f"cannot allocate the tensor {list(sm.size)}: {str(e)[:100]}", path=path, key=key
        ) from None


class _ValuesPlanner(LoadPlanner):
    """Our LoadPlanner; for DCP's own format, values come from torch.load(weights_only=True)."""

    def __init__(self, torch_saved_values: bool) -> None:
        super().__init__()
        self.torch_saved_values = torch_saved_values

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if self.torch_saved_values and not isinstance(value, ObjectBytes):
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:
                text = " ".join(str(e).split())[:200]  # torch's message spans lines
                raise UnsupportedError(
                    f"DCP stored this value as a pickle that torch.load(weights_only=True) refuses: {text}",
                    key=fqn,
                ) from None
            value = ObjectBytes(obj)
        super().load_bytes(read_item, value)


# -- DCP's own format, without unpickling arbitrary objects ------------------------------------------


def _allowed_globals() -> dict[tuple[str, str], Any]:
    import collections
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {}
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("PosixPath", "PurePosixPath"):  # a checkpoint_id given as a path
        allowed[("pathlib", name)] = allowed[("pathlib._local", name)] = getattr(pathlib, name)
    layouts: dict[str, torch.layout] = {}
    for attr in dir(torch):
        obj = getattr(torch, attr, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", attr)] = obj
        if isinstance(obj, torch.layout):
            layouts[str(obj)] = obj

    def layout(name: object) -> torch.layout:  # how torch pickles a layout: by its name
        if not isinstance(name, str) or name not in layouts:
            raise pickle.UnpicklingError(f"unknown torch layout {str(name)[:40]!r}")
        return layouts[name]

    allowed[("torch.serialization", "_get_layout")] = layout
    return allowed


class _MetadataUnpickler(pickle._Unpickler):
    """Builds only DCP's metadata classes, torch sizes, dtypes and layouts: no other code runs.

    Python's unpickler, not C's: reading from a buffer that holds the whole file, it asks for
    what an opcode declares and gets at most what remains, so a length beyond the file fails at
    once (C's allocates the declared length first, and sizes its memo table by the largest
    index an opcode names)."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")
        return found


def _unpickle_metadata(path: str) -> object:
    """The object DCP's .metadata holds, read within its size (LimitError above
    MAX_DCP_METADATA_BYTES), unpickled by _MetadataUnpickler; CorruptError for any failure."""
    try:
        fd = open_regular(path, follow_symlinks=False)
    except FileNotFoundError:
        raise IncompleteError("DCP's .metadata is missing: the save did not finish", path=path) from None
    except OSError as e:
        raise IncompleteError(f"DCP's .metadata cannot be read: {e.strerror}", path=path) from None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_DCP_METADATA_BYTES:
            raise LimitError(f"DCP's .metadata is {size} bytes, above {MAX_DCP_METADATA_BYTES}", path=path)
        data = pread_exact(fd, 0, size)
    finally:
        os.close(fd)
    if not _MetadataUnpickler.allowed:
        _MetadataUnpickler.allowed = _allowed_globals()
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # whatever unpickling these bytes raises, they are not DCP metadata
        text = " ".join(str(e).split())[:200] or "the data ends before what an opcode declares"
        raise CorruptError(
            f"DCP metadata cannot be read safely: {type(e).__name__}: {text}", path=path
        ) from None


class DCPFormatReader(FileSystemReader):
    """Reads a directory in DCP's own format (``.metadata`` and ``*.distcp``) as hostile input.

    ``.metadata`` goes through a restricted, bounded unpickler and then through the same
    validator as our commit record (metadata.from_value: chunks tile their tensors, planner
    data describes one tree); each storage location must be a slice of a regular file of the
    directory, slices of a file must not overlap, and items are read by ``read_data`` below
    (torch.load(weights_only=True)), each checked for the dtype and shape the metadata gives.
    DCP's stream transforms (its compression extension) are refused as unsupported.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.directory = os.path.abspath(os.fspath(path))
        self._md: Metadata | None = None
        self._where: dict[MetadataIndex, mdv.Location] = {}
        self._infos: dict[MetadataIndex, _StorageInfo] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._md is None:
            path = os.path.join(self.directory, DCP_METADATA_NAME)
            self._md, self._where, self._infos = _validated(_unpickle_metadata(path), self.directory, path)
        md = dataclasses.replace(self._md)
        md.storage_meta = dataclasses.replace(md.storage_meta or StorageMeta(), load_id=self.load_id)
        return md

    def storage_infos(self) -> dict[MetadataIndex, _StorageInfo]:
        """Each item's slice of a file (read_metadata checked them)."""
        if self._md is None:
            self.read_metadata()
        return self._infos

    def check_items(self, fqns: set[str] | None = None) -> tuple[list[CheckpointError], int]:
        """No problems (read_metadata checked every location); the bytes of the slices that hold
        the tensors of `fqns` (all: None), which bound what their chunks can hold."""
        if self._md is None:
            self.read_metadata()
        held = sum(
            self._infos[idx].length
            for idx, loc in self._where.items()
            if loc.sizes is not None and (fqns is None or idx.fqn in fqns)
        )
        return [], held

    def read_data(self, plan: LoadPlan, planner: _BaseLoadPlanner) -> Future[None]:
        if self._md is None:
            self.read_metadata()
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            info = self._infos.get(req.storage_index)
            if info is None:
                raise CorruptError(
                    "DCP's .metadata has no saved item here", path=self.directory, key=req.storage_index.fqn
                )
            per_file.setdefault(info.relative_path, []).append(req)
        for name in sorted(per_file):
            path = os.path.join(self.directory, name)
            try:
                fd = open_regular(path, follow_symlinks=False)
            except OSError as e:
                raise IncompleteError(
                    f"{name} named by DCP's .metadata cannot be read: {e.strerror}", path=path
                ) from None
            try:
                for req in per_file[name]:
                    info = self._infos[req.storage_index]
                    data = pread_exact(fd, info.offset, info.length)
                    if len(data) != info.length:
                        raise IncompleteError(
                            f"{name} ends before the item's bytes", path=path, key=req.storage_index.fqn
                        )
                    self._read_item(req, data, planner, path)
            finally:
                os.close(fd)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, req: ReadItem, data: bytes, planner: _BaseLoadPlanner, path: str) -> None:
        fqn = req.storage_index.fqn
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(data))
            return
        try:
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            text = " ".join(str(e).split())[:200]
            raise CorruptError(
                f"the saved chunk cannot be read: {type(e).__name__}: {text}", path=path, key=fqn
            ) from None
        loc = self._where[req.storage_index]
        sm = self._md.state_dict_metadata[fqn] if self._md is not None else None
        assert isinstance(sm, TensorStorageMetadata)
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            raise CorruptError(f"the saved chunk is a {type(t).__name__}, not a tensor", path=path, key=fqn)
        if t.dtype != sm.properties.dtype:
            # copying would convert silently (floats truncated into ints)
            raise CorruptError(
                f"the saved chunk is {t.dtype}, DCP's .metadata says {sm.properties.dtype}",
                path=path,
                key=fqn,
            )
        if tuple(t.shape) != loc.sizes:
            raise CorruptError(
                f"the saved chunk has shape {list(t.shape)}, DCP's .metadata says {list(loc.sizes or ())}",
                path=path,
                key=fqn,
            )
        box = t[tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))]
        target = planner.resolve_tensor(req).detach()
        if target.shape != box.shape:
            raise CorruptError(
                f"DCP asked for {list(target.shape)}, the box is {list(box.shape)}", path=path, key=fqn
            )
        target.copy_(box)
        planner.commit_tensor(req, target)


def _validated(
    raw: object, directory: str, path: str
) -> tuple[Metadata, dict[MetadataIndex, mdv.Location], dict[MetadataIndex, _StorageInfo]]:
    """DCP's Metadata checked as our commit record is (its tensors, values and planner data go
    through metadata.to_value and from_value), each location a bounded slice of a regular file
    of `directory`; (metadata, each item's chunk shape and dtype, each item's slice)."""
    md = _typed_metadata(raw, path)
    infos = _storage_infos(md, path)
    files = sorted({info.relative_path for info in infos.values()})
    number = {name: i for i, name in enumerate(files)}
    slots = list(infos.values())
    key_of = {idx: (number[info.relative_path], k) for k, (idx, info) in enumerate(infos.items())}
    for fqn, sm in md.state_dict_metadata.items():
        wanted = (
            [MetadataIndex(fqn, c.offsets) for c in sm.chunks]
            if isinstance(sm, TensorStorageMetadata)
            else [MetadataIndex(fqn)]
        )
        if any(w not in key_of for w in wanted):
            raise CorruptError("DCP's .metadata has no storage location for an item", path=path, key=fqn)
    value = mdv.to_value(md, key_of, 1, path)
    checked, where = mdv.from_value(value, files, path)
    by_key = {idx: slots[loc.key] for idx, loc in where.items()}
    _check_slices(directory, files, list(by_key.values()), path)
    checked.storage_data = by_key
    return checked, where, by_key


def _typed_metadata(raw: object, path: str) -> Metadata:
    """A Metadata rebuilt from `raw` with every field of the type DCP gives it: an unpickled
    dataclass's fields are whatever the pickle set."""
    if type(raw) is not Metadata or type(getattr(raw, "state_dict_metadata", None)) is not dict:
        raise CorruptError("DCP's .metadata does not hold DCP metadata", path=path)
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for k, v in raw.state_dict_metadata.items():
        if type(k) is not str:
            raise CorruptError("DCP's .metadata has a key that is not a str", path=path)
        if type(v) is BytesStorageMetadata:
            sdm[k] = BytesStorageMetadata()
        elif type(v) is TensorStorageMetadata:
            sdm[k] = _typed_tensor(v, path, k)
        else:
            raise CorruptError("DCP's .metadata has an entry of an unknown kind", path=path, key=k)
    version = getattr(raw, "version", None)
    if version is not None and type(version) is not str:
        raise CorruptError("DCP's .metadata has a version that is not a str", path=path)
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=getattr(raw, "planner_data", None),  # checked by metadata.from_value
        storage_data=getattr(raw, "storage_data", None),
        storage_meta=_typed_storage_meta(getattr(raw, "storage_meta", None), path),
        version=version,
    )


def _typed_tensor(v: TensorStorageMetadata, path: str, key: str) -> TensorStorageMetadata:
    props, size, chunks = (getattr(v, f, None) for f in ("properties", "size", "chunks"))
    dtype, layout = getattr(props, "dtype", None), getattr(props, "layout", torch.strided)
    if (
        type(props) is not TensorProperties
        or not isinstance(dtype, torch.dtype)
        or not isinstance(layout, torch.layout)
    ):
        raise CorruptError("DCP's .metadata has tensor properties of the wrong types", path=path, key=key)
    if dtype not in dtypes.TORCH_NAMES or layout != torch.strided:
        raise UnsupportedError(f"a tensor of {dtype} and {layout} is not supported", path=path, key=key)
    grad = getattr(props, "requires_grad", False)
    ok = type(size) is torch.Size and type(chunks) is list and type(grad) is bool
    ok = ok and all(
        type(c) is ChunkStorageMetadata
        and type(getattr(c, "offsets", None)) is torch.Size
        and type(getattr(c, "sizes", None)) is torch.Size
        and len(c.offsets) == len(c.sizes) == len(size)  # type: ignore[arg-type]
        for c in chunks  # type: ignore[union-attr]
    )
    if not ok:
        raise CorruptError("DCP's .metadata has a tensor entry of the wrong types", path=path, key=key)
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype, requires_grad=grad),
        size=size,  # type: ignore[arg-type]
        chunks=[ChunkStorageMetadata(offsets=c.offsets, sizes=c.sizes) for c in chunks],  # type: ignore[union-attr]
    )


def _typed_storage_meta(v: object, path: str) -> StorageMeta | None:
    if v is None:
        return None
    cid, sid, modules = (getattr(v, f, None) for f in ("checkpoint_id", "save_id", "modules"))
    modules = [] if modules is None else modules  # older DCP versions have no modules
    if type(v) is not StorageMeta or type(modules) is not list:
        raise CorruptError("DCP's .metadata has a storage_meta of the wrong type", path=path)
    return StorageMeta(
        checkpoint_id=None if cid is None else str(cid),
        save_id=sid if type(sid) is str else None,
        modules=[m for m in modules if type(m) is str],  # type: ignore[union-attr]
    )


def _storage_infos(md: Metadata, path: str) -> dict[MetadataIndex, _StorageInfo]:
    """DCP's storage locations, each a slice [offset, offset + length) of a file named plainly
    (no directory, no leading dot), without stream transforms."""
    if type(md.storage_data) is not dict:
        raise CorruptError("DCP's .metadata has no storage locations", path=path)
    out: dict[MetadataIndex, _StorageInfo] = {}
    for idx, info in md.storage_data.items():
        fqn = getattr(idx, "fqn", None)
        if type(idx) is not MetadataIndex or type(fqn) is not str or type(info) is not _StorageInfo:
            raise CorruptError("DCP's .metadata has a storage location of the wrong type", path=path)
        name, at, n = (getattr(info, f, None) for f in ("relative_path", "offset", "length"))
        if type(name) is not str or fmt.REF_NAME_RE.fullmatch(name) is None:
            raise CorruptError(
                f"DCP's .metadata names the file {str(name)[:80]!r}, not a plain name", path=path, key=fqn
            )
        if type(at) is not int or type(n) is not int or at < 0 or n < 0:
            raise CorruptError(
                "DCP's .metadata has a slice that is not two non-negative ints", path=path, key=fqn
            )
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedError(
                "DCP's stream transforms (compression) are not supported", path=path, key=fqn
            )
        offset = getattr(idx, "offset", None)
        if offset is not None and type(offset) is not torch.Size:
            raise CorruptError("DCP's .metadata has a storage location of the wrong type", path=path, key=fqn)
        out[MetadataIndex(fqn, offset)] = _StorageInfo(name, at, n)
    return out


def _check_slices(directory: str, files: list[str], infos: list[_StorageInfo], path: str) -> None:
    """Each file a regular file in `directory` (no symlink), each slice inside its file, and the
    slices of a file disjoint: the items' bytes are then at most the files' bytes."""
    sizes = {}
    for name in files:
        try:
            st = os.lstat(os.path.join(directory, name))
        except FileNotFoundError:
            raise IncompleteError(f"{name} named by DCP's .metadata is missing", path=path) from None
        except OSError as e:
            raise IncompleteError(
                f"{name} named by DCP's .metadata cannot be read: {e.strerror}", path=path
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptError(f"{name} named by DCP's .metadata is not a regular file", path=path)
        sizes[name] = st.st_size
    end = dict.fromkeys(files, 0)
    for info in sorted(infos, key=lambda i: (i.relative_path, i.offset)):
        name = info.relative_path
        if info.offset < end[name] and info.length:
            raise CorruptError(f"two items of {name} overlap at byte {info.offset}", path=path)
        if info.offset + info.length > sizes[name]:
            raise CorruptError(
                f"an item at bytes {info.offset} + {info.length} of {name} lies beyond its {sizes[name]} bytes",
                path=path,
            )
        end[name] = max(end[name], info.offset + info.length)


# -- DCP's own format at a glance (for describe) ----------------------------------------------------


def describe_dcp_format(path: str, out: dict[str, Any]) -> dict[str, Any]:
    """summary.describe() for DCP's own format: its .metadata checked as consolidate checks it."""
    out["format"] = "dcp-filesystem"
    reader = DCPFormatReader(path)
    try:
        md = reader.read_metadata()
    except CheckpointError as e:
        out["problem"] = str(e)
        return out
    tensors = sum(isinstance(v, TensorStorageMetadata) for v in md.state_dict_metadata.values())
    names = sorted({info.relative_path for info in reader.storage_infos().values()})
    out.update(
        complete=True,
        tensors=tensors,
        values=len(md.state_dict_metadata) - tensors,
        files=[{"name": n, "rank": None, "status": "ok"} for n in names],
    )
    return out
