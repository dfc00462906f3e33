"""CheckpointManager: a training run's directory of checkpoints, one per saved step.

Layout: ``<directory>/step-000001000/`` holds the step's state file (``state.ckpt``) and,
written last, its commit record (``COMMIT``, see multifile.py).  A step is complete exactly
when its commit record verifies and names files that are there unchanged; nothing else ever
counts as a checkpoint.  So:

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

import fcntl
import os
import stat
import threading
from typing import Any

from ..background import inflight
from ..engine import commit, marks
from ..engine.ckptdir import CheckpointDir
from ..errors import (
    CheckpointError,
    UnsupportedError,
)
from ..fileio import is_url
from ..files import encryption, recordsign
from ..files import save as writer
from . import locks, resume, retention
from .archiver import Archiver
from .objectrun import ObjectRun
from .scan import RunScan, StepRecords
from .stepcommit import StepCommits
from .steps import (
    MAX_STEP,
    STATE_NAME,
    CheckpointInfo,
    StepJob,
    held,
    step_dirname,
)
from .stepsave import StepOptions


class CheckpointManager(StepCommits):
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

        snapshot="fork" (non-blocking saves, see ckptfmt.save): the child writes each state file,
        encrypting it, or (incremental) writing only the chunks it does not find in the base; on
        an object store this process uploads what it wrote.  In a run of several ranks each
        rank forks when save() is called and its child writes that rank's file once DCP has
        planned the save (ckptfmt/dcp/forkstage.py)."""
        retention.check_rules(keep_last, keep_every, keep_best, best_mode)
        writer.check_save_args(compression, None, None)
        writer.check_snapshot(snapshot)
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
        self._encrypt, self._decrypt = encryption.run_keys(encrypt_with, decrypt_with, "a CheckpointManager")
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
        # how every signed commit record is written (with the key loaded once, at __init__)
        self._record_options = writer.save_options(sign_with=self._sign_key)
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

            return sharded.save_step(self._steps(), step, state, metrics, meta, scan)
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

    def _steps(self) -> RunSteps:
        """This run as a save of several ranks sees it (runs/stepsave.py)."""
        return RunSteps(self)

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
                snapshot=self.snapshot,
                min_reference_bytes=incremental.MIN_REFERENCE_BYTES,
                within=within,
                storage_options=storage_options,
                encrypt_with=self._encrypt,
                decrypt_with=self._decrypt,
                create_only=create_only,
            )
        options = writer.save_options(
            compression=self.compression,
            blocking=self.blocking,
            snapshot=self.snapshot,
            storage_options=storage_options,
            encrypt_with=self._encrypt,
        )
        return writer.save_file(payload, target, options, within=within, create_only=create_only)

    def wait(self) -> None:
        """Wait for every save in flight (and for the archive copies of the saves made); raise
        the first error of a save nobody has seen fail.  A failed archive copy is not raised:
        it is warned about, kept locally and tried again (see archive_failures()); an archive
        copy still running after an hour is (StorageError saying what it does, and the deadline)."""
        self._wait_all()
        if self._archiver is not None:
            self._archiver.wait()
        self._raise_failed()

    def archive_failures(self) -> dict[int, str]:
        """Steps whose copy to the archive failed last time, and why (empty without an archive)."""
        return self._archiver.failures() if self._archiver is not None else {}

    def remove(self, step: int) -> None:
        """Delete checkpoint `step` (files that other checkpoints refer to are kept); in a
        tiered run its archived copy too, so that neither tier resumes from it: the archived
        copy first, as an archive that fails must leave the step whole in both tiers (a local
        copy gone and an archived one kept is resumed from once the archive answers again)."""
        self._wait_all()
        removed = False
        if self._archiver is not None:
            self._archiver.wait()  # no copy reads the step while it goes; a stalled archive fails first
            removed = self._archiver.remove(step)
        removed = self._remove_local(step) or removed
        if not removed:
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory}")

    def _remove_local(self, step: int) -> bool:
        scan = self._scan()
        for s in scan.statuses:
            if s.step == step:
                if s.info is not None:
                    others = {r for c in scan.complete() if c.step != step for r in c.references}
                    self._retire(s.path, others)
                else:
                    self._delete_step(s.path, scan.referenced())
                return True
        return False


class RunSteps:
    """A local run's side of the step-saving protocol (runs/stepsave.py): the manager's own
    save machinery, lent to a save of several ranks."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager

    @property
    def directory(self) -> str:
        return self.manager.directory

    @property
    def options(self) -> StepOptions:
        m = self.manager
        return StepOptions(
            m.compression, m.blocking, m.incremental, m.snapshot, m._sign_key, m._encrypt, m._decrypt
        )

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return None

    def step_path(self, step: int) -> str:
        return os.path.join(self.manager.directory, step_dirname(step))

    def prepare_step(self, job: StepJob, scan: RunScan | None) -> list[CheckpointInfo]:
        m = self.manager
        # an incremental save has waited for the saves in flight: they are done since the scan
        now = m._scan() if scan is None or (m.incremental and scan.busy) else scan
        m._cleanup(now)
        job.path, job.lock_fd = m._make_step_dir(job.step, now)
        return now.complete()

    def wait_all(self) -> None:
        self.manager._wait_all()

    def commit_when_written(self, job: StepJob) -> inflight.SaveHandle | None:
        return self.manager._commit_when_written(job)

    def abandon(self, job: StepJob) -> None:
        self.manager._abandon(job)

    def committed(self) -> None:
        m = self.manager
        if m._archiver is not None:
            m._archiver.kick()
        m._rotate()

    def step_committed(self, job: StepJob) -> None:
        """Nothing: rank 0 made the step's directory afresh, so no other save left files in it."""

    def cost_known(self, job: StepJob) -> None:
        m = self.manager
        job.handle._durable_now(self.step_bytes(job))
        job.handle._finish(None)
        job.handle._returning(job.began)
        m._remember(job)

    def step_bytes(self, job: StepJob) -> int:
        """The bytes of the files of `job`'s step, by its record (DCP's coordinator wrote it);
        0 on a rank that does not hold the step directory."""
        return self.manager._step_bytes(job, None)


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
