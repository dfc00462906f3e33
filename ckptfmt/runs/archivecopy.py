"""An archive copy: a complete local step copied into a run on an object store (spec 13.7).

Every file is uploaded only if absent and verified after upload, the commit record last and
only if absent, each object after a copy marker (objectnames.copy_marker) in its step's
prefix.  A copy that finds the step's prefix holding objects already (what a copy cut short
left, another archiver's copy under way) writes the step's files under names of its own
(files/names.py: ``state.<h>.ckpt``, ``rank-NNNNN.<h>.ckpt``) and uploads a record naming
those: it never relies on an object of the step it did not write (but one a later step's
committed record refers to, which every cleanup keeps: the archive copies the newest step
first), so a cleaner that deletes only the versions it listed
(ObjectRun.remove_interrupted_copies) never deletes what a live copy's record names.  Once
committed, it sweeps what its record does not name (ObjectRun.sweep_step).  A signed record
cannot be rewritten without its key: a signed step's files keep their names, and one found
there is used when it is the very file.

The objects of earlier steps an incremental step refers to keep the names its files' own
indexes give them (section 12); one found there is used when it is the very file, looked
for only once the copy's marker is in that step's prefix and no sweep of it that began
before is still at work (ObjectRun.wait_out_sweeps): no sweep deletes it after that.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable

from ..engine.ckptdir import CheckpointDir
from ..errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptError,
    LimitError,
    ObjectExistsError,
    UnsupportedError,
)
from ..files import multifile, recordsign
from ..files.names import save_token, with_token
from ..files.places import describe_object, holds_file
from ..files.reader import CheckpointFile
from ..files.verify import verify
from ..storage import listing
from ..storage.download import head
from ..storage.upload import upload_bytes, upload_file
from ..storage.urls import ObjectURL, parse_url
from .objectnames import StoreStamp, claiming, referenced_step
from .objectrun import ObjectRun
from .steps import CheckpointInfo
from .writeanswer import store_answered


def put_step(
    run: ObjectRun,
    step: int,
    local: str,
    *,
    claim: str | None = None,
    before_commit: Callable[[multifile.CommitRecord], None] | None = None,
) -> CheckpointInfo:
    """Copy the complete local step directory `local` into `run` as step `step`: each file
    it names, verified after upload, then its commit record, uploaded only if absent.  A step
    already there with the same files (by identity) and references is left as it is; one with
    others is an error.  The objects of earlier steps an incremental step reads from are
    uploaded first where the archive does not hold them yet (without their records: they are
    kept for this one).  `claim`: a copy marker name (copy_marker()) put into each step prefix
    before anything is written there, deleted once the commit record is in (None: no
    marker, for an archive no cleaner or other copy works on meanwhile);
    `before_commit(record)`: runs once every file is uploaded and verified, right before the
    commit record (`record`, naming the files as uploaded) goes up."""
    copy = _Copy(run, step, claim)
    with claiming(claim), CheckpointDir.open(local) as d:
        record = multifile.check_complete(d)
        existing = _existing(run, step)
        if existing is not None:
            if not _same_save(existing, record):
                raise CheckpointError(f"{run.step_path(step)} holds another save of step {step}")
            return _complete_info(run, step)
        for ref in record.references:
            _put_reference(run, d, ref, copy.claim_prefix)
        copy.claim_prefix(step)
        try:
            archived = copy.put_files(d, record)
            if before_commit is not None:
                before_commit(archived)
            record_size = copy.commit(d, record, archived)
        except BaseException:
            copy.withdraw()
            raise
        copy.release_marker()
    copy.sweep(archived)
    # every file was verified after its upload: the step is complete without a listing
    return run.info_of(step, archived, record_size)


class _Copy:
    """One copy of a step: the markers it put, the names it gives the step's files."""

    def __init__(self, run: ObjectRun, step: int, claim: str | None) -> None:
        self.run = run
        self.step = step
        self.claim = claim
        self.url = run.step_place(step).url
        self.claimed: list[ObjectURL] = []
        self.token: str | None = None  # the copy's own digits (save_token) once it needs them
        self.uploaded: dict[str, str] = {}  # objects of names of its own it uploaded: version
        self.kept: frozenset[str] = frozenset()  # files of the step later steps' committed records name
        self.record_unknown = False  # the record's write was sent and got no answer: it may land

    def claim_prefix(self, of: int) -> StoreStamp | None:
        """Put this copy's marker into step `of`'s prefix, once: the store's clock as it
        proves it where it was put now (None where not)."""
        url = self.run.step_place(of).url.child(self.claim) if self.claim is not None else None
        if url is None or self.claim is None or url in self.claimed:
            return None
        upload_bytes(b"a ckptfmt archive copy in progress\n", str(url), self.run.options)
        stamp = StoreStamp(self.claim, time.monotonic())
        self.claimed.append(url)
        return stamp

    def put_files(self, d: CheckpointDir, record: multifile.CommitRecord) -> multifile.CommitRecord:
        """Upload the step's files; `record` naming them as uploaded.  Names of the copy's
        own where the prefix holds anything but its marker (listed after the marker went in,
        so of two copies at least one sees the other's), or where an upload finds its name
        taken, unless the record is signed (it cannot be rewritten)."""
        signed = any(p.sha256 is not None for p in record.files)
        listed = listing.listed(self.url, self.run.options)
        there = set(listed) - {self.claim}
        if not signed and there:
            self.token = save_token()
            # a file a later step's committed record refers to (copied first, the archive
            # lagging) is kept for it by every cleanup: used when it is this very file
            try:
                self.kept = self.run.read_by_later_steps(self.step) & there
            except LimitError:  # too many later records to read: a copy of its own instead
                self.kept = frozenset()
        files = tuple(self._put_file(d, part, signed) for part in record.files)
        return dataclasses.replace(record, files=files)

    def _put_file(self, d: CheckpointDir, part: multifile.PartRecord, signed: bool) -> multifile.PartRecord:
        """Upload one file of the step, verified after upload; the file's part as uploaded.
        An object already there is never replaced, nor used unless it is this very file
        (checked as an upload is) and the record is signed (what a copy cut short left) or
        a later step's committed record refers to it."""
        if part.name in self.kept and holds_file(self._url_of(part.name), self.run.options, part):
            name = part.name
        else:
            name = self._upload_part(d, part, signed)
        url = self._url_of(name)
        report = verify(url, storage_options=self.run.options, decrypt_with=self.run.decrypt)
        if not report.ok:
            raise CorruptError(f"the uploaded copy fails verification: {report.problems[0]}", path=url)
        with CheckpointFile(url, storage_options=self.run.options, decrypt_with=self.run.decrypt) as f:
            found = multifile.identity_of(f, part.name)
        multifile.check_identity(found, part, part.name, url)
        return dataclasses.replace(part, name=name)

    def _upload_part(self, d: CheckpointDir, part: multifile.PartRecord, signed: bool) -> str:
        """Upload the local file `part`, created only if absent; its name there.  A name found
        taken: the copy's own name for it, or for a signed record the object there when it is
        this very file."""
        fd = multifile.open_part(d, part, d.path)
        try:
            try:
                return self._upload(fd, part)
            except ObjectExistsError:
                if self.token is not None or not signed:  # taken meanwhile: under a name of its own
                    self.token = self.token or save_token()
                    return self._upload(fd, part)
                if holds_file(self._url_of(part.name), self.run.options, part):
                    return part.name
                raise
        finally:
            os.close(fd)

    def _upload(self, fd: int, part: multifile.PartRecord) -> str:
        """Upload the local file `fd` (`part`) under its name, or the copy's own name for it
        once the copy has its digits; the name."""
        name = part.name
        if self.token is not None:
            own = with_token(part.name, self.token)
            if own is None:
                raise UnsupportedError(
                    f"{part.name} is no state or rank file: it takes no name of a copy's own",
                    path=self.run.step_path(self.step),
                )
            name = own
        url = self._url_of(name)
        upload_file(fd, url, self.run.options, if_absent=True)
        if self.token is not None:  # its version, for a failed copy to delete only it
            self.uploaded[name] = head(parse_url(url), self.run.options)[1]
        return name

    def _url_of(self, name: str) -> str:
        return f"{self.run.step_path(self.step)}/{name}"

    def commit(
        self, d: CheckpointDir, record: multifile.CommitRecord, archived: multifile.CommitRecord
    ) -> int:
        """Upload the commit record, only if absent: the local one's bytes where the files kept
        their names, else `archived` written afresh (its `created` kept: the archiver knows
        a step by it); the record's size."""
        url = self._url_of(multifile.COMMIT_NAME)
        try:
            if archived == record:
                fd = d.open_file(multifile.COMMIT_NAME)
                try:
                    return upload_file(fd, url, self.run.options, if_absent=True)
                finally:
                    os.close(fd)
            self.run.step_place(self.step).write_record(archived)
        except FileExistsError:  # another copy's record: this one's never landed
            raise
        except BaseException as e:  # without the store's answer the record may land yet
            self.record_unknown = not store_answered(e)
            raise
        return head(parse_url(url), self.run.options)[0]

    def withdraw(self) -> None:
        """After a failure: delete what this copy uploaded under names of its own, each by its
        version, unless the step's record names it (ObjectRun.delete_uncommitted); anything
        left goes with the step's cleanup.  Nothing goes where the record's write got no
        answer: it may land yet, naming them."""
        if self.record_unknown:
            return
        for name, version in self.uploaded.items():
            try:
                self.run.delete_uncommitted(self.step, name, version)
            except (CheckpointError, OSError):  # the copy's own failure is the one to report
                pass

    def release_marker(self) -> None:
        """Delete the step's own marker now its record is in; those in the prefixes of objects
        it refers to stay, so that once no step refers to them they are known as ours
        (remove_interrupted_copies)."""
        own = self.url.child(self.claim) if self.claim is not None else None
        if own is not None and own in self.claimed:
            listing.delete_object(own, self.run.options)

    def sweep(self, archived: multifile.CommitRecord) -> None:
        """Once committed under names of its own: delete what other copies left in the step
        and its record does not name (ObjectRun.sweep_step, which keeps what later steps'
        records refer to, read again after its marker is in),
        unless a live writer's marker is there (it may be uploading an object of this step a
        later step refers to; what is left then goes with the next archive pass's
        remove_interrupted_copies, once that marker is dead).  A failure is warned about: the
        step is complete."""
        if self.token is None:
            return
        try:
            self.run.sweep_step(self.step, archived)
        except (CheckpointError, OSError) as e:
            warnings.warn(
                f"step {self.step} archived to {self.run.path}; removing what other copies left "
                f"there failed (removed once the step is): {e}",
                CheckpointWarning,
                stacklevel=2,
            )


def _same_save(a: multifile.CommitRecord, b: multifile.CommitRecord) -> bool:
    """Whether two records of a step commit the same files (by identity: an archive copy may
    name them as its own) and references."""
    return a.references == b.references and [dataclasses.replace(p, name="") for p in a.files] == [
        dataclasses.replace(p, name="") for p in b.files
    ]


def _existing(run: ObjectRun, step: int) -> multifile.CommitRecord | None:
    try:
        return run.record(step)
    except FileNotFoundError:
        return None


def _complete_info(run: ObjectRun, step: int) -> CheckpointInfo:
    found = run.listing()
    status = run.status_of(step, found.get(step, {}), found)
    if status.info is None:
        raise status.error(f"step {step} is not complete in the archive: {status.problem}", path=status.path)
    return status.info


def _put_reference(
    run: ObjectRun,
    d: CheckpointDir,
    ref: multifile.PartRecord,
    claim: Callable[[int], StoreStamp | None],
) -> None:
    """Make sure the archive holds the object reference `ref` of local step `d` names (the
    same file: length, file id, index checksum, and the signed record's SHA-256 where it
    gives one), uploading it if absent.  Its chunks are verified through the step that reads
    them, once that is uploaded."""
    # the marker first, found or not: a sweep of that step (a copy of it committing, an
    # archive pass) that lists after it keeps away while this copy may commit a record naming
    # the object; one that listed before it is waited out before anything there is looked at
    step = referenced_step(ref.name, run.path)[0]
    stamp = claim(step)
    if stamp is not None:
        run.wait_out_sweeps(step, stamp)
    url = run.reference_url(ref.name)
    try:
        found = describe_object(url, run.options, ref.name)[0]  # never its index
    except FileNotFoundError:
        fd = multifile.open_part(d, ref, d.path)
        try:
            upload_file(fd, url, run.options, if_absent=True)
            return
        except ObjectExistsError:  # another archiver's copy meanwhile: checked as found
            found = describe_object(url, run.options, ref.name)[0]
        finally:
            os.close(fd)
    multifile.check_identity(found, dataclasses.replace(ref, sha256=None), ref.name, url)
    if ref.sha256 is not None:  # a signed step: the very bytes its record vouches for
        recordsign.check_object(url, ref, run.options, None)
