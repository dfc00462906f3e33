"""What the names in a run's prefix on an object store mean (runs/objectrun.py): a commit
record's references to other steps, the objects ckptfmt writes in a step, and the copy
markers an archiver puts into a step's prefix before it writes there, and the store's clock by
which the age of another writer's marker or step is judged (spec 13.7).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeGuard

from ..engine import commit
from ..errors import CorruptError, IncompleteError
from ..files import multifile
from ..files.names import is_own_name
from ..files.places import STALE_AFTER
from ..storage import listing
from ..storage.client import deadline
from ..storage.listing import Listed
from .steps import parse_step_dirname

#: the start of the name of a copy marker: ``step-N/ARCHIVING.<host>.<pid>.<start>.<random>``,
#: written by an archiver before anything else it writes into a step's prefix and deleted
#: after the step's commit record (or the step) is; see remove_interrupted_copies
COPY_MARKER = "ARCHIVING."
#: the start of the name of a sweep's marker: ``step-N/SWEEPING.<host>.<pid>.<start>.<random>``,
#: put by ObjectRun.sweep_step before its last listing of the step and deleted once it is
#: done: a copy that puts its own marker in the step waits for such a sweep to end before it
#: looks for an object there to refer to (one of them sees the other)
SWEEP_MARKER = "SWEEPING."
#: seconds from a sweep's marker within which every DELETE the sweep sends has ended, its
#: deadline included (ObjectRun.sweep_step): it sends none that could end later
SWEEP_DELETES_WITHIN = 300.0
#: the deadline of a sweep's DELETE at most, in seconds (storage option deadline, lowered to
#: this for them): a longer one would leave a sweep no time to delete within its bound
SWEEP_DELETE_DEADLINE = 60.0
#: seconds a store's time is believed ahead of this host's clock at most (storage/listing.py)
STORE_AHEAD_AT_MOST = listing.STORE_AHEAD_AT_MOST
#: the "directory" beneath a run's prefix where a cleaner reads the store's clock
#: (runs/storeclock.py read_stamp): ``<run>/CLOCK/ARCHIVING.<owner>``, a marker named as a
#: copy's is (and aged as one where a reading died), never in a step's prefix, where a
#: concurrent sweep or copy would take it for a live copy's; no step, listing of steps or
#: cleanup of a step sees it
CLOCK_DIR = "CLOCK"
#: seconds a copy waits at most for a sweep whose marker it finds (ObjectRun.wait_out_sweeps),
#: and the age past which a sweep's marker is dead wherever it was written: a sweep's marker,
#: live for at most SWEEP_DELETES_WITHIN, aged by a store time wrong by up to
#: STORE_AHEAD_AT_MOST still looks live while it may delete, with as much again to spare for
#: a DELETE it sent just before its bound (derived, so that changing one keeps it so)
SWEEP_WAIT = SWEEP_DELETES_WITHIN + STORE_AHEAD_AT_MOST + SWEEP_DELETES_WITHIN


Entry = Listed  # what a listing says of one object: size, last written, version
ByStep = dict[int, dict[str, Entry]]  # a run's objects: {step: {name in the step: Entry}}


class RunListing(ByStep):
    """A listing of a run (ObjectRun.listing), `date`: the store's time when it answered
    (storage/listing.py Listing.date), and `readings`: the markers of readings of the store's
    clock beneath CLOCK_DIR (runs/storeclock.py), by name, which one that died leaves."""

    date: datetime.datetime | None = None
    readings: dict[str, Entry]

    def __init__(self) -> None:
        super().__init__()
        self.readings = {}


def sweep_options(options: dict[str, Any]) -> dict[str, Any]:
    """The storage options of a sweep's DELETEs: `options`, their deadline at most
    SWEEP_DELETE_DEADLINE."""
    if deadline(options) <= SWEEP_DELETE_DEADLINE:
        return options
    return options | {"deadline": SWEEP_DELETE_DEADLINE}


def is_copy_marker(name: str) -> bool:
    """Whether `name` (relative to a step's prefix) is an archiver's copy marker."""
    return name.startswith(COPY_MARKER) and "/" not in name


def is_sweep_marker(name: str) -> bool:
    """Whether `name` (relative to a step's prefix) is a sweep's marker."""
    return name.startswith(SWEEP_MARKER) and "/" not in name


def is_marker(name: str) -> bool:
    """Whether `name` (relative to a step's prefix) is a writer's marker: a copy's or a sweep's."""
    return is_copy_marker(name) or is_sweep_marker(name)


def copy_marker() -> str:
    """A copy marker name owned by this process (engine/commit.py's owner rule)."""
    return COPY_MARKER + commit.owned_suffix()


def sweep_marker() -> str:
    """A sweep's marker name owned by this process (engine/commit.py's owner rule)."""
    return SWEEP_MARKER + commit.owned_suffix()


# this process's copy markers whose copy (or deletion) is under way: one of this process's
# markers that is not here was left by a copy that failed
_claims_in_use: collections.Counter[str] = collections.Counter()
_claims_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child has none of its parent's copies or rotations under way (their markers
    are the parent's: engine/commit.py's owner rule), and the lock may have been held."""
    global _claims_lock
    _claims_lock = threading.Lock()
    _claims_in_use.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@contextlib.contextmanager
def claiming(claim: str | None) -> Iterator[None]:
    """Marker `claim` is in use (by a copy or a rotation, which may nest) while this lasts."""
    if claim is None:
        yield
        return
    with _claims_lock:
        _claims_in_use[claim] += 1
    try:
        yield
    finally:
        with _claims_lock:
            _claims_in_use[claim] -= 1
            if not _claims_in_use[claim]:
                del _claims_in_use[claim]


def hold_claim(claim: str) -> None:
    """Marker `claim` stays in use for the rest of this process's life: its copy's commit record
    was written without an answer and may land yet, naming the objects the marker guards, so
    no rotation or sweep of this process may take it for a failed copy's (one of another
    process takes it for live while this process lives: engine/commit.py's owner rule)."""
    with _claims_lock:
        _claims_in_use[claim] += 1


def referenced_step(name: str, owner: str) -> tuple[int, str]:
    """(step, name in it) of a commit record's reference ``../step-N/NAME``; CorruptError for
    anything else (on a store a reference never leaves the run's prefix)."""
    ref = multifile.reference_parts(name)
    step = parse_step_dirname(ref.directory) if ref is not None and ref.up and ref.directory else None
    if ref is None or step is None:
        raise CorruptError(
            f"the commit record refers to {name[:80]!r}, not to a step of this run", path=owner
        )
    return step, ref.name


def check_listed(listed: Listed | None, part: multifile.PartRecord, owner: str) -> None:
    """The listing's entry for a file the commit record names: there, of the recorded length."""
    if listed is None:
        raise IncompleteError(f"{part.name} named by the commit record is missing", path=owner)
    if listed.size != part.length:
        raise CorruptError(
            f"{part.name} is {listed.size} bytes, the commit record says {part.length}", path=owner
        )


def written_here(name: str) -> bool:
    """Whether `name`, in a step's prefix, is an object ckptfmt writes there: its files and
    record (files/names.py is_own_name) or a marker (a copy's or a sweep's)."""
    return is_own_name(name) or is_marker(name)


def in_steps(name: str, steps: set[str]) -> bool:
    """Whether `name` (relative to the run) is an object ckptfmt writes in one of `steps`."""
    step, _, rest = name.partition("/")
    return step in steps and written_here(rest)


def host_now() -> datetime.datetime:
    """This host's clock: it bounds what a store's stamps are believed to say (StoreStamp), and
    tells which markers and steps could look dead at all (store_time_bound), never the age
    of another writer's object itself (it may run ahead of the store's by a day)."""
    return datetime.datetime.now(datetime.timezone.utc)


def store_time_bound(now: datetime.datetime) -> datetime.datetime:
    """The latest time a store time proven now could say, by this host's clock `now`: what
    is young by it is young by every store time believed (StoreStamp caps its stamp at
    STORE_AHEAD_AT_MOST ahead), so nothing needs proving (a cleaner's filter, never a verdict)."""
    return now + datetime.timedelta(seconds=STORE_AHEAD_AT_MOST)


def _believed(t: datetime.datetime | None, now: datetime.datetime) -> TypeGuard[datetime.datetime]:
    """Whether `t`, a time a store told, may be taken as the store's: at most
    STORE_AHEAD_AT_MOST ahead of this host's clock `now`."""
    return t is not None and t <= now + datetime.timedelta(seconds=STORE_AHEAD_AT_MOST)


class StoreStamp:
    """The store's clock as an object this process put proves it: the time the store lists the
    object written (its Last-Modified, stamped by the clock that stamps every object, a sweep's
    marker too), moved on by this process's monotonic clock since the PUT returned.  The stamp
    came before that return, so the time told is never later than the store's (by more than
    the Last-Modified's rounding, a second); a listing's Date may come from another clock (a
    proxy or another gateway in front of the store) and is believed only where earlier.  A
    stamp more than STORE_AHEAD_AT_MOST ahead of this host's clock is taken as that far ahead:
    still no later than the store's where the stamp is true (this host is behind), and where
    it is forged (a hostile store or proxy) no later than this host's clock allows."""

    def __init__(self, name: str, put_returned: float) -> None:
        """`name`: the object's key relative to the prefix listed; `put_returned`: the
        monotonic time its PUT returned."""
        self.name = name
        self.put_returned = put_returned
        self._written: datetime.datetime | None = None

    def now(self, listed: dict[str, Listed], host_time: datetime.datetime) -> datetime.datetime | None:
        """The store's time now, at least, by the object's entry in `listed` (or in a listing
        before: the first that showed it; `host_time`: this host's clock, which caps it); None
        until one shows it (a listing that lags behind the PUT proves nothing)."""
        if self._written is None:
            entry = listed.get(self.name)
            if entry is not None and entry.modified is not None:
                self._written = min(entry.modified, store_time_bound(host_time))
        if self._written is None:
            return None
        return self._written + datetime.timedelta(seconds=time.monotonic() - self.put_returned)

    def store_time(
        self, listed: dict[str, Listed], date: datetime.datetime | None
    ) -> datetime.datetime | None:
        """The store's time by which another writer's objects are aged now (proven_store_time):
        this stamp's, by `listed` as now() reads it, a listing's Date `date` taken where earlier."""
        host = host_now()
        return proven_store_time(date, self.now(listed, host), host)


def proven_store_time(
    date: datetime.datetime | None, proven: datetime.datetime | None, now: datetime.datetime
) -> datetime.datetime | None:
    """The store's time by which another writer's object (a marker, a step's newest object) is
    aged: never later than what the store's own stamps prove, `proven` (a StoreStamp's), a
    listing's Date `date` taken only where earlier (and believed by this host's clock `now`);
    None (nothing aged) where nothing is proven.  An age is the store's time less a
    Last-Modified: a Date from another clock than the one that stamped it (one ahead of it by
    minutes), or this host's clock (a day ahead), would make live work look dead.  Without a
    Date the proven time moves on by this process's clock, where the newest time listed
    would stand still."""
    if proven is None:
        return None
    if date is None or not _believed(date, now):
        return proven
    return min(date, proven)


#: how much older than it is a store's Last-Modified may make an object look: S3 lists them
#: in whole seconds, cut down
STAMP_ROUNDING = datetime.timedelta(seconds=listing.STAMP_ROUNDING)


def aged_past(at: datetime.datetime, when: datetime.datetime, bound: datetime.timedelta) -> bool:
    """Whether an object the store stamped at `when` is older than `bound` at the store's time
    `at` (proven_store_time), though the stamp may be cut down by STAMP_ROUNDING: older by
    that much more, the margin no larger than the bound itself (none for a bound below 0).  A real bound (a day, a
    sweep's wait) is never cut short by the stamp's rounding; a bound of 0, a caller's "all
    written before now", stays that (the proven time moves on from its own stamp by this
    process's clock, so what was written before it is older by more than 0)."""
    return at - when > bound + min(STAMP_ROUNDING, max(bound, datetime.timedelta(0)))


def marker_dead(
    name: str,
    when: datetime.datetime | None,
    older_than: datetime.timedelta,
    at: datetime.datetime | None,
) -> bool:
    """Whether marker `name` (a copy's or a sweep's, written at `when`) was left by a writer
    that has ended: one of this host whose process is gone, or one written elsewhere that is
    older than both `older_than` and STALE_AFTER at the store's time `at` (proven_store_time;
    None: none is aged): a cleaner's shorter bound (cleanup's) must never make a live copy on
    another host look dead, as its age is all that can be asked of it.  A sweep's marker is
    dead too once older than SWEEP_WAIT (the sweep deletes nothing then): one a sweep on
    another host left when killed holds up no copy for longer.  Ages go by the store's time,
    never this host's, which may be ahead of it by more than either bound."""
    if is_sweep_marker(name) and when is not None and at is not None:
        if aged_past(at, when, datetime.timedelta(seconds=SWEEP_WAIT)):
            return True
    suffix = name[len(SWEEP_MARKER if is_sweep_marker(name) else COPY_MARKER) :]
    if suffix.startswith(commit.owner_token() + "."):  # this process's
        with _claims_lock:
            return name not in _claims_in_use
    owner = commit.parse_owned_suffix(suffix)
    verdict = None if owner is None else commit.owner_dead(*owner)
    if verdict is not None:
        return verdict
    return when is not None and at is not None and aged_past(at, when, max(older_than, STALE_AFTER))


def has_live_marker(
    listed: dict[str, Listed],
    older_than: datetime.timedelta,
    at: datetime.datetime | None,
    kind: Callable[[str], bool] = is_marker,
) -> bool:
    """Whether a step's prefix, `listed`, holds the marker (of `kind`: by default a copy's or a
    sweep's) of a writer still at work there (marker_dead, by the store's time `at`): what a
    copy has uploaded so far, or found there to refer to, is not yet named by any record."""
    return any(kind(n) and not marker_dead(n, e.modified, older_than, at) for n, e in listed.items())


def stale(listed: dict[str, Listed], older_than: datetime.timedelta, at: datetime.datetime | None) -> bool:
    """Whether every object of `listed` (a step's prefix) was written more than `older_than`
    before the store's time `at` (None: nothing is stale), as the store lists them (one
    listed without a time, or none listed: not stale, the safe side), by a second more for
    the stamps' rounding (aged_past): a live saver writes more often."""
    times = [e.modified for e in listed.values()]
    if at is None or not times or any(t is None for t in times):
        return False
    return all(aged_past(at, t, older_than) for t in times if t is not None)


def writer_came(before: Collection[str], now: Collection[str]) -> bool:
    """Whether a step's prefix, listed `before` and `now`, holds a copy marker or a commit
    record now that it did not: another writer has come since, and may use what it found
    there (an archiver's copy keeps the very file another's copy, cut short, left), so what
    `before` lists is no longer a dead writer's alone to delete."""
    return any(n not in before and (n == multifile.COMMIT_NAME or is_marker(n)) for n in now)


def in_a_step(name: str) -> bool:
    """Whether `name` (a key relative to the run) is one ckptfmt writes in a step's
    "directory": only those are the run's (a run may share its prefix, even a whole bucket,
    with other things, and a step's with another program's objects)."""
    top, sep, rest = name.partition("/")
    return sep == "/" and is_own_name(rest) and parse_step_dirname(top) is not None
