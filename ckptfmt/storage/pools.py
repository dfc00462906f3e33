"""Work handed to pools of threads, which may refuse it at interpreter exit; a batch of calls
that stops at its first failure.

concurrent.futures registers its exit hook with ``threading._register_atexit``: it runs in
``threading._shutdown``, after the hooks registered later (background/inflight.py's, which
wait for saves in flight) and before non-daemon threads are joined and ``atexit`` handlers
run.  From then on every pool refuses new work with a plain RuntimeError.  Work still being
handed out then (a thread of the program's that goes on loading or saving, a "final
checkpoint" saved or loaded by an ``atexit`` handler) must still end, and end whole: every
submission of ckptfmt's goes through `submit_or_run` or `run_into`, which run the work on the
calling thread, one after another, once pools refuse it (`run_each` too; torch's async_save,
whose pool is torch's, gives way to a blocking save then: dcp/api.py).  Work run so must not
wait for work submitted after it, and its caller must not hold a lock the work takes.
"""

from __future__ import annotations

import concurrent.futures.thread as futures_thread
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Executor, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from ..errors import StorageError

T = TypeVar("T")


def pools_refuse_work() -> bool:
    """Whether concurrent.futures' exit hook has run: every pool refuses new work."""
    return bool(getattr(futures_thread, "_shutdown", False))


def submit_or_run(pool: Executor, fn: Callable[..., T], *args: Any) -> Future[T]:
    """`pool.submit(fn, *args)`, or, where the interpreter's exit has stopped the pools taking
    work, `fn(*args)` run here and now; its outcome in the Future returned either way."""
    done: Future[T] = Future()
    run_into(pool, done, fn, *args)
    return done


def run_into(
    pool: Executor, done: Future[T], fn: Callable[..., T], *args: Any, here: Callable[[], None] | None = None
) -> None:
    """Run `fn(*args)` on `pool`, its outcome set on `done` (a Future the caller made, and may
    have published before the work could start: a request registered as in flight, under a
    lock the work takes once over); where pools refuse work, here and now, `here` called first
    (what makes work that would wait for a later caller able to run on this one).  `done`
    cancelled before it starts, or its work cancelled in the pool's queue (a shutdown's
    cancel_futures: `done` then cancelled too): the work never runs.  A submit that fails for
    another reason (no thread could start, an interrupt) cancels `done` before it is raised:
    whoever waits for it is told at once, not left waiting for work no thread will run."""

    def outcome() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:  # the outcome is the future's, as on a pool
            done.set_exception(e)
        else:
            done.set_result(result)

    try:
        queued = pool.submit(outcome)
    except RuntimeError:
        if not pools_refuse_work():
            done.cancel()
            raise  # no thread could start, or the pool was shut down by its owner: not an exit
    except BaseException:
        done.cancel()
        raise
    else:
        queued.add_done_callback(lambda q: done.cancel() if q.cancelled() else None)
        return
    if here is not None:
        here()
    outcome()


def wait_all(futures: Sequence[Future[None]]) -> None:
    """Wait for every one of `futures` (fetches, whose own deadlines bound them); the first
    failure is raised once all are over."""
    first: BaseException | None = None
    for f in futures:
        e = _outcome(f)
        if e is not None and first is None:
            first = e
    if first is not None:
        raise first


def wait_quietly(futures: Sequence[Future[None]]) -> None:
    """Wait for fetches whose outcome no longer matters (a read that failed already)."""
    for f in futures:
        _outcome(f)


def _outcome(f: Future[None]) -> BaseException | None:
    """A fetch's failure once it is over; one cancelled (never sent, or its pool shut down while
    this waited) is a StorageError: no wait ends in a bare CancelledError."""
    try:
        return f.exception()
    except CancelledError:
        return StorageError("a fetch waited for was cancelled: never sent, or its object closed")


def run_each(call: Callable[[Any], T], items: Iterable[Any], threads: int, name: str) -> list[T]:
    """`call(item)` for each item, `threads` at a time on a pool of its own (threads named
    `name`), their results in order.  Once one fails no further call starts (those queued are
    cancelled) and, once those running are over, the failure of the earliest item among those
    that ran is raised (which thread failed first does not decide it): a batch of
    requests whose first is refused sends no more.  Where pools refuse work (interpreter
    exit), or one thread would do, the calls are made here in turn, the first failure ending
    them.  The batch is waited for as long as its calls take, `threads` at a time: what bounds
    each call (a request's deadline) bounds it."""
    todo = list(items)
    if len(todo) <= 1 or threads <= 1 or pools_refuse_work():
        return [call(item) for item in todo]
    stop = threading.Event()
    failed: list[tuple[int, BaseException]] = []  # (position, failure): the lowest is raised
    lock = threading.Lock()

    def unless_stopped(i: int) -> T:
        if stop.is_set():
            raise _Skipped
        try:
            return call(todo[i])
        except BaseException as e:
            with lock:
                failed.append((i, e))
            stop.set()
            raise

    futures: list[Future[T]] = []
    with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix=name) as pool:
        for i in range(len(todo)):
            if stop.is_set():
                break
            # at exit: run here, in turn (a failure sets `stop` before the next)
            futures.append(submit_or_run(pool, unless_stopped, i))
        wait(futures, return_when=FIRST_EXCEPTION)
        if stop.is_set():
            for f in futures:
                f.cancel()
    if failed:
        raise min(failed, key=lambda f: f[0])[1]
    return [f.result() for f in futures]


class _Skipped(Exception):
    """A call of run_each not made: an earlier one failed (never raised out of run_each)."""
