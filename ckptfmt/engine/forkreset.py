"""Objects whose state belongs to the process that made them, made anew in a forked child (a
DataLoader worker, a rank's helper): one registry and one after-fork hook serve them all.

A fork copies an object as it stands: its locks (a thread of the parent's may hold one at the
fork, and the child would wait on it for ever), its counts of work in progress (which never
ends in the child) and its books of what that work holds.  An object registered here
(`register`, as it is made) has its `_forget_in_child` called in the child right after the
fork, while the child has one thread; the registry holds it weakly, so registering keeps
nothing alive, and `unregister` takes out one whose state is no longer anyone's (closed).
Module-level state keeps its own hook beside it (ARCHITECTURE.md: the one mechanism is
``os.register_at_fork(after_in_child=...)``, of which this is one).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Protocol


class ForgetsInChild(Protocol):
    def _forget_in_child(self) -> None:
        """Make this process's own locks and books in place of the parent's copies."""


_REGISTERED: weakref.WeakSet[ForgetsInChild] = weakref.WeakSet()


def register(obj: ForgetsInChild) -> None:
    """Have `obj._forget_in_child()` called in every child forked while `obj` lives."""
    _REGISTERED.add(obj)


def unregister(obj: ForgetsInChild) -> None:
    """No longer: `obj` is closed (a child has nothing of it to make anew)."""
    _REGISTERED.discard(obj)


def registered() -> list[ForgetsInChild]:
    """The objects registered now (for tests)."""
    return list(_REGISTERED)


def _after_fork_in_child() -> None:
    # each object on its own: one that fails leaves the others' locks and books the child's
    for obj in list(_REGISTERED):
        try:
            obj._forget_in_child()
        except Exception:
            logging.getLogger("ckptfmt").warning(
                "after a fork, making %r's state anew in the child failed", obj, exc_info=True
            )


os.register_at_fork(after_in_child=_after_fork_in_child)
