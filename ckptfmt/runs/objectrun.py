"""A run directory on an object store: the layout of a local run (``step-N/`` holding the
state file and, written last, ``COMMIT``) read and written through ckptfmt.storage.

It serves as the archive tier of a local CheckpointManager (steps copied there once
committed by runs/archivecopy.py) and as the store behind ``CheckpointManager("s3://bucket/run")``.  A step is
complete exactly as on disk: its commit record verifies and names files that are there
with the recorded length, file id and index checksum.  Everything listed or read is hostile
input: step names are parsed as on disk, a listing naming keys outside the run is refused,
and records are bounded before they are decoded.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import (
    CheckpointError,
    IncompleteError,
    LimitError,
    StorageError,
)
from ..files import multifile
from ..files.names import is_own_name
from ..files.places import STALE_AFTER
from ..files.reader import CheckpointFile
from ..files.verify import VerifyReport
from ..format.timestamps import parse_utc
from ..storage import listing
from ..storage.client import check_options, deadline
from ..storage.download import head
from ..storage.upload import upload_bytes
from ..storage.urls import ObjectURL, parse_url
from . import leftovers, objectnames
from .objectnames import (
    CLOCK_DIR,
    SWEEP_DELETES_WITHIN,
    SWEEP_WAIT,
    ByStep,
    Entry,
    RunListing,
    StoreStamp,
    check_listed,
    claiming,
    has_live_marker,
    is_copy_marker,
    is_marker,
    is_sweep_marker,
    marker_dead,
    referenced_step,
    store_time_bound,
    sweep_marker,
    sweep_options,
    written_here,
)
from .stepcheck import verify_objects
from .stepplace import StepPlace
from .steps import (
    CheckpointInfo,
    StepStatus,
    listed_references,
    newest_unknown,
    newest_unread,
    parse_step_dirname,
    step_dirname,
)

#: the commit records latest() and a resume read at most, newest first (spec 13.7): each is a
#: GET, and a run whose newest steps are this many damaged ones needs a person anyway
MAX_CANDIDATES = 64
#: the commit records statuses() (ls, rotation, a save's preparation) reads at most, newest
#: first (spec 13.7): steps with a record beyond them are reported unread, never deleted,
#: and nothing older than them is deleted either (what they refer to is not known)
MAX_STATUS_RECORDS = 1024


#: commit records an ObjectRun keeps as read (statuses() reads at most MAX_STATUS_RECORDS)
MAX_KNOWN_RECORDS = 4096


class ObjectRun:
    """The steps of a run kept under an object-store prefix."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        decrypt: Any = None,
        trusted: list[Any] | None = None,
    ) -> None:
        """`decrypt`: the key of an encrypted run's state files (they are read with it).
        `trusted`: public keys (recordsign.public_keys) one of which must have signed a step's
        commit record before its files are read (spec 16.7); listing, rotation and cleanup do
        not look at signatures."""
        self.url: ObjectURL = parse_url(url, need_key=False)
        self.decrypt = decrypt
        self.trusted = trusted
        self.path = str(self.url).rstrip("/")
        self.options = check_options(storage_options)
        # commit records read (or refused) by this run's statuses, by the step and the record's
        # size and version (ETag, generation) as listed: a version names one write, where a
        # Last-Modified to the second names every record a step was given within it (a step
        # removed and saved again); the archiver lists and judges the archive several times per copy
        self._records: dict[tuple[int, int | None, str], multifile.CommitRecord | CheckpointError] = {}
        self._records_lock = threading.Lock()  # the archive thread and the caller's share a run

    def __repr__(self) -> str:
        return f"ObjectRun({self.path!r})"

    def step_path(self, step: int) -> str:
        return f"{self.path}/{step_dirname(step)}"

    def step_url(self, step: int) -> ObjectURL:
        return self.url.child(step_dirname(step))

    def step_place(self, step: int) -> StepPlace:
        """Step `step` as the place of a multi-file checkpoint (files/places.py)."""
        return StepPlace(self.step_url(step), self.options, step)

    # -- reading -------------------------------------------------------------------------

    def listing(self) -> RunListing:
        """The run's objects by step: {step: {name in the step: (size, last written, version)}}: one
        listing of the prefix, which statuses(), cleanup() and remove_interrupted_copies()
        also take, so that what one moment's listing serves is not listed again."""
        listed = listing.listed(self.url, self.options)
        out = RunListing()
        out.date = listed.date
        for key, entry in listed.items():
            top, _, name = key.partition("/")
            step = parse_step_dirname(top)
            if step is not None and name:
                out.setdefault(step, {})[name] = entry
            elif top == CLOCK_DIR and is_copy_marker(name):
                out.readings[name] = entry
        return out

    def statuses(self, found: ByStep | None = None) -> list[StepStatus]:
        """Every step under the prefix, complete or not, by step.  A step without its record
        that holds an object a complete step refers to is `retained` (an incremental run's
        rotated step, kept for its chunks).  `found`: the listing to judge (None: listed here).
        Records are read newest first, at most MAX_STATUS_RECORDS of them (one GET each):
        older steps with a record are `unread` (a listing naming thousands of records must
        not cost thousands of requests)."""
        found = self.listing() if found is None else found
        out: list[StepStatus] = []
        reads = 0
        for step in sorted(found, reverse=True):
            names = found[step]
            reads += multifile.COMMIT_NAME in names
            if reads > MAX_STATUS_RECORDS and multifile.COMMIT_NAME in names:
                out.append(_unread(step, self.step_path(step)))
            else:
                out.append(self.status_of(step, names, found))
        out.reverse()
        referenced = {url for s in out if s.info is not None for url in s.info.references}
        for s in out:
            if (
                s.info is None
                and not (s.damaged or s.unknown)
                and any(u.startswith(s.path + "/") for u in referenced)
            ):
                s.retained = True
                s.problem = "no commit record: kept for the objects later steps refer to"
        return out

    def newest_first(self, limit: int = MAX_CANDIDATES) -> Iterator[StepStatus]:
        """The run's steps, newest first, each read when reached (one listing, then one GET a
        step with a commit record): a reader that stops at the first sound step reads no
        other record.  At most `limit` records are read: LimitError when the next step
        would need one more (a listing naming thousands of commit records that are not
        checkpoints must not keep a resume reading for minutes)."""
        found = self.listing()
        reads = 0
        for step in sorted(found, reverse=True):
            names = found[step]
            if multifile.COMMIT_NAME in names:
                reads += 1
                if reads > limit:
                    raise LimitError(
                        f"the newest {limit} steps with a commit record hold no checkpoint that "
                        f"could be used; older ones are not read (MAX_CANDIDATES)",
                        path=self.path,
                    )
            yield self.status_of(step, names, found)

    def checkpoints(self) -> list[CheckpointInfo]:
        """The complete steps, oldest first."""
        return [s.info for s in self.statuses() if s.info is not None]

    def resumable(self) -> list[CheckpointInfo]:
        """The complete steps a resume may go to, oldest first: those newer than any step whose
        record the store failed to serve (it may be a newer checkpoint: going back past it
        would fork the run); StorageError when it is newer than all of them."""
        statuses = self.statuses()
        unknown = newest_unknown(statuses)
        below = -1 if unknown is None else unknown.step
        out = [s.info for s in statuses if s.info is not None and s.step > below]
        if unknown is not None and not out:
            raise StorageError(f"step {unknown.step}: {unknown.problem}", path=unknown.path)
        return out

    def status_of(
        self,
        step: int,
        names: dict[str, Entry],
        found: ByStep,
    ) -> StepStatus:
        """Step `step` judged by the run's listing `found` (`names`: its objects there).  A
        store that fails reading its record is not a damaged step: it is `unknown`, which
        nothing deletes, and which a resume does not go back past (that would fork the run)."""
        path = self.step_path(step)
        if multifile.COMMIT_NAME not in names:
            return StepStatus(
                step, path, problem="no commit record: the save did not finish", error=IncompleteError
            )
        try:
            return StepStatus(step, path, info=self._info(step, names, found))
        except StorageError as e:
            return StepStatus(
                step, path, problem=f"unknown: the store failed: {e}", error=StorageError, unknown=True
            )
        except CheckpointError as e:
            return StepStatus(step, path, problem=e.reason, damaged=True, error=type(e))
        except FileNotFoundError as e:  # deleted between the listing and the read
            return StepStatus(step, path, problem=f"{e.filename} vanished", error=IncompleteError)

    def record(self, step: int, size: int | None = None, *, trusted: Any = None) -> multifile.CommitRecord:
        """Step `step`'s commit record, bounded by its size before it is decoded; with
        `trusted` keys it must be signed by one of them and carry every file's SHA-256."""
        return self.step_place(step).record_sized(size, trusted)

    def _info(
        self,
        step: int,
        names: dict[str, Entry],
        found: ByStep,
    ) -> CheckpointInfo:
        record = self.listed_record(step, names[multifile.COMMIT_NAME])
        path = self.step_path(step)
        for part in record.files:
            check_listed(names.get(part.name), part, path)
        for ref in record.references:
            other, name = referenced_step(ref.name, path)
            check_listed(found.get(other, {}).get(name), ref, path)
        return self.info_of(step, record, names[multifile.COMMIT_NAME].size)

    def info_of(self, step: int, record: multifile.CommitRecord, record_size: int) -> CheckpointInfo:
        """The CheckpointInfo of complete step `step`, whose record (of `record_size` bytes) is
        `record`."""
        path = self.step_path(step)
        return CheckpointInfo(
            step=step,
            path=path,
            metrics=dict(record.metrics),
            metadata=dict(record.metadata),
            size=sum(p.length for p in record.files) + record_size,
            created=parse_utc(record.created),
            files=tuple(f"{path}/{p.name}" for p in record.files),
            references=tuple(self._reference_url(ref.name) for ref in record.references),
            layout=record.layout,
        )

    def listed_record(self, step: int, listed: Entry, *, listed_size: bool = True) -> multifile.CommitRecord:
        """Step `step`'s commit record as `listed` (size, version): read once, then known while
        the listing shows that version (refused ones too: junk is not read again); read each
        time where the listing gives no version; without `listed_size`, read by the size the
        store gives, not the listing's."""
        size = listed.size if listed_size else None
        if listed.version is None:  # nothing tells this record from another written since
            return self.record(step, size)
        key = (step, size, listed.version)
        with self._records_lock:
            known = self._records.get(key)
        if known is None:
            try:
                known = self.record(step, size)
            except StorageError:  # the store failed, not the record: asked again next time
                raise
            except CheckpointError as e:
                known = e
            with self._records_lock:
                self._records[key] = known
                while len(self._records) > MAX_KNOWN_RECORDS:
                    del self._records[next(iter(self._records))]
        if isinstance(known, CheckpointError):
            raise known
        return known

    def reference_url(self, name: str) -> str:
        """The URL of the object a commit record's reference ``../step-N/NAME`` names."""
        return self._reference_url(name)

    def _reference_url(self, name: str) -> str:
        other, part = referenced_step(name, self.path)
        return f"{self.step_path(other)}/{part}"

    def trusted_record(self, step: int) -> multifile.CommitRecord:
        """Step `step`'s commit record as a reader demanding signatures takes it (SignatureError
        unless a trusted key signed it); without trusted keys, the record as it is."""
        return self.record(step, trusted=self.trusted)

    def open_part(self, info: CheckpointInfo, name: str | None = None) -> CheckpointFile:
        """Part `name` of a complete step (None: its first, a "state" step's state object),
        opened and checked against its commit record (ObjectPlace.open_named: the open pins the
        object's ETag, so what is checked is what is read); the objects of earlier steps it
        reads chunks from must be ones the record names.  With trusted keys the record must be
        signed by one, and each object read is hashed against it first, at the version its
        reads are then pinned to."""
        record = self.trusted_record(info.step)
        name = record.files[0].name if name is None else name  # a "state" step's one state object
        return self.step_place(info.step).open_named(
            record, name, name, trusted=self.trusted, decrypt=self.decrypt
        )

    def verify_step(self, info: CheckpointInfo) -> VerifyReport:
        """Every file of a complete step verified chunk by chunk, after the checks a load makes
        (stepcheck.verify_objects): with trusted keys, the record's signature and each file's
        SHA-256 against it."""
        return verify_objects(self.step_place(info.step), self.decrypt, self.trusted)

    # -- writing -------------------------------------------------------------------------

    def delete_step(self, step: int) -> None:
        """Delete a step: its commit record first, so it stops being a checkpoint before its
        files go; only the objects ckptfmt writes in a step (is_own_name): another program's
        object beneath it stays."""
        listing.delete_prefix(self.step_url(step), self.options, written_here, first=(multifile.COMMIT_NAME,))

    def rotate(
        self,
        done: list[CheckpointInfo],
        kept: set[int],
        statuses: list[StepStatus] | None = None,
        *,
        needed: set[str] | None = None,
        claim: str | None = None,
    ) -> list[int]:
        """Delete the complete steps `done` not in `kept` (returned); one that a kept step reads objects
        of (or one of `needed`, objects of a step about to commit) is only retired.
        `statuses`: the run's, read with `done` (None: read here); `claim`: a copy marker put
        into each step before it is deleted (so a deletion cut short is known as ours)."""
        statuses = self.statuses() if statuses is None else statuses
        unknown = newest_unknown(statuses)  # what it refers to is not known: nothing older goes
        below = -1 if unknown is None else unknown.step
        dropped = [c for c in done if c.step not in kept and c.step > below]
        if not dropped:
            return []
        needed = {url for c in done if c.step in kept for url in c.references} | (needed or set())
        later = leftovers.LaterReferences(self, statuses)
        with claiming(claim):
            for c in dropped:  # only later steps read its objects: records hidden among those
                self.drop(c, needed | later.later_than(c.step, complete=False), claim)
        return [c.step for c in dropped]

    def drop(self, info: CheckpointInfo, needed: set[str], claim: str | None = None) -> None:
        """Delete complete step `info`, or only retire it where `needed` (objects that steps
        kept read from) holds objects of it; `claim`: as for rotate."""
        if claim is not None:  # a deletion cut short, or a retired step's objects, stay known as ours
            marker = self.step_url(info.step).child(claim)
            upload_bytes(b"a ckptfmt archive step being retired\n", str(marker), self.options)
        if any(url.startswith(info.path + "/") for url in needed) or not self.delete_unclaimed(
            info.step, claim
        ):
            self.retire_step(info.step)

    def delete_unclaimed(self, step: int, claim: str | None = None) -> bool:
        """Delete step `step` (its record first, then what ckptfmt wrote there, each by the
        version listed) unless a live writer's copy marker is in its prefix or a later step's
        record refers to an object of it, both judged once this deletion's own sweep marker is
        in: a save about to refer to an object of the step puts its copy marker there first and
        then waits out a sweep's marker it finds (ObjectRunManager._claiming_references), so one
        of the two sees the other and no record lands naming what was deleted.  Whether it
        deleted; `claim`: the caller's own copy marker in the prefix, deleted last.  No DELETE
        is sent that could end past SWEEP_DELETES_WITHIN (the bound that save's wait relies
        on): the marker then stays, dead once this is over (remove_interrupted_copies)."""
        url = self.step_url(step)
        name = sweep_marker()
        with claiming(name):
            began = time.monotonic()  # before the PUT: a save may list the marker before it returns
            upload_bytes(b"a ckptfmt deletion of a step in progress\n", str(url.child(name)), self.options)
            stamp = StoreStamp(name, time.monotonic())
            try:
                listed = listing.listed(url, self.options)
                at = stamp.store_time(listed, listed.date)
                others = {n: e for n, e in listed.items() if n not in (name, claim)}
                claimed = has_live_marker(others, STALE_AFTER, at, is_copy_marker)
                if claimed or self.read_by_later_steps(step):
                    listing.delete_object(url.child(name), self.options)
                    return False
            except BaseException:  # nothing deleted yet: nothing for a cleaner to come back to
                with contextlib.suppress(CheckpointError, OSError):
                    listing.delete_object(url.child(name), self.options)
                raise
            doomed = _step_objects_in_order(listed, claim, at)
            if self._delete_within([(url.child(n), v) for n, v in doomed], began):
                listing.delete_object(url.child(name), self.options)
        return True

    def remove_step(self, step: int, claim: str | None = None) -> bool:
        """Remove step `step` (the run goes back to an earlier step): deleted, or only retired
        where other steps read objects of it; whether the run held it at all."""
        statuses = self.statuses()
        found = next((s for s in statuses if s.step == step), None)
        if found is None:
            return False
        if found.unknown:
            raise StorageError(f"step {step} is not removed: {found.problem}", path=found.path)
        unknown = newest_unknown(statuses)
        if unknown is not None and step < unknown.step:
            raise StorageError(
                f"step {step} is not removed: step {unknown.step}: {unknown.problem}", path=found.path
            )
        if found.unread or step < newest_unread(statuses):  # what unread steps refer to is unknown
            why = f"past the {MAX_STATUS_RECORDS} newest records read (spec 13.7): not removed"
            raise LimitError(f"step {step} is {why}", path=self.step_path(step))
        others = {url for s in statuses if s.info is not None and s.step != step for url in s.info.references}
        others |= leftovers.LaterReferences(self, statuses).later_than(step)  # only later steps read it
        if found.info is not None:
            with claiming(claim):
                self.drop(found.info, others, claim)
        elif not any(url.startswith(found.path + "/") for url in others):
            self.delete_step(step)
        return True

    def retire_step(self, step: int) -> None:
        """Make a step stop being a checkpoint (its commit record deleted) while keeping the
        objects later steps refer to; cleanup leaves it while they do."""
        listing.delete_object(self.step_url(step).child(multifile.COMMIT_NAME), self.options)

    def referenced(self) -> set[str]:
        """The objects steps with a commit record refer to (an incremental run's): never
        deleted.  Counts the records a listing leaves out (references_of_incomplete)."""
        return self._referenced_by(self.statuses())

    def _referenced_by(self, statuses: list[StepStatus]) -> set[str]:
        return listed_references(statuses) | self.references_of_incomplete(statuses)

    def references_of_incomplete(self, statuses: list[StepStatus]) -> set[str]:
        """The objects referred to by the steps `statuses` shows as not complete but whose
        record is there all the same (incomplete_references, each step's)."""
        return {url for s in statuses for url in self.incomplete_references(s)}

    def incomplete_references(self, status: StepStatus, found: ByStep | None = None) -> set[str]:
        """The objects referred to by step `status` where the listing shows it not complete but
        its record is there all the same: one a HEAD finds though the listing left it out, or
        a damaged step's (a listing that leaves out or misstates a file it names); deleting
        what they read would break them once the store answers truly.  A damaged step's record
        as `found` (the listing its status was judged by) lists it is the one already read:
        not asked again.  CheckpointError when a record the listing hid cannot be read (what
        it refers to is unknown)."""
        s = status
        if s.unknown:
            raise StorageError(f"what step {s.step} refers to is not known: {s.problem}", path=s.path)
        if s.info is not None or s.unread or not (s.damaged or self.has_record(s.step)):
            return set()
        listed = None if found is None or not s.damaged else found.get(s.step, {}).get(multifile.COMMIT_NAME)
        try:
            record = self._record_as_stored(s.step, listed)
        except FileNotFoundError:  # deleted since the listing or the HEAD
            return set()
        except StorageError:
            raise
        except CheckpointError:
            if s.damaged:  # a record that cannot be read: nothing it names can be loaded
                return set()
            raise
        return {self._reference_url(ref.name) for ref in record.references}

    def _record_as_stored(self, step: int, listed: Entry | None) -> multifile.CommitRecord:
        """Step `step`'s record: the one read already by the size `listed` gives, where that
        read succeeded; else read again by the size the store gives (a listing that misstates
        the record's size is what made the step damaged: what the record names must still be
        known, else a cleanup deletes what it reads)."""
        if listed is None:
            return self.record(step)
        try:
            return self.listed_record(step, listed)
        except StorageError:
            raise
        except CheckpointError:  # read by the store's size: known, as the listed read is, after
            return self.listed_record(step, listed, listed_size=False)

    def has_record(self, step: int) -> bool:
        """Whether step `step`'s commit record is an object, asked by one HEAD: a listing that
        leaves it out (a lying or lagging store) must not make a complete step look abandoned.
        Anything there, readable or not, counts as a record."""
        try:
            head(self.step_url(step).child(multifile.COMMIT_NAME), self.options)
        except FileNotFoundError:
            return False
        except CheckpointError:
            return True
        return True

    def sweep_step(
        self,
        step: int,
        record: multifile.CommitRecord,
        *,
        older_than: datetime.timedelta = STALE_AFTER,
    ) -> bool:
        """Delete what other saves left in step `step`, committed with `record`: objects
        ckptfmt writes in a step (never a marker, never the record) that the record does not
        name, each by the version `listed` gives (If-Match); whether it swept.  No record of
        the step can name them: a step's record is created only once, and names only objects
        its own writer uploaded (spec 13.7).  A later step's record can (the step committed by
        another writer and retired by its rotation before this commit, or an archive copy
        adopting a leftover of it): those are left.
        Nothing goes while a live writer's copy marker (marker_dead, by `older_than`) is in the
        prefix: it may be uploading, or have found there, an object its later step will refer
        to.  The last listing is made after this sweep's own marker (sweep_marker) is in: a
        copy whose marker it does not show finds this sweep's and waits for its end
        (wait_out_sweeps) before it looks for an object of the step, so nothing it refers to
        is deleted after it looked.  The later records are read after that listing (one read
        before it proves nothing: a copy may have adopted an object since and be gone).  No
        DELETE is sent that could end, its deadline (at most SWEEP_DELETE_DEADLINE) included,
        past SWEEP_DELETES_WITHIN seconds from the marker (the bound a copy's wait relies on).
        A sweep cut short so, or failing once its marker is in (a DELETE's LimitError too),
        leaves its marker: dead once the sweep is over, it brings remove_interrupted_copies
        back to the step.  Only where the later records cannot all be read (LimitError before
        any DELETE) does its marker go, nothing deleted."""
        url = self.step_url(step)
        listed = listing.listed(url, self.options)
        named = {p.name for p in record.files} | {multifile.COMMIT_NAME}
        others = {
            n: e.version
            for n, e in listed.items()
            if is_own_name(n) and n not in named and e.version is not None  # none: nothing to delete by
        }
        if not others:
            return True
        # this host's clock bounds what any store time proven next could say: a copy's marker
        # young by it is live (nothing to prove); one old by it is judged once the sweep's is in
        if has_live_marker(listed, older_than, store_time_bound(objectnames.host_now()), is_copy_marker):
            return False
        name = sweep_marker()
        marker = url.child(name)
        with claiming(name):
            began = time.monotonic()  # before the PUT: a copy may list the marker before it returns
            upload_bytes(b"a ckptfmt sweep in progress\n", str(marker), self.options)
            stamp = StoreStamp(name, time.monotonic())  # after: the store's clock, at least
            try:
                doomed = self._doomed_now(step, others, older_than, stamp)
            except LimitError:  # nothing deleted yet: nothing for a cleaner to come back to
                with contextlib.suppress(CheckpointError, OSError):
                    listing.delete_object(marker, self.options)
                raise
            # a DELETE that fails (whatever its error) or time that runs out leaves the marker,
            # dead once unclaimed, so that a cleaner (remove_interrupted_copies) sweeps again
            finished = doomed is None or self._delete_within(doomed, began)
            if finished:
                listing.delete_object(marker, self.options)
        return doomed is not None and finished

    def _doomed_now(
        self, step: int, others: dict[str, str], older_than: datetime.timedelta, own: StoreStamp
    ) -> list[tuple[ObjectURL, str]] | None:
        """What of `others` (name: version) sweep_step deletes, judged once its marker, `own`,
        is in: None where a live copy's marker is there now (nothing goes; copy markers aged
        by the store's time that marker proves, none where the listing does not show it),
        else those no later step's record reads (LimitError where too many later records: none
        goes)."""
        url = self.step_url(step)
        listed = listing.listed(url, self.options)
        if has_live_marker(listed, older_than, own.store_time(listed, listed.date), is_copy_marker):
            return None
        later = self.read_by_later_steps(step)
        return [(url.child(n), v) for n, v in others.items() if n not in later]

    def _delete_within(self, doomed: Sequence[tuple[ObjectURL, str | None]], began: float) -> bool:
        """Delete each (object, version) of `doomed` (If-Match), none of them once its DELETE
        could end past SWEEP_DELETES_WITHIN seconds from monotonic `began` (the sweep's marker):
        whether every one was sent."""
        options = sweep_options(self.options)
        each = deadline(options)
        for target, version in doomed:
            if time.monotonic() - began + each > SWEEP_DELETES_WITHIN:
                return False  # it could end after a copy that found the marker stops waiting
            listing.delete_object(target, options, if_match=version)
        return True

    def wait_out_sweeps(self, step: int, own: StoreStamp, within: float | None = None) -> None:
        """Wait until no live sweep's marker (sweep_step; marker_dead) is in step `step`'s
        prefix, or for SWEEP_WAIT seconds: past it a sweep that put its marker before this
        wait began deletes nothing more.  Called by a copy after its own marker, `own`, is in
        the prefix and before it looks for an object there to refer to: a sweep that began
        later sees that marker.  Markers are aged by the store's time as that marker's
        Last-Modified proves it (proven_store_time: a listing's Date only where earlier), so
        a Date from another clock makes no live sweep's marker look dead, and without a Date
        the wait still moves on.  `within`: seconds the caller may wait at most (a save's
        storage deadline), StorageError when a live sweep's marker is there still then."""
        url = self.step_url(step)
        ends = time.monotonic() + SWEEP_WAIT
        gives_up = ends if within is None else min(ends, time.monotonic() + within)
        pause = 0.05
        while time.monotonic() < ends:
            listed = listing.listed(url, self.options)
            store_now = own.store_time(listed, listed.date)
            if not has_live_marker(listed, STALE_AFTER, store_now, is_sweep_marker):
                return
            if gives_up < ends and time.monotonic() >= gives_up:
                why = f"a deletion of it (a sweep's marker) was not over within {within} s (storage option deadline)"
                raise StorageError(f"step {step} is not referred to: {why}", path=str(url))
            time.sleep(min(pause, max(0.0, gives_up - time.monotonic())))
            pause = min(2 * pause, 1.0)

    def read_by_later_steps(self, step: int) -> frozenset[str]:
        """The objects of step `step` the records of later steps refer to (only later steps
        refer to a step's objects): one listing of the run, one GET a later record not read
        yet (usually none: the step swept is the newest).  LimitError past MAX_STATUS_RECORDS of them: what the others refer
        to is not known, so nothing is swept."""
        found = self.listing()
        later = {s: names for s, names in found.items() if s > step}
        if sum(multifile.COMMIT_NAME in names for names in later.values()) > MAX_STATUS_RECORDS:
            raise LimitError(
                f"more than {MAX_STATUS_RECORDS} later steps may read objects of step {step}: "
                "none of them is deleted",
                path=self.step_path(step),
            )
        statuses = [self.status_of(s, names, found) for s, names in sorted(later.items())]
        prefix = self.step_path(step) + "/"
        return frozenset(u[len(prefix) :] for u in self._referenced_by(statuses) if u.startswith(prefix))

    def sweep_committed(self, step: int) -> None:
        """sweep_step of step `step` by the commit record there now, if one can be read."""
        try:
            record = self.record(step)
        except (FileNotFoundError, CheckpointError):  # none, or none to go by: nothing is swept
            return
        self.sweep_step(step, record)

    def delete_uncommitted(self, step: int, name: str, version: str) -> None:
        """Delete object `name` of step `step`, which a failed save wrote as `version` (the
        ETag its upload got), unless the step's commit record names it (one GET: this save's
        own record may have landed although its request failed).  The delete is conditional
        on `version` (If-Match): whatever happens between the read and the delete, another
        writer's object of that name is never deleted, and no record but this save's own can
        name this version (a save commits only the version it uploaded).  A record that cannot
        be read now leaves the object (cleanup's, with its step)."""
        try:
            record: multifile.CommitRecord | None = self.record(step)
        except FileNotFoundError:
            record = None
        except CheckpointError:
            return
        if record is None or all(p.name != name for p in record.files):
            listing.delete_object(self.step_url(step).child(name), self.options, if_match=version)

    def cleanup(
        self,
        older_than: datetime.timedelta = STALE_AFTER,
        found: RunListing | None = None,
        statuses: list[StepStatus] | None = None,
    ) -> None:
        """Delete what crashed savers left (leftovers.cleanup); `statuses`: the run's, judged by
        the listing `found`, where the caller has them."""
        leftovers.cleanup(self, older_than, found, statuses)

    def remove_interrupted_copies(
        self, older_than: datetime.timedelta = STALE_AFTER, found: RunListing | None = None
    ) -> list[int]:
        """Remove what archive copies and sweeps that died left (leftovers.remove_interrupted_copies);
        the steps whose prefix was deleted."""
        return leftovers.remove_interrupted_copies(self, older_than, found).removed


def _unread(step: int, path: str) -> StepStatus:
    """The status of a step whose commit record statuses() does not read (MAX_STATUS_RECORDS)."""
    return StepStatus(
        step,
        path,
        problem=f"not read: only the newest {MAX_STATUS_RECORDS} commit records are (MAX_STATUS_RECORDS)",
        error=LimitError,
        unread=True,
    )


def _step_objects_in_order(
    listed: dict[str, Entry], claim: str | None, at: datetime.datetime | None
) -> list[tuple[str, str | None]]:
    """What deleting a step's prefix `listed` deletes, (name, version) in the order it goes:
    the commit record (it stops being a checkpoint first), the step's files, the markers of
    writers that have ended, and the caller's own marker `claim` last (a deletion cut short
    stays known as ours).  A sweep's marker, of the deletion itself or another live one, stays."""
    files = [n for n in listed if is_own_name(n) and n != multifile.COMMIT_NAME]
    dead = [
        n
        for n in listed
        if is_marker(n) and n != claim and marker_dead(n, listed[n].modified, STALE_AFTER, at)
    ]
    names = [multifile.COMMIT_NAME] * (multifile.COMMIT_NAME in listed) + files + dead
    names += [claim] if claim is not None and claim in listed else []
    return [(n, listed[n].version) for n in names]
