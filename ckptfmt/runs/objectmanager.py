"""CheckpointManager("s3://bucket/run"): a run kept on an object store, with the guarantees
of a local run.

Each save writes ``step-N/state.ckpt`` as one object (streamed, committed whole by its
multipart upload), then the commit record ``step-N/COMMIT``, created only if absent, so a
step is complete exactly when its record is there and names the state object with its
length, file id and index checksum.  The state object is created only if absent too, and a
save deletes nothing in its step before its record is in: where the step holds objects
already (a crashed save's, or a live writer's about to commit) its state object gets a name
of its own (``state.<16 hex>.ckpt``), and those objects go once it has committed (spec
13.7).  ``latest()`` never picks an incomplete step; rotation deletes a step's record
before its files; commit-less steps and multipart uploads left by crashed savers are
cleaned by later saves once they are a day old (a store has no locks: age stands in for
"no live process holds it").  Loading, resuming and verifying are the
local manager's, reading through ranged GETs pinned to each object's ETag.  With sign_with
the record carries the state object's SHA-256, read back after upload, and is signed; with
trusted_keys a step is read only when a trusted key signed it, each object hashed against
its record first (spec 13.7, 16.7).

Incremental saves refer to objects of earlier steps (spec 12 on a store, 13.7); rotation
retires a step later ones read from (its record deleted, its objects kept while referred to).

Several ranks (or DTensors) save a step as a DCP checkpoint on the store, each rank its own
object (``rank-NNNNN.<16 hex>.ckpt``, named by the rank for this save), the commit record
(layout "dcp") created last, only if absent, by DCP's coordinator.

Not in this version: an archive tier of an object-store run, and encrypted multi-rank runs
(each raises at construction or save).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ..background import inflight
from ..errors import CheckpointError, CheckpointWarning, LimitError, StorageError
from ..files import multifile
from ..files import save as writer
from ..files.names import own_state_name
from ..files.places import ObjectPlace
from ..files.reader import CheckpointFile
from ..files.verify import VerifyReport
from ..format.index import External
from ..format.timestamps import MICROSECONDS, format_utc, utc_now
from ..storage import listing
from ..storage.client import deadline
from ..storage.upload import upload_bytes
from ..storage.urls import ObjectURL
from . import objectnames, resume
from .manager import CheckpointManager, RunSteps, is_sharded_save
from .objectnames import StoreStamp, claiming, copy_marker
from .objectrun import ObjectRun
from .scan import RunScan
from .steps import CheckpointInfo, StepJob, StepStatus, newest_unknown
from .writeanswer import store_answered


class ObjectRunManager(CheckpointManager):
    """A run's checkpoints under an object-store prefix (made by CheckpointManager(url, ...))."""

    def _open(self, directory: str, storage_options: dict[str, Any] | None) -> None:
        """Take the run's place: the prefix `directory` (a URL) of an object store."""
        self.run = ObjectRun(directory, storage_options, decrypt=self._decrypt, trusted=self._trusted)
        self.directory = self.run.path
        # how every commit record is written (signed with the key loaded once, at __init__)
        self._record_options = writer.save_options(storage_options=self.run.options, sign_with=self._sign_key)

    def _open_archive(
        self,
        archive: str,
        keep_last: int | None,
        keep_every: int | None,
        storage_options: dict[str, Any] | None,
    ) -> None:
        raise ValueError("a run on an object store is an archive already: archive= needs a local directory")

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r})"

    # -- reading the run --------------------------------------------------------------

    def statuses(self) -> list[StepStatus]:
        return self.run.statuses()

    def checkpoints(self) -> list[CheckpointInfo]:
        return self.run.checkpoints()

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, the steps read newest first and the reading
        stopped at it (ObjectRun.newest_first: at most MAX_CANDIDATES records); the newer
        steps that are not one are skipped with a warning."""
        return next(self._complete_newest_first(), None)

    def _complete_newest_first(self, warn: bool = True) -> Iterator[CheckpointInfo]:
        """The complete steps newest first (those a trusted key signed, where keys are trusted),
        read as they are reached; with `warn`, the others
        met on the way are warned about, but for saves in flight (no step newer than a
        complete one is kept for a later step's objects: those refer to older steps).  A step
        whose record the store failed to serve ends them: StorageError when none came before
        it (it may be the newest checkpoint; an older one would fork the run)."""
        busy = self._in_flight_steps()
        first = True
        for s in self.run.newest_first():
            if s.unknown:
                if first:
                    raise StorageError(f"step {s.step}: {s.problem}", path=s.path)
                return
            if s.info is not None:
                # a step no trusted key signed is skipped as a damaged one is: it does not make
                # an unknown step below it an older checkpoint's to pass over
                trusted = next(self._trusted_first([s.info]), None)
                if trusted is not None:
                    first = False
                    yield trusted
            elif warn and s.step not in busy:
                warnings.warn(f"skipping {s.path}: {s.problem}", CheckpointWarning, stacklevel=4)

    def _find(self, step: int | None) -> list[CheckpointInfo]:
        """The checkpoint of `step`; with None, the complete ones a resume may fall back on,
        newest first: those among the newest MAX_CANDIDATES steps with a commit record
        (ObjectRun.newest_first), so that no listing keeps a resume reading records for long."""
        if step is not None:
            return super()._find(step)
        found: list[CheckpointInfo] = []
        try:
            found.extend(self._complete_newest_first(warn=False))
        except LimitError as e:
            if not found:
                raise CheckpointError(f"no complete checkpoint in {self.directory}: {e.reason}") from e
        if not found:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        return found

    def _check_trusted(self, info: CheckpointInfo) -> None:
        self.run.trusted_record(info.step)

    @contextlib.contextmanager
    def _state_file(self, info: CheckpointInfo) -> Iterator[CheckpointFile]:
        with self.run.open_part(info) as f:
            yield f

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check every file of checkpoint `step` (the newest complete one when None)."""
        return self.run.verify_step(self._find(step)[0])

    # -- saving ---------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: dict[str, float] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> inflight.SaveHandle | None:
        """Save `state` as checkpoint `step` (see CheckpointManager.save)."""
        metrics, meta = self._check_save(step, metrics, metadata)
        if is_sharded_save(state):  # every rank uploads its shard (sharded.py)
            from . import sharded

            return sharded.save_step(self._steps(), step, state, metrics, meta)
        if self.incremental:
            # the next object refers to the newest committed step's (or to what that one refers
            # to): a save in flight must commit, and rotate, before that base is chosen, or its
            # rotation deletes what this save is about to refer to
            self._wait_all()
        statuses = self._prepare_step(step)
        from .rng import capture_rng

        payload = resume.build_payload(state, step, capture_rng())
        path = self.run.step_path(step)
        job = StepJob(step, path, -1, metrics, meta, inflight.SaveHandle(path))
        if any(s.step == step for s in statuses):  # objects of another save: never written over
            job.state_name, job.sweep = own_state_name(), True
        try:
            job.file_handle = self._upload_state(job, payload, statuses)
        except BaseException:
            self._abandon(job)
            raise
        job.written = True  # begun (or, when blocking, done): what it made is this save's
        return self._commit_when_written(job)

    def _steps(self) -> ObjectRunSteps:
        return ObjectRunSteps(self)

    def _prepare_step(self, step: int) -> list[StepStatus]:
        """Check that `step` is after the newest checkpoint (ValueError) and holds no commit
        record, clean stale uploads and steps; the run's statuses before the save.  Objects
        the step holds without a record are left: they may be a live writer's about to commit
        (a save of the step writes a state object of its own beside them, and deletes them
        once it has committed, spec 13.7)."""
        found = self.run.listing()  # one listing for the checks and the cleanup of the same moment
        statuses = self.run.statuses(found)
        newest = max(
            [s.step for s in statuses if s.info is not None] + list(self._in_flight_steps()), default=None
        )
        if newest is not None and step <= newest:
            raise ValueError(
                f"step {step} is not after the newest checkpoint (step {newest}) in {self.directory}"
            )
        unknown = newest_unknown(statuses)
        if unknown is not None and unknown.step >= step:  # it may be a checkpoint at or after `step`
            raise StorageError(
                f"step {step} is not saved: step {unknown.step}: {unknown.problem}", path=unknown.path
            )
        this = next((s for s in statuses if s.step == step), None)
        if this is not None and (this.damaged or this.unread):
            raise CheckpointError(
                f"step {step} holds a commit record that is not a checkpoint ({this.problem}); it is "
                f"not saved over: remove({step}) deletes it",
                path=this.path,
            )
        if this is not None and self.run.has_record(step):  # one HEAD, where the step is not empty
            raise CheckpointError(
                f"step {step} has a commit record that the store's listing did not show; not saved over",
                path=this.path,
            )
        self._tidy(self.directory, lambda: self.run.cleanup(found=found, statuses=statuses))
        return statuses

    def _store_options(self) -> dict[str, Any] | None:
        return self.run.options

    def _upload_state(self, job: StepJob, payload: dict[str, Any], statuses: list[StepStatus]) -> Any:
        """Upload the step's state object, created only if absent (another writer's of the same
        step is never replaced: ObjectExistsError), under a name of this save's own where the
        step held objects already; an incremental run's refers to the chunks the newest
        complete step already holds (its own or those it refers to)."""
        done = [s.info for s in statuses if s.info is not None]
        base = done[-1].state_path if done else None
        return self._save_state(
            payload, f"{job.path}/{job.state_name}", base, storage_options=self.run.options, create_only=True
        )

    def _commit(self, job: StepJob) -> multifile.CommitRecord:
        """Write the step's commit record, created only if absent, naming the state object;
        with sign_with the record carries the object's SHA-256 (read back whole, pinned to
        the version named) and is signed (spec 16.7)."""
        url = f"{job.path}/{job.state_name}"
        place = self.run.step_place(job.step)
        with self._claiming_references(job, place) as claim:
            with self._uploaded_state(job, url) as f:
                _check_uploaded_here(f.etag, job, url)
                part = multifile.identity_of(f, job.state_name)
                claim([ext.rel for ext in f.externals])
                refs = tuple(self._describe(place, job.state_name, ext) for ext in f.externals)
                if self._sign_key is not None:
                    part = place.with_digest(part, f.etag)
            return self._write_record(job, part, refs)

    def _write_record(
        self, job: StepJob, part: multifile.PartRecord, refs: tuple[multifile.PartRecord, ...]
    ) -> multifile.CommitRecord:
        """Put the step's commit record, only if absent, naming state object `part` and the
        objects of earlier steps `refs`; then sweep what other saves left in the step."""
        # its time fixed now: a record found there can be told for this one (_is_this_record)
        created = format_utc(utc_now(), MICROSECONDS)
        record = multifile.CommitRecord(job.step, "state", (part,), refs, job.metrics, job.metadata, created)
        try:
            writer.save_file(
                record.as_value(),
                f"{job.path}/{multifile.COMMIT_NAME}",
                self._record_options,
                create_only=True,
            )
        except FileExistsError:
            if not self._is_this_record(job, record):
                raise CheckpointError(
                    f"step {job.step} was committed by another writer meanwhile", path=job.path
                ) from None
        except BaseException as e:
            # without the store's answer (a timeout, a reset, an answer cut short) it may have
            # the record whole: it may land yet, naming the state object, which must then stay
            job.record_unknown = not store_answered(e)
            raise
        if job.sweep:  # what other saves left in the step is nobody's now
            self._tidy(job.path, lambda: self.run.sweep_step(job.step, record))
        return record

    def _is_this_record(self, job: StepJob, record: multifile.CommitRecord) -> bool:
        """Whether the commit record that refused this save's (its write is create-only) is
        this save's own: an attempt whose answer was lost made it, and the retry found it.
        It is when it says what `record` says, to its creation time and the state object's
        file id, which no other save's names (one GET; one that cannot be read is not, but
        StorageError when the store fails to serve it: that says nothing of whose it is, so the
        outcome is unknown and what the record names stays)."""
        try:
            return self.run.record(job.step) == record
        except StorageError:
            job.record_unknown = True
            raise
        except (FileNotFoundError, CheckpointError):
            return False

    @contextlib.contextmanager
    def _claiming_references(self, job: StepJob, place: ObjectPlace) -> Iterator[Callable[[list[str]], None]]:
        """While the commit record is described and written: a function that puts this save's
        copy marker into the prefix of each earlier step whose objects (references, relative
        to `place`) the record will name, and waits out a deletion of that step under way
        (ObjectRun.wait_out_sweeps), before they are looked at.  A deletion (a rotation's, a
        remove's, another writer's: ObjectRun.delete_unclaimed) that lists the prefix after
        the marker is in only retires the step; one that put its sweep marker first is over
        before they are looked at.  The markers go once the record is in (it names the
        objects then), or the save failed, but for a record whose write got no answer: it
        may land yet (they are dead once this process is, and go with the step)."""
        name = copy_marker()
        claimed: list[ObjectURL] = []

        def claim(references: list[str]) -> None:
            steps = sorted({objectnames.referenced_step(rel, place.path)[0] for rel in references})
            for step in steps:
                marker = self.run.step_url(step).child(name)
                upload_bytes(
                    b"a ckptfmt save referring to this step's objects\n", str(marker), self.run.options
                )
                stamp = StoreStamp(name, time.monotonic())
                claimed.append(marker)
                self.run.wait_out_sweeps(step, stamp, within=deadline(self.run.options))

        with claiming(name):
            try:
                yield claim
            finally:
                if job.record_unknown:
                    objectnames.hold_claim(name)
                else:
                    for marker in claimed:
                        self._tidy(str(marker), lambda m=marker: listing.delete_object(m, self.run.options))

    def _uploaded_state(self, job: StepJob, url: str) -> CheckpointFile:
        """The state object this save uploaded, opened to be described; CheckpointError when it
        is gone: a writer that committed the step since deletes what its record does not name."""
        try:
            return CheckpointFile(url, storage_options=self.run.options, decrypt_with=self._decrypt)
        except FileNotFoundError:
            raise CheckpointError(
                f"step {job.step}: the state object this save uploaded is gone (another writer "
                "committed the step meanwhile and deleted it, or someone else did); not committed",
                path=url,
            ) from None

    def _describe(self, place: ObjectPlace, state_name: str, ext: External) -> multifile.PartRecord:
        """The commit record's entry for the object the reference `ext` of the new step (at
        `place`) leads to, with its digest when the record is signed; CorruptError unless it
        is the file the state object was written against (its file id and length): another
        object there now is not named, nor vouched for; CheckpointError when none is there
        (another writer removed or rotated that step meanwhile)."""
        url = str(place.object_url(ext.rel))
        try:
            part, etag = place.described(ext.rel)
        except FileNotFoundError:
            raise CheckpointError(
                f"{state_name} reads chunks from {url}, which is gone (another writer removed or rotated "
                "its step meanwhile); not committed",
                path=place.path,
            ) from None
        multifile.check_named(state_name, [ext], [part], url)
        return place.with_digest(part, etag) if self._sign_key is not None else part

    def _abandon(self, job: StepJob) -> None:
        """A failed save: remove the state object it uploaded, and nothing else.  A save whose
        upload failed made no object (the uploader aborts its multipart upload; cleanup
        aborts what a crash left).  A step whose commit record names the object (this save's
        own record, landed although its request failed) keeps it.  A save of several ranks
        (no rank knows every rank file to be this save's) removes its rank files only once
        another writer's record is in the step, which cannot name them; without one, the next
        save of the step that commits deletes them, or cleanup once stale.  A save whose
        record's write got no definite answer keeps its object: the record may land after
        any read of it (cleanup deletes the step once stale, if no record did)."""
        if job.layout == "dcp":
            if job.file_handle is not None:
                job.file_handle.exception()  # waits for the upload
            self._tidy(job.path, lambda: self.run.sweep_committed(job.step))
            return
        if job.record_unknown:  # the record may land naming it: cleanup's, once the step is stale
            return
        uploaded = job.written
        if job.file_handle is not None:
            uploaded = uploaded and job.file_handle.exception() is None  # waits for it
        version = None if job.file_handle is None else job.file_handle.version
        if uploaded and version is not None:  # no version: not provably ours (cleanup's, once stale)
            self._tidy(job.path, lambda: self.run.delete_uncommitted(job.step, job.state_name, version))

    def _step_bytes(self, job: StepJob, record: multifile.CommitRecord | None) -> int:
        """The bytes of the objects step `job` committed, by its record: the one this save
        wrote, else (DCP's coordinator wrote it) the one _dcp_committed read, else read now."""
        if record is None and job.coordinator:
            record = job.record or self.run.step_place(job.step).read_record()
        return 0 if record is None else sum(p.length for p in record.files)

    def _dcp_committed(self, job: StepJob) -> None:
        """Step `job`, saved by several ranks, is committed: read its record back (one GET,
        kept for _step_bytes) and delete what other saves left in the step by it
        (ObjectRun.sweep_step, which keeps what later steps read: the DCP writer leaves that
        to the run).  What cannot be read or deleted is warned about, the step committed."""

        def sweep() -> None:
            job.record = self.run.step_place(job.step).read_record()
            self.run.sweep_step(job.step, job.record)

        self._tidy(job.path, sweep)

    def _rotate(self) -> None:
        """Retention after a commit, by a listing made now: the commit, and other writers, have
        changed the run since the save's preparation listed it, and what rotation deletes must
        be judged on what is there (a step another writer committed meanwhile may refer to an
        older one).  No rule set: nothing to delete, and nothing listed."""
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            return
        statuses = self.statuses()  # once: the records are read by one GET each
        done = [s.info for s in statuses if s.info is not None]
        self.run.rotate(done, self._kept_steps(done), statuses)

    def remove(self, step: int) -> None:
        """Delete checkpoint `step`."""
        self._wait_all()
        if not self.run.remove_step(step):
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory}")


def _check_uploaded_here(etag: str | None, job: StepJob, url: str) -> None:
    """The state object about to be committed is the version this save uploaded (its
    handle's): CheckpointError when another writer's is there now (it deleted this save's as
    a leftover and wrote its own), which this save's record must not name."""
    version = None if job.file_handle is None else job.file_handle.version
    if version is not None and (etag or "").strip('"') != version.strip('"'):
        raise CheckpointError(
            f"step {job.step}: the state object is not the one this save uploaded (another "
            "writer replaced it meanwhile); not committed",
            path=url,
        )


CheckpointManager.url_manager = ObjectRunManager


class ObjectRunSteps(RunSteps):
    """A run on an object store's side of the step-saving protocol (runs/stepsave.py)."""

    manager: ObjectRunManager

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self.manager.run.options

    def step_path(self, step: int) -> str:
        return self.manager.run.step_path(step)

    def prepare_step(self, job: StepJob, scan: RunScan | None) -> list[CheckpointInfo]:
        return [s.info for s in self.manager._prepare_step(job.step) if s.info is not None]

    def step_committed(self, job: StepJob) -> None:
        self.manager._dcp_committed(job)
