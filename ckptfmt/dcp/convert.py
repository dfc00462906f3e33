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
import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from .. import multifile, writer
from ..errors import CheckpointError, CorruptError, IncompleteError, UnsupportedError
from .api import _single_process_ok
from .planners import LoadPlanner
from .storage import LAYOUT, RANK_FILE_RE, Reader
from .values import ObjectBytes

DCP_METADATA_NAME = ".metadata"


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
) -> ConsolidateReport:
    """Write the checkpoint in directory `src` as one ckptfmt file `out` with full tensors.

    The whole state is assembled in memory first (as ``dcp_to_torch_save`` does).  A
    smaller `chunk_size` lets a later sharded ``load`` of the file read closer to just
    each rank's slice (a chunk is the unit that is read and verified).
    """
    source = os.path.abspath(os.fspath(src))
    target = os.path.abspath(os.fspath(out))
    if not os.path.isdir(source):
        raise UnsupportedError("not a directory: consolidate reads a sharded DCP checkpoint", path=source)
    if os.path.exists(os.path.join(source, multifile.COMMIT_NAME)):
        reader: Any = Reader(source, verify=verify)
        kind = "ckptfmt-dcp"
    elif os.path.exists(os.path.join(source, DCP_METADATA_NAME)):
        reader = DCPFormatReader(source)
        kind = "dcp-filesystem"
    else:
        raise IncompleteError(
            "neither a ckptfmt commit record nor DCP's .metadata: not a complete DCP checkpoint", path=source
        )
    md = reader.read_metadata()
    state = skeleton(md)
    with _single_process_ok():
        dcp.load(state, storage_reader=reader, planner=_ValuesPlanner(kind == "dcp-filesystem"), no_dist=True)
    tensors = [v for v in md.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata)]
    nbytes = sum(t.size.numel() * torch.empty((), dtype=t.properties.dtype).element_size() for t in tensors)
    writer.save(
        state,
        target,
        compression=compression,
        level=level,
        chunk_size=chunk_size,
        metadata={"consolidated_from": kind},
    )
    return ConsolidateReport(
        kind, len(tensors), len(md.state_dict_metadata) - len(tensors), nbytes, os.path.getsize(target)
    )


def skeleton(md: Metadata) -> dict[str, Any]:
    """The saved state's structure with an empty full-size tensor for each tensor (DCP's keys
    unflattened through the metadata's planner_data), ready for ``dcp.load`` to fill."""
    state: dict[str, Any] = {}
    pd = md.planner_data
    for k, v in md.state_dict_metadata.items():
        value: Any = v  # a value's placeholder is its BytesStorageMetadata, as in DCP
        if isinstance(v, TensorStorageMetadata):
            value = torch.empty(v.size, dtype=v.properties.dtype)
        if isinstance(pd, dict) and k in pd:
            set_element(state, pd[k], value)
        else:
            state[k] = value
    return state


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
                raise UnsupportedError(
                    f"DCP stored this value as a pickle that torch.load(weights_only=True) refuses: {str(e)[:200]}",
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


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, torch sizes, dtypes and layouts: no other code runs."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")
        return found


class DCPFormatReader(FileSystemReader):
    """DCP's FileSystemReader with a restricted unpickler for ``.metadata`` (its items are read by
    DCP with torch.load(weights_only=True))."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(os.fspath(self.path), DCP_METADATA_NAME)
        if not _MetadataUnpickler.allowed:
            _MetadataUnpickler.allowed = _allowed_globals()
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise IncompleteError("DCP's .metadata is missing: the save did not finish", path=path) from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
            raise CorruptError(f"DCP metadata cannot be read safely: {str(e)[:200]}", path=path) from None
        if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
            raise CorruptError("DCP's .metadata does not hold DCP metadata", path=path)
        if not isinstance(md.storage_data, dict):
            raise CorruptError("DCP's .metadata has no storage locations", path=path)
        for k, v in md.state_dict_metadata.items():
            if not isinstance(k, str) or not isinstance(v, (TensorStorageMetadata, BytesStorageMetadata)):
                raise CorruptError("DCP's .metadata has an entry of an unknown kind", path=path)
        md.storage_meta = dataclasses.replace(md.storage_meta or StorageMeta(), load_id=self.load_id)
        return md


# -- describing a directory (for `ckptfmt ls` / `verify`) ---------------------------------------------


def describe(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A DCP checkpoint directory at a glance: complete or why not, its rank files, its contents.

    Reads only the commit record and each rank file's prologue and footer (no data).
    """
    path = os.path.abspath(os.fspath(directory))
    out: dict[str, Any] = {"path": path, "complete": False, "problem": None, "files": []}
    present = sorted(n for n in os.listdir(path) if RANK_FILE_RE.fullmatch(n)) if os.path.isdir(path) else []
    try:
        record = multifile.read_commit(path)
    except CheckpointError as e:
        out["problem"] = str(e)
        out["files"] = [{"name": n, "rank": _rank(n), "status": "unnamed"} for n in present]
        return out
    out.update(step=record.step, layout=record.layout, created=record.created)
    if record.layout == LAYOUT and isinstance(record.layout_data, dict):
        d = record.layout_data
        columns = d.get("tensors")
        keys = columns.get("keys") if isinstance(columns, dict) else None
        out.update(
            world_size=d.get("world_size"),
            tensors=len(keys) if isinstance(keys, list) else 0,
            values=len(d.get("bytes") or {}),
        )
    problems = []
    for part in record.files:
        entry: dict[str, Any] = {"name": part.name, "rank": _rank(part.name), "length": part.length}
        try:
            multifile.check_part(path, part, path)
            entry["status"] = "ok"
        except CheckpointError as e:
            entry["status"] = "missing" if isinstance(e, IncompleteError) else "damaged"
            entry["problem"] = e.reason
            problems.append(e.reason)
        out["files"].append(entry)
    named = {p.name for p in record.files}
    out["files"] += [{"name": n, "rank": _rank(n), "status": "unnamed"} for n in present if n not in named]
    out["complete"] = not problems
    out["problem"] = "; ".join(problems) or None
    out["bytes"] = sum(p.length for p in record.files)
    return out


def _rank(name: str) -> int | None:
    m = RANK_FILE_RE.fullmatch(name)
    return int(m.group(1)) if m else None
