"""Non-blocking saves: snapshot into staging memory, write on a background thread.

``save(state, path, blocking=False)`` returns a SaveHandle once every tensor has
been copied into staging slabs: from then on the caller may change parameters
and optimizer state, and the file still holds the values at call time.  When
the state is larger than the staging limit, the snapshot hands full slabs to
the writer as it goes and waits for slabs to come back, so the caller is
blocked only while what does not fit is copied.

Host storages are staged in ordinary slabs, accelerator storages in pinned
ones (copied asynchronously, fenced by an event on the source device's
stream).  One slab of each kind stays open, so a state that alternates between
the two (AdamW's CPU ``step`` tensors between its GPU moments) fills two slabs,
not one slab per change.  Chunks reach the writer in file order whatever slab
they were staged in; a slab goes back to the pool once the writer has written
every chunk in it and every copy into it has finished.

Failures leave nothing behind: a snapshot that fails part-way hands its open
slabs to the writer to give back, a writer thread that cannot start takes the
temp file and the in-flight mark with it, and the writer gives back every slab
the snapshot hands it, even after an error.  Errors are never lost: ``wait()``
raises them; a handle dropped without ``wait()`` has its error raised by the
next save, or printed at interpreter exit (inflight.py).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from typing import Any

import torch

from ..engine import bytesview, chunkwrite
from ..engine import native as _native
from ..engine.ckptdir import CheckpointDir
from ..engine.commit import AtomicFile
from ..engine.writeoptions import WriteOptions
from ..format.encode import Encoded
from . import forksave, inflight
from .inflight import SaveHandle
from .staging import POOL, StagingPool


def _accelerator_type() -> str | None:
    """The device type of this process's accelerator (None without one)."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    return None if acc is None else acc.type


def _fence(device: torch.device) -> Any:
    """An event that completes when the work issued so far on `device`'s current stream has.

    A device-to-host copy runs on the current stream of the *source* device, which
    is not the current device's when the tensor lives on another one (a copy from
    device 1 while device 0 is current): the event is recorded on that stream.
    """
    return torch.accelerator.current_stream(device).record_event()


def _copy_into_slab(
    src: torch.UntypedStorage, start: int, length: int, dst: torch.Tensor, pinned: bool
) -> None:
    """Copy bytes start..start+length of a device storage into a slab (asynchronously when pinned:
    the copy is queued on the source device's current stream, before any later change to it)."""
    piece = bytesview.storage_as_uint8(src)[start : start + length]
    dst[:length].copy_(piece, non_blocking=pinned)


def _host_bytes(src: torch.UntypedStorage | Any) -> memoryview | None:
    """A byte view of a CPU storage or array, None for device storages."""
    if isinstance(src, bytes):  # an array as its stored bytes (format/arrays.py)
        return memoryview(src)
    if isinstance(src, torch.UntypedStorage):
        if src.device.type != "cpu":
            return None
        return bytesview.storage_bytes(src)
    return bytesview.array_bytes(src)


class _Slab:
    """A slab being filled."""

    __slots__ = ("tensor", "view", "used")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.view = bytesview.tensor_bytes(tensor)
        self.used = 0


class _Piece:
    """The next chunks of the file, in order, and what to do once they are written.

    events: wait for these before reading the views (asynchronous copies into them);
    release: slabs that no later piece uses, given back once this piece is written.
    """

    __slots__ = ("views", "events", "release")

    def __init__(self, views: list[tuple[memoryview, int]], events: list[Any], release: list[torch.Tensor]):
        self.views = views
        self.events = events
        self.release = release


def save_async(
    encoded: Encoded,
    path: str,
    options: WriteOptions,
    *,
    snapshot: str = "copy",
    staged: forksave.ForkSnapshot | None = None,
    within: CheckpointDir | None = None,
    output: Any = None,
) -> SaveHandle:
    """Snapshot `encoded` (checked already: nothing is written for a state that cannot be)
    and write it in the background as `options` say; return once the snapshot is taken.

    output: where the file goes when not an AtomicFile of `path` beneath `within`: an
    object upload (storage/upload.py's ObjectFile, not yet entered).

    snapshot: "copy" copies the state into staging memory (below); "fork" takes a
    copy-on-write snapshot in a child process (forksave.py), ValueError where it cannot.
    staged: a ForkSnapshot taken earlier (forksave.take_snapshot), whose child writes it."""
    if staged is not None:
        return forksave.save_forked(encoded, path, options, within=within, output=output, staged=staged)
    if snapshot == "fork":
        reason = forksave.why_not(encoded)
        if reason is not None:
            raise ValueError(f"{path}: snapshot='fork' is not possible: {reason}")
        return forksave.save_forked(encoded, path, options, within=within, output=output)
    return _save_copied(encoded, path, options, within=within, output=output)


def _save_copied(
    encoded: Encoded,
    path: str,
    options: WriteOptions,
    *,
    within: CheckpointDir | None,
    output: Any = None,
) -> SaveHandle:
    handle = SaveHandle(path)
    pieces: queue.Queue[_Piece | BaseException | None] = queue.Queue()
    # The writer starts when the snapshot is complete, or as soon as the snapshot
    # has to wait for staging memory: until then it would only compete with the
    # caller's copies for cores and memory bandwidth.
    go = threading.Event()
    atomic = AtomicFile(path, within) if output is None else output
    pool = POOL
    owner = threading.Lock()
    thread = threading.Thread(
        target=_write_worker,
        args=(handle, atomic, encoded, pieces, go, options, pool, owner),
        name=f"ckptfmt-save-{os.path.basename(path)}",
        daemon=False,
    )
    handle._thread = thread
    atomic.__enter__()  # creation errors (missing directory, permissions) are raised now
    if options.dedup is not None:  # closed by the writer, or below when it cannot start
        options.dedup.claim()
    inflight.begin(handle)
    try:
        thread.start()
    except BaseException as e:  # no thread: nothing will ever finish this save
        if not owner.acquire(blocking=False):  # the writer began: it ends the save, failed, so
            # it is never left waiting for a `go` no one would give (a thread the exit waits for)
            pieces.put(e)
            go.set()
            inflight.watch(handle)
            raise
        inflight.end(handle)
        if options.dedup is not None:
            options.dedup.close()
        atomic.__exit__(None, None, None)
        handle._finish(e)
        raise
    try:
        _snapshot(encoded, pieces, options.chunk_size, go.set, pool)
    except BaseException as e:
        pieces.put(e)
        go.set()
        handle._done.wait(inflight.DEADLINE)  # the writer gives its slabs back; the error is this one
        raise
    go.set()
    inflight.watch(handle)
    return handle


def _snapshot(
    encoded: Encoded,
    pieces: queue.Queue[Any],
    chunk_size: int,
    on_wait: Any,
    pool: StagingPool | None = None,
) -> None:
    """Copy every storage into slabs, handing the chunks to the writer as slabs fill.

    Host bytes are copied in spans as long as fit the open host slab (on the
    engine's threads when it is built); accelerator storages are copied
    asynchronously into the open pinned slab.  On an error the slabs not yet
    given to the writer are handed over (without their chunks) for it to give back.
    """
    pool = POOL if pool is None else pool
    slab_bytes = pool.slab_size(chunk_size)
    threads = _native.default_threads()
    accel = _accelerator_type()
    open_slabs: dict[bool, _Slab | None] = {False: None, True: None}  # by pinned
    views: list[tuple[memoryview, int]] = []
    events: dict[torch.device, Any] = {}  # the newest fence per source device
    closed: list[torch.Tensor] = []

    def close(pinned: bool) -> None:
        slab = open_slabs[pinned]
        if slab is not None:
            closed.append(slab.tensor)
            open_slabs[pinned] = None

    def hand_over() -> None:
        nonlocal views, events, closed
        if views or events or closed:
            pieces.put(_Piece(views, list(events.values()), closed))
        views, events, closed = [], {}, []

    def make_room(pinned: bool) -> None:
        """The pool is full: the open slab of the other kind goes to the writer too."""
        close(not pinned)
        hand_over()
        on_wait()

    try:
        for plan in encoded.storages:
            src = plan.source
            host = _host_bytes(src)
            device = None if host is not None else torch.device(src.device)  # type: ignore[union-attr]
            pinned = device is not None and device.type == accel
            start = 0
            while start < plan.nbytes:
                left = plan.nbytes - start
                slab = open_slabs[pinned]
                room = 0 if slab is None else max(0, slab.tensor.numel() - slab.used)
                # a span is the rest of the storage, or as many whole chunks as fit
                span = left if left <= room else room // chunk_size * chunk_size
                if slab is None or span == 0:
                    close(pinned)
                    hand_over()
                    slab = _Slab(pool.acquire(slab_bytes, pinned, functools.partial(make_room, pinned)))
                    open_slabs[pinned] = slab
                    span = min(left, slab.tensor.numel())
                at = slab.used
                if host is not None:
                    if _native.built():
                        _native.copy(slab.view[at : at + span], host[start : start + span], threads)
                    else:
                        slab.view[at : at + span] = host[start : start + span]
                else:
                    assert isinstance(src, torch.UntypedStorage) and device is not None
                    _copy_into_slab(src, start, span, slab.tensor[at : at + span], pinned)
                    if pinned:
                        events[device] = _fence(device)
                for off in range(0, span, chunk_size):
                    n = min(chunk_size, span - off)
                    views.append((slab.view[at + off : at + off + n], plan.width))
                slab.used = -(-(at + span) // 64) * 64  # every span starts 64-byte aligned in the slab
                start += span
    except BaseException:
        views = []  # nothing more is written; the slabs (and fences of copies into them) go back
        close(False)
        close(True)
        hand_over()
        raise
    close(False)
    close(True)
    hand_over()
    pieces.put(None)


def _retire(item: _Piece, pool: StagingPool) -> None:
    """Give a written piece's closed slabs back, once no copy into them can still be running."""
    item.views = []
    try:
        for event in item.events:
            event.synchronize()
    except BaseException:
        for slab in item.release:  # a copy may still land there: never reuse it
            pool.discard(slab)
        raise
    for slab in item.release:
        pool.release(slab)


_MORE = object()  # _take_batch: the snapshot has not ended yet
#: a batch written in one engine call holds at most this many bytes of chunks
BATCH_BYTES = 1 << 30


def _take_batch(pieces: queue.Queue[Any]) -> tuple[list[_Piece], Any]:
    """The pieces handed over so far (at least one, waiting for it), up to BATCH_BYTES.

    Writing them in one engine call keeps every thread busy across slab boundaries,
    instead of starting and draining the threads once per slab.  Returns the batch
    and what ended it: _MORE, None (the snapshot is complete) or the snapshot's error.
    """
    batch: list[_Piece] = []
    size = 0
    item = pieces.get()
    while True:
        if item is None or isinstance(item, BaseException):
            return batch, item
        batch.append(item)
        size += sum(len(v) for v, _ in item.views)
        if size >= BATCH_BYTES:
            return batch, _MORE
        try:
            item = pieces.get_nowait()
        except queue.Empty:
            return batch, _MORE


def _write_worker(
    handle: SaveHandle,
    atomic: Any,
    encoded: Encoded,
    pieces: queue.Queue[Any],
    go: threading.Event,
    options: WriteOptions,
    pool: StagingPool,
    owner: threading.Lock,
) -> None:
    if not owner.acquire(blocking=False):
        return  # _save_copied failed first and cleaned up
    exc: BaseException | None = None
    ended = False  # the snapshot's last item (None, or its error) has been taken
    replaced: list[int] = []  # the file this save replaced, held open: freed after the save is done
    try:
        go.wait()
        file_id = chunkwrite.new_file_id()
        # an incremental save (dedup) digests the snapshot here, on this thread, not the caller's
        out = chunkwrite.ChunkWriter(
            atomic.fd, file_id, options, path=handle.path, on_written=getattr(atomic, "written", None)
        )
        while not ended:
            batch, last = _take_batch(pieces)
            try:
                if exc is None and batch:
                    for item in batch:
                        for event in item.events:
                            event.synchronize()
                    out.write([v for item in batch for v in item.views])
            except BaseException as e:  # keep taking pieces so the snapshot never waits forever
                exc = e
            finally:
                for item in batch:
                    _retire(item, pool)
            if last is not _MORE:
                ended = True
                if last is not None:
                    raise last
        if exc is None:
            length = out.finish(encoded)
            atomic.commit(free_replaced=replaced.append)
            handle.version = getattr(atomic, "etag", None)  # an object upload's
            handle._durable_now(length)
    except BaseException as e:
        exc = exc or e
        while not ended:  # the snapshot is still handing over pieces: give their slabs back
            item = pieces.get()
            if item is None or isinstance(item, BaseException):
                ended = True
            else:
                try:
                    _retire(item, pool)
                except BaseException:
                    pass  # discarded, not reused
    finally:
        if options.dedup is not None:  # its base: not left open by a failure's traceback
            options.dedup.close()
        inflight.close_then_settle(handle, lambda: atomic.__exit__(None, None, None), exc, replaced)
