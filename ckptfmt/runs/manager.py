"""CheckpointManager: a training run's directory of checkpoints, one per saved step.

Layout: ``<directory>/step-000001000/`` holds the step's state file
(``state.ckpt``) and, written last, its commit record (``COMMIT``, see
multifile.py).  A step is complete exactly when its commit record verifies and
names files that are there unchanged; nothing else ever counts as a
checkpoint.  So:

* a save writes its step directory under a temporary name, locks it, marks it
  (engine.marks), renames it into place, writes the state file (atomically, like
  any save), and only then writes the commit record;
* ``latest()`` is the newest complete step; incomplete, damaged or foreign
  step directories are skipped with a warning that says why;
* rotation runs after a commit, never deletes the newest complete checkpoint,
  and never deletes a file that a kept checkpoint refers to (incremental runs);
* a step directory without a commit record is removed by a later save when it
  bears ckptfmt's mark (or is empty) and no live process holds its lock (a
  crashed or failed save); one without the mark is another tool's, never deleted;
* non-blocking saves return after the snapshot; their commit records are
  written in the order the saves were made, each after its files are durable;
* with ``sign_with`` every commit record is signed (spec 16.7: it carries the
  SHA-256 of every file it names); with ``trusted_keys`` ``latest()``, ``load``,
  ``load_into`` and ``verify`` accept only steps whose record a trusted key
  signed, and check every file a load reads against it before reading it.  A
  newest step that is not so signed is skipped like a damaged one; saving,
  cleanup and rotation never look at signatures, so trusting keys never
  deletes anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import stat
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from ..background import inflight
from ..engine import commit, marks
from ..engine.ckptdir import CheckpointDir, LinkError
from ..errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptError,
    SignatureError,
    StorageError,
    UnsupportedError,
)
from ..fileio import is_url
from ..files import encryption, multifile, recordsign
from ..files import load_into as inplace
from ..files import save as writer
from ..files.reader import CheckpointFile
from ..files.targets import MismatchError
from ..files.verify import VerifyReport
from ..format import devices
from ..gcpause import pausing_in_main_thread
from . import locks, resume, retention
from .archiver import ArchiveLag, Archiver
from .objectrun import ObjectRun
from .scan import RunScan, StepRecords
from .stepcheck import resume_entries, verify_in_run
from .steps import (
    MAX_STEP,
    STATE_NAME,
    CheckpointInfo,
    StepJob,
    StepStatus,
    held,
    step_dirname,
)

#: the saves whose cost save_cost() answers for
COSTS_KEPT = 1024

#: one INFO line per committed save (with a tiered run's archive lag); silent unless the
#: application configures logging
logger = logging.getLogger("ckptfmt")


class CheckpointManager:
    """A run's checkpoints in one directory; see the module docstring for the guarantees.

    Given an object-store URL (``s3://bucket/run``) instead of a directory, the manager is an
    ObjectRunManager (runs/objectmanager.py): the same layout and guarantees on the store."""

    #: the manager of runs on an object store; runs/objectmanager.py (a subclass of this
    #: class, so not importable from here) registers itself when ckptfmt is imported
    url_manager: type[CheckpointManager] | None = None

    def __new__(cls, directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> CheckpointManager:
        if cls is CheckpointManager and is_url(os.fspath(directory)) and cls.url_manager is not None:
            return super().__new__(cls.url_manager)
        return super().__new__(cls)

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: str | None = None,
        best_mode: str = "min",
        compression: str | None = None,
        blocking: bool = True,
        incremental: bool = False,
        snapshot: str = "copy",
        archive: str | None = None,
        archive_keep_last: int | None = None,
        archive_keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        sign_with: Any = None,
        trusted_keys: Any = None,
        encrypt_with: Any = None,
        decrypt_with: Any = None,
    ) -> None:
        """archive: an object-store URL (``s3://bucket/run``) where every committed step is also
        copied, in the background and verified after upload; `archive_keep_last` and
        `archive_keep_every` are that tier's retention rules (the local ones stay those of
        this directory; a step is kept locally until the archive holds it or a newer step
        its rules keep instead: runs/archiver.py).  latest(), load() and load_into() look at
        both tiers: a new node without the old disk resumes from the archive, and a local
        copy that is missing or damaged is read from there; an archive that cannot be read
        is warned about and the local tier used (see _archived_if_readable).
        An incremental step is archived with the objects of earlier steps it reads from.
        storage_options: the object store's client settings (see ckptfmt.save).

        sign_with: an Ed25519 private key (as ``ckptfmt.save`` takes it) that signs every
        step's commit record; trusted_keys: public keys, one of which must have signed a step
        for it to be loaded, resumed from, found by latest() or verified (spec 16.7).  An
        archive keeps the signed records as they are, and its steps are read with the same
        checks; on a store every file a load reads is hashed against the record first (one
        more pass over its bytes).

        encrypt_with: a key (as ``ckptfmt.save`` takes it) that encrypts every step's state file
        (spec section 17; the commit record, with the metrics, stays in clear); decrypt_with:
        the key that reads them (default `encrypt_with`, unless that is a key service's
        callable).  latest(), ls and verify need it too: they read each state file's index.
        Archived copies stay encrypted.  Encrypted runs combine with incremental saves, signing,
        archives, stores and several ranks.

        snapshot="fork" (non-blocking saves, see ckptfmt.save) is refused where the child that
        writes a fork snapshot cannot do the work: with incremental saves (their digests are
        compared with the base's in this process), on an object store (the child only writes a
        local file), and, at the first save, in a run of several ranks (DCP stages each shard
        itself).  Encrypted runs take fork snapshots: the child encrypts each chunk."""
        retention.check_rules(keep_last, keep_every, keep_best, best_mode)
        writer.check_save_args(compression, None, None)
        writer.check_snapshot(snapshot)
        if snapshot == "fork" and incremental:
            raise ValueError("snapshot='fork' cannot be combined with incremental saves")
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.keep_best = keep_best
        self.best_mode = best_mode
        self.compression = compression
        self.blocking = bool(blocking)
        self.incremental = bool(incremental)
        self.snapshot = snapshot  # how non-blocking saves snapshot the state: writer.save
        self._sign_key = recordsign.private_key(sign_with)  # a bad key fails here, not at a commit
        writer.signer(self._sign_key)  # and an engine without libcrypto
        self._trusted = recordsign.public_keys(trusted_keys)
        # a bad key, or an engine without libcrypto, fails here, not at the first save
        self._encrypt, self._decrypt = encryption.save_and_read_keys(encrypt_with, decrypt_with)
        self._lock = threading.Lock()
        self._saves: dict[int, inflight.SaveHandle] = {}  # the latest saves' handles, by step
        self._jobs: list[StepJob] = []  # in flight, or finished with an error nobody has seen
        #: the archive tier (an object-store run), when `archive` is given
        self.archive: ObjectRun | None = None
        self._archiver: Archiver | None = None
        self._open(os.fspath(directory), None if archive is not None else storage_options)
        if archive is not None:
            self._open_archive(archive, archive_keep_last, archive_keep_every, storage_options)
        elif (archive_keep_last, archive_keep_every) != (None, None):
            raise ValueError("archive_keep_last and archive_keep_every need archive=")

    def _open(self, directory: str, storage_options: dict[str, Any] | None) -> None:
        """Take the run's place: here a local directory (made if missing)."""
        if storage_options is not None:
            raise ValueError("storage_options need archive= (or a run URL)")
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        # rotation (on commit threads) and cleanup (in save) both delete step directories
        self._delete_lock = threading.RLock()
        # saves, cleanup and rotation judge steps without signatures (trusting keys never
        # deletes a step); reads judge them as a trusting reader does: a state file is read
        # with the key only once its record's signature and its signed SHA-256 held
        self._records = StepRecords(self.directory, self._decrypt)
        self._read_records = (
            self._records
            if self._trusted is None
            else StepRecords(self.directory, self._decrypt, self._trusted)
        )

    def _open_archive(
        self,
        archive: str,
        keep_last: int | None,
        keep_every: int | None,
        storage_options: dict[str, Any] | None,
    ) -> None:
        self.archive = ObjectRun(archive, storage_options, decrypt=self._decrypt, trusted=self._trusted)
        self._archiver = Archiver(
            self.archive,
            keep_last=keep_last,
            keep_every=keep_every,
            local_steps=lambda: self._scan().complete(),
            on_archived=self._rotate,
        )
        if _archives_here() and self._scan().complete():  # steps an earlier process left unarchived
            self._archiver.kick()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r})"

    # -- reading the directory --------------------------------------------------------

    def _in_flight_steps(self) -> set[int]:
        with self._lock:
            return {j.step for j in self._jobs if not j.handle.done()}

    def statuses(self) -> list[StepStatus]:
        """Every step directory, complete or not, by step."""
        return self._read_records.scan().statuses

    def checkpoints(self) -> list[CheckpointInfo]:
        """The complete checkpoints, oldest first."""
        return self._read_records.scan().complete()

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint; directories that are not one are skipped with a warning."""
        scan = self._scan(self._read_records)
        local = self._newest_complete(scan.statuses, scan.busy, scan.foreign)
        archived = self._archived_if_readable(None if local is None else local.step)
        if archived and (local is None or archived[-1].step > local.step):
            return archived[-1]
        return local

    def _newest_complete(
        self, statuses: list[StepStatus], busy: set[int], foreign: Iterable[tuple[str, str]] = ()
    ) -> CheckpointInfo | None:
        """latest() of a run whose steps are `statuses`: the newest complete checkpoint (with
        trusted keys, the newest a trusted key signed).  Steps that are not one are skipped
        with a warning, but for those in flight (`busy`) and those kept for the objects later
        steps read (retained); so are the `foreign` entries (path, why) of the run directory."""
        for s in statuses:
            if s.info is None and s.step not in busy and not s.retained:
                warnings.warn(f"skipping {s.path}: {s.problem}", CheckpointWarning, stacklevel=3)
        for path, why in foreign:
            warnings.warn(f"skipping {path}: {why}", CheckpointWarning, stacklevel=3)
        done = [s.info for s in statuses if s.info is not None]
        return next(self._trusted_first(reversed(done)), None)

    def _store_options(self) -> dict[str, Any] | None:
        """The object store's client settings where steps may lie on one (the archive's)."""
        return self.archive.options if self.archive is not None else None

    def _archived(self) -> list[CheckpointInfo]:
        """The archive's complete steps, oldest first (none without an archive); with trusted
        keys only those a trusted key signed, the others skipped with a warning."""
        if self.archive is None:
            return []
        listed = self.archive.checkpoints()
        if self._archiver is not None:
            self._archiver.saw(c.step for c in listed)
        return list(reversed(list(self._trusted_first(reversed(listed)))))

    def _archived_if_readable(self, local_newest: int | None) -> list[CheckpointInfo]:
        """_archived(), or none with a warning when the archive cannot be listed (down, stalling
        or answering nonsense): a resume goes on from the local tier.  Unless the archive was
        seen (by this process) holding a step newer than `local_newest`, the local tier's
        newest complete step: resuming from an older one would fork the run, so that is a
        StorageError naming both steps."""
        try:
            return self._archived()
        except (CheckpointError, OSError) as e:
            assert self.archive is not None and self._archiver is not None
            known = self._archiver.known_newest()
            if known is not None and (local_newest is None or known > local_newest):
                raise StorageError(
                    f"the archive cannot be read ({e}) and was seen holding step {known}, newer than "
                    f"the local tier's newest ({local_newest}); not resuming from an older step",
                    path=self.archive.path,
                ) from e
            warnings.warn(
                f"the archive {self.archive.path} could not be checked ({e}); using the local tier "
                f"only (its newest complete step: {local_newest})",
                CheckpointWarning,
                stacklevel=3,
            )
            return []

    def _trusted_first(self, newest_first: Any) -> Iterator[CheckpointInfo]:
        """The checkpoints of `newest_first` whose commit record a trusted key signed (all of
        them when no key is trusted); each newer one that is not is skipped with a warning,
        as a damaged step is."""
        for info in newest_first:
            if self._trusted is not None:
                try:
                    self._check_trusted(info)
                except (CheckpointError, OSError) as e:
                    warnings.warn(f"skipping {info.path}: {e}", CheckpointWarning, stacklevel=3)
                    continue
            yield info

    def _check_trusted(self, info: CheckpointInfo) -> None:
        """Raise unless a trusted key signed the commit record of `info` (either tier)."""
        if is_url(info.path):
            assert self.archive is not None
            self.archive.trusted_record(info.step)
            return
        with self._step_dir(info) as d:
            recordsign.read_trusted(d, self._trusted)

    @contextlib.contextmanager
    def _step_dir(self, info: CheckpointInfo) -> Iterator[CheckpointDir]:
        """Step directory `info`, opened beneath the run directory without following a link."""
        with CheckpointDir.open(self.directory) as run, run.sub(os.path.basename(info.path)) as d:
            yield d

    def _find(self, step: int | None) -> list[CheckpointInfo]:
        """The checkpoint of `step`, or every complete one newest first when step is None."""
        statuses = self.statuses()
        local_newest = max((s.step for s in statuses if s.info is not None), default=None)
        archived = {c.step: c for c in self._archived_if_readable(local_newest)}
        if step is None:
            local = {
                info.step: info
                for info in self._trusted_first(s.info for s in reversed(statuses) if s.info is not None)
            }
            # newest first; a step in both tiers: the local copy, then the archived one
            found = [
                info
                for st in sorted(set(local) | set(archived), reverse=True)
                for info in (local.get(st), archived.get(st))
                if info is not None
            ]
            if not found:
                raise CheckpointError(f"no complete checkpoint in {self.directory}")
            return found
        for s in statuses:
            if s.step == step:
                if s.info is None:
                    if step in archived:
                        return [archived[step]]
                    raise s.error(f"step {step} is not a complete checkpoint: {s.problem}", path=s.path)
                return [s.info] + ([archived[step]] if step in archived else [])
        if step in archived:
            return [archived[step]]
        raise CheckpointError(f"no checkpoint of step {step} in {self.directory}")

    # -- saving -----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: dict[str, float] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> inflight.SaveHandle | None:
        """Save `state` as checkpoint `step`; objects with state_dict() are saved as their state dicts.

        Blocking (the default): returns once the checkpoint is committed.
        Non-blocking: returns a SaveHandle after the snapshot; the commit follows
        in the background, in the order of the save calls.
        """
        metrics, meta = self._check_save(step, metrics, metadata)
        scan = self._scan()  # every decision before the step directory exists reads this one
        self._check_step_is_new(step, scan)
        if is_sharded_save(state):  # every rank saves its shard; the step commits like any other
            from . import sharded

            return sharded.save_step(self, step, state, metrics, meta, scan)
        from .rng import capture_rng

        payload = resume.build_payload(state, step, capture_rng())
        self._cleanup(scan)
        if self.incremental:
            self._wait_all()  # the next file refers to the previous one: it must be committed
            if scan.busy:
                scan = self._scan()  # those saves have committed (or failed) since the scan
        path, lock_fd = self._make_step_dir(step, scan)
        job = StepJob(step, path, lock_fd, metrics, meta, inflight.SaveHandle(path))
        job.base = _newest_state_file(scan) if self.incremental else None
        try:
            job.file_handle = self._write_state(job, payload)
        except BaseException:
            self._abandon(job)
            raise
        return self._commit_when_written(job)

    def _check_save(
        self, step: int, metrics: dict[str, float] | None, metadata: dict[str, str] | None
    ) -> tuple[dict[str, float], dict[str, str]]:
        """save()'s arguments checked (metrics and metadata as plain dicts), after raising the
        error of an earlier save nobody has seen fail."""
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must be an int from 0 to {MAX_STEP}, not {step!r}")
        checked = check_metrics(metrics), writer.check_save_args(None, None, metadata)
        self._raise_failed()
        return checked

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
        with self._lock:
            before = self._jobs[-1].thread if self._jobs else None
            self._jobs.append(job)
            job.thread = threading.Thread(
                target=self._finish, args=(job, before), name=f"ckptfmt-commit-{job.step}", daemon=False
            )
            job.thread.start()
        return job.handle

    def _scan(self, records: StepRecords | None = None) -> RunScan:
        """One scan of the run directory, with the steps this manager had in flight before it
        began (a step in flight is not yet complete, and never a leftover to remove);
        `records`: the reads' records (default the saves', which never consider signatures)."""
        busy = self._in_flight_steps()
        scan = (records or self._records).scan()
        scan.busy = busy
        return scan

    def _check_step_is_new(self, step: int, scan: RunScan) -> None:
        newest = max([c.step for c in scan.complete()] + list(scan.busy), default=None)
        if newest is not None and step <= newest:
            raise ValueError(
                f"step {step} is not after the newest checkpoint (step {newest}) in {self.directory}; "
                "if the run was resumed from an earlier step, remove the later ones first "
                "(CheckpointManager.remove(step))"
            )

    def _make_step_dir(self, step: int, scan: RunScan | None = None) -> tuple[str, int]:
        """Create the step directory already locked: made under a temporary name (owned as
        every temp name is, engine.commit), then renamed; `scan`: the save's scan."""
        name = step_dirname(step)
        final = os.path.join(self.directory, name)
        with CheckpointDir.open(self.directory) as run:
            found = run.lstat(name)
            if found is not None and stat.S_ISDIR(found.st_mode):
                if locks.is_locked(final):
                    raise CheckpointError(f"{final} is being written by another process")
                scan = scan or self._scan()
                if any(s.step == step and not s.ours for s in scan.statuses):
                    raise UnsupportedError(
                        "a folder ckptfmt did not make (no commit record, no mark) has this step's "
                        "name: it is never deleted nor written into; move it away to save this step",
                        path=final,
                    )
                self._delete_step(final, keep=scan.referenced())
            elif found is not None:  # a link or a file squatting on the name: removed as a name
                run.unlink(name)
            tmp, _ = commit.new_temp(run, name, run.mkdir)
            try:
                sub = run.sub(tmp)
                try:
                    marks.put_mark(sub, "ckptfmt.CheckpointManager")  # before it has its name
                    if (
                        locks.try_lock(sub.fd) is False
                    ):  # another process's cleanup is probing it this instant
                        fcntl.flock(sub.fd, fcntl.LOCK_EX)  # probes let go at once
                    run.rename(tmp, name)
                    run.fsync()
                except BaseException:
                    sub.close()
                    run.remove_tree(tmp)
                    raise
            finally:
                commit.disown(tmp)
        return final, sub.fd

    def _write_state(self, job: StepJob, payload: dict[str, Any]) -> Any:
        return self._save_state(payload, os.path.join(job.path, STATE_NAME), job.base, within=held(job))

    def _save_state(
        self,
        payload: dict[str, Any],
        target: str,
        base: str | None,
        *,
        within: CheckpointDir | None = None,
        storage_options: dict[str, Any] | None = None,
        create_only: bool = False,
    ) -> Any:
        """Write a step's state file `target` as this run saves them; an incremental run's
        refers to the chunks of `base` (the newest complete step's state file, or None).
        `within`: the locked step directory it is written beneath; `storage_options`: the
        client's settings where `target` lies on an object store; `create_only`: an object
        created only if absent (ObjectExistsError otherwise)."""
        if self.incremental:
            from ..files import incremental

            return incremental.save(
                payload,
                target,
                base=base,
                compression=self.compression,
                blocking=self.blocking,
                min_reference_bytes=incremental.MIN_REFERENCE_BYTES,
                within=within,
                storage_options=storage_options,
                encrypt_with=self._encrypt,
                decrypt_with=self._decrypt,
                _create_only=create_only,
            )
        return writer.save(
            payload,
            target,
            compression=self.compression,
            blocking=self.blocking,
            snapshot=self.snapshot,
            storage_options=storage_options,
            encrypt_with=self._encrypt,
            _within=within,
            _create_only=create_only,
        )

    def _finish(self, job: StepJob, before: threading.Thread | None) -> None:
        """Wait for the files, write the commit record, rotate; report through job.handle."""
        exc: BaseException | None = None
        record: multifile.CommitRecord | None = None
        try:
            if before is not None:
                before.join()  # commits happen in the order of the saves
            if job.file_handle is not None:
                job.file_handle.wait()
            if job.layout == "state":  # a save of several ranks: DCP's coordinator wrote it
                record = self._commit(job)
        except BaseException as e:
            exc = e
        try:
            if not job.coordinator:
                pass  # another rank holds the step directory, and rotates or removes it
            elif exc is None:
                job.handle._durable_now(self._step_bytes(job, record))
                if self._archiver is not None:
                    self._archiver.kick()
                self._rotate()
                self._log_commit(job)
            else:
                self._abandon(job)
        except (OSError, CheckpointError) as e:
            warnings.warn(f"rotation in {self.directory} failed: {e}", CheckpointWarning, stacklevel=2)
        finally:
            if job.lock_fd >= 0:
                os.close(job.lock_fd)
                job.lock_fd = -1
            with self._lock:
                if exc is None and job in self._jobs:
                    self._jobs.remove(job)
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
        wrote, else (DCP's coordinator wrote it) read back; 0 on a rank that does not hold the
        step directory."""
        if record is None and job.lock_fd >= 0:
            record = multifile.read_commit(held(job))
        return 0 if record is None else sum(p.length for p in record.files)

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
        for a step this manager did not save lately."""
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
                rels = [ext.rel for ext in f.externals]
            refs = tuple(multifile.describe_in(d, rel) for rel in rels)
        record = multifile.CommitRecord(job.step, "state", parts, refs, job.metrics, job.metadata)
        if self._sign_key is not None:
            recordsign.write_signed(d, record, self._sign_key)
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
        with self._lock:
            threads = [j.thread for j in self._jobs if j.thread is not None]
        for t in threads:
            t.join()

    def wait(self) -> None:
        """Wait for every save in flight (and for the archive copies of the saves made); raise
        the first error of a save nobody has seen fail.  A failed archive copy is not raised:
        it is warned about, kept locally and tried again (see archive_failures())."""
        self._wait_all()
        if self._archiver is not None:
            self._archiver.wait()
        self._raise_failed()

    def archive_failures(self) -> dict[int, str]:
        """Steps whose copy to the archive failed last time, and why (empty without an archive)."""
        return self._archiver.failures() if self._archiver is not None else {}

    # -- rotation and cleanup ---------------------------------------------------------------

    def _rotate(self) -> None:
        """Rotation after a commit: it scans the directory afresh, as the commit (on a commit
        thread for non-blocking saves) has changed it since the save's scan."""
        with self._delete_lock:
            self._rotate_locked(self._scan())

    def _rotate_locked(self, scan: RunScan) -> None:
        done = scan.complete()
        kept = retention.kept_steps(
            [(c.step, c.metrics) for c in done],
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            keep_best=self.keep_best,
            best_mode=self.best_mode,
        )
        if self._archiver is not None:  # not yet safe in the archive: kept here until it is
            kept |= self._archiver.keeps_locally(c.step for c in done)
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

    def remove(self, step: int) -> None:
        """Delete checkpoint `step` (files that other checkpoints refer to are kept)."""
        self._wait_all()
        scan = self._scan()
        for s in scan.statuses:
            if s.step == step:
                if s.info is not None:
                    others = {r for c in scan.complete() if c.step != step for r in c.references}
                    self._retire(s.path, others)
                else:
                    self._delete_step(s.path, scan.referenced())
                return
        raise CheckpointError(f"no checkpoint of step {step} in {self.directory}")

    # -- loading ----------------------------------------------------------------------------------

    def _first_that_loads(self, step: int | None, fallback: bool, attempt: Any) -> tuple[Any, list[str]]:
        """attempt(info) on checkpoint `step`, or newest first when step is None; with fallback,
        a checkpoint whose files turn out damaged is skipped with a warning (a mismatch with
        the caller's objects is never a reason to go back)."""
        skipped: list[str] = []
        found = self._find(step)
        for i, info in enumerate(found):
            try:
                return attempt(info), skipped
            except MismatchError:
                raise
            except Exception as e:  # with fallback, a step that fails for any reason is skipped
                if i + 1 < len(found) and found[i + 1].step == info.step:  # its archived copy
                    warnings.warn(
                        f"step {info.step} in {self.directory} does not load ({e}); reading the archived copy",
                        CheckpointWarning,
                        stacklevel=3,
                    )
                    continue
                if not fallback or step is not None:
                    raise
                warnings.warn(f"skipping step {info.step}: {e}", CheckpointWarning, stacklevel=3)
                skipped.append(f"step {info.step}: {e}")
        raise CheckpointError(f"no checkpoint in {self.directory} loads: {'; '.join(skipped)[:2000]}")

    @pausing_in_main_thread
    def load(self, step: int | None = None, map_location: Any = None, *, fallback: bool = False) -> Any:
        """The state saved at `step` (the newest complete one when None); stateful objects come
        back as their state dicts.  fallback=True: when the newest checkpoint fails to load
        (damaged files), warn and try the next older one."""
        return self._first_that_loads(step, fallback, lambda info: self._load_one(info, map_location))[0]

    def _load_one(self, info: CheckpointInfo, map_location: Any) -> Any:
        if info.layout == "dcp":  # saved by several ranks: assembled here with full tensors
            from . import sharded

            return sharded.load_step(info, self._trusted, self._store_options(), self._decrypt)
        devices.check_map_location(map_location)
        with self._state_file(info) as f:
            payload = f.load_subtree(f.tree.root, map_location, True)
        if not isinstance(payload, dict) or "state" not in payload:
            raise CorruptError("not a checkpoint manager's state file", path=info.state_path)
        return payload["state"]

    @contextlib.contextmanager
    def _state_file(self, info: CheckpointInfo) -> Iterator[CheckpointFile]:
        """The state file of step `info`, as its commit record names it: the step directory and
        the file are opened without following a link, checked (check_step), and read through
        the descriptor that was checked; every file it reads chunks from is one the record names.
        With trusted keys the record must be signed by one and equal the one checked, and every
        file it names is hashed against it first."""
        if is_url(info.path):  # the archived copy: opened and checked against its record
            assert self.archive is not None
            with self.archive.open_part(info) as remote:
                yield remote
            return
        inflight.wait_for_path(info.state_path)
        with self._step_dir(info) as d:
            record = self._read_records.record(d, info.step)  # check_step: the references and the root too
            part = record.files[0]
            if self._trusted is None:
                fd = multifile.open_part(d, part, d.path)
            else:
                signed = recordsign.read_trusted(d, self._trusted)
                if signed != record:
                    raise SignatureError("the commit record changed while it was read", path=d.path)
                recordsign.check_files(d, signed.references, d.path)
                fd = recordsign.open_trusted_part(d, signed.files[0], d.path)
            with CheckpointFile(d.path_of(part.name), fd=fd, within=d, decrypt_with=self._decrypt) as f:
                yield f

    def load_into(
        self,
        state: Any,
        step: int | None = None,
        strict: bool = True,
        *,
        fallback: bool = False,
        restore_rng: bool = True,
    ) -> resume.ResumeReport:
        """Resume: fill `state` (modules, optimizers, schedulers, scalers, data loaders, tensors and
        plain values) from checkpoint `step` (the newest complete one when None), then restore
        every RNG.  Differences from the saved run are returned and warned about once; with
        strict=True, architecture, shape and key differences raise MismatchError first."""
        report, skipped = self._first_that_loads(
            step, fallback, lambda info: self._load_into_one(info, state, strict, restore_rng)
        )
        report.skipped = skipped
        return report

    def _load_into_one(
        self, info: CheckpointInfo, state: Any, strict: bool, restore_rng: bool
    ) -> resume.ResumeReport:
        if info.layout == "dcp":  # saved by several ranks: loaded into this run's sharding
            from . import sharded

            return sharded.load_step_into(
                info, state, restore_rng, self._trusted, self._store_options(), self._decrypt
            )
        with self._state_file(info) as f:
            root = resume.node_items(f, f.tree.root)  # its entries: check_step
            fp, rng_state = resume_entries(f)
            differences = resume.check_resume(f, fp, rng_state, state, strict)
            resume.check_target(f, root["state"], state, strict, fp)  # before anything is filled
            report = resume.ResumeReport(step=info.step, path=info.path, differences=differences)
            # every chunk of the state is checked before any of the caller's objects is
            # filled, so a damaged checkpoint leaves them all as they were
            inplace.verify_subtree(f, root["state"])
            resume.restore_into(f, root["state"], state, "", report, strict=strict, verify=True, atomic=False)
        if restore_rng and rng_state is not None:
            from .rng import restore_rng as restore

            restore(rng_state)
            report.rng_restored = True
        if differences:
            warnings.warn(
                f"{info.path}: resuming with {len(differences)} difference(s) from the saved run: "
                + "; ".join(differences[:3])
                + (" ..." if len(differences) > 3 else ""),
                CheckpointWarning,
                stacklevel=3,
            )
        return report

    # -- verifying -------------------------------------------------------------------------------

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check every file of checkpoint `step` (the newest complete one when None)."""
        info = self._find(step)[0]
        if is_url(info.path):  # only the archive holds it
            assert self.archive is not None
            return self.archive.verify_step(info)
        return verify_in_run(
            self.directory, os.path.basename(info.path), info.step, self._trusted, self._decrypt
        )


def _archives_here() -> bool:
    """Whether this process copies steps to the archive: in a job of several ranks, rank 0
    only (it holds each step directory while saving, and rotates); the others read it."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def _newest_state_file(scan: RunScan) -> str | None:
    """The state file an incremental save may refer to: the newest complete one."""
    done = scan.complete()
    return done[-1].state_path if done else None


def is_sharded_save(state: Any) -> bool:
    """Save through DCP (ckptfmt.dcp, a file per rank): a process group is initialised and it
    runs several ranks, or `state` holds DTensors or sharded tensors (FSDP2 at world size 1),
    which one state file cannot hold.  Checked without importing torch.distributed."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    if dist.get_world_size() > 1:
        return True
    from .sharded import holds_distributed_tensors

    return holds_distributed_tensors(state)


def check_metrics(metrics: dict[str, float] | None) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError("metrics must be a dict of str to int or float")
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if hasattr(v, "item") and callable(v.item):  # a 0-d tensor or numpy scalar
            v = v.item()
        if type(k) is not str or type(v) not in (int, float):
            raise TypeError(f"metrics must map str to int or float; {k!r} maps to {type(v).__name__}")
        out[k] = v
    return out
