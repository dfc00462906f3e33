"""load_into(): fill existing tensors in place, like load_state_dict(strict=...).

Every tensor of the target is matched by key path with the checkpoint; all
shapes and dtypes are checked before anything is modified.  Matching tensors
are filled from the file: straight into their memory when the target is a
contiguous CPU tensor and the file holds exactly its bytes, otherwise through a
temporary buffer no larger than that one storage.  Non-tensor values are set in
mutable containers.  Targets on the "meta" device have no memory: the loaded
tensor replaces them in their container.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import background, dtypes, tree
from .errors import CheckpointError
from .reader import CheckpointFile


class MismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the target: keys, shapes or dtypes differ."""


@dataclass
class LoadReport:
    """What load_into() found, like the result of load_state_dict()."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    loaded: int = 0


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _target_items(obj: Any, prefix: str) -> Iterator[tuple[str, Any, Any, Any]]:
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
            yield from _target_items(v, path)
        else:
            yield path, obj, k, v


def _file_items(f: CheckpointFile, i: int, prefix: str) -> Iterator[tuple[str, int]]:
    node = f.tree.nodes[i]
    if node[0] in ("dict", "odict"):
        for k, v in node[1]:
            key = tree.decode(f.tree, k, _no_storage, f.path)
            yield from _file_items(f, v, _join(prefix, key))
    elif node[0] in ("list", "tuple"):
        for n, j in enumerate(node[1]):
            yield from _file_items(f, j, _join(prefix, n))
    else:
        yield prefix, i


def _constant(st: torch.UntypedStorage) -> Callable[[int], torch.UntypedStorage]:
    return lambda _sid: st


def _no_storage(sid: int) -> torch.UntypedStorage:
    raise AssertionError("keys hold no tensors")


def load_into(
    path: str | os.PathLike[str],
    state: Any,
    *,
    strict: bool = True,
    verify: bool = True,
) -> LoadReport:
    """Fill the tensors of `state` from the checkpoint at `path`; return missing/unexpected keys.

    Raises MismatchError before modifying anything when a shape or dtype differs,
    or (with strict=True) when keys are missing or unexpected.
    """
    background.wait_for_path(path)
    with CheckpointFile(path) as f:
        return fill_from_node(f, f.tree.root, state, strict=strict, verify=verify)


def fill_from_node(f: CheckpointFile, top: int, state: Any, *, strict: bool, verify: bool) -> LoadReport:
    """load_into() for the subtree of node `top` of an open file: key paths are relative to it."""
    in_file = dict(_file_items(f, top, ""))
    targets = list(_target_items(state, ""))
    report = LoadReport()
    target_keys = set()
    problems = []
    for key, _, _, value in targets:
        target_keys.add(key)
        i = in_file.get(key)
        if i is None:
            report.missing_keys.append(key)
            continue
        node = f.tree.nodes[i]
        if isinstance(value, torch.Tensor):
            if node[0] != "tensor":
                problems.append(f"{key}: the checkpoint holds a {node[0]}, the target a tensor")
                continue
            m = node[1]
            if list(value.shape) != m["shape"]:
                problems.append(f"{key}: shape mismatch: checkpoint {m['shape']}, target {list(value.shape)}")
            elif dtypes.TORCH_DTYPES[m["dtype"]] != value.dtype:
                problems.append(
                    f"{key}: dtype mismatch: checkpoint {m['dtype']}, target "
                    f"{dtypes.TORCH_NAMES.get(value.dtype, str(value.dtype))}"
                )
    report.unexpected_keys = [k for k in in_file if k not in target_keys]
    if problems:
        raise MismatchError(
            problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""), path=f.path
        )
    if strict and (report.missing_keys or report.unexpected_keys):
        parts = []
        if report.missing_keys:
            parts.append(
                f"missing keys {report.missing_keys[:5]}" + ("..." if len(report.missing_keys) > 5 else "")
            )
        if report.unexpected_keys:
            parts.append(
                f"unexpected keys {report.unexpected_keys[:5]}"
                + ("..." if len(report.unexpected_keys) > 5 else "")
            )
        raise MismatchError("; ".join(parts), path=f.path)
    _fill(f, targets, in_file, verify, report)
    return report


def _direct(f: CheckpointFile, value: torch.Tensor, m: dict[str, Any]) -> bool:
    """The file's storage is exactly this contiguous CPU tensor's bytes, laid out the same way:
    read straight into it."""
    rec = f.storages[m["storage"]]
    return (
        value.device.type == "cpu"
        and value.is_contiguous()
        and not value.is_conj()
        and m["offset"] == 0
        and m["stride"] == list(value.stride())  # same layout, not just the same bytes
        and rec.nbytes == value.numel() * value.element_size()
        and rec.nbytes > 0
    )


def _fill(
    f: CheckpointFile,
    targets: list[tuple[str, Any, Any, Any]],
    in_file: dict[str, int],
    verify: bool,
    report: LoadReport,
) -> None:
    direct: dict[int, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, int]] = []
    replace: list[tuple[Any, Any, int]] = []
    for key, container, ckey, value in targets:
        i = in_file.get(key)
        if i is None:
            continue
        node = f.tree.nodes[i]
        if isinstance(value, torch.Tensor):
            m = node[1]
            if value.is_meta:
                replace.append((container, ckey, i))
            elif _direct(f, value, m) and m["storage"] not in direct:
                direct[m["storage"]] = value
            else:
                copies.append((value, i))
            report.loaded += 1
        elif not isinstance(container, tuple):
            replace.append((container, ckey, i))
            report.loaded += 1
    # 1. storages that land directly in target memory, all chunks in one parallel read
    items = []
    for sid, t in direct.items():
        flat = t.detach().reshape(-1).view(torch.uint8)
        items.extend(f._chunk_views(sid, flat))
    with torch.no_grad():
        f.read_into(items, verify)
        # 2. everything else through a temporary host copy of its storage, one storage at a time
        done: dict[int, torch.UntypedStorage] = {}
        for value, i in sorted(copies, key=lambda c: f.tree.nodes[c[1]][1]["storage"]):
            sid = f.tree.nodes[i][1]["storage"]
            if sid in direct:
                src_storage = direct[sid].untyped_storage()
            else:
                if sid not in done:
                    done.clear()  # keep at most one temporary storage alive
                    done[sid] = f.read_storage(sid, verify)
                src_storage = done[sid]
            src = tree.decode(f.tree, i, _constant(src_storage), f.path)
            value.copy_(src, non_blocking=value.device.type != "cpu")  # type: ignore[arg-type]
        # 3. values and meta targets: replaced in their containers
        for container, ckey, i in replace:
            container[ckey] = f.load_subtree(i, None, verify)
    for dev in {v.device for v, _ in copies if v.device.type not in ("cpu", "meta")}:
        torch.accelerator.synchronize(dev)
