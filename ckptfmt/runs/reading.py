"""The reading side of a checkpoint manager (CheckpointManager's base, runs/manager.py): the
run's steps as they are found in its directory and archive, the newest complete one, loads
and resumes from them with their fallbacks, and verifying them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from ..background import inflight
from ..engine.ckptdir import CheckpointDir
from ..errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptError,
    SignatureError,
    StorageError,
)
from ..fileio import is_url
from ..files import load_into as inplace
from ..files import multifile, recordsign
from ..files.reader import CheckpointFile
from ..files.targets import MismatchError
from ..files.verify import VerifyReport
from ..format import devices
from ..gcpause import pausing_in_main_thread
from . import resume
from .archiver import Archiver
from .objectrun import ObjectRun
from .scan import RunScan, StepRecords
from .stepcheck import resume_entries, verify_in_run
from .steps import (
    CheckpointInfo,
    StepJob,
    StepStatus,
)


class RunReading:
    """Finding, loading and verifying the steps of a run; its state is the manager's."""

    # set by CheckpointManager.__init__ (and _open, _open_archive)
    directory: str
    archive: ObjectRun | None
    _archiver: Archiver | None
    _trusted: Any
    _decrypt: Any
    _records: StepRecords
    _read_records: StepRecords
    _lock: threading.Lock
    _jobs: list[StepJob]

    def _scan(self, records: StepRecords | None = None) -> RunScan:
        """One scan of the run directory, with the steps this manager had in flight before it
        began (a step in flight is not yet complete, and never a leftover to remove);
        `records`: the reads' records (default the saves', which never consider signatures)."""
        busy = self._in_flight_steps()
        scan = (records or self._records).scan()
        scan.busy = busy
        return scan

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
        """The archive's complete steps a resume may go to, oldest first (none without an
        archive; ObjectRun.resumable); with trusted keys only those a trusted key signed, the
        others skipped with a warning."""
        if self.archive is None:
            return []
        listed = self.archive.resumable()
        if self._archiver is not None:
            self._archiver.saw(listed)
        return list(reversed(list(self._trusted_first(reversed(listed)))))

    def _archived_if_readable(self, local_newest: int | None) -> list[CheckpointInfo]:
        """_archived(), or none with a warning when the archive cannot be listed (down, stalling
        or answering nonsense): a resume goes on from the local tier.  Unless the archive was
        seen (by this process) holding a step newer than `local_newest`, the local tier's
        newest complete step: resuming from an older one would fork the run, so that is a
        StorageError naming both steps.  Where the local tier holds no complete step the
        store's failure is raised as it is: the archive may hold the run's steps, and a
        resume from nothing would fork it as surely (a new node's first resume)."""
        try:
            return self._archived()
        except (CheckpointError, OSError) as e:
            assert self.archive is not None and self._archiver is not None
            if local_newest is None and isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
                raise
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
            differences = resume.check_resume(fp, rng_state is not None, state, strict, f.path)
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
