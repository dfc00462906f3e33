"""Pausing Python's cyclic garbage collector while ckptfmt builds many small objects.

Encoding a state into its object tree, parsing an index and decoding a tree allocate
tens of thousands of short-lived, acyclic lists and dicts.  Each such burst makes
the collector run, and a full collection walks every object of the process: in a
training process (torch, the model, the optimizer: hundreds of thousands of objects)
that took about half of a small DCP save or load.  These sections make no reference
cycles worth collecting, so the collector waits until they end; it is switched back
on only by the last section to end, in whatever thread, and only if it was on.  Whole
blocking calls pause only in the main thread (see pausing_in_main_thread).
"""

from __future__ import annotations

import functools
import gc
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused() -> Iterator[None]:
    """No automatic garbage collection inside (nestable, shared by all threads)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            if _depth > 0:  # 0 after a fork reset it in this (child) process
                _depth -= 1
                if _depth == 0 and _was_enabled:
                    gc.enable()


def _after_fork_in_child() -> None:
    """A child forked while some thread was inside a section has only the forking thread:
    the others' sections never end there, so the collector comes back on now."""
    global _lock, _depth
    _lock = threading.Lock()
    if _depth > 0:
        _depth = 0
        if _was_enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def pausing(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` runs with the collector paused: for sections that build objects and do no I/O."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with paused():
            return fn(*args, **kwargs)

    return run


def pausing_in_main_thread(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` runs with the collector paused when called from the main thread, where a training
    loop waits for it (a blocking save or load, I/O included).  Called from another thread
    (a non-blocking save, DCP's async save) the rest of the process goes on meanwhile, so only
    its object-building sections pause, for as long as they run."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        with paused():
            return fn(*args, **kwargs)

    return run
