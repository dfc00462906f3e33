"""The commit side of a checkpoint manager (between rotation and CheckpointManager, its
subclass, runs/manager.py): a step committed once its files are written, in the order of the
saves (blocking, or on a commit thread of its own), its commit record, its cost and INFO line,
then archiving and rotation; a failed save's step removed, and its error raised to the caller
of the next save or of wait().
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import warnings
from typing import Any

from ..background import inflight
from ..errors import CheckpointError, CheckpointWarning, DeadlineError
from ..fileio import is_url
from ..files import multifile, recordsign
from ..files.reader import CheckpointFile
from .archiver import ArchiveLag
from .rotation import RunRotation
from .steps import STATE_NAME, StepJob, held

#: the saves whose cost save_cost() answers for
COSTS_KEPT = 1024

#: one INFO line per committed save (with a tiered run's archive lag); silent unless the
#: application configures logging
logger = logging.getLogger("ckptfmt")


class StepCommits(RunRotation):
    """Committing a run's steps; its state is the manager's."""

    # set by CheckpointManager.__init__
    incremental: bool
    blocking: bool
    _sign_key: Any
    _record_options: Any
    _saves: dict[int, inflight.SaveHandle]

    def _commit_when_written(self, job: StepJob) -> inflight.SaveHandle | None:
        """Commit `job` once its files are written: now when blocking, else on a thread of its
        own after the commits of earlier saves (commit records go in the order of the saves)."""
        self._remember(job)
        if self.blocking:
            self._finish(job, None)
            job.handle.wait()
            job.handle._returning(job.began)
            return None
        job.handle._returning(job.began)
        # in flight as a non-blocking save: the exit waits for its commit, reports it if unseen
        inflight.begin(job.handle)
        inflight.watch(job.handle, owner_reports=True)
        with self._lock:
            before = self._jobs[-1].thread if self._jobs else None
            self._jobs.append(job)
            job.thread = threading.Thread(
                target=self._finish, args=(job, before), name=f"ckptfmt-commit-{job.step}", daemon=False
            )
            failed: BaseException | None = None
            try:
                job.thread.start()
            except BaseException as e:  # no thread (a limit, an exit refusing them): no save
                self._jobs.remove(job)
                failed = e
        if failed is not None:
            job.handle._observed = True  # raised here
            inflight.end(job.handle)
            job.handle._finish(failed)
            try:
                self._abandon(job)
            finally:
                raise failed  # noqa: B012  (the start's failure, not a cleanup's)
        return job.handle

    def _finish(self, job: StepJob, before: threading.Thread | None) -> None:
        """Wait for the files, write the commit record, rotate; report through job.handle."""
        exc: BaseException | None = None
        record: multifile.CommitRecord | None = None
        try:
            if before is not None:
                inflight.Deadline().join(before, f"the commit of the save before step {job.step}", job.path)
            if job.file_handle is not None:
                job.file_handle.wait()
            if job.layout == "state":  # a save of several ranks: DCP's coordinator wrote it
                record = self._commit(job)
        except BaseException as e:
            exc = e
        try:
            if not job.coordinator:  # another rank holds the step directory, and rotates or removes it
                if exc is None:
                    job.handle._durable_now(_own_rank_file_bytes(job))
            elif exc is None:
                job.handle._durable_now(self._step_bytes(job, record))
                if self._archiver is not None:
                    self._archiver.kick()
                self._rotate()
                self._log_commit(job)
            elif not isinstance(exc, DeadlineError):  # past it the files may still be written:
                self._abandon(job)  # what they leave is a dead save's, for cleanup
        except (OSError, CheckpointError) as e:
            warnings.warn(f"rotation in {self.directory} failed: {e}", CheckpointWarning, stacklevel=2)
        finally:
            if job.lock_fd >= 0:
                os.close(job.lock_fd)
                job.lock_fd = -1
            with self._lock:
                if exc is None and job in self._jobs:
                    self._jobs.remove(job)
            inflight.end(job.handle)
            job.handle._finish(exc)

    def _log_commit(self, job: StepJob) -> None:
        """The INFO line of a committed save (with the archive's lag in a tiered run)."""
        if not logger.isEnabledFor(logging.INFO):
            return
        lag = self.archive_lag
        durable = time.perf_counter() - job.began
        logger.info(
            "step %d committed in %s: %d bytes, durable after %.3f s%s",
            job.step,
            self.directory,
            job.handle._bytes,
            durable,
            ""
            if lag is None
            else f"; archive lag: {lag.steps} step(s), {lag.seconds:.1f} s (archive at step {lag.archived})",
        )

    def _step_bytes(self, job: StepJob, record: multifile.CommitRecord | None) -> int:
        """The bytes of the files step `job` committed, by its record: the one this process
        wrote, else (DCP's coordinator wrote it) read back; on a rank that does not hold the
        step directory, its own rank file's."""
        if record is None and job.lock_fd >= 0:
            record = multifile.read_commit(held(job))
        if record is not None:
            return sum(p.length for p in record.files)
        return _own_rank_file_bytes(job)

    def _remember(self, job: StepJob) -> None:
        """Keep the handle of a save for save_cost() (the last COSTS_KEPT saves)."""
        with self._lock:
            self._saves[job.step] = job.handle
            while len(self._saves) > COSTS_KEPT:
                del self._saves[next(iter(self._saves))]

    def save_cost(self, step: int) -> inflight.SaveCost | None:
        """What the save of `step` by this manager cost (inflight.SaveCost: the time the caller
        was blocked, the time to durable, the bytes of the step's files, the throughput and, in
        a tiered run, the time until the archive held it); None while it runs, if it failed, or
        for a step this manager did not save lately.  In a run of several ranks each rank has
        one: its bytes are the step's on rank 0, which holds the step, and the rank's own
        file's on the others."""
        with self._lock:
            handle = self._saves.get(step)
        if handle is None or handle.cost is None:
            return None
        cost = handle.cost
        if self._archiver is None:
            return cost
        archived = self._archiver.archived_at(step)
        if archived is None:
            return cost
        return dataclasses.replace(cost, archived_s=max(archived - handle._began, cost.durable_s))

    @property
    def archive_lag(self) -> ArchiveLag | None:
        """How far the archive is behind this directory: complete local steps newer than its
        newest, and for how long the oldest of them has waited (None without an archive)."""
        if self._archiver is None:
            return None
        return self._archiver.lag(self._scan().complete())

    def _commit(self, job: StepJob) -> multifile.CommitRecord:
        """Write the step's commit record, naming the state file and every file it reads
        chunks from, each described through the step directory this save holds."""
        d = held(job)
        parts = (multifile.describe_in(d, STATE_NAME),)
        refs: tuple[multifile.PartRecord, ...] = ()
        if self.incremental:
            fd = d.open_file(STATE_NAME)
            with CheckpointFile(d.path_of(STATE_NAME), fd=fd, within=d, decrypt_with=self._decrypt) as f:
                refs = tuple(multifile.describe_in(d, ext.rel) for ext in f.externals)
                multifile.check_named(STATE_NAME, f.externals, refs, job.path)
        record = multifile.CommitRecord(job.step, "state", parts, refs, job.metrics, job.metadata)
        if self._sign_key is not None:
            recordsign.write_signed(d, record, None, self._record_options)
        else:
            multifile.write_commit(job.path, record, within=d)
        return record

    def _abandon(self, job: StepJob) -> None:
        """A failed save: remove what it wrote (its step never became a checkpoint)."""
        if job.file_handle is not None and not job.file_handle.done():
            job.file_handle.exception()
        if job.lock_fd >= 0:
            os.close(job.lock_fd)
            job.lock_fd = -1
        self._delete_step(job.path, keep=self._scan().referenced())

    def _raise_failed(self) -> None:
        """Raise the error of an earlier non-blocking save that nobody has waited for."""
        with self._lock:
            self._jobs = [j for j in self._jobs if not (j.handle.done() and j.handle._observed)]
            failed = [j for j in self._jobs if j.handle.done() and j.handle._exc is not None]
            if not failed:
                return
            self._jobs.remove(failed[0])
        failed[0].handle._observed = True
        raise CheckpointError(
            f"an earlier save of step {failed[0].step} failed: {failed[0].handle._exc}"
        ) from (failed[0].handle._exc)

    def _wait_all(self) -> None:
        """Wait for the commit threads of the saves in flight, all within one
        inflight.wait_seconds(None): DeadlineError naming the step still committing then."""
        with self._lock:
            threads = [(j.step, j.thread) for j in self._jobs if j.thread is not None]
        deadline = inflight.Deadline()
        for step, t in threads:
            deadline.join(t, f"the save of step {step}", self.directory)


def _own_rank_file_bytes(job: StepJob) -> int:
    """The length of the rank file this process wrote into `job`'s local step directory (0
    where there is none: a single-process save, a step on a store)."""
    if job.layout != "dcp" or is_url(job.path):
        return 0
    import torch.distributed as dist

    from ..files.names import rank_file_name

    try:
        return os.stat(os.path.join(job.path, rank_file_name(dist.get_rank()))).st_size
    except OSError:
        return 0
