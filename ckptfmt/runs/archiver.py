"""The archive tier of a run: committed local steps copied to an object store in the
background, and the archive's own retention.

A step is handed over after its commit record is durable on disk.  One thread copies the
steps in commit order (ObjectRun.put_step: each file verified after upload, the commit
record last), then applies the archive's retention rules, which never delete the newest
archived step.  Until a step is in the archive it is "pending", and the local rotation
spares pending steps, so no step is lost between the tiers; a failed copy is warned about
and tried again after the next commit.  Training never waits for any of it: the thread
runs while there is work and ends when there is none (a process exiting waits for the copy
in progress, as it waits for saves in flight).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import deque
from collections.abc import Callable

from ..errors import CheckpointWarning
from . import retention
from .objectrun import ObjectRun


class Archiver:
    """Copies committed steps of a local run to `run` and rotates it."""

    def __init__(
        self,
        run: ObjectRun,
        *,
        keep_last: int | None,
        keep_every: int | None,
        on_archived: Callable[[], None] | None = None,
    ) -> None:
        """`on_archived`: called (on the archive thread) after steps were copied, so the local
        rotation can now drop what it kept for the archive."""
        retention.check_rules(keep_last, keep_every, None, "min")
        self.run = run
        self.on_archived = on_archived
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._queue: deque[tuple[int, str]] = deque()
        self._pending: set[int] = set()
        self._failed: dict[int, tuple[str, str]] = {}  # step -> (local path, why)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, step: int, path: str) -> None:
        """Archive the committed local step `step` (its directory `path`); steps whose copy
        failed before are tried again first."""
        with self._cond:
            retry = sorted(self._failed.items())
            self._failed.clear()
            for s, (p, _) in retry:
                if os.path.isdir(p):
                    self._queue.append((s, p))
                else:
                    self._pending.discard(s)
            self._queue.append((step, path))
            self._pending.add(step)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ckptfmt-archive", daemon=False)
                self._thread.start()

    def pending(self) -> set[int]:
        """Steps not yet safely in the archive (queued, being copied, or failed): the local
        rotation keeps them."""
        with self._cond:
            return set(self._pending)

    def failures(self) -> dict[int, str]:
        """Steps whose last copy failed, and why (they are tried again after the next commit)."""
        with self._cond:
            return {s: why for s, (_, why) in self._failed.items()}

    def wait(self) -> None:
        """Wait until every step handed over has been copied or has failed."""
        with self._cond:
            while self._thread is not None:
                self._cond.wait()

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._thread = None
                    self._cond.notify_all()
                    return
                step, path = self._queue.popleft()
            if self._archive(step, path) and self.on_archived is not None:
                try:
                    self.on_archived()
                except Exception as e:
                    warnings.warn(
                        f"rotation after archiving step {step} failed: {e}", CheckpointWarning, stacklevel=1
                    )

    def _archive(self, step: int, path: str) -> bool:
        """Copy one step; whether it is now in the archive."""
        try:
            self.run.put_step(step, path)
        except Exception as e:  # any failure: kept locally and tried again later
            with self._cond:
                self._failed[step] = (path, str(e))
            warnings.warn(
                f"archiving step {step} to {self.run.path} failed (kept on local disk, tried again "
                f"after the next save): {e}",
                CheckpointWarning,
                stacklevel=1,
            )
            return False
        with self._cond:
            self._pending.discard(step)
        try:
            self._rotate()
        except Exception as e:
            warnings.warn(f"rotation in {self.run.path} failed: {e}", CheckpointWarning, stacklevel=1)
        return True

    def _rotate(self) -> None:
        statuses = self.run.statuses()  # once: rotate reads the records they show
        done = [s.info for s in statuses if s.info is not None]
        kept = retention.kept_steps(
            [(c.step, c.metrics) for c in done], keep_last=self.keep_last, keep_every=self.keep_every
        )
        self.run.rotate(done, kept, statuses)
