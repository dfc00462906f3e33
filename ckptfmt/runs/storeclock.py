"""The store's time as a cleaner of a run on an object store proves it before it judges a
sweep's marker dead (spec 13.7): a marker of its own put, listed and deleted
(objectnames.StoreStamp), so that a listing's Date from another clock than the one stamping
objects makes no live sweep's marker look dead.
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
from .objectnames import StoreStamp, claiming, copy_marker, is_marker, marker_dead, proven_store_time


def read_stamp(url: ObjectURL, options: dict[str, object]) -> StoreStamp:
    """The store's clock as proven now (StoreStamp): a copy marker of this process put into the
    step prefix `url`, read back from a listing of it and deleted (an object of ckptfmt's own
    meanwhile, recognisable as such if this process dies first)."""
    name = copy_marker()
    with claiming(name):
        try:
            # inside the try: a PUT whose answer is lost may still have written the marker,
            # which other hosts would take for a live copy's for a day
            upload_bytes(b"a ckptfmt reading of the store's clock\n", str(url.child(name)), options)
            stamp = StoreStamp(name, time.monotonic())
            stamp.now(listing.listed(url, options), datetime.datetime.now(datetime.timezone.utc))
        except BaseException:
            with contextlib.suppress(CheckpointError, OSError):  # the first failure is the one told
                listing.delete_object(url.child(name), options)
            raise
        listing.delete_object(url.child(name), options)
    return stamp


def markers_dead(
    found: dict[int, dict[str, Listed]],
    now: datetime.datetime,
    older_than: datetime.timedelta,
    dated: datetime.datetime | None,
    date: datetime.datetime | None,
    stamp_in: Callable[[int], StoreStamp],
) -> tuple[dict[int, list[str]], set[int]]:
    """The dead markers of a run's listing `found` by step (marker_dead), and the steps holding
    a live one.  A sweep's marker dead only by the listing's store time, `dated` (store_time;
    `date`: the listing's Date), is judged again by the store's time proven (`stamp_in(step)`,
    one reading for the run, taken only where needed; proven_store_time): a Date from another
    clock than the one stamping objects must not let its marker, which copies wait for, be
    deleted while its sweep may delete."""
    stamp: StoreStamp | None = None
    dead: dict[int, list[str]] = {}
    live: set[int] = set()
    for step, names in found.items():
        for name, entry in names.items():
            if not is_marker(name):
                continue
            gone = marker_dead(name, entry.modified, now, older_than)
            if not gone and marker_dead(name, entry.modified, now, older_than, dated):
                stamp = stamp_in(step) if stamp is None else stamp
                store_now = proven_store_time(date, stamp.now({}, now), now)
                gone = marker_dead(name, entry.modified, now, older_than, store_now)
            if gone:
                dead.setdefault(step, []).append(name)
            else:
                live.add(step)
    return dead, live
