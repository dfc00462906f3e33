"""ckptfmt as the storage layer of torch.distributed.checkpoint (DCP).

DCP plans which rank writes which shard and reshards on load; ckptfmt stores the
bytes: one checksummed ckptfmt file per rank, written in parallel by the C engine,
and a commit record written last by the coordinator that names every rank file
and holds DCP's global metadata as plain values.  Nothing is pickled::

    from ckptfmt import dcp as cdcp

    cdcp.save(state_dict, "ckpt/step-100")          # every rank calls it
    fut = cdcp.async_save(state_dict, path)         # returns after the snapshot
    cdcp.load(state_dict, "ckpt/step-100")          # in place, any world size

    # the same pieces, for code that calls DCP itself
    dcp.save(sd, storage_writer=cdcp.Writer(path), planner=cdcp.SavePlanner())
    dcp.load(sd, storage_reader=cdcp.Reader(path), planner=cdcp.LoadPlanner())

``consolidate(dir, out)`` writes one ckptfmt file with full tensors (from our
directories or DCP's own FileSystemWriter format); ``load`` also accepts such a
file and gives each rank only its slice.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import Stager, async_save, load, save
    from .convert import consolidate
    from .planners import LoadPlanner, SavePlanner
    from .rankplan import StorageInfo
    from .reader import Reader
    from .storage import Writer
    from .summary import describe

#: the public names and the module each comes from, imported on first use where torch is not
#: imported yet: they import torch, and ``ckptfmt verify`` of a DCP directory runs this
#: package's checks (check, metadata, sources) where torch is not installed
_LAZY = {
    "Stager": "api",
    "async_save": "api",
    "load": "api",
    "save": "api",
    "consolidate": "convert",
    "describe": "summary",
    "LoadPlanner": "planners",
    "SavePlanner": "planners",
    "StorageInfo": "rankplan",
    "Reader": "reader",
    "Writer": "storage",
}

__all__ = [
    "LoadPlanner",
    "Reader",
    "SavePlanner",
    "Stager",
    "StorageInfo",
    "Writer",
    "async_save",
    "consolidate",
    "describe",
    "load",
    "save",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    from .torchimport import release_default_group

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    release_default_group()  # the module imported torch's DCP, maybe after init_process_group()
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if sys.modules.get("torch") is not None:
    # a process that uses torch imports torch's DCP now (often before its process group
    # exists) and never keeps the default group alive through it (torchimport.py); this
    # package's own modules stay lazy
    from .torchimport import import_torch_dcp

    import_torch_dcp()
