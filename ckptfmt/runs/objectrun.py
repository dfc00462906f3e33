"""A run directory on an object store: the layout of a local run (``step-N/`` holding the
state file and, written last, ``COMMIT``) read and written through ckptfmt.storage.

It serves as the archive tier of a local CheckpointManager (steps copied there once
committed, each file verified after upload, the commit record uploaded last and only if
absent) and as the store behind ``CheckpointManager("s3://bucket/run")``.  A step is
complete exactly as on disk: its commit record verifies and names files that are there
with the recorded length, file id and index checksum.  Everything listed or read is hostile
input: step names are parsed as on disk, a listing naming keys outside the run is refused,
and records are bounded before they are decoded.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from ..engine.ckptdir import CheckpointDir
from ..errors import CheckpointError, CorruptError, IncompleteError, UnsupportedError
from ..files import multifile
from ..files.places import STALE_AFTER, ObjectPlace
from ..files.reader import CheckpointFile
from ..files.verify import verify
from ..format.timestamps import parse_utc
from ..storage import listing
from ..storage.client import check_options
from ..storage.upload import upload_file
from ..storage.urls import ObjectURL, parse_url
from .steps import STATE_NAME, CheckpointInfo, StepStatus, parse_step_dirname, step_dirname


class ObjectRun:
    """The steps of a run kept under an object-store prefix."""

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, *, decrypt: Any = None
    ) -> None:
        """`decrypt`: the key of an encrypted run's state files (they are read with it)."""
        self.url: ObjectURL = parse_url(url, need_key=False)
        self.decrypt = decrypt
        self.path = str(self.url).rstrip("/")
        self.options = check_options(storage_options)

    def __repr__(self) -> str:
        return f"ObjectRun({self.path!r})"

    def step_path(self, step: int) -> str:
        return f"{self.path}/{step_dirname(step)}"

    def _step_url(self, step: int) -> ObjectURL:
        return self.url.child(step_dirname(step))

    def _place(self, step: int) -> ObjectPlace:
        """Step `step` as the place of a multi-file checkpoint (files/places.py)."""
        return ObjectPlace(self._step_url(step), self.options)

    # -- reading -------------------------------------------------------------------------

    def _listing(self) -> dict[int, dict[str, tuple[int, datetime.datetime | None]]]:
        """The run's objects by step: {step: {name in the step: (size, last written)}}."""
        out: dict[int, dict[str, tuple[int, datetime.datetime | None]]] = {}
        for key, entry in listing.objects(self.url, self.options).items():
            top, _, name = key.partition("/")
            step = parse_step_dirname(top)
            if step is not None and name:
                out.setdefault(step, {})[name] = entry
        return out

    def statuses(self) -> list[StepStatus]:
        """Every step under the prefix, complete or not, by step."""
        out = []
        for step, names in sorted(self._listing().items()):
            out.append(self._status(step, names))
        return out

    def checkpoints(self) -> list[CheckpointInfo]:
        """The complete steps, oldest first."""
        return [s.info for s in self.statuses() if s.info is not None]

    def _status(self, step: int, names: dict[str, tuple[int, datetime.datetime | None]]) -> StepStatus:
        path = self.step_path(step)
        if multifile.COMMIT_NAME not in names:
            return StepStatus(
                step, path, problem="no commit record: the save did not finish", error=IncompleteError
            )
        try:
            return StepStatus(step, path, info=self._info(step, names))
        except CheckpointError as e:
            return StepStatus(step, path, problem=e.reason, damaged=True, error=type(e))
        except FileNotFoundError as e:  # deleted between the listing and the read
            return StepStatus(step, path, problem=f"{e.filename} vanished", error=IncompleteError)

    def record(self, step: int, size: int | None = None) -> multifile.CommitRecord:
        """Step `step`'s commit record, bounded by its size before it is decoded."""
        url = f"{self.step_path(step)}/{multifile.COMMIT_NAME}"
        record = self._place(step).record_sized(size)
        if record.step != step:
            raise CorruptError(f"the commit record is for step {record.step}, not {step}", path=url)
        if record.references:
            raise UnsupportedError(
                "a step that reads chunks of earlier steps (incremental) is not read from an object store",
                path=url,
            )
        return record

    def _info(self, step: int, names: dict[str, tuple[int, datetime.datetime | None]]) -> CheckpointInfo:
        record = self.record(step, names[multifile.COMMIT_NAME][0])
        path = self.step_path(step)
        for part in record.files:
            listed = names.get(part.name)
            if listed is None:
                raise IncompleteError(f"{part.name} named by the commit record is missing", path=path)
            if listed[0] != part.length:
                raise CorruptError(
                    f"{part.name} is {listed[0]} bytes, the commit record says {part.length}", path=path
                )
        return CheckpointInfo(
            step=step,
            path=path,
            metrics=dict(record.metrics),
            metadata=dict(record.metadata),
            size=sum(p.length for p in record.files) + names[multifile.COMMIT_NAME][0],
            created=parse_utc(record.created),
            files=tuple(f"{path}/{p.name}" for p in record.files),
            layout=record.layout,
        )

    def open_part(self, info: CheckpointInfo, name: str = STATE_NAME) -> CheckpointFile:
        """Part `name` of a complete step, opened and checked against its commit record (the
        open pins the object's ETag: what is checked is what is read)."""
        record = self.record(info.step)
        part = next((p for p in record.files if p.name == name), None)
        if part is None:
            raise CorruptError(f"the commit record names no {name}", path=info.path)
        return self._place(info.step).open_part(part, name, decrypt=self.decrypt)

    def verify_step(self, info: CheckpointInfo) -> list[str]:
        """Every file of a complete step verified chunk by chunk: the problems, one per line."""
        problems: list[str] = []
        for url in info.files:
            report = verify(url, storage_options=self.options, decrypt_with=self.decrypt)
            problems.extend(f"{url}: {p}" for p in report.problems)
        return problems

    # -- writing -------------------------------------------------------------------------

    def put_step(self, step: int, local: str) -> CheckpointInfo:
        """Copy the complete local step directory `local` here: each file it names, verified
        after upload, then its commit record, uploaded only if absent.  A step already here
        with the same record is left as it is; one with another record is an error."""
        with CheckpointDir.open(local) as d:
            record = multifile.check_complete(d)
            if record.references:
                raise UnsupportedError(
                    "an incremental step (it reads chunks of earlier steps) cannot be archived", path=local
                )
            existing = self._existing(step)
            if existing is not None:
                if existing.files != record.files:
                    raise CheckpointError(f"{self.step_path(step)} holds another save of step {step}")
                return self._complete_info(step)
            for part in record.files:
                self._put_file(d, part, f"{self.step_path(step)}/{part.name}")
            commit_fd = d.open_file(multifile.COMMIT_NAME)
            try:
                upload_file(
                    commit_fd, f"{self.step_path(step)}/{multifile.COMMIT_NAME}", self.options, if_absent=True
                )
            finally:
                os.close(commit_fd)
        return self._complete_info(step)

    def _existing(self, step: int) -> multifile.CommitRecord | None:
        try:
            return self.record(step)
        except FileNotFoundError:
            return None

    def _complete_info(self, step: int) -> CheckpointInfo:
        status = self._status(step, self._listing().get(step, {}))
        if status.info is None:
            raise status.error(
                f"step {step} is not complete in the archive: {status.problem}", path=status.path
            )
        return status.info

    def _put_file(self, d: CheckpointDir, part: multifile.PartRecord, url: str) -> None:
        fd = multifile.open_part(d, part, d.path)
        try:
            upload_file(fd, url, self.options)
        finally:
            os.close(fd)
        report = verify(url, storage_options=self.options, decrypt_with=self.decrypt)
        if not report.ok:
            raise CorruptError(f"the uploaded copy fails verification: {report.problems[0]}", path=url)
        with CheckpointFile(url, storage_options=self.options, decrypt_with=self.decrypt) as f:
            found = multifile.PartRecord(
                part.name, f.prologue.file_length, f.prologue.file_id, f.footer.index_checksum
            )
        multifile.check_identity(found, part, part.name, url)

    def delete_step(self, step: int) -> None:
        """Delete a step: its commit record first, so it stops being a checkpoint before its
        files go."""
        listing.delete_prefix(self._step_url(step), self.options, first=(multifile.COMMIT_NAME,))

    def cleanup(self, older_than: datetime.timedelta = STALE_AFTER) -> None:
        """Abort multipart uploads of crashed savers and delete commit-less steps whose newest
        object is older than `older_than` (a live saver writes more often than that)."""
        listing.abort_stale_uploads(self.url, self.options, older_than)
        now = datetime.datetime.now(datetime.timezone.utc)
        for step, names in self._listing().items():
            if multifile.COMMIT_NAME in names:
                continue
            times = [t for _, t in names.values() if t is not None]
            if times and now - max(times) > older_than:
                self.delete_step(step)
