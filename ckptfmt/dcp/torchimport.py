"""torch's DCP imported without keeping the default process group alive.

torch.distributed.checkpoint imports torch.distributed.nn.functional (default_planner ->
_shard -> sharded_tensor -> reshard), whose collectives take ``group=group.WORLD`` as a
default argument.  A default is evaluated when its module is imported: None before
``init_process_group()``, the default group after.  Imported after, the group stays
referenced by those defaults past ``destroy_process_group()`` and is freed only at
interpreter exit, where its gloo threads, still running, abort the process ("terminate
called without an active exception"; tests/test_process_groups.py).  ckptfmt imports DCP
when ckptfmt.dcp is first imported in a process that uses torch (the checkpoint manager: at
its first sharded save), often after the caller's ``init_process_group()``, so each import
is followed by `release_default_group`: the defaults that hold the default group
become None, which those functions read as the default group, the value they have in a
process that imported them before any group existed.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

#: the modules whose defaults are looked at: torch's distributed package only
_SCOPE = "torch.distributed."


def import_torch_dcp() -> None:
    """Import torch.distributed.checkpoint, then release_default_group()."""
    import torch.distributed.checkpoint  # noqa: F401

    release_default_group()


def release_default_group() -> None:
    """Set to None every default argument of a function of torch.distributed's modules that
    holds the default process group (see the module doc)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    world = dist.group.WORLD
    if world is None:  # no group: nothing imported now can hold one
        return
    for name, module in list(sys.modules.items()):
        if name.startswith(_SCOPE) and isinstance(module, types.ModuleType):
            for fn in _functions_of(module):
                _release_in(fn, world)


def _functions_of(module: types.ModuleType) -> Iterator[types.FunctionType]:
    """The functions `module` defines: its own and its classes' methods.  Values are told
    apart by their type alone: reading an attribute of some warns (torch.distributed.reduce_op)."""
    for value in list(vars(module).values()):
        kind = type(value)
        if kind is types.FunctionType:
            if value.__module__ == module.__name__:
                yield value
        elif issubclass(kind, type) and value.__module__ == module.__name__:
            for member in list(vars(value).values()):
                fn = member.__func__ if type(member) in (staticmethod, classmethod) else member
                if type(fn) is types.FunctionType:
                    yield fn


def _release_in(fn: types.FunctionType, world: Any) -> None:
    defaults = fn.__defaults__
    if defaults and any(d is world for d in defaults):
        fn.__defaults__ = tuple(None if d is world else d for d in defaults)
    kwdefaults = fn.__kwdefaults__
    if kwdefaults and any(d is world for d in kwdefaults.values()):
        fn.__kwdefaults__ = {k: None if d is world else d for k, d in kwdefaults.items()}
