"""save, load and async_save: DCP's engine with ckptfmt's storage and planners plugged in."""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

from ..engine import bytesview, forkreset
from ..engine import native as _native
from ..engine.ckptdir import CheckpointDir
from ..errors import CheckpointError
from ..fileio import is_url
from ..files import multifile, places
from ..files.save import check_snapshot
from ..gcpause import pausing_in_main_thread
from ..storage.pools import pools_refuse_work
from .forkstage import ForkStager, wait_previous
from .planners import LoadPlanner, SavePlanner
from .reader import held_reader
from .storage import SaveOptions, Writer, held_writer

if TYPE_CHECKING:
    from typing_extensions import Unpack

_NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"
#: tensors at least this large are staged by the engine's parallel copy
_PARALLEL_COPY_BYTES = 4 << 20


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _single_process_ok() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        yield


def _save_planner(process_group: dist.ProcessGroup | None, kind: str) -> SavePlanner:
    """A planner that reuses the previous save's plans when nothing changed (DCP's plan cache):
    a training job saves the same structure every time, and sending every rank's plan to the
    coordinator and back is most of a save's fixed cost.  Cached per group of ranks and per
    `kind` of save (a blocking save may run while an async one plans in DCP's thread)."""
    if _distributed():
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)  # type: ignore[arg-type]
        key = f"{kind}:ranks:" + ",".join(map(str, ranks))
    else:
        key = f"{kind}:no_dist"
    return SavePlanner(enable_plan_caching=True, cache_key=key)


def _record_left(path: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether a commit record is still at `path` (False where the place cannot say)."""
    try:
        with places.place_at(path, storage_options) as p:
            return p.exists(multifile.COMMIT_NAME)
    except (CheckpointError, OSError, ValueError):
        return False


def _failure(
    doing: str, path: str, e: BaseException, storage_options: dict[str, Any] | None = None
) -> CheckpointError:
    """One CheckpointError for a failed save or load, naming the ranks that failed and why."""
    note = ""
    if doing == "save" and _record_left(path, storage_options):
        # it failed before the coordinator removed the old record (while planning): still there
        note = f"; the checkpoint already in {path} was left as it was"
    elif doing == "save":
        note = f"; no commit record was written, so {path} is not a checkpoint (earlier checkpoints are untouched)"
    if isinstance(e, CheckpointException):
        failures = sorted(e.failures.items())
        first = failures[0][1][0]
        ranks = ", ".join(str(r) for r, _ in failures)
        text = f"{doing} failed on rank{'s' if len(failures) > 1 else ''} {ranks}: {first}{note}"
        cls = type(first) if isinstance(first, CheckpointError) else CheckpointError
        try:
            return cls(text, path=path)
        except TypeError:  # a subclass with another signature
            return CheckpointError(text, path=path)
    rank = dist.get_rank() if _distributed() else 0
    return CheckpointError(
        f"{doing} failed on rank {rank}: a collective with the other ranks failed "
        f"(did a rank die, or time out?): {str(e)[:500]}{note}",
        path=path,
    )


def _mapped(
    doing: str, path: str, e: BaseException, storage_options: dict[str, Any] | None = None
) -> BaseException:
    """What to raise for `e` from DCP: a CheckpointError naming the ranks for DCP's own
    failures and, with several ranks, for the RuntimeErrors its collectives raise; any
    other error as it is."""
    if isinstance(e, CheckpointException) or (isinstance(e, RuntimeError) and _distributed()):
        return _failure(doing, path, e, storage_options)
    return e


def _raise_mapped(
    doing: str, path: str, e: BaseException, storage_options: dict[str, Any] | None = None
) -> None:
    """Raise `_mapped`'s error for `e` when it is another one (the caller re-raises `e` itself)."""
    mapped = _mapped(doing, path, e, storage_options)
    if mapped is not e:
        raise mapped from e


def _set_up_save(
    path: str | os.PathLike[str],
    group: dist.ProcessGroup | None,
    kind: str,
    options: SaveOptions,
    within: CheckpointDir | None = None,
    step_dir: bool = False,
) -> tuple[Writer, SavePlanner]:
    """What save and async_save set up alike: the Writer of directory `path` with the
    caller's options (`within`, `step_dir`: see held_writer), and the planner of `kind` of
    save for `group` (see _save_planner)."""
    w = held_writer(path, within=within, step_dir=step_dir, **options)
    return w, _save_planner(group, kind)


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    **options: Unpack[SaveOptions],
) -> Metadata:
    """Save a (sharded) state dict into directory `path`; every rank of the group calls it.

    Each rank writes its items into ``rank-NNNNN.ckpt``; the coordinator then writes the
    commit record.  Without an initialised process group this runs in this process alone.
    Errors on any rank are raised on every rank as a CheckpointError naming the ranks.
    `options` (``SaveOptions``): compression, level, chunk_size, step, metrics, metadata,
    overwrite, sign_with and encrypt_with; ``overwrite=False`` refuses a `path` that already
    holds a checkpoint; ``sign_with`` (an Ed25519 private key) signs the commit record, which
    then carries every rank file's SHA-256 (spec 16.7); ``encrypt_with`` (a key) encrypts every
    rank file (spec section 17).  `path` may be an object-store URL (``s3://bucket/prefix``,
    with ``storage_options``): each rank streams its file into its own object, the commit
    record is created last, only if absent.
    """
    return save_within(state_dict, path, process_group=process_group, **options)


@pausing_in_main_thread
def save_within(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    within: CheckpointDir | None = None,
    step_dir: bool = False,
    **options: Unpack[SaveOptions],
) -> Metadata:
    """save for ckptfmt's own callers: `within` and `step_dir` as for held_writer (the
    checkpoint manager's step directory)."""
    w, planner = _set_up_save(path, process_group, "blocking", options, within, step_dir)
    target = w.path
    try:
        for place in (target, w.options.base):  # the place written, and the one read from
            if place is not None:
                _LAST_SAVE.wait_if_at(place)
        with _single_process_ok():
            return dcp.save(
                state_dict,
                storage_writer=w,
                planner=planner,
                process_group=process_group,
                no_dist=not _distributed(),
            )
    except BaseException as e:
        planner.forget_cached_plans()  # every rank gets the error: all caches start over
        _raise_mapped("save", target, e, w.storage_options)
        raise
    finally:
        w.close()


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    verify: bool = True,
    trusted_keys: Any = None,
    decrypt_with: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Load into `state_dict` in place, resharding to this run's layout; every rank calls it.

    `path` is a checkpoint directory written by ``save`` (any number of ranks) or a single
    ckptfmt file holding full tensors (each rank reads only its slice).  Stateful values
    (modules, optimizers) get ``load_state_dict`` called, as with ``dcp.load``.
    `trusted_keys`: Ed25519 public keys; the commit record must be signed by one (a save
    made with ``sign_with``), and each rank checks every file it reads against the record's
    SHA-256 before anything of `state_dict` is written (spec 16.7; SignatureError).
    `decrypt_with`: the key of a save made with ``encrypt_with`` (DecryptionError without it).
    `path` may be an object-store URL (``s3://bucket/prefix``, the client's settings in
    `storage_options`): each rank fetches only the byte ranges it needs.
    """
    load_within(
        state_dict,
        path,
        process_group=process_group,
        verify=verify,
        trusted_keys=trusted_keys,
        decrypt_with=decrypt_with,
        storage_options=storage_options,
    )


@pausing_in_main_thread
def load_within(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    within: CheckpointDir | None = None,
    **options: Any,
) -> None:
    """load for ckptfmt's own callers: `within`, the checkpoint's directory they opened (see
    held_reader); `options`: load's."""
    target = places.normalized(path)
    storage_options = options.get("storage_options")
    reader = held_reader(target, within=within, **options)
    try:
        _LAST_SAVE.wait_if_at(target)
        reader.read_metadata()  # a missing or damaged commit record fails here, on every rank, plainly
        with _single_process_ok():
            dcp.load(
                state_dict,
                storage_reader=reader,
                planner=LoadPlanner(),
                process_group=process_group,
                no_dist=not _distributed(),
            )
    except CheckpointError:
        raise
    except BaseException as e:
        _raise_mapped("load", target, e, storage_options)
        raise
    finally:
        reader.close()


# -- async ---------------------------------------------------------------------------------------


class Stager:
    """DCP's AsyncStager: a snapshot of the state dict into CPU buffers kept across saves.

    Fresh memory costs page faults on every first touch, so the buffers of one save are
    reused by the next (keyed by the value's key path, shape and dtype).  Before copying,
    ``stage`` waits for the previous save that used the buffers to finish writing.
    DTensors are staged as DTensors over their local shard.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._pending: tuple[concurrent.futures.Future[Any], str] | None = None
        self._lock = threading.Lock()
        forkreset.register(self)

    def _forget_in_child(self) -> None:
        """A forked child's copy (engine/forkreset.py): the parent's save is not the child's to wait for, and a parent
        thread may have held the lock at the fork."""
        self._pending, self._lock = None, threading.Lock()

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def synchronize_staging(self) -> None:
        pass

    def wait(self, path: str | None = None) -> None:
        """Wait for the save that last used the buffers, before a save of `path` (its error
        stays with its future; the wait has a deadline: forkstage.wait_previous)."""
        with self._lock:
            pending = self._pending
        if pending is not None:
            wait_previous(*pending, path)

    def track(self, fut: concurrent.futures.Future[Any], path: str) -> None:
        """The save of `path` just staged into the buffers: the next stage() waits for it."""
        with self._lock:
            self._pending = (fut, path)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.wait()
        used: set[tuple[Any, ...]] = set()
        with torch.no_grad():
            out = self._copy(state_dict, (), used)
        for key in [k for k in self._buffers if k not in used]:  # values that are gone
            del self._buffers[key]
        return out  # type: ignore[no-any-return]

    def _copy(self, obj: Any, path: tuple[Any, ...], used: set[tuple[Any, ...]]) -> Any:
        if isinstance(obj, DTensor):
            local = self._tensor(obj.to_local(), path, used)
            return DTensor.from_local(
                local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
            )
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, used)
        if isinstance(obj, dict):
            out = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
            for k, v in obj.items():
                out[k] = self._copy(v, (*path, k), used)
            return out
        if isinstance(obj, list):
            return [self._copy(v, (*path, i), used) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self._copy(v, (*path, i), used) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, path: tuple[Any, ...], used: set[tuple[Any, ...]]) -> torch.Tensor:
        key = (path, tuple(t.shape), t.dtype)
        used.add(key)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
            self._buffers[key] = buf
        src = t.detach()
        nbytes = src.numel() * src.element_size()
        if (
            nbytes >= _PARALLEL_COPY_BYTES
            and src.device.type == "cpu"
            and src.is_contiguous()
            and not src.is_conj()
            and not src.is_neg()
            and _native.built()
        ):
            dst_view = bytesview.contiguous_bytes(buf)
            src_view = bytesview.contiguous_bytes(src)
            _native.copy(dst_view, src_view, _native.default_threads())
        else:
            buf.copy_(src)
        return buf

    def close(self) -> None:
        self.wait()
        self._buffers.clear()


class _LastSave:
    """The background save this process started last, whatever staged it: every background
    save waits for it first (wait_previous, with its deadline), as two in flight would run
    their collectives on the same group in threads of their own, interleaved differently on
    each rank.  A Stager's or ForkStager's own wait sees only the saves it staged."""

    def __init__(self) -> None:
        self._previous: tuple[concurrent.futures.Future[Any], str] | None = None
        self._lock = threading.Lock()

    def track(self, future: concurrent.futures.Future[Any], path: str) -> None:
        with self._lock:
            self._previous = (future, path)

    def forget_in_child(self) -> None:
        self._previous, self._lock = None, threading.Lock()

    def wait(self, path: str | None = None) -> None:
        with self._lock:
            previous = self._previous
        if previous is not None:
            wait_previous(*previous, path)

    def wait_if_at(self, path: str) -> None:
        """Wait for the last background save when it saves into `path` (normalized): a blocking
        save there would otherwise be overwritten by the older state when that one commits, and
        a load, or a save against it as its base, would find the old record withdrawn and the
        new one not yet written."""
        with self._lock:
            previous = self._previous
        if previous is not None and _same_place(previous[1], path):
            wait_previous(*previous, path)


def _same_place(a: str, b: str) -> bool:
    """Whether two normalized places are one: a URL by its text, a local path once resolved."""
    if is_url(a) or is_url(b):
        return a == b
    return os.path.realpath(a) == os.path.realpath(b)


_DEFAULT_STAGER = Stager()
_LAST_SAVE = _LastSave()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, a rank's helper) starts with no background save of
    its own: the parent's futures never end there, so a child's first save would wait for them
    until their deadline, or for ever on a lock a parent thread held at the fork.  Each Stager
    forgets its own (engine/forkreset.py)."""
    _LAST_SAVE.forget_in_child()
    ForkStager.forget_in_child()


os.register_at_fork(after_in_child=_forget_in_child)
# base group -> weak reference to its checkpoint group.  Weak on both sides: once
# destroy_process_group() drops torch's references, the groups must be freed then, by the
# thread that destroys them.  A group kept alive here would be freed at interpreter exit,
# where gloo's threads may need the GIL and the process aborts ("terminate called without an
# active exception").
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, weakref.ref[dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)


def _checkpoint_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group of its own for background saves, so their collectives never interleave with
    the training loop's on the same group.  Made on first use: every rank calls async_save."""
    if not _distributed():
        return None
    base = process_group or dist.group.WORLD
    assert base is not None
    found = _GROUPS.get(base)
    group = None if found is None else found()
    if group is None:
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        group = dist.new_group(ranks=ranks, backend="gloo")
        _GROUPS[base] = weakref.ref(group)
    return group


def async_save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    stager: Stager | None = None,
    snapshot: str = "copy",
    **options: Unpack[SaveOptions],
) -> concurrent.futures.Future[Metadata]:
    """Like ``save``, but returns once the state is staged (copied into reused CPU buffers).

    The rest runs in DCP's background thread (``dcp.async_save``) on a dedicated gloo
    group.  The future resolves to DCP's Metadata, or raises a CheckpointError.
    ``snapshot="fork"`` stages by fork instead of a copy (forkstage.py: Linux, the C engine,
    host memory not shared with other processes, else ValueError): each rank returns once
    fork() has, and a child process writes its file from a copy-on-write view of the rank's
    memory as it was then.
    """
    return save_in_background(
        state_dict, path, process_group=process_group, stager=stager, snapshot=snapshot, **options
    )


def _saved_here(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    process_group: dist.ProcessGroup | None,
    within: CheckpointDir | None,
    step_dir: bool,
    stager: Stager | None,
    options: SaveOptions,
) -> concurrent.futures.Future[Metadata]:
    """save_in_background once the interpreter's exit has made every pool refuse work (a final
    checkpoint saved by an atexit handler): the save made here, blocking, on `process_group`
    (the background saves' checkpoint group), its outcome in the future returned; after the
    background save before it, as every background save is."""
    out: concurrent.futures.Future[Metadata] = concurrent.futures.Future()
    try:
        for before in (ForkStager, stager or _DEFAULT_STAGER):
            before.wait(os.fspath(path))
        saved = save_within(
            state_dict, path, process_group=process_group, within=within, step_dir=step_dir, **options
        )
    except BaseException as e:  # the outcome is the future's, as async_save's
        out.set_exception(e)
    else:
        out.set_result(saved)
    return out


def save_in_background(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    stager: Stager | None = None,
    within: CheckpointDir | None = None,
    step_dir: bool = False,
    snapshot: str = "copy",
    **options: Unpack[SaveOptions],
) -> concurrent.futures.Future[Metadata]:
    """async_save for ckptfmt's own callers: `within` and `step_dir` as for ``Writer`` (the
    checkpoint manager's step directory, held open and locked by rank 0)."""
    check_snapshot(snapshot)
    if snapshot == "fork" and stager is not None:
        raise ValueError("snapshot='fork' stages by fork: it takes no stager")
    # the same group at exit as before it: a rank whose pools refuse work (an atexit handler's
    # save) meets the ranks whose pools do not on the group their background saves use
    group = _checkpoint_group(process_group)
    if pools_refuse_work():  # torch's async_save writes on a pool, which refuses it at exit
        return _saved_here(state_dict, path, group, within, step_dir, stager, options)
    if not _distributed():  # DCP warns from its own thread: filter just that message
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
    w, planner = _set_up_save(path, group, "async", options, within, step_dir)
    st: Stager | ForkStager = ForkStager(w) if snapshot == "fork" else (stager or _DEFAULT_STAGER)
    # one background save at a time, whichever way the last was staged (see ForkStager)
    target = w.path
    # its wait in stage() is then at once; the last background save is waited for whichever
    # stager staged it (a save staged by another Stager than this one's runs on the same group)
    for before in (ForkStager, stager or _DEFAULT_STAGER, _LAST_SAVE):
        before.wait(target)
    try:
        inner = dcp.async_save(
            state_dict,
            storage_writer=w,
            planner=planner,
            process_group=group,
            async_stager=st,  # type: ignore[arg-type]
            no_dist=not _distributed(),
        )
    except BaseException:
        w.drop_fork_snapshot()
        raise
    assert isinstance(inner, concurrent.futures.Future)
    out: concurrent.futures.Future[Metadata] = concurrent.futures.Future()

    def done(f: concurrent.futures.Future[Any]) -> None:
        w.drop_fork_snapshot()
        w.close()
        if f.exception() is not None:
            planner.forget_cached_plans()
        try:
            out.set_result(f.result())
        except BaseException as e:
            out.set_exception(_mapped("save", target, e, w.storage_options))

    inner.add_done_callback(done)
    st.track(out, target)
    _LAST_SAVE.track(out, target)
    return out
