"""Matching a checkpoint's entries against the live state load_into() fills.

Both sides are flattened to dotted key paths ("model.layers.0.weight"): the file's
entries from its checked tree, the target's leaves from its dicts, lists and tuples.
`match` pairs them and checks, before anything is read or written, that every target
tensor has the shape and dtype of its entry and can be written (no overlapping
elements, no meta tensor inside a tuple).  What it finds is the caller's `LoadReport`,
like load_state_dict()'s result; a mismatch, or with strict=True a missing or
unexpected key, is a `MismatchError`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError
from ..format import dtypes
from ..format.decode import decode_key
from .reader import CheckpointFile

#: one leaf of the target: (dotted key, its container, its key in the container, the value)
Target = tuple[str, Any, Any, Any]


class MismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the target: keys, shapes or dtypes differ."""


@dataclass
class LoadReport:
    """What load_into() found, like the result of load_state_dict()."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    loaded: int = 0


@dataclass
class Matched:
    """The target's leaves, the file's entries by dotted key, and what the match found."""

    targets: list[Target]
    in_file: dict[str, int]
    report: LoadReport
    #: key -> (chunk, address): the targets that take one whole chunk of the file as they are
    whole: dict[str, tuple[int, int]] = field(default_factory=dict)


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def target_items(obj: Any, prefix: str) -> Iterator[Target]:
    """(dotted key, container, key in container, value) for every leaf of the target."""
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return
    for k, v in items:
        path = _join(prefix, k)
        if isinstance(v, (dict, list, tuple)) and not isinstance(v, torch.Size):
            yield from target_items(v, path)
        else:
            yield path, obj, k, v


def file_items(f: CheckpointFile, i: int, prefix: str) -> Iterator[tuple[str, int]]:
    """(dotted key, node) for every leaf under node i of the file's tree."""
    node = f.tree.nodes[i]
    if node[0] in ("dict", "odict"):
        nodes = f.tree.nodes
        for k, v in node[1]:
            key = nodes[k][1] if nodes[k][0] == "str" else decode_key(f.tree, k, f.path)
            if nodes[v][0] == "tensor":  # a leaf: no generator of its own
                yield _join(prefix, key), v
            else:
                yield from file_items(f, v, _join(prefix, key))
    elif node[0] in ("list", "tuple"):
        for n, j in enumerate(node[1]):
            yield from file_items(f, j, _join(prefix, n))
    else:
        yield prefix, i


def _tensor_problem(key: str, value: torch.Tensor, node: list[Any], container: Any) -> str | None:
    """Why target tensor `value` cannot take node's tensor, or None."""
    if node[0] != "tensor":
        return f"{key}: the checkpoint holds a {node[0]}, the target a tensor"
    m = node[1]
    if list(value.shape) != m["shape"]:
        return f"{key}: shape mismatch: checkpoint {m['shape']}, target {list(value.shape)}"
    if dtypes.TORCH_DTYPES[m["dtype"]] != value.dtype:
        return (
            f"{key}: dtype mismatch: checkpoint {m['dtype']}, target "
            f"{dtypes.TORCH_NAMES.get(value.dtype, str(value.dtype))}"
        )
    # targets load_into() could not write: found now, not half way through the writes
    if value.is_meta:
        if isinstance(container, tuple):
            return f"{key}: a meta tensor inside a tuple cannot be replaced"
        return None
    # a contiguous tensor's elements never share memory: the overlap check only for the others
    if value.numel() > 1 and not value.is_contiguous() and torch._debug_has_internal_overlap(value) == 1:
        return f"{key}: several elements of the target share memory (an expanded tensor?)"
    return None


def _key_problems(report: LoadReport) -> str:
    """The first few missing and unexpected keys, for a strict load's error."""
    parts = []
    for what, keys in (("missing", report.missing_keys), ("unexpected", report.unexpected_keys)):
        if keys:
            parts.append(f"{what} keys {keys[:5]}" + ("..." if len(keys) > 5 else ""))
    return "; ".join(parts)


def _whole_chunk(value: torch.Tensor, m: dict[str, Any], rec: Any) -> bool:
    """Whether target `value`, a contiguous CPU tensor, takes file tensor `m` with no problem and
    as the commonest target of all: dense in the file's layout (the same strides, shape and dtype,
    no conjugate or negative bit of its own) and the whole of its storage `rec`, which is one
    chunk: that chunk is read straight into the target's memory.  Cheapest tests first; the
    conjugate bit is asked only of complex tensors (no other kind has one)."""
    dt = value.dtype
    return (
        rec.n_chunks == 1
        and m["offset"] == 0
        and dt is dtypes.TORCH_DTYPES[m["dtype"]]
        and rec.nbytes == math.prod(m["shape"]) * dt.itemsize
        and value.shape == tuple(m["shape"])
        and value.stride() == tuple(m["stride"])
        and not value.is_neg()
        and (value.is_conj() == m["conj"] if dt.is_complex else not m["conj"])
    )


def _plan_shared_keys_one_by_one(whole: dict[str, tuple[int, int]], targets: list[Target]) -> None:
    """Drop from `whole` every key that several targets share ("a.b" and "a": {"b"}): `whole`
    is looked up by key, so any other target under that key, whatever it is, would be planned
    as a read into the whole-chunk target's memory and never filled itself.  make_plan plans
    such targets one by one, as it does any other."""
    counts = Counter(t[0] for t in targets)
    for key, n in counts.items():
        if n > 1:
            whole.pop(key, None)


def match(f: CheckpointFile, top: int, state: Any, *, strict: bool) -> Matched:
    """Pair the leaves of `state` with the entries under node `top`; MismatchError before any read.

    The commonest targets (_whole_chunk) are recognised in the same look as their checks, and
    their place recorded in `Matched.whole`: a state of many small tensors is mostly cache
    misses on the tensors, so each is looked at once."""
    in_file = dict(file_items(f, top, ""))
    targets = list(target_items(state, ""))
    report = LoadReport()
    problems = []
    whole: dict[str, tuple[int, int]] = {}
    nodes, records = f.tree.nodes, f.storages
    tensor = torch.Tensor
    missing = report.missing_keys
    for key, container, _, value in targets:
        i = in_file.get(key)
        if i is None:
            missing.append(key)
            continue
        if isinstance(value, tensor):
            node = nodes[i]
            if node[0] == "tensor" and value.is_cpu and value.is_contiguous():
                rec = records[node[1]["storage"]]
                if _whole_chunk(value, node[1], rec):
                    whole[key] = (rec.first_chunk, value.data_ptr())
                    continue
            problem = _tensor_problem(key, value, node, container)
            if problem:
                problems.append(problem)
    target_keys = {t[0] for t in targets}
    if len(target_keys) < len(targets):  # several targets under one dotted key
        _plan_shared_keys_one_by_one(whole, targets)
    report.unexpected_keys = [k for k in in_file if k not in target_keys]
    if problems:
        raise MismatchError(
            problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""), path=f.path
        )
    if strict and (report.missing_keys or report.unexpected_keys):
        raise MismatchError(_key_problems(report), path=f.path)
    return Matched(targets, in_file, report, whole)
