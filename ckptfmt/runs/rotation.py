"""Rotation and cleanup for a checkpoint manager (CheckpointManager's base, runs/manager.py):
applying the retention rules after a commit, removing what saves that died left behind, and
deleting steps, only ever beneath the run directory's descriptor and only what ckptfmt made.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

from ..engine import commit, marks
from ..engine.ckptdir import CheckpointDir, LinkError
from ..errors import (
    CheckpointError,
    CheckpointWarning,
)
from ..files import multifile
from . import locks, retention
from .reading import RunReading
from .scan import RunScan
from .steps import CheckpointInfo


class RunRotation(RunReading):
    """Deleting what a run no longer keeps; its state is the manager's."""

    # set by CheckpointManager.__init__
    _delete_lock: threading.RLock
    keep_last: int | None
    keep_every: int | None
    keep_best: str | None
    best_mode: str

    # -- rotation and cleanup ---------------------------------------------------------------

    def _rotate(self) -> None:
        """Rotation after a commit: it scans the directory afresh, as the commit (on a commit
        thread for non-blocking saves) has changed it since the save's scan."""
        with self._delete_lock:
            self._rotate_locked(self._scan())

    def _kept_steps(self, done: list[CheckpointInfo]) -> set[int]:
        """The steps of `done` (complete checkpoints) this run's retention rules keep."""
        return retention.kept_steps(
            [(c.step, c.metrics) for c in done],
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            keep_best=self.keep_best,
            best_mode=self.best_mode,
        )

    def _rotate_locked(self, scan: RunScan) -> None:
        done = scan.complete()
        kept = self._kept_steps(done)
        if self._archiver is not None:  # not yet safe in the archive: kept here until it is
            kept |= self._archiver.keeps_locally(done)
        keep_files = {r for c in done if c.step in kept for r in c.references}
        for c in done:
            if c.step not in kept:
                self._retire(c.path, keep_files)
                scan.forget(c.path)

    def _retire(self, path: str, keep: set[str]) -> None:
        """Stop a step being a checkpoint (commit record first), then delete what nothing refers to."""
        self._records.forget(path)
        self._read_records.forget(path)
        with CheckpointDir.open(self.directory) as run:
            try:
                d = run.sub(os.path.basename(path))
            except (FileNotFoundError, LinkError):
                return  # gone, or not a directory of ours any more: nothing to retire
            with d:
                d.unlink(multifile.COMMIT_NAME)
                d.fsync()
        self._delete_step(path, keep)

    def _delete_step(self, path: str, keep: set[str]) -> None:
        """Delete a step directory that is not (or no longer) a checkpoint, sparing `keep`."""
        with self._delete_lock:
            self._delete_step_locked(path, keep)

    def _delete_step_locked(self, path: str, keep: set[str]) -> None:
        """Everything inside is reached through the step directory's own descriptor, opened
        without following a link: a step directory swapped for a link (at any moment) leads
        nowhere outside the run."""
        self._records.forget(path)
        self._read_records.forget(path)
        name = os.path.basename(path)
        with CheckpointDir.open(self.directory) as run:
            try:
                d = run.sub(name)
            except (FileNotFoundError, LinkError):
                return  # gone, or a link: never delete what a link points to
            with d:
                marks.put_mark(d, "ckptfmt.CheckpointManager")  # cut short, it is still ours
                if d.unlink(multifile.COMMIT_NAME):  # never leave files that a commit record still names
                    d.fsync()
                for entry in d.names():
                    if entry != marks.MARK_NAME and d.path_of(entry) not in keep:
                        d.remove_tree(entry)
                marks.remove_mark_if_alone(d)
            run.rmdir(name)

    def _cleanup(self, scan: RunScan | None = None) -> None:
        """Remove step directories of saves that died (unlocked, without a commit record) and
        abandoned temporary step directories, then finish an interrupted rotation; `scan`:
        the save's scan (one is taken when not given)."""
        with self._delete_lock:
            self._cleanup_locked(scan or self._scan())

    def _cleanup_locked(self, scan: RunScan) -> None:
        newest = scan.newest_step()
        newest = -1 if newest is None else newest
        keep = scan.referenced()
        for s in list(scan.statuses):
            if s.info is not None or s.step in scan.busy or not s.ours:
                continue  # complete, being saved, or not ckptfmt's (never deleted)
            if s.damaged and s.step > newest:
                continue  # the newest data there is: leave it for a person to look at
            locked = locks.is_locked(s.path)
            if locked or (locked is None and s.step > newest):
                continue  # a live save (or, without locks, possibly one)
            self._tidy(s.path, lambda path=s.path: self._delete_step(path, keep))
            scan.forget(s.path)
        with CheckpointDir.open(self.directory) as run:
            for name in scan.temp_names:
                if commit.abandoned_temp_dir(run, name):
                    self._tidy(run.path_of(name), lambda name=name: run.remove_tree(name))
        # Finish a rotation that a kill between a commit and its rotation (or an error)
        # left undone.  Otherwise the next rotation comes only after this save's commit,
        # and every kill that lands in that window again leaves one more checkpoint
        # than the rules keep (tests/test_manager_crash.py found 4 with keep_last=2).
        try:
            self._rotate_locked(scan)
        except (OSError, CheckpointError) as e:
            warnings.warn(f"rotation in {self.directory} failed: {e}", CheckpointWarning, stacklevel=3)

    def _tidy(self, path: str, remove: Any) -> None:
        """Remove a leftover of a dead save; one that cannot be removed (a foreign tree, no
        permission) is warned about and left, never a reason for this save to fail."""
        try:
            remove()
        except (OSError, CheckpointError) as e:
            warnings.warn(f"cannot remove {path}: {e}", CheckpointWarning, stacklevel=4)
