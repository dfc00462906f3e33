"""The archive tier of a run: committed local steps copied to an object store in the
background, and the archive's own retention.

What still needs archiving is derived from the two tiers, never remembered: each pass of
the archive thread (when a manager starts with local steps, after every commit) lists the
archive, then copies

* first a step the archive's `keep_every` rule keeps that it does not hold yet and that is
  older than its newest (such a step is never skipped), else
* the newest complete local step, when it is newer than the archive's newest: steps in
  between that no rule keeps are skipped, so a lagging archive costs local disk only the
  steps saved while one copy runs;

each with archivecopy.put_step (every file verified after upload, the archive's rotation
right before the commit record, so it never holds more steps than its rules keep), until
nothing is left.  A local step is "pending" (kept on local disk whatever the local rules
say) until the archive holds it or holds a newer step and its rules would not keep this one
(`keeps_locally`); while the archive has not been listed yet, every local step is.

Every object an archiver writes into a step's prefix comes after a copy marker
(objectrun.COPY_MARKER), deleted once the step's commit record is in: a copy or deletion
cut short is recognisably ckptfmt's, and the next pass removes it once its writer is
provably gone (ObjectRun.remove_interrupted_copies).  A failed pass is warned about and
tried again after the next save.  Training never waits for any of it; a process exiting
waits for the copy in progress, as it waits for saves in flight.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
import warnings
from collections.abc import Callable, Iterable

from ..background import inflight
from ..errors import CheckpointWarning, StorageError
from ..files import multifile
from . import archivecopy, leftovers, retention
from .objectnames import copy_marker
from .objectrun import ObjectRun
from .steps import CheckpointInfo, StepStatus

#: seconds Archiver.wait() waits for the archive thread by default: a copy of a large step over
#: a slow link may take this long; a store that stalls has each request cut by its own deadline
#: far sooner, and a wait is never unbounded whatever the store does (the bound of every wait
#: for a background save's work)
DEFAULT_WAIT = inflight.DEADLINE


@dataclasses.dataclass(frozen=True)
class ArchiveLag:
    """How far the archive is behind the local tier."""

    #: complete local steps newer than the archive's newest (all of them while not known)
    steps: int
    #: how long the oldest of them has waited (0 when none)
    seconds: float
    #: the archive's newest complete step as last listed (None: not listed yet, or empty)
    archived: int | None


class Archiver:
    """Copies committed steps of a local run to `run` and rotates it."""

    def __init__(
        self,
        run: ObjectRun,
        *,
        keep_last: int | None,
        keep_every: int | None,
        local_steps: Callable[[], list[CheckpointInfo]],
        on_archived: Callable[[], None] | None = None,
    ) -> None:
        """`local_steps`: the local tier's complete steps, oldest first, read afresh;
        `on_archived`: called (on the archive thread) once the archive was listed or a step
        copied, so the local rotation can drop what it kept for the archive."""
        retention.check_rules(keep_last, keep_every, None, "min")
        self.run = run
        self.local_steps = local_steps
        self.on_archived = on_archived
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._claim = copy_marker()
        # the archive's complete steps, each with when its record was written (the same in
        # both tiers: the archive's record is the local one's bytes), so a step saved again
        # after a rollback is not taken for the older save of that number; None: not listed yet
        self._held: dict[int, datetime.datetime] | None = None
        self._failed: dict[int, str] = {}  # step -> why its last copy failed
        self._conflicts: set[int] = set()  # local steps another save of which the archive holds (warned)
        self._archived_at: dict[int, float] = {}  # step -> perf_counter() when it was copied
        self._wanted = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._copying: int | None = None  # the step the archive thread is copying now
        self._dropped = False  # a rotation of this pass deleted or retired a step

    # -- what the tiers say ------------------------------------------------------------------

    def _owed(self, step: int) -> bool:
        """Whether the archive's rules keep `step` whatever is newer (it is never skipped):
        `keep_every` keeps it, or no rule is set (the archive keeps every step)."""
        if self.keep_last is None and self.keep_every is None:
            return True
        return self.keep_every is not None and step % self.keep_every == 0

    def keeps_locally(self, steps: Iterable[CheckpointInfo]) -> set[int]:
        """The steps among `steps` (complete local ones) that the local tier must keep for the
        archive: not held there (another save of the same step number is not this one), and
        neither superseded by a newer archived step nor skippable (kept by `keep_every`);
        every one while the archive has not been listed."""
        with self._cond:
            held = None if self._held is None else dict(self._held)
        if held is None:
            return {c.step for c in steps}
        newest = max(held, default=-1)
        return {
            c.step
            for c in steps
            if not _holds(held, c) and (c.step > newest or self._owed(c.step) or c.step in held)
        }

    def saw(self, archived: Iterable[CheckpointInfo]) -> None:
        """The archive was found holding the complete steps `archived` (a listing made
        elsewhere, by latest()): what it holds is known from now on."""
        with self._cond:
            self._held = {**(self._held or {}), **{c.step: c.created for c in archived}}

    def known_newest(self) -> int | None:
        """The newest step the archive was last seen holding (None: not seen)."""
        with self._cond:
            return max(self._held, default=None) if self._held is not None else None

    def lag(self, local: list[CheckpointInfo]) -> ArchiveLag:
        """How far the archive is behind the complete local steps `local` (oldest first)."""
        newest = self.known_newest()
        with self._cond:
            listed = self._held is not None
        behind = [c for c in local if not listed or newest is None or c.step > newest]
        seconds = 0.0
        if behind:
            waited = datetime.datetime.now(datetime.timezone.utc) - behind[0].created
            seconds = max(0.0, waited.total_seconds())
        return ArchiveLag(steps=len(behind), seconds=seconds, archived=newest)

    def archived_at(self, step: int) -> float | None:
        """When (perf_counter) this process copied `step` to the archive, if it did lately."""
        with self._cond:
            return self._archived_at.get(step)

    def failures(self) -> dict[int, str]:
        """Steps whose last copy failed and that are still to be copied, and why (they are
        tried again after the next save)."""
        with self._cond:
            return dict(self._failed)

    # -- the archive thread --------------------------------------------------------------------

    def kick(self) -> None:
        """Bring the archive up to date with the local tier, in the background."""
        with self._cond:
            self._wanted = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ckptfmt-archive", daemon=False)
                self._thread.start()

    def wait(self, timeout: float = DEFAULT_WAIT) -> None:
        """Wait until the archive thread has nothing left to do (or failed), at most `timeout`
        seconds: StorageError saying what it is doing (copying a step, named, or listing and
        rotating) and the deadline when it is still busy then (it goes on; a later wait may
        find it done).  A thread that ended without marking the archiver idle (one a fork left
        behind) is never waited for: StorageError at once, and the next kick() starts another."""
        if not 0 < timeout <= 86400 * 7:
            raise ValueError(f"timeout must be seconds above 0, at most a week, not {timeout!r}")
        end = time.monotonic() + timeout
        with self._cond:
            while self._thread is not None:
                if not self._thread.is_alive():  # started under the lock: it has ended
                    self._thread = None
                    raise StorageError(
                        "the archive thread ended without finishing its pass (steps not yet archived "
                        "stay on local disk; the next save archives them)",
                        path=self.run.path,
                    )
                left = end - time.monotonic()
                if left <= 0:
                    raise StorageError(
                        f"the archive is still {self._doing()} after the wait's deadline of "
                        f"{timeout:g} s (Archiver.wait timeout); it goes on in the background",
                        path=self.run.path,
                    )
                self._cond.wait(min(left, 1.0))  # a second at most: a thread that ended is seen

    def _doing(self) -> str:
        """What the live archive thread is doing, as wait's error says it (under the lock)."""
        if self._copying is not None:
            return f"copying step {self._copying}"
        return "listing or rotating the archive (no step being copied)"

    def remove(self, step: int) -> bool:
        """Remove the archive's copy of `step` (the run goes back to an earlier step), once the
        archive thread is idle (no copy of it under way); whether the archive held it."""
        self.wait()
        removed = self.run.remove_step(step, claim=self._claim)
        with self._cond:
            if self._held is not None:
                self._held.pop(step, None)
            self._archived_at.pop(step, None)
            self._failed.pop(step, None)
            self._conflicts.discard(step)
        return removed

    def _work(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self._wanted:
                        return
                    self._wanted = False
                try:
                    self._pass()
                except Exception as e:  # the archive is down or lies: local disk keeps every step
                    warnings.warn(
                        f"archiving to {self.run.path} failed (steps not yet archived stay on local "
                        f"disk; tried again after the next save): {e}",
                        CheckpointWarning,
                        stacklevel=1,
                    )
        finally:  # also when a warning raises (warnings as errors): never busy without a thread
            with self._cond:
                self._thread = None
                self._cond.notify_all()

    def _pass(self) -> None:
        """Remove what interrupted copies left, list the archive, finish an interrupted
        rotation, then copy what the tiers say is missing, one step at a time."""
        found = self.run.listing()  # one listing serves both: what the first deletes is left out
        first = leftovers.remove_interrupted_copies(self.run, found=found)
        removed = set(first.removed)
        statuses = self.run.statuses({step: names for step, names in found.items() if step not in removed})
        with self._cond:
            self._held = {s.step: s.info.created for s in statuses if s.info is not None}
        self._local_rotation()  # first: what an earlier process kept for the archive may go now
        self._dropped = False  # before the first rotation: what it drops counts as this pass's
        self._rotate(None, statuses)
        copied: set[int] = set()
        while (nxt := self._next()) is not None:
            if not self._copy(nxt):
                return
            copied.add(nxt.step)
        # a second removal can judge what the first could not only where this pass changed
        # it: a rotation dropped a step (objects it read are read no more; a retired step
        # holds this pass's marker, dead now), or a copy committed a step where the first
        # left a dead copy's markers in a commit-less prefix (now swept by its record).  Live
        # markers, and dead ones kept by a live writer, are another process's to end.
        if self._dropped or first.waiting & copied:
            self.run.remove_interrupted_copies()

    def _next(self) -> CheckpointInfo | None:
        """The local step to copy next: a kept-by-rule step the archive skipped, else the newest
        local step when the archive is behind it; None when the archive is up to date."""
        local = self.local_steps()
        with self._cond:
            held = dict(self._held or {})
        newest = max(held, default=-1)
        for c in local:
            if c.step in held and not _holds(held, c):
                self._conflict(c.step)
        owed = [c for c in local if c.step < newest and c.step not in held and self._owed(c.step)]
        if owed:
            return owed[-1]
        if local and local[-1].step > newest:
            return local[-1]
        return None

    def _conflict(self, step: int) -> None:
        """Local step `step` is another save than the archive's step of that number (the run
        went back without remove()): it is never copied over it, and stays on local disk."""
        why = (
            f"the archive holds another save of step {step} (kept on local disk; remove({step}) retires both)"
        )
        with self._cond:
            self._failed[step] = why
            if step in self._conflicts:
                return
            self._conflicts.add(step)
        warnings.warn(f"not archiving step {step} to {self.run.path}: {why}", CheckpointWarning, stacklevel=2)

    def _copy(self, info: CheckpointInfo) -> bool:
        """Copy one local step; whether it is now in the archive."""
        with self._cond:
            self._copying = info.step
        try:
            archivecopy.put_step(
                self.run, info.step, info.path, claim=self._claim, before_commit=self._rotate
            )
        except Exception as e:  # any failure: kept locally and tried again later
            with self._cond:
                self._failed[info.step] = str(e)
            warnings.warn(
                f"archiving step {info.step} to {self.run.path} failed (kept on local disk, tried again "
                f"after the next save): {e}",
                CheckpointWarning,
                stacklevel=1,
            )
            return False
        finally:
            with self._cond:
                self._copying = None
        with self._cond:
            assert self._held is not None
            self._held[info.step] = info.created
            self._archived_at[info.step] = time.perf_counter()
            while len(self._archived_at) > 1024:
                del self._archived_at[next(iter(self._archived_at))]
            newest = max(self._held)
            self._failed = {s: why for s, why in self._failed.items() if s > newest or self._owed(s)}
            self._failed.pop(info.step, None)
        self._local_rotation()
        return True

    def _local_rotation(self) -> None:
        if self.on_archived is None:
            return
        try:
            self.on_archived()
        except Exception as e:
            warnings.warn(f"local rotation after archiving failed: {e}", CheckpointWarning, stacklevel=1)

    def _rotate(
        self, adding: multifile.CommitRecord | None, statuses: list[StepStatus] | None = None
    ) -> None:
        """The archive's rotation, by its rules over the steps it holds and the step `adding`
        (a commit record about to be uploaded, or None): a step the rules drop goes before
        the new step commits, so the archive never holds more than they keep.  `statuses`:
        the archive's, just read (None: read here: before a commit, the archive as this pass's
        earlier copies and rotations left it, which deleted steps)."""
        statuses = self.run.statuses() if statuses is None else statuses  # rotate reads the same
        done = [s.info for s in statuses if s.info is not None]
        entries = [(c.step, c.metrics) for c in done]
        needed: set[str] = set()
        if adding is not None and adding.step is not None:  # put_step checked it is this step's
            entries.append((adding.step, dict(adding.metrics)))
            needed = {self.run.reference_url(ref.name) for ref in adding.references}
        kept = retention.kept_steps(entries, keep_last=self.keep_last, keep_every=self.keep_every)
        if self.run.rotate(done, kept, statuses, needed=needed, claim=self._claim):
            self._dropped = True


def _holds(held: dict[int, datetime.datetime], local: CheckpointInfo) -> bool:
    """Whether the archive's step of `local`'s number is this very save (its record written
    at the same instant)."""
    return held.get(local.step) == local.created
