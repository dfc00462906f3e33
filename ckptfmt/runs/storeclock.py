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
from ..storage import listing
from ..storage.listing import Listed
from ..storage.upload import upload_bytes
from ..storage.urls import ObjectURL
from . import objectnames
from .objectnames import (
    STORE_AHEAD_AT_MOST,
    StoreStamp,
    claiming,
    copy_marker,
    is_marker,
    latest_store_time,
    marker_dead,
)

#: seconds a store's time (a Last-Modified, an upload's start) may be cut down by: S3 lists
#: them in whole seconds
STAMP_ROUNDING = 1.0


def read_stamp(url: ObjectURL, options: dict[str, object]) -> StoreStamp:
    """The store's clock as proven now (StoreStamp): a copy marker of this process put into the
    step prefix `url`, read back from a listing of it and deleted (an object of ckptfmt's own
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
    (read_stamp in the prefix of the step being judged: a PUT, a listing and a DELETE), then
    moved on by this process's monotonic clock; a pass that finds nothing looking old makes
    no request for it."""

    def __init__(self, step_url: Callable[[int], ObjectURL], options: dict[str, object]) -> None:
        """`step_url(step)`: the prefix of step `step`, where the reading's marker goes."""
        self._step_url = step_url
        self._options = options
        self._stamp: StoreStamp | None = None

    def now(self, step: int) -> datetime.datetime | None:
        """The store's time now as proven (StoreStamp), read in step `step`'s prefix if not read
        yet; None where the reading's listing did not show its marker (nothing is aged then).
        No listing's Date is needed: the stamp is the store's own, and moves on without one."""
        if self._stamp is None:
            self._stamp = read_stamp(self._step_url(step), self._options)
        return self._stamp.store_time({}, None)


def markers_dead(
    found: dict[int, dict[str, Listed]],
    older_than: datetime.timedelta,
    clock: StoreClock,
) -> tuple[dict[int, list[str]], set[int]]:
    """The dead markers of a run's listing `found` by step (marker_dead), and the steps holding
    a live one.  A marker not dead by its owner alone but old enough to be dead by the latest
    time the store's could be (latest_store_time) is aged by the store's time proven
    (`clock`, read once for the run, only where needed): neither this host's clock nor a
    Date from another clock than the one stamping objects must let a live writer's marker be
    deleted."""
    latest = latest_store_time(objectnames.host_now())
    dead: dict[int, list[str]] = {}
    live: set[int] = set()
    for step, names in found.items():
        for name, entry in names.items():
            if not is_marker(name):
                continue
            gone = marker_dead(name, entry.modified, older_than, None)
            if not gone and marker_dead(name, entry.modified, older_than, latest):
                gone = marker_dead(name, entry.modified, older_than, clock.now(step))
            if gone:
                dead.setdefault(step, []).append(name)
            else:
                live.add(step)
    return dead, live


def abort_stale_uploads(
    url: ObjectURL,
    options: dict[str, object],
    ours: Callable[[str], bool],
    older_than: datetime.timedelta,
    date: datetime.datetime | None,
    clock: Callable[[], datetime.datetime | None],
) -> None:
    """Abort the uploads beneath `url` whose key relative to it is `ours` begun more than
    `older_than` ago by the store's clock (savers that crashed).  The store stamps when an
    upload began and the bound is an age by this host's clock, so it is moved by how far this
    host's may be ahead of the store's: STORE_AHEAD_AT_MOST where the listing's Date, `date`,
    shows it no further ahead (no request made), else as far as the store's time proven,
    `clock()` (StoreClock.now), shows it, and a second more for the store's rounding; none
    is aborted where no store time is proven.  A host whose clock runs a day ahead so aborts
    no live saver's upload."""
    host = objectnames.host_now()
    margin = datetime.timedelta(seconds=STORE_AHEAD_AT_MOST)
    if date is None or host - date > margin:
        at = clock()
        if at is None:
            return
        margin = max(host - at, datetime.timedelta(0)) + datetime.timedelta(seconds=STAMP_ROUNDING)
    listing.abort_stale_uploads(url, options, older_than + margin, ours)


def abort_uploads_begun_before(
    url: ObjectURL,
    options: dict[str, object],
    ours: Callable[[str], bool],
    began: float,
    at: datetime.datetime | None,
) -> None:
    """Abort the uploads beneath `url` whose key relative to it is `ours` (prefixes a cleaner
    just removed) begun before monotonic time `began` (the cleaner's start) by the store's
    clock, `at` (now, proven: StoreClock): a newcomer's uploads begun since stay.  The store
    stamps when an upload began and the bound is an age by this host's clock, so it is moved
    by how far this host's is ahead of the store's, and by a second more (a store's times
    may be whole seconds, cut down); where no store time is proven (None), none is aborted
    (they go with a later cleanup's stale uploads)."""
    if at is None:
        return
    ahead = objectnames.host_now() - at  # negative where this host's clock is behind
    since = datetime.timedelta(seconds=time.monotonic() - began + STAMP_ROUNDING) + ahead
    listing.abort_stale_uploads(url, options, since, ours)
