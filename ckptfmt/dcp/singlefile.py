"""A single ckptfmt file read as a DCP checkpoint: its state flattened the way DCP flattens.

``cdcp.load(state_dict, "model.ckpt")`` loads a file with full tensors (one written by
``consolidate``, ``ckptfmt.save`` or a checkpoint manager) into any sharding: DCP sees
each tensor as one saved chunk and asks each rank for just its box of it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import UnsupportedError
from ..files.reader import CheckpointFile
from ..format import dtypes
from ..format.decode import decode
from . import metadata as mdv


def file_metadata(f: CheckpointFile, name: str) -> tuple[Metadata, dict[MetadataIndex, mdv.Location]]:
    """DCP metadata for one ckptfmt file: its state flattened the way DCP flattens a state dict
    (dicts always, lists only when they hold tensors or dicts), each tensor one whole chunk."""
    t = f.tree
    if t.nodes[t.root][0] not in ("dict", "odict"):
        raise UnsupportedError("the state is not a dict, so it has no DCP keys", path=f.path)
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    where: dict[MetadataIndex, mdv.Location] = {}
    mappings: dict[str, tuple[str | int, ...]] = {}
    for path, node in _flatten(f, t.root, ()):
        fqn = ".".join(map(str, path))
        if fqn in sdm:
            raise UnsupportedError(f"two entries flatten to the DCP key {fqn!r}", path=f.path)
        mappings[fqn] = path
        kind, body = t.nodes[node][0], t.nodes[node][1:]
        if kind == "tensor":
            m = body[0]
            shape = torch.Size(m["shape"])
            props = TensorProperties(dtype=dtypes.TORCH_DTYPES[m["dtype"]], requires_grad=m["requires_grad"])
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)
            sdm[fqn] = TensorStorageMetadata(properties=props, size=shape, chunks=[chunk])
            where[MetadataIndex(fqn, chunk.offsets)] = mdv.Location(name, node, tuple(shape))
        else:
            sdm[fqn] = BytesStorageMetadata()
            where[MetadataIndex(fqn)] = mdv.Location(name, node)
    md = Metadata(state_dict_metadata=sdm, planner_data=mappings, version=mdv.DCP_VERSION)
    return md, where


def _flatten(
    f: CheckpointFile, node: int, path: tuple[str | int, ...]
) -> Iterator[tuple[tuple[str | int, ...], int]]:
    """DCP's traverse_state_dict over the node table: (key path, leaf node)."""
    nodes = f.tree.nodes
    kind = nodes[node][0]
    if kind in ("dict", "odict"):
        for k, v in nodes[node][1]:
            key = decode(f.tree, k, _no_storage, f.path)
            yield from _flatten(f, v, (*path, str(key)))
    elif kind == "list" and not _terminal(f, node):
        for i, v in enumerate(nodes[node][1]):
            yield from _flatten(f, v, (*path, i))
    else:
        yield path, node


def _terminal(f: CheckpointFile, node: int) -> bool:
    """DCP's rule: a list is a leaf unless it holds a tensor, a dict, or a non-leaf list."""
    for c in f.tree.nodes[node][1]:
        kind = f.tree.nodes[c][0]
        if kind in ("tensor", "dict", "odict") or (kind == "list" and not _terminal(f, c)):
            return False
    return True


def _no_storage(sid: int) -> torch.UntypedStorage:
    raise AssertionError("dict keys never hold tensors")
