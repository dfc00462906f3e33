"""Objects a forked child inherits in use from its parent (a Reader a DataLoader worker's
Dataset holds): each belongs to the process that made it, and a child's first use of it makes
its state anew.

A fork copies an object being read as it stands: its pool of threads (which the child lacks:
work handed to it waits for ever), its locks (which a thread of the parent's may have held at
the fork), its books of requests in flight (which never land in the child) and its spool (a
memfd whose pages parent and child would share).  The after-fork hook (engine/forkreset.py,
with which every live `Inherited` is registered until it is closed) marks each so, and gives
it a lock of the child's own; its first use in the child (a method
decorated `renewed_in_child`) then calls its `_renew` under that lock, and one closed before
any use lets go of only the child's copies (`_let_go`).  Nothing of the parent's is written,
freed or waited for in the child.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ..engine import forkreset

F = TypeVar("F", bound=Callable[..., Any])


class Inherited:
    """An object whose state belongs to one process: see the module."""

    def __init__(self) -> None:
        self._renew_lock = threading.Lock()
        #: made by a parent, not used yet by this process (a forked child)
        self._inherited = False
        forkreset.register(self)  # until it is closed

    def _renew(self) -> None:
        """Make this process's own state in place of the parent's (called once, at the first use
        in a child, under the renewal lock); what it raises is the use's, and the next use tries
        again."""
        raise NotImplementedError

    def _let_go(self) -> None:
        """Close, in a child that never used it, only what the child holds of the parent's
        state (its copies of descriptors and mappings)."""
        raise NotImplementedError

    def _forget_in_child(self) -> None:
        """In a forked child (forkreset): the parent's, renewed at its first use here, under a
        lock of this process's own (the parent's may be held by a thread the child lacks)."""
        self._renew_lock = threading.Lock()
        self._inherited = True

    def _own(self) -> None:
        """Before a use: a child's first renews the state (_renew)."""
        if self._inherited:
            with self._renew_lock:
                if self._inherited:
                    self._renew()
                    self._inherited = False

    def _disown(self) -> bool:
        """At close: no longer live; in a child that never used it, what the child holds of the
        parent's let go of (_let_go) and True: the parent's state is not the child's to close."""
        forkreset.unregister(self)
        if not self._inherited:
            return False
        with self._renew_lock:
            if not self._inherited:
                return False
            self._inherited = False
            self._let_go()
            return True


def renewed_in_child(method: F) -> F:
    """`method` of an Inherited, its state renewed first in a forked child (_own)."""

    @functools.wraps(method)
    def owned(self: Inherited, *args: Any, **kwargs: Any) -> Any:
        self._own()
        return method(self, *args, **kwargs)

    return cast(F, owned)
