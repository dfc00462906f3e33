"""Saves in flight: their handles, waiting for a path, and errors nobody waited for.

Loads, saves and removals of a path first wait for the non-blocking save in
flight on it (``wait_for_path``).  A failed save whose handle was dropped
without ``wait()`` has its error raised by the next save (``raise_unobserved``)
or printed at interpreter exit, which first waits for every save in flight.

Every wait here ends by a deadline: the caller's timeout, else twice DEADLINE (read when the
wait begins: a save's own waits end by DEADLINE, and their error is the one to report), past
which DeadlineError names what was waited for (the save goes on).  Deadline is that bound, for
these waits and every other wait for a save's end (the manager's, a sharded save's), and the
bound of a forked child's write (background/forksave.py, given DEADLINE).

This module imports nothing of ckptfmt but fileio and errors, so readers (api, verify,
inplace) can wait for saves without importing the writer.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import DeadlineError
from ..fileio import is_url

log = logging.getLogger("ckptfmt")

#: seconds a background save's own waits last at most before the save fails: a forked
#: child's write (background/forksave.py: the child is killed), a staged child's wait for its
#: job, a save's wait for the one staged before it (dcp/forkstage.py).  The hour the
#: archive's wait allows too (runs/archiver.DEFAULT_WAIT), and every wait for a save's end
#: that is given no timeout (SaveHandle.wait, wait_for_path, a manager's wait for its commits);
#: read when each wait begins.
DEADLINE = 3600.0


def wait_seconds(timeout: float | None) -> float:
    """How long a wait for a save's end given `timeout` lasts: `timeout`, else twice DEADLINE
    as it is now (the save's own waits end by DEADLINE and fail it: a wait that began with
    them must not end first, with its own error instead of theirs)."""
    return 2 * DEADLINE if timeout is None else timeout


def deadline_error(what: str, seconds: float, timeout: float | None, path: str | None) -> DeadlineError:
    """The DeadlineError of a wait for `what` (of `path`) still unfinished after `seconds`,
    naming the bound that ended it (the caller's timeout, or twice DEADLINE)."""
    bound = "the wait's timeout" if timeout is not None else "twice ckptfmt.background.inflight.DEADLINE"
    return DeadlineError(
        f"{what} is still running after {seconds:g} s ({bound}); it goes on in the background",
        path=path,
    )


class Deadline:
    """The bound of a wait for saves to end, or of several waits in turn: wait_seconds(timeout)
    from when it is made (DEADLINE read then).  Each wait through it that has not ended by
    then raises deadline_error naming what it waited for."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        self.seconds = wait_seconds(timeout)
        self._end = time.monotonic() + self.seconds

    def left(self) -> float:
        """Seconds left before the bound (never below 0)."""
        return max(0.0, self._end - time.monotonic())

    def wait(self, wait: Callable[[float], bool], what: str, path: str | None) -> None:
        """`wait(seconds)` (whether `what`, of `path`, ended within them) given the seconds
        left; DeadlineError when it did not."""
        if not wait(self.left()):
            raise deadline_error(what, self.seconds, self.timeout, path)

    def join(self, thread: threading.Thread, what: str, path: str | None) -> None:
        """Wait for `thread` (doing `what`) to end, as wait()."""

        def joined(seconds: float) -> bool:
            thread.join(seconds)
            return not thread.is_alive()

        self.wait(joined, what, path)


@dataclass(frozen=True)
class SaveCost:
    """What one save cost, for charting checkpoint stalls beside the loss.

    ``blocked_s``: seconds the caller waited in the save call (the whole save when blocking,
    the snapshot when not); ``durable_s``: seconds from the call until the file was durable at
    its path (committed: fsync, rename, directory fsync; uploaded whole on a store);
    ``bytes``: the bytes written (the file's length); ``throughput``: bytes per second of
    ``durable_s``; ``archived_s``: seconds from the call until an archive tier held it (the
    checkpoint manager's steps with ``archive=``; None otherwise or not yet)."""

    path: str
    bytes: int
    blocked_s: float
    durable_s: float
    archived_s: float | None = None

    @property
    def throughput(self) -> float:
        return self.bytes / self.durable_s if self.durable_s > 0 else float("inf")

    def metrics(self, prefix: str = "ckptfmt/") -> dict[str, float]:
        """The cost as numbers for a metrics logger (TensorBoard, W&B): seconds, bytes, GB/s."""
        out = {
            f"{prefix}save_blocked_s": self.blocked_s,
            f"{prefix}save_durable_s": self.durable_s,
            f"{prefix}save_bytes": float(self.bytes),
            f"{prefix}save_GBps": self.throughput / 1e9,
        }
        if self.archived_s is not None:
            out[f"{prefix}save_archived_s"] = self.archived_s
        return out

    def line(self) -> str:
        """One line for a log: where, how much, how long the caller waited, how long to durable."""
        archived = "" if self.archived_s is None else f", archived after {self.archived_s:.3f} s"
        return (
            f"saved {self.path}: {self.bytes} bytes, caller blocked {self.blocked_s:.3f} s, "
            f"durable after {self.durable_s:.3f} s ({self.throughput / 1e9:.2f} GB/s){archived}"
        )


class SaveHandle:
    """The result of a save: running (non-blocking) or done; ``cost`` once it succeeded."""

    def __init__(self, path: str, began: float | None = None) -> None:
        self.path = path
        #: perf_counter() at the save call; when it returned to the caller; when durable
        self._began = time.perf_counter() if began is None else began
        self._returned: float | None = None
        self._durable: float | None = None
        self._bytes = 0
        self._logged = threading.Lock()  # the cost is logged once, when both ends are known
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._observed = False
        #: its failure is raised by its owner (a run's manager, at its next save or wait), not
        #: by the next plain save's raise_unobserved: only the exit reports one nobody saw
        self._owner_reports = False
        #: how the state was snapshotted: "copy" (into staging memory) or "fork" (copy-on-write)
        self.snapshot = "copy"
        self._pid: int | None = None  # the child writing a fork snapshot
        self._thread: threading.Thread | None = None  # the thread that finishes the save (joinable)
        #: the version (ETag) the store gave the object a save to a URL created, once done: what
        #: this save, and no other writer, wrote there
        self.version: str | None = None

    def done(self) -> bool:
        """True once the file is committed (or the save failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the file is durable at its path; raise the save's error if it failed.
        At most `timeout` seconds (None: twice DEADLINE): DeadlineError (a TimeoutError)
        while the save still runs then (it goes on; a later wait may find it done)."""
        self._wait_done(timeout)
        self._observed = True
        if self._exc is not None:
            raise self._exc

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error, or None; waits like wait()."""
        self._wait_done(timeout)
        self._observed = True
        return self._exc

    def _wait_done(self, timeout: float | None) -> None:
        Deadline(timeout).wait(self._done.wait, "the save", self.path)

    @property
    def cost(self) -> SaveCost | None:
        """What the save cost (SaveCost), once it is durable; None while it runs or if it failed."""
        return self._cost() if self._done.is_set() else None

    def _cost(self) -> SaveCost | None:
        if self._exc is not None or self._durable is None:
            return None
        returned = self._durable if self._returned is None else min(self._returned, self._durable)
        return SaveCost(self.path, self._bytes, returned - self._began, self._durable - self._began)

    def _returning(self, began: float) -> SaveHandle:
        """The save call that began at `began` returns this handle to its caller now."""
        self._began = began
        self._returned = time.perf_counter()
        if self._done.is_set():
            self._log_cost()
        return self

    def _durable_now(self, nbytes: int) -> None:
        """The file is durable at its path now, `nbytes` long."""
        self._durable = time.perf_counter()
        self._bytes = nbytes

    def _finish(self, exc: BaseException | None) -> None:
        self._exc = exc  # set before done: whoever sees done() sees the final error
        if self._returned is not None:
            self._log_cost()  # before done: whoever waited for the save finds it logged
        self._done.set()

    def _log_cost(self) -> None:
        """One INFO line on the "ckptfmt" logger with the cost (silent unless configured)."""
        cost = self._cost()
        if cost is not None and log.isEnabledFor(logging.INFO) and self._logged.acquire(blocking=False):
            log.info("%s", cost.line())

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


def watch(handle: SaveHandle, *, owner_reports: bool = False) -> None:
    """Keep a returned handle so that its error is raised later if nobody waits for it.
    Handles that ended well, or whose error was seen, are let go of here: a run's manager
    watches every step's and may never make the plain save that raise_unobserved serves."""
    handle._owner_reports = owner_reports
    with _lock:
        _unobserved[:] = [h for h in _unobserved if not (h.done() and (h._exc is None or h._observed))]
        _unobserved.append(handle)


def settle(handle: SaveHandle, exc: BaseException | None, replaced: list[int]) -> None:
    """End a background save: unmark its path, hand `exc` (or success) to its handle, then
    close the descriptors of files it replaced (freeing them is off the caller's wait)."""
    # an OSError of the system is given the path; one of ckptfmt's (a StorageError: no errno)
    # names its URL already, and its class takes no errno (rebuilding it would raise here
    # and leave the handle never done)
    if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
        exc = type(exc)(exc.errno, exc.strerror, handle.path)
    end(handle)
    try:
        handle._finish(exc)
    finally:
        for fd in replaced:
            os.close(fd)


def close_then_settle(
    handle: SaveHandle, close: Callable[[], None], exc: BaseException | None, replaced: list[int]
) -> None:
    """End a background save whose file is still open: `close` it (its AtomicFile's exit,
    which removes a file not committed), then settle the handle even if closing fails: an
    exit waits for the handle."""
    try:
        close()
    finally:
        settle(handle, exc, replaced)


def wait_for_path(path: str | os.PathLike[str]) -> None:
    """Wait for the save in flight on `path`, if any (its error stays with its handle), at
    most wait_seconds(None): DeadlineError naming the path while it still runs then (the
    caller's load, save or removal of the path is not made)."""
    with _lock:
        h = _in_flight.get(_key(path))
    if h is not None:
        Deadline().wait(h._done.wait, "the non-blocking save in flight on it", h.path)


def raise_unobserved() -> None:
    """Raise the error of an earlier non-blocking save nobody waited for (one per call)."""
    with _lock:
        # each handle is looked at once: one that finishes during this scan is either
        # counted as finished everywhere or as running everywhere, never dropped
        seen = [(h, h.done()) for h in _unobserved]
        failed = [h for h, done in seen if done and h._exc is not None and not h._observed]
        report = next((h for h in failed if not h._owner_reports), None)
        _unobserved[:] = [h for h, done in seen if (not done or h in failed) and h is not report]
    if report is not None:
        report._observed = True
        raise RuntimeError(
            f"an earlier non-blocking save of {report.path} failed and was never waited for"
        ) from report._exc


_exit_deadline: Deadline | None = None


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, a fork snapshot) has none of its parent's saves in
    flight: its exit must not wait for them (the threads that would end them are the parent's),
    and its lock may have been held by one of those threads at the fork."""
    global _lock, _exit_deadline
    _lock = threading.Lock()
    _in_flight.clear()
    _unobserved.clear()
    _exit_deadline = None


os.register_at_fork(after_in_child=_forget_in_child)


def _exit_bound() -> Deadline:
    """One bound for every wait at exit: an exit never hangs on a stuck save."""
    global _exit_deadline
    if _exit_deadline is None:
        _exit_deadline = Deadline()
    return _exit_deadline


def _wait_all(handles: list[SaveHandle]) -> list[tuple[SaveHandle, bool]]:
    """Wait for `handles` in turn within the one bound of the exit; whether each ended."""
    deadline = _exit_bound()
    return [(h, h._done.wait(deadline.left())) for h in handles]


def _finish_before_pools_stop() -> None:
    """Wait for the saves in flight while thread pools still take work: a threads' exit hook,
    run before concurrent.futures' own (registered at its import, earlier; these hooks run
    last-registered first), which makes every pool refuse new work (storage/pools.py: what
    is handed to a pool after that runs on the thread handing it)."""
    with _lock:
        handles = list(_in_flight.values())
    _wait_all(handles)


def _register_before_pools_stop() -> None:
    """Register _finish_before_pools_stop as a threads' exit hook (threading._register_atexit,
    on every Python this project supports)."""
    import concurrent.futures.thread  # noqa: F401  its exit hook registered before ours

    try:
        threading._register_atexit(_finish_before_pools_stop)  # type: ignore[attr-defined]
    except RuntimeError:  # imported while the interpreter exits: _at_exit alone waits
        pass


_register_before_pools_stop()


@atexit.register
def _at_exit() -> None:
    with _lock:
        # a handle both in flight and watched (a non-blocking save's) is reported once
        handles = list({id(h): h for h in [*_in_flight.values(), *_unobserved]}.values())
    for h, done in _wait_all(handles):
        if not done:
            print(f"ckptfmt: non-blocking save of {h.path} still running at exit: abandoned", file=sys.stderr)
        elif h._exc is not None and not h._observed:
            print(f"ckptfmt: non-blocking save of {h.path} failed: {h._exc!r}", file=sys.stderr)
