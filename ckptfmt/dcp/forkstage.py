"""Fork snapshots for DCP's asynchronous saves (``async_save(..., snapshot="fork")``).

DCP calls its stager (``AsyncStager.stage``) in the caller's thread, then plans the save with
the other ranks and writes it on a background thread.  The copying Stager (api.py) copies
the state into CPU buffers there; this one forks instead (background/forksave.py,
``take_snapshot``): the child holds the rank's memory as it is at that instant, and the
staged state handed to DCP is the same memory under new tensor objects (so a parameter
given new storage later, ``p.data = ...``, changes nothing staged).  DCP plans from the
staged state while training goes on (shapes and addresses only: no byte of it is read in
this process), and the Writer (storage.py) hands the child its rank file's plan; the child
writes it from its unchanged view, in C only, and the Writer's thread commits it as a fork
save of one process does.  The child never touches the process group: it runs no Python.

What fork cannot snapshot is refused before anything is saved (ValueError, as for
``ckptfmt.save(snapshot="fork")``): tensors on an accelerator, in pinned or shared memory.
Views that are not contiguous (and conjugate or negative views) are copied before the fork,
as the Writer would copy them later; a contiguous view of a larger buffer (an FSDP shard of
its padded buffer) is written from that buffer's bytes, without a copy.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import ctypes
import threading
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..background import forksave, inflight
from ..errors import CheckpointError, UnsupportedError
from ..format.render import render_key


class ForkStager:
    """DCP's AsyncStager for one save through `writer` (storage.py's Writer): ``stage`` forks
    the child that will write this rank's file and gives it to the writer.

    Like the copying Stager, it first waits for the previous save it staged (`track`): two
    background saves in flight would run their collectives on the same group in threads of
    their own, interleaved differently on each rank (a deadlock).  That wait has a deadline
    (wait_previous)."""

    _previous: tuple[concurrent.futures.Future[Any], str] | None = None
    _lock = threading.Lock()

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    @classmethod
    def track(cls, future: concurrent.futures.Future[Any], path: str) -> None:
        """The save of `path` just staged: the next stage() waits for it."""
        with cls._lock:
            cls._previous = (future, path)

    @classmethod
    def forget_in_child(cls) -> None:
        """A forked child waits for none of its parent's saves (dcp.api's at-fork handler)."""
        cls._previous, cls._lock = None, threading.Lock()

    @classmethod
    def wait(cls, path: str | None = None) -> None:
        """Wait for the save last staged by fork, before a save of `path` (wait_previous)."""
        with cls._lock:
            previous = cls._previous
        if previous is not None:
            wait_previous(*previous, path)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def synchronize_staging(self) -> None:
        pass

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.wait(self._writer.path)
        sources: list[tuple[str, Any]] = []
        with torch.no_grad():
            staged = _aliased(state_dict, (), sources)
        self._writer.take_fork_snapshot(forksave.take_snapshot(sources))
        return staged  # type: ignore[no-any-return]

    def close(self) -> None:
        pass


def wait_previous(future: concurrent.futures.Future[Any], previous: str, path: str | None) -> None:
    """Wait for the background save of `previous` staged before the save of `path` (its error
    stays with its future), at most inflight.DEADLINE seconds: past that, CheckpointError
    naming both and the deadline (the save of `path` is not started; the other goes on).
    Its own waits have that deadline too, so only a save stuck elsewhere (a collective
    another rank never joins) is still running then."""
    seconds = inflight.DEADLINE
    done, _ = concurrent.futures.wait([future], timeout=seconds)
    if not done:
        raise CheckpointError(
            f"the background save of {previous} staged before this one is still running after "
            f"the deadline of {seconds:g} s; this save was not started",
            path=path,
        )


def _aliased(obj: Any, path: tuple[Any, ...], sources: list[tuple[str, Any]]) -> Any:
    """`obj` with every tensor a new tensor object over the same memory (DTensors over their
    local shard), every array and other value copied now; `sources` collects the memory."""
    if isinstance(obj, DTensor):
        local = _tensor(obj._local_tensor, path, sources)
        return DTensor.from_local(
            local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
        )
    if isinstance(obj, torch.Tensor):
        return _tensor(obj, path, sources)
    if isinstance(obj, np.ndarray) and obj.dtype != object:
        fortran = obj.ndim > 1 and obj.flags.f_contiguous and not obj.flags.c_contiguous
        out = np.array(obj, order="F" if fortran else "C", copy=True)  # laid out as encode keeps it
        sources.append((_key(path), out))
        return out
    if isinstance(obj, dict):
        d = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
        for k, v in obj.items():
            d[k] = _aliased(v, (*path, k), sources)
        return d
    if isinstance(obj, list):
        return [_aliased(v, (*path, i), sources) for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return tuple(_aliased(v, (*path, i), sources) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def _key(path: tuple[Any, ...]) -> str:
    """The key path a message names a staged value by."""
    text = ""
    for k in path:
        text = render_key(text, k)
    return text


def _tensor(t: torch.Tensor, path: tuple[Any, ...], sources: list[tuple[str, Any]]) -> torch.Tensor:
    alias = t.detach()
    if not alias.is_contiguous() or alias.is_conj() or alias.is_neg():
        alias = alias.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    sources.append((_key(path), alias.untyped_storage()))
    return alias


def exact(t: torch.Tensor, key: str) -> torch.Tensor:
    """A tensor that is exactly `t`'s bytes, row-major, without copying them (Writer's _compact
    copies; a copy made now would hold what the memory holds now, not at the snapshot): `t`
    itself, or a tensor over just its bytes of the larger buffer it views."""
    nbytes = t.numel() * t.element_size()
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        raise UnsupportedError(
            "the planner resolved a view that is not contiguous after the fork snapshot was taken "
            "(it cannot be copied from the snapshot); use snapshot='copy'",
            key=key,
        )
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes:
        return t
    if nbytes == 0:
        return torch.empty(tuple(t.shape), dtype=t.dtype)
    raw = (ctypes.c_char * nbytes).from_address(t.data_ptr())  # kept alive by the tensor
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(tuple(t.shape))
