"""What dead writers left in a run on an object store (runs/objectrun.py), found and removed:
steps without a commit record that a crashed save left (`cleanup`), and what archive copies
and sweeps that died left (`remove_interrupted_copies`).  Each is judged by the store's time
proven (runs/storeclock.py), never this host's clock, and by what the run's commit records
refer to; only what ckptfmt provably wrote goes, and only the versions listed (spec 13.7).
"""

from __future__ import annotations

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

    def references_of_incomplete(self, statuses: list[StepStatus]) -> set[str]: ...

    def sweep_step(
        self, step: int, record: multifile.CommitRecord, *, older_than: datetime.timedelta = STALE_AFTER
    ) -> bool: ...


def holds_any(run: Run, step: int, urls: set[str]) -> bool:
    """Whether one of `urls` is an object of step `step` of `run`."""
    prefix = run.step_path(step) + "/"
    return any(u.startswith(prefix) for u in urls)


def cleanup(run: Run, older_than: datetime.timedelta = STALE_AFTER, found: RunListing | None = None) -> None:
    """Abort multipart uploads of crashed savers (storeclock.abort_crashed_uploads), delete
    what clock readings that died left (remove_dead_readings), and delete commit-less
    steps whose newest object is older than `older_than` (a live saver writes more often),
    all by the store's time, proven (StoreClock: read once, only where something looks
    that old by the latest time the store's could be), never this host's, which may be
    ahead of it by more than the bound: another host's live saver keeps its step.
    `found`: the run's listing to go by (None: listed here); one a little old serves, as
    a step is deleted only by a HEAD's word and the versions then listed."""
    found = run.listing() if found is None else found
    clock = StoreClock(run.url, run.options)
    abort_crashed_uploads(run.url, run.options, in_a_step, older_than, clock)
    storeclock.remove_dead_readings(run.url, run.options, found.readings, older_than, clock)
    latest = store_time_bound(objectnames.host_now())  # young by it: young by the store's
    statuses: list[StepStatus] | None = None  # read only when a step is stale: a GET a record
    below, listed = -1, set()
    hidden: set[str] | None = None  # what records a listing left out refer to: a HEAD a step
    for step, names in sorted(found.items()):
        if multifile.COMMIT_NAME in names or has_live_marker(names, older_than, latest):
            continue  # a step, or an archive copy under way: its record is yet to come
        if not stale(names, older_than, latest):
            continue
        if statuses is None:
            statuses = run.statuses(found)
            below, listed = newest_unread(statuses), listed_references(statuses)
        # steps older than an unread one may hold what it refers to: never deleted; a step
        # a listed record reads (an incremental run's retired step) is skipped before any HEAD
        if step <= below or holds_any(run, step, listed):
            continue
        hidden = run.references_of_incomplete(statuses) if hidden is None else hidden
        if not holds_any(run, step, hidden) and not run.has_record(step):
            storeclock.delete_leftover(run.step_url(step), run.options, older_than, clock)


def remove_interrupted_copies(
    run: Run, older_than: datetime.timedelta = STALE_AFTER, found: RunListing | None = None
) -> list[int]:
    """Remove what archive copies (and deletions) that died left; returns the steps whose
    prefix was deleted.  A step prefix is such a leftover when it holds markers (a copy's,
    COPY_MARKER, or a sweep's cut short, SWEEP_MARKER) and every one is dead: its writer ran on this host and its process has
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
    if not dead:
        return []
    statuses = run.statuses(found)
    referenced = listed_references(statuses) | run.references_of_incomplete(statuses)
    below = newest_unread(statuses)
    removed: list[int] = []
    for step, markers in sorted(dead.items()):
        names, url = found[step], run.step_url(step)
        if step in live:
            continue  # a live writer's (the dead markers go with its own, or later)
        if step < below and multifile.COMMIT_NAME not in names:
            continue  # an unread newer step may refer to its objects
        if multifile.COMMIT_NAME in names:
            if not sweep_ended_copies(run, step, older_than):  # what they left beside the record
                continue  # a live writer's now: the dead markers go once it is done
            doomed = markers  # then their markers
        elif holds_any(run, step, referenced):
            continue  # kept for a later step's objects: its markers say it is ours once not
        elif run.has_record(step):
            doomed = markers  # a record the listing left out
        elif not storeclock.stale_objects(names, older_than, clock):
            continue  # a plain saver on another host may be writing here (spec 13.7)
        elif writer_came(names, listing.listed(url, run.options)):
            continue  # another writer's now: its marker says so, once it is dead
        else:
            # ckptfmt's own objects only: another program may keep its own in the prefix
            doomed = [n for n in names if is_own_name(n)] + markers
            removed.append(step)
        listing.delete_versions(url, run.options, [(n, names[n].version) for n in doomed])
    if removed:
        ours = functools.partial(in_steps, steps={step_dirname(s) for s in removed})
        abort_removed_steps_uploads(run.url, run.options, ours, began, older_than, clock)
    return removed


def sweep_ended_copies(run: Run, step: int, older_than: datetime.timedelta) -> bool:
    """In complete step `step`, whose copy markers are all dead (by `older_than`): delete
    what those copies left beside the record (a copy that lost the race to commit, or was
    killed, while another copy committed under names of its own), as sweep_step does.  A
    record that cannot be read leaves what they left.  False when nothing is swept: a
    live writer's marker is there now (one came since the run was listed), or too many
    later records to read; the dead markers must stay then, or what their copies left
    would never be swept."""
    try:
        return run.sweep_step(step, run.record(step), older_than=older_than)
    except FileNotFoundError:  # deleted since the listing
        return True
    except StorageError:
        raise
    except LimitError:  # what the later steps read is not known: everything stays
        return False
    except CheckpointError:  # nothing to go by
        return True
