"""Removals of checkpoints put off until the saves in flight are durable.

ModelCheckpoint removes the checkpoint a new one replaces (``save_top_k``) right after the
new one's ``save_checkpoint`` returns: with non-blocking saves its file is still being
written then, and a process killed before it commits would be left with neither file (with
``save_top_k=1``, no checkpoint at all).  A removal asked for while saves are in flight is
therefore kept until every one of them has committed, and made then (at the plugin's next
call: a save, a removal, ``wait`` or ``teardown``), so one checkpoint more than the rule
keeps may be on disk meanwhile.  It is dropped, and the file kept, where one of those saves
failed (the older checkpoint is then the newest there is; the failure is raised as usual),
or where a save to the same path begins first (what is there then is no longer the file
Lightning asked to remove).

A removal that fails (a permission, a store's error) is logged as a WARNING on the
``ckptfmt`` logger and the file kept: the save about to begin is made all the same (``wait``
and ``teardown`` raise a save's error first, then a removal's).  A removal still waiting when
the process exits without ``teardown`` (Fabric, the plugin used directly) is made at exit,
once ckptfmt's exit hook has waited for the saves in flight (a threads' exit hook, run before
every atexit handler).  A save begun by an atexit handler that runs before this module's (one
registered after ckptfmt's import) is still running then: the removal it holds back is
dropped and the older file kept (a removal is made only once every save it waits for has
committed: ``ready``, ``wanted``).  Where the process is killed, or
a save failed, the file a dropped removal would have deleted stays: one checkpoint more than
``save_top_k``, to be deleted by hand.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ckptfmt

log = logging.getLogger("ckptfmt")

#: seconds the exit waits for a plugin's removals to be free (a thread making them at exit)
EXIT_LOCK_SECONDS = 30.0


@dataclass
class _Removal:
    key: str  # the path's key among the saves in flight (plugin.save_checkpoint's)
    remove: Callable[[], None]
    after: tuple[ckptfmt.SaveHandle, ...]  # the saves in flight when it was asked for

    def ready(self) -> bool:
        return all(h.done() for h in self.after)

    def wanted(self) -> bool:
        """Whether the removal is still to be made (every save it waited for committed)."""
        return all(h.cost is not None for h in self.after)


class PendingRemovals:
    """One plugin's removals waiting for its saves in flight, in the order they were asked for."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        # held while a removal is made: a save to its path waits for it (cancel) rather than
        # commit first and be deleted
        self._lock = threading.Lock()
        self._pending: list[_Removal] = []

    def defer(self, key: str, remove: Callable[[], None], after: Sequence[ckptfmt.SaveHandle]) -> None:
        """Make `remove` (of the checkpoint whose key is `key`) once the saves `after` committed."""
        with self._lock:
            self._pending.append(_Removal(key, remove, tuple(after)))
            _waiting(self, True)

    def cancel(self, key: str) -> None:
        """A save to the path of `key` begins: no removal asked for before touches what it writes."""
        with self._lock:
            self._pending = [r for r in self._pending if r.key != key]
            _waiting(self, bool(self._pending))

    def run_ready(self) -> list[BaseException]:
        """Make the removals whose saves have all ended (and drop those where one failed); the
        others wait on.  A removal that fails (a permission, a store's error) is logged as a
        WARNING and the others made: the caller (a save about to begin) carries on.  Returns
        the failures, in order."""
        with self._lock:
            return self._run_ready()

    def run_at_exit(self) -> None:
        """The process exits (ckptfmt's exit hook has waited for its saves in flight): make the
        ready removals; warn of those whose saves still ran, whose files are kept."""
        if not self._lock.acquire(timeout=EXIT_LOCK_SECONDS):
            log.warning("checkpoint removals not made at exit: another thread held them")
            return
        try:
            self._run_ready()
            for r in self._pending:
                log.warning(
                    "checkpoint %s not removed at exit: a save it waited for was still running "
                    "(delete it by hand once that save is done)",
                    r.key,
                )
            self._pending = []
            _waiting(self, False)
        finally:
            self._lock.release()

    def _run_ready(self) -> list[BaseException]:
        ready: list[_Removal] = []
        waiting: list[_Removal] = []
        for r in self._pending:
            (ready if r.ready() else waiting).append(r)
        self._pending = waiting
        _waiting(self, bool(waiting))
        errors: list[BaseException] = []
        for r in ready:
            if not r.wanted():
                continue
            try:
                r.remove()
            except Exception as e:  # a removal failing must not stop the others, nor a save
                log.warning("checkpoint %s could not be removed (kept; delete it by hand): %r", r.key, e)
                errors.append(e)
        return errors


#: the removals of this process still waiting for saves (held here so that the exit makes them
#: even where the plugin was dropped without teardown)
_WAITING: set[PendingRemovals] = set()
_WAITING_LOCK = threading.Lock()


def _waiting(removals: PendingRemovals, pending: bool) -> None:
    with _WAITING_LOCK:
        if pending:
            _WAITING.add(removals)
        else:
            _WAITING.discard(removals)


def _forget_in_child() -> None:
    """A forked child makes none of its parent's removals (its saves are the parent's)."""
    global _WAITING_LOCK
    _WAITING_LOCK = threading.Lock()
    _WAITING.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _at_exit() -> None:
    """Make the removals a process asked for but did not wait for (Fabric, the plugin used
    without teardown).  atexit hooks run after ckptfmt's threads' exit hook
    (background/inflight.py), which waits for every save in flight within the exit's bound."""
    with _WAITING_LOCK:
        waiting = [r for r in _WAITING if r.pid == os.getpid()]
    for removals in waiting:
        removals.run_at_exit()
