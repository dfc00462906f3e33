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
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ckptfmt


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
        # held while a removal is made: a save to its path waits for it (cancel) rather than
        # commit first and be deleted
        self._lock = threading.Lock()
        self._pending: list[_Removal] = []

    def defer(self, key: str, remove: Callable[[], None], after: Sequence[ckptfmt.SaveHandle]) -> None:
        """Make `remove` (of the checkpoint whose key is `key`) once the saves `after` committed."""
        with self._lock:
            self._pending.append(_Removal(key, remove, tuple(after)))

    def cancel(self, key: str) -> None:
        """A save to the path of `key` begins: no removal asked for before touches what it writes."""
        with self._lock:
            self._pending = [r for r in self._pending if r.key != key]

    def run_ready(self) -> None:
        """Make the removals whose saves have all ended (and drop those where one failed); the
        others wait on.  The first removal that fails is raised once the others were tried."""
        with self._lock:
            ready: list[_Removal] = []
            waiting: list[_Removal] = []
            for r in self._pending:
                (ready if r.ready() else waiting).append(r)
            self._pending = waiting
            errors: list[BaseException] = []
            for r in ready:
                if not r.wanted():
                    continue
                try:
                    r.remove()
                except Exception as e:  # a removal failing must not stop the others
                    errors.append(e)
        if errors:
            raise errors[0]
