"""A remote file's chunks read window by window, within what a load's memory bound leaves.

The chunk reader (chunkread.py) hands the chunks of one object on a store here: their
requests are planned at once (fetchplan), so a window's edge never splits one; the next
windows' requests are in flight while one window's chunks are read (the store kept busy, as
by a plain parallel download), and a window's bytes are given back once read.  Under a
load's max_bytes the windows are sized to what the bound leaves once the index, the
destinations, the decode buffers and the bytes the spools hold already are counted (`Room`);
a bound that leaves less than one window and the largest chunk is refused (LimitError).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from ..errors import LimitError
from . import fetchplan
from .sources import Fetcher

T = TypeVar("T")
Range = tuple[int, int]


@dataclass(frozen=True)
class Room:
    """A load's memory bound (max_bytes) and what it has taken besides the spool's windows."""

    bound: int
    index: int
    tensors: int
    decode: int
    #: bytes the spools hold already that no other read uses (what reads left)
    held: int

    def spare(self) -> int:
        return self.bound - self.index - self.tensors - self.decode - self.held


def windows_for(
    room: Room, stored: Sequence[Range], outstanding: Sequence[Range], path: str
) -> tuple[int, int]:
    """(bytes per window, windows in flight) to read the `stored` byte ranges by under a memory
    bound: what fits `room` beside the largest of them (all of them where what is left to fetch
    fits: bytes held already are in `room`); LimitError naming each part of the bound where not
    even one window does.  What is left to fetch is counted in the whole pages the spool will
    hold for it (small ranges with gaps hold a page each): those of `outstanding` (the
    fetcher's, whole: cuts add no page)."""
    largest = max((hi - lo for lo, hi in stored), default=0)
    to_fetch = fetchplan.paged_bytes(outstanding)
    fits = fetchplan.windows_within(room.spare(), largest, to_fetch)
    if fits is None:
        raise LimitError(
            f"reading these chunks from the store needs more than max_bytes={room.bound} bytes of "
            f"memory: the index {room.index}, the tensors {room.tensors}, decode buffers "
            f"{room.decode}, {room.held} fetched already, and at least "
            f"{fetchplan.least_room(largest)} to fetch chunks through",
            path=path,
        )
    return fits


def read_by_window(
    remote: Fetcher,
    stored: Sequence[Range],
    items: Sequence[T],
    read: Callable[[list[T]], None],
    room: Room | None,
    path: str,
    asked: bool = False,
) -> None:
    """Fetch the `stored` byte range of each of `items` and `read` them a window at a time;
    a chunk is read in the window whose requests bring its last bytes in (the first, where
    those are held or in flight already: their futures come with its own).  Under a bound
    (`room`), requests are no larger than a window, ranges are not merged across gaps (a gap's
    bytes would be held, never given back, until the object is closed) and a window's pages
    are freed before the next window is asked for.  `asked`: every request for them is made
    already (start_into, planned with chunks read elsewhere): only the chunks' own bytes are
    waited for, never a request's range again, whose other bytes the spool does not get."""
    if not items:
        return
    bounded = room is not None
    cell: int | None = None
    gap: int | None = None
    if room is None:
        window, ahead = fetchplan.FETCH_WINDOW, fetchplan.FETCH_AHEAD
        requests = remote.plan(stored)
    else:  # what is left to fetch, counted in pages for the windows' size, cut at their grid
        outstanding = remote.plan(stored, cut=False)
        window, ahead = windows_for(room, stored, outstanding, path)
        requests = fetchplan.cut_at_grid(outstanding, window)
        cell, gap = window, 0
    windows = fetchplan.request_windows(requests, window)
    chunks = fetchplan.chunks_by_window(requests, windows, [(r, (r, item)) for r, item in zip(stored, items)])
    windows = windows or [[]]

    started = 0  # windows asked for, in order ...
    done = 0  # ... and read and given back

    def start(i: int) -> list[Future[None]]:
        nonlocal started
        started = i + 1
        # the window's chunks used (kept in the spool) until read, whatever other reads of the
        # object give back meanwhile
        return remote.start([] if asked else windows[i], cell, gap, uses=[r for r, _ in chunks[i]])

    pending: list[list[Future[None]]] = []
    try:  # the first windows' starts within it too: one that fails gives back the uses before it
        for i in range(min(ahead, len(windows))):
            pending.append(start(i))
        for i, in_window in enumerate(chunks):
            remote.wait(pending.pop(0))
            try:
                if in_window:
                    read([item for _, item in in_window])
            finally:
                done = i + 1
                remote.release([r for r, _ in in_window], wait=bounded)
            if i + ahead < len(windows):
                pending.append(start(i + ahead))
    finally:
        for futures in pending:
            remote.wait_quietly(futures)
        # a read that failed gives back what it asked for and did not read
        if done < started:
            remote.release([r for in_window in chunks[done:started] for r, _ in in_window])
