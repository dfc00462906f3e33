"""Work handed to a pool of threads that may refuse it: at interpreter exit.

Once concurrent.futures' exit hook has run (before ``atexit`` handlers, after the threads'
own exit hooks), every pool refuses new work with a plain RuntimeError.  A store save still
finishing then (a non-blocking save whose wait ran later than that hook, a save made by an
``atexit`` handler) must still end, and end whole: its requests then run on the calling
thread, one after another.
"""

from __future__ import annotations

import concurrent.futures.thread as futures_thread
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


def pools_refuse_work() -> bool:
    """Whether concurrent.futures' exit hook has run: every pool refuses new work."""
    return bool(getattr(futures_thread, "_shutdown", False))


def submit_or_run(pool: Executor, fn: Callable[..., T], *args: Any) -> Future[T]:
    """`pool.submit(fn, *args)`, or, where the interpreter's exit has stopped the pools taking
    work, `fn(*args)` run here and now; its outcome in the Future returned either way."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        if not pools_refuse_work():
            raise  # the pool was shut down by its owner: a bug, not an exit
    done: Future[T] = Future()
    try:
        done.set_result(fn(*args))
    except BaseException as e:  # the outcome is the future's, as on a pool
        done.set_exception(e)
    return done
