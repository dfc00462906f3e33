"""What dead writers left in a run on an object store (runs/objectrun.py), found and removed:
steps without a commit record that a crashed save left (`cleanup`), and what archive copies
and sweeps that died left (`remove_interrupted_copies`).  Each is judged by the store's time
proven (runs/storeclock.py), never this host's clock, and by what the run's commit records
refer to; only what ckptfmt provably wrote goes, and only the versions listed (spec 13.7).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import time
from typing import Any, Protocol

from ..errors import CheckpointError, LimitError, StorageError
from ..files import multifile
from ..files.names import is_own_name
from ..files.places import STALE_AFTER
from ..storage import listing
from ..storage.urls import ObjectURL
from . import objectnames, storeclock
from .objectnames import (
    ByStep,
    Entry,
    RunListing,
    has_live_marker,
    in_a_step,
    in_steps,
    stale,
    store_time_bound,
    writer_came,
)
from .steps import StepStatus, listed_references, newest_unread, step_dirname
from .storeclock import StoreClock, abort_crashed_uploads, abort_removed_steps_uploads, markers_dead


class Run(Protocol):
    """What of a run on a store (objectrun.ObjectRun) its cleanups use."""

    url: ObjectURL
    options: dict[str, Any]

    def listing(self) -> RunListing: ...

    def statuses(self, found: ByStep | None = None) -> list[StepStatus]: ...

    def step_path(self, step: int) -> str: ...

    def step_url(self, step: int) -> ObjectURL: ...

    def has_record(self, step: int) -> bool: ...

    def record(
        self, step: int, size: int | None = None, *, trusted: Any = None
    ) -> multifile.CommitRecord: ...

    def incomplete_references(self, status: StepStatus, found: ByStep | None = None) -> set[str]: ...

    def listed_record(self, step: int, listed: Entry) -> multifile.CommitRecord: ...

    def sweep_step(
        self, step: int, record: multifile.CommitRecord, *, older_than: datetime.timedelta = STALE_AFTER
    ) -> bool: ...


def holds_any(run: Run, step: int, urls: set[str]) -> bool:
    """Whether one of `urls` is an object of step `step` of `run`."""
    prefix = run.step_path(step) + "/"
    return any(u.startswith(prefix) for u in urls)


class LaterReferences:
    """What the records of a run's steps refer to, asked of the steps later than one judged:
    a record refers only to objects of earlier steps (stepplace.StepPlace refuses any other
    as damaged), so whether a step's objects are read is a question for later steps alone.
    The records the listing showed complete cost nothing; a step shown without a complete
    record costs a HEAD (a record the listing hid?) and, where one is there, a GET, each
    asked once and only where a verdict needs it (ObjectRun.incomplete_references)."""

    def __init__(self, run: Run, statuses: list[StepStatus], found: ByStep | None = None) -> None:
        """`statuses`: the run's, judged by its listing `found` (None: not at hand; a damaged
        step's record is then read again)."""
        self._run, self._statuses, self._found = run, statuses, found
        self._incomplete: dict[int, set[str]] = {}

    def later_than(self, step: int, *, complete: bool = True) -> set[str]:
        """The objects the records of steps after `step` refer to; without `complete`, only
        the records of steps the listing does not show complete (hidden or damaged)."""
        out: set[str] = set()
        for s in self._statuses:
            if s.step <= step:
                continue
            if s.info is not None:
                out.update(s.info.references if complete else ())
                continue
            if s.step not in self._incomplete:
                self._incomplete[s.step] = self._run.incomplete_references(s, self._found)
            out |= self._incomplete[s.step]
        return out


def cleanup(
    run: Run,
    older_than: datetime.timedelta = STALE_AFTER,
    found: RunListing | None = None,
    statuses: list[StepStatus] | None = None,
) -> None:
    """Abort multipart uploads of crashed savers (storeclock.abort_crashed_uploads), delete
    what clock readings that died left (remove_dead_readings), and delete commit-less
    steps whose newest object is older than `older_than` (a live saver writes more often),
    all by the store's time, proven (StoreClock: read once, only where something looks
    that old by the latest time the store's could be), never this host's, which may be
    ahead of it by more than the bound: another host's live saver keeps its step.
    `found`: the run's listing to go by (None: listed here); one a little old serves, as
    a step is deleted only by a HEAD's word and the versions then listed.  `statuses`: the
    run's, judged by `found` (None: judged here, and only once a step looks stale)."""
    if found is None:
        found, statuses = run.listing(), None
    clock = StoreClock(run.url, run.options)
    abort_crashed_uploads(run.url, run.options, in_a_step, older_than, clock)
    storeclock.remove_dead_readings(run.url, run.options, found.readings, older_than, clock)
    latest = store_time_bound(objectnames.host_now())  # young by it: young by the store's
    below, listed = -1, set()
    later: LaterReferences | None = None  # what records a listing left out refer to
    for step, names in sorted(found.items()):
        if multifile.COMMIT_NAME in names or has_live_marker(names, older_than, latest):
            continue  # a step, or an archive copy under way: its record is yet to come
        if not stale(names, older_than, latest):
            continue
        if later is None:
            statuses = run.statuses(found) if statuses is None else statuses  # a GET a record
            below, listed = newest_unread(statuses), listed_references(statuses)
            later = LaterReferences(run, statuses, found)
        # steps older than an unread one may hold what it refers to: never deleted; a step
        # a listed record reads (an incremental run's retired step) is skipped before any HEAD
        if step <= below or holds_any(run, step, listed):
            continue
        if not holds_any(run, step, later.later_than(step)) and not run.has_record(step):
            storeclock.delete_leftover(run.step_url(step), run.options, older_than, clock)


@dataclasses.dataclass
class CopiesRemoved:
    """What remove_interrupted_copies did: `removed`, the steps whose prefix it deleted, and
    `waiting`, the steps without a commit record whose dead markers it left (their objects
    too young, another writer come since, a later step reading them, an unread step newer):
    a copy of such a step committed since makes them judgeable now (sweep_step's)."""

    removed: list[int] = dataclasses.field(default_factory=list)
    waiting: set[int] = dataclasses.field(default_factory=set)


def remove_interrupted_copies(
    run: Run, older_than: datetime.timedelta = STALE_AFTER, found: RunListing | None = None
) -> CopiesRemoved:
    """Remove what archive copies (and deletions) that died left.  A step prefix is such a
    leftover when it holds markers (a copy's, COPY_MARKER, or a sweep's cut short,
    SWEEP_MARKER) and every one is dead: its writer ran on this host and its process has
    ended, or (written elsewhere, where that cannot be asked) it is older than
    `older_than`.  Such a prefix without a commit record (by the listing and by a HEAD)
    whose objects no step refers to, and whose objects other than markers are all older than
    `older_than` by the store's time proven (a plain saver on another host may be writing
    into a step where a copy died: spec 13.7), is deleted, its markers last, so that a deletion cut
    short stays recognisable; one that a step refers to is left whole (its markers say it
    is ours once nothing does); in a complete step what those copies left beside the record
    goes (sweep_step: own names its record does not name, unless a later record
    reads them), then the dead markers (both stay where it finds a live writer's marker
    now: one that came since `found`).  A prefix with
    no marker, or with a live writer's, is never touched here (cleanup).
    Only the versions `found` lists go (If-Match), and not in a prefix another writer has
    come to since (writer_came).  `found`: the run's listing to go by (None: listed here)."""
    found = run.listing() if found is None else found
    began = time.monotonic()
    clock = StoreClock(run.url, run.options)
    storeclock.remove_dead_readings(run.url, run.options, found.readings, older_than, clock)
    dead, live = markers_dead(found, older_than, clock)
    done = CopiesRemoved()
    if not dead:
        return done
    statuses = run.statuses(found)
    records = {s.step: s.info for s in statuses}
    later = LaterReferences(run, statuses, found)
    below = newest_unread(statuses)
    for step, markers in sorted(dead.items()):
        names, url = found[step], run.step_url(step)
        if step in live:
            continue  # a live writer's (the dead markers go with its own, or later)
        if multifile.COMMIT_NAME in names:
            if not sweep_ended_copies(run, step, names, older_than, records.get(step) is not None):
                continue  # a live writer's now: the dead markers go once it is done
            doomed = markers  # then their markers
        elif step < below:
            done.waiting.add(step)  # an unread newer step may refer to its objects
            continue
        elif holds_any(run, step, later.later_than(step)):
            done.waiting.add(step)  # kept for a later step's objects: its markers say it is ours once not
            continue
        elif run.has_record(step):
            doomed = markers  # a record the listing left out
        elif not storeclock.stale_objects(names, older_than, clock):
            done.waiting.add(step)  # a plain saver on another host may be writing here (spec 13.7)
            continue
        elif writer_came(names, listing.listed(url, run.options)):
            done.waiting.add(step)  # another writer's now: its marker says so, once it is dead
            continue
        else:
            # ckptfmt's own objects only: another program may keep its own in the prefix
            doomed = [n for n in names if is_own_name(n)] + markers
            done.removed.append(step)
        listing.delete_versions(url, run.options, [(n, names[n].version) for n in doomed])
    if done.removed:
        ours = functools.partial(in_steps, steps={step_dirname(s) for s in done.removed})
        abort_removed_steps_uploads(run.url, run.options, ours, began, older_than, clock)
    return done


def sweep_ended_copies(
    run: Run, step: int, names: dict[str, Entry], older_than: datetime.timedelta, complete: bool
) -> bool:
    """In step `step`, listed with a commit record (`names`), whose copy markers are all dead
    (by `older_than`): delete what those copies left beside the record (a copy that lost the
    race to commit, or was killed, while another copy committed under names of its own), as
    sweep_step does.  The record is the one the listing shows, read once (`complete`: its
    status was judged complete, so it is known); one that cannot be read leaves what they
    left.  False when nothing is swept: a live writer's marker is there now (one came since
    the run was listed), or too many later records to read; the dead markers must stay
    then, or what their copies left would never be swept."""
    try:
        listed = names[multifile.COMMIT_NAME]
        record = run.listed_record(step, listed) if complete else run.record(step)
        return run.sweep_step(step, record, older_than=older_than)
    except FileNotFoundError:  # deleted since the listing
        return True
    except StorageError:
        raise
    except LimitError:  # what the later steps read is not known: everything stays
        return False
    except CheckpointError:  # nothing to go by
        return True
