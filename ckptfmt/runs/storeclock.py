"""The store's time as a cleaner of a run on an object store proves it before it judges the
age of another writer's marker or step (spec 13.7): a marker of its own put, listed and
deleted (objectnames.StoreStamp), so that neither this host's clock (which may run a day
ahead of the store's) nor a listing's Date from another clock than the one stamping objects
makes another writer's live work look dead.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable

from ..errors import CheckpointError
from ..files import multifile
from ..storage import listing
from ..storage.listing import Listed
from ..storage.upload import upload_bytes
from ..storage.urls import ObjectURL
from . import objectnames
from .objectnames import (
    CLOCK_DIR,
    StoreStamp,
    claiming,
    copy_marker,
    has_live_marker,
    is_marker,
    marker_dead,
    stale,
    store_time_bound,
    written_here,
)

_ROUNDING = datetime.timedelta(seconds=listing.STAMP_ROUNDING)


def read_stamp(url: ObjectURL, options: dict[str, object]) -> StoreStamp:
    """The store's clock as proven now (StoreStamp): a marker of this process (named as a copy
    marker is, so that a crashed reading's is aged and removed as one: ObjectRun.cleanup) put
    into `url` (the run's CLOCK_DIR), read back from a listing of it and deleted (an object of ckptfmt's own
    meanwhile, recognisable as such if this process dies first).  A listing that does not show
    it yet proves nothing: the stamp then ages nothing (the safe side)."""
    name = copy_marker()
    with claiming(name):
        try:
            # inside the try: a PUT whose answer is lost may still have written the marker,
            # which other hosts would take for a live copy's for a day
            upload_bytes(b"a ckptfmt reading of the store's clock\n", str(url.child(name)), options)
            stamp = StoreStamp(name, time.monotonic())
            stamp.now(listing.listed(url, options), objectnames.host_now())
        except BaseException:
            with contextlib.suppress(CheckpointError, OSError):  # the first failure is the one told
                listing.delete_object(url.child(name), options)
            raise
        listing.delete_object(url.child(name), options)
    return stamp


class StoreClock:
    """The store's time for one pass of a cleaner over a run: proven once, when first asked
    (read_stamp in the run's CLOCK_DIR: a PUT, a listing and a DELETE), then
    moved on by this process's monotonic clock; a pass that finds nothing looking old makes
    no request for it."""

    def __init__(self, run: ObjectURL, options: dict[str, object]) -> None:
        """`run`: the run's prefix; the reading's marker goes beneath its CLOCK_DIR, never in a
        step's prefix, where a concurrent sweep or copy would take it for a live copy's."""
        self._url = run.child(CLOCK_DIR)
        self._options = options
        self._stamp: StoreStamp | None = None

    def proven_time(self) -> datetime.datetime | None:
        """The store's time now as proven (StoreStamp): the first call reads it (a PUT, a
        listing and a DELETE); None where the reading's listing did not show its marker
        (nothing is aged then).  No listing's Date is needed: the stamp is the store's own,
        and moves on without one."""
        if self._stamp is None:
            self._stamp = read_stamp(self._url, self._options)
        return self._stamp.store_time({}, None)


def markers_dead(
    found: dict[int, dict[str, Listed]],
    older_than: datetime.timedelta,
    clock: StoreClock,
) -> tuple[dict[int, list[str]], set[int]]:
    """The dead markers of a run's listing `found` by step (marker_dead), and the steps holding
    a live one.  A marker not dead by its owner alone but old enough to be dead by the latest
    time the store's could be (store_time_bound) is aged by the store's time proven
    (`clock`, read once for the run, only where needed): neither this host's clock nor a
    Date from another clock than the one stamping objects must let a live writer's marker be
    deleted."""
    latest = store_time_bound(objectnames.host_now())
    dead: dict[int, list[str]] = {}
    live: set[int] = set()
    for step, names in found.items():
        for name, entry in names.items():
            if not is_marker(name):
                continue
            gone = marker_dead(name, entry.modified, older_than, None)
            if not gone and marker_dead(name, entry.modified, older_than, latest):
                gone = marker_dead(name, entry.modified, older_than, clock.proven_time())
            if gone:
                dead.setdefault(step, []).append(name)
            else:
                live.add(step)
    return dead, live


def abort_crashed_uploads(
    url: ObjectURL,
    options: dict[str, object],
    ours: Callable[[str], bool],
    older_than: datetime.timedelta,
    clock: StoreClock,
) -> int:
    """Abort the uploads beneath `url` whose key relative to it is `ours` begun more than
    `older_than` before the store's time proven (savers that crashed), a second more for the
    store's rounding.  The uploads are listed first; the store's time is proven (`clock`,
    once) only where one of ours began before the earliest time that could be that old
    (store_time_bound): never judged by this host's clock, nor by a listing's Date, which may
    come from another clock (a gateway's agreeing with a host a day ahead, or a hostile
    far-future one); none is aborted where no store time is proven."""

    def cutoff(oldest: datetime.datetime) -> datetime.datetime | None:
        if oldest >= store_time_bound(objectnames.host_now()) - older_than:
            return None  # young by every store time believed: nothing to prove
        at = clock.proven_time()
        return None if at is None else listing.earlier_by(at, older_than, _ROUNDING)

    return listing.abort_uploads_begun_before(url, options, ours, cutoff)


def abort_removed_steps_uploads(
    url: ObjectURL,
    options: dict[str, object],
    ours: Callable[[str], bool],
    began: float,
    older_than: datetime.timedelta,
    clock: StoreClock,
) -> int:
    """Abort the uploads beneath `url` whose key relative to it is `ours` (prefixes a cleaner
    just removed) begun both before monotonic time `began` (the cleaner's start) and more than
    `older_than` before the store's time (proven: `clock`), a second more for the store's
    rounding: a newcomer's uploads begun since stay, and so does a live saver's under way in
    such a prefix (an upload not yet complete is no listed object, so nothing the removal
    looked at could show it); where no store time is proven, none is aborted (they go with a
    later cleanup's crashed uploads)."""

    def cutoff(oldest: datetime.datetime) -> datetime.datetime | None:
        at = clock.proven_time()
        if at is None:
            return None
        since = datetime.timedelta(seconds=time.monotonic() - began)
        return listing.earlier_by(at, max(since, older_than), _ROUNDING)

    return listing.abort_uploads_begun_before(url, options, ours, cutoff)


def stale_objects(names: dict[str, Listed], older_than: datetime.timedelta, clock: StoreClock) -> bool:
    """Whether the objects of a step's prefix `names` other than markers are all older than
    `older_than` by the store's time proven (`clock`; objectnames.stale), or there are none:
    a prefix whose markers are dead may still be a plain saver's on another host, which
    writes more often than that (spec 13.7)."""
    objects = {n: e for n, e in names.items() if not is_marker(n)}
    return not objects or stale(objects, older_than, clock.proven_time())


def remove_dead_readings(
    run: ObjectURL,
    options: dict[str, object],
    readings: dict[str, Listed],
    older_than: datetime.timedelta,
    clock: StoreClock,
) -> None:
    """Delete the markers that readings of the store's clock which died left beneath the
    run's CLOCK_DIR (`readings`, by name, as listed), each dead as a copy's marker is
    (markers_dead, by the store's time proven): only the versions listed (If-Match)."""
    if not readings:
        return
    dead, _ = markers_dead({0: readings}, older_than, clock)
    doomed = [(n, readings[n].version) for n in dead.get(0, [])]
    listing.delete_versions(run.child(CLOCK_DIR), options, doomed)


def delete_leftover(
    url: ObjectURL, options: dict[str, object], older_than: datetime.timedelta, clock: StoreClock
) -> None:
    """Delete what a dead save left in the step prefix `url` (ObjectRun.cleanup: no commit
    record by the listing and a HEAD, its newest object older than the cleanup bound
    `older_than`): only the versions listed now (If-Match; an object listed without an ETag is
    left), never a commit record, so that an object another writer puts there meanwhile
    stays, and so does its record; nothing where that listing shows a live archive copy's
    marker or an object younger than the bound (one a writer put since cleanup listed), each
    aged by the store's time proven (`clock`, the cleanup's), never this host's."""
    found = listing.listed(url, options)
    at = clock.proven_time()
    if has_live_marker(found, older_than, at) or not stale(found, older_than, at):
        return
    ours = [(n, e.version) for n, e in found.items() if written_here(n) and n != multifile.COMMIT_NAME]
    listing.delete_versions(url, options, ours)
