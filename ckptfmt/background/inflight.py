"""Saves in flight: their handles, waiting for a path, and errors nobody waited for.

Loads, saves and removals of a path first wait for the non-blocking save in
flight on it (``wait_for_path``).  A failed save whose handle was dropped
without ``wait()`` has its error raised by the next save (``raise_unobserved``)
or printed at interpreter exit, which first waits for every save in flight.

This module imports nothing of ckptfmt but fileio, so readers (api, verify, inplace)
can wait for saves without importing the writer.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

from ..fileio import is_url


class SaveHandle:
    """The result of a non-blocking save."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._observed = False
        #: how the state was snapshotted: "copy" (into staging memory) or "fork" (copy-on-write)
        self.snapshot = "copy"
        self._pid: int | None = None  # the child writing a fork snapshot
        self._thread: threading.Thread | None = None  # the thread that finishes the save (joinable)

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
        self._exc = exc  # set before done: whoever sees done() sees the final error
        self._done.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._exc else "done")
        return f"<SaveHandle {self.path!r} {state}>"


_lock = threading.Lock()
#: the save in flight on each path (by real path); never rebound, only changed in place
_in_flight: dict[str, SaveHandle] = {}
#: handles returned to callers whose errors have not been seen yet
_unobserved: list[SaveHandle] = []


def _key(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return text if is_url(text) else os.path.realpath(text)


def begin(handle: SaveHandle) -> None:
    """Mark `handle.path` as having a save in flight."""
    with _lock:
        _in_flight[_key(handle.path)] = handle


def end(handle: SaveHandle) -> None:
    """Unmark `handle.path` (if this handle's save is still the one marked there)."""
    key = _key(handle.path)
    with _lock:
        if _in_flight.get(key) is handle:
            del _in_flight[key]


def watch(handle: SaveHandle) -> None:
    """Keep a returned handle so that its error is raised later if nobody waits for it."""
    with _lock:
        _unobserved.append(handle)


def settle(handle: SaveHandle, exc: BaseException | None, replaced: list[int]) -> None:
    """End a background save: unmark its path, hand `exc` (or success) to its handle, then
    close the descriptors of files it replaced (freeing them is off the caller's wait)."""
    if isinstance(exc, OSError) and exc.filename is None:
        exc = type(exc)(exc.errno, exc.strerror, handle.path)
    end(handle)
    try:
        handle._finish(exc)
    finally:
        for fd in replaced:
            os.close(fd)


def wait_for_path(path: str | os.PathLike[str]) -> None:
    """Wait for the save in flight on `path`, if any (its error stays with its handle)."""
    with _lock:
        h = _in_flight.get(_key(path))
    if h is not None:
        h._done.wait()


def raise_unobserved() -> None:
    """Raise the error of an earlier non-blocking save nobody waited for (one per call)."""
    with _lock:
        # each handle is looked at once: one that finishes during this scan is either
        # counted as finished everywhere or as running everywhere, never dropped
        seen = [(h, h.done()) for h in _unobserved]
        failed = [h for h, done in seen if done and h._exc is not None and not h._observed]
        report = failed[0] if failed else None
        _unobserved[:] = [h for h, done in seen if (not done or h in failed) and h is not report]
    if report is not None:
        report._observed = True
        raise RuntimeError(
            f"an earlier non-blocking save of {report.path} failed and was never waited for"
        ) from report._exc


@atexit.register
def _at_exit() -> None:
    with _lock:
        handles = list(_in_flight.values()) + list(_unobserved)
    for h in handles:
        h._done.wait()
        if h._exc is not None and not h._observed:
            print(f"ckptfmt: non-blocking save of {h.path} failed: {h._exc!r}", file=sys.stderr)
