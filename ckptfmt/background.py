"""Non-blocking saves: snapshot into staging memory, write on a background thread.

``save(state, path, blocking=False)`` returns a SaveHandle once every tensor has
been copied into staging slabs: from then on the caller may change parameters
and optimizer state, and the file still holds the values at call time.  When
the state is larger than the staging limit, the snapshot hands full slabs to
the writer as it goes and waits for slabs to come back, so the caller is
blocked only while what does not fit is copied.

Saves, loads and removals of a path wait for the save in flight on that path.
Errors are never lost: ``wait()`` raises them; a handle dropped without
``wait()`` has its error raised by the next save, or printed at interpreter
exit, which waits for every save in flight first.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
from typing import Any

import torch

from . import _native, tree, writer
from .staging import POOL


class SaveHandle:
    """The result of a non-blocking save."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._observed = False

    def done(self) -> bool:
        """True once the file is committed (or the save failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the file is durable at its path; raise the save's error if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.path}: save still in progress after {timeout} s")
        self._observed = True
        if self._exc is not None:
            raise self._exc

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error, or None; waits like wait()."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.path}: save still in progress after {timeout} s")
        self._observed = True
        return self._exc

    def _finish(self, exc: BaseException | None) -> None:
        self._exc = exc
        self._done.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._exc else "done")
        return f"<SaveHandle {self.path!r} {state}>"


_lock = threading.Lock()
_in_flight: dict[str, SaveHandle] = {}
_unobserved: list[SaveHandle] = []


def _key(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.fspath(path))


def wait_for_path(path: str | os.PathLike[str]) -> None:
    """Wait for the save in flight on `path`, if any (its error stays with its handle)."""
    with _lock:
        h = _in_flight.get(_key(path))
    if h is not None:
        h._done.wait()


def raise_unobserved() -> None:
    """Raise the error of an earlier non-blocking save nobody waited for (one per call)."""
    with _lock:
        failed = [h for h in _unobserved if h.done() and h._exc is not None and not h._observed]
        _unobserved[:] = [h for h in _unobserved if not h.done() or h in failed[1:]]
    if failed:
        h = failed[0]
        h._observed = True
        raise RuntimeError(
            f"an earlier non-blocking save of {h.path} failed and was never waited for"
        ) from h._exc


@atexit.register
def _at_exit() -> None:
    with _lock:
        handles = list(_in_flight.values()) + list(_unobserved)
    for h in handles:
        h._done.wait()
        if h._exc is not None and not h._observed:
            print(f"ckptfmt: non-blocking save of {h.path} failed: {h._exc!r}", file=sys.stderr)


def _copy_into_slab(src: torch.UntypedStorage, start: int, length: int, dst: torch.Tensor) -> None:
    flat = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src)
    piece = flat[start : start + length]
    if src.device.type == "cpu":
        dst[:length].copy_(piece)
    else:  # issued on the current stream: later kernels that change the source run after it
        dst[:length].copy_(piece, non_blocking=True)


class _Piece:
    __slots__ = ("slab", "views", "event")

    def __init__(self, slab: torch.Tensor | None, views: list[tuple[memoryview, int]], event: Any) -> None:
        self.slab = slab
        self.views = views
        self.event = event


def save_async(
    state: object,
    path: str,
    *,
    compression: str | None,
    level: int | None,
    metadata: dict[str, str],
    chunk_size: int,
    dedup: writer.Dedup | None = None,
) -> SaveHandle:
    encoded = tree.encode(state)  # unsupported objects fail here, before anything is written
    handle = SaveHandle(path)
    atomic = writer.AtomicFile(path)
    atomic.__enter__()  # creation errors (missing directory, permissions) are raised now
    pieces: queue.Queue[_Piece | BaseException | None] = queue.Queue()
    # The writer starts when the snapshot is complete, or as soon as the snapshot
    # has to wait for staging memory: until then it would only compete with the
    # caller's copies for cores and memory bandwidth.
    go = threading.Event()
    with _lock:
        _in_flight[_key(path)] = handle
    thread = threading.Thread(
        target=_write_worker,
        args=(handle, atomic, encoded, pieces, go, compression, level, metadata, chunk_size, dedup),
        name=f"ckptfmt-save-{os.path.basename(path)}",
        daemon=False,
    )
    thread.start()
    try:
        _snapshot(encoded, pieces, chunk_size, go.set)
    except BaseException as e:
        pieces.put(e)
        go.set()
        handle._done.wait()
        raise
    go.set()
    with _lock:
        _unobserved.append(handle)
    return handle


def _host_bytes(src: torch.UntypedStorage | Any) -> memoryview | None:
    """A byte view of a CPU storage or array, None for accelerator storages."""
    if isinstance(src, torch.UntypedStorage):
        if src.device.type != "cpu":
            return None
        return torch.empty(0, dtype=torch.uint8).set_(src).numpy().data.cast("B")
    return src.reshape(-1, order="A").view("u1").data.cast("B")


def _snapshot(encoded: tree.Encoded, pieces: queue.Queue[Any], chunk_size: int, on_wait: Any) -> None:
    """Copy every storage into slabs, handing each full slab to the writer.

    Host bytes are copied in spans as long as fit the current slab (on the
    engine's threads when it is built); accelerator storages are copied
    asynchronously into pinned slabs on the current stream.
    """
    slab_bytes = POOL.slab_size(chunk_size)
    threads = _native.default_threads()
    slab: torch.Tensor | None = None
    slab_view: memoryview | None = None
    used = 0
    views: list[tuple[memoryview, int]] = []
    pinned = False
    event: Any = None

    def hand_over() -> None:
        nonlocal slab, slab_view, used, views, event
        if slab is not None:
            pieces.put(_Piece(slab, views, event))
        slab, slab_view, used, views, event = None, None, 0, [], None

    for plan in encoded.storages:
        src = plan.source
        host = _host_bytes(src)
        accel = host is None
        start = 0
        while start < plan.nbytes:
            left = plan.nbytes - start
            room = 0 if slab is None or pinned != accel else slab.numel() - used
            # a span is the rest of the storage, or as many whole chunks as fit
            span = left if left <= room else room // chunk_size * chunk_size
            if span == 0:
                hand_over()
                pinned = accel and torch.accelerator.is_available()
                slab = POOL.acquire(slab_bytes, pinned, on_wait)
                slab_view = slab.numpy().data.cast("B")
                span = min(left, slab.numel())
            assert slab is not None and slab_view is not None
            if host is not None:
                if _native.built():
                    _native.copy(slab_view[used : used + span], host[start : start + span], threads)
                else:
                    slab_view[used : used + span] = host[start : start + span]
            else:
                _copy_into_slab(src, start, span, slab[used : used + span])  # type: ignore[arg-type]
                event = torch.Event(device=src.device.type)  # type: ignore[union-attr]
                event.record()
            for off in range(0, span, chunk_size):
                n = min(chunk_size, span - off)
                views.append((slab_view[used + off : used + off + n], plan.width))
            used = -(-(used + span) // 64) * 64  # every span starts 64-byte aligned in the slab
            start += span
    hand_over()
    pieces.put(None)


def _write_worker(
    handle: SaveHandle,
    atomic: writer.AtomicFile,
    encoded: tree.Encoded,
    pieces: queue.Queue[Any],
    go: threading.Event,
    compression: str | None,
    level: int | None,
    metadata: dict[str, str],
    chunk_size: int,
    dedup: writer.Dedup | None,
) -> None:
    exc: BaseException | None = None
    go.wait()
    file_id = writer._file_id()
    # an incremental save (dedup) digests the snapshot here, on this thread, not the caller's
    out = writer.ChunkWriter(
        atomic.fd, file_id, compression=compression, level=level, path=handle.path, dedup=dedup
    )
    try:
        while True:
            item = pieces.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            try:
                if exc is None:
                    if item.event is not None:
                        item.event.synchronize()
                    out.write(item.views)
            except BaseException as e:  # keep draining so the snapshot never waits forever
                exc = e
            finally:
                item.views = []
                if item.slab is not None:
                    POOL.release(item.slab)
        if exc is None:
            writer.finish_file(atomic.fd, file_id, encoded, out.chunks, out.pos, metadata, chunk_size, dedup)
            atomic.commit()
    except BaseException as e:
        exc = exc or e
        while True:  # release whatever the snapshot still hands over
            try:
                item = pieces.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Piece) and item.slab is not None:
                POOL.release(item.slab)
    finally:
        atomic.__exit__(None, None, None)
        if isinstance(exc, OSError) and exc.filename is None:
            exc = type(exc)(exc.errno, exc.strerror, handle.path)
        with _lock:
            if _in_flight.get(_key(handle.path)) is handle:
                del _in_flight[_key(handle.path)]
        handle._finish(exc)
