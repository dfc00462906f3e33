"""Pausing Python's cyclic garbage collector while ckptfmt builds many small objects.

Encoding a state into its object tree, parsing an index and decoding a tree allocate
tens of thousands of short-lived, acyclic lists and dicts.  Each such burst makes
the collector run, and a full collection walks every object of the process: in a
training process (torch, the model, the optimizer: hundreds of thousands of objects)
that took about half of a small DCP save or load.  These sections make no reference
cycles worth collecting, so the collector waits until they end; it is switched back
on only by the last section to end, in whatever thread, and only if it was on.
"""

from __future__ import annotations

import functools
import gc
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
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def pausing(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` runs with the collector paused."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with paused():
            return fn(*args, **kwargs)

    return run
