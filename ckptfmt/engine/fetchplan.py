"""How a remote file's chunk reads are cut into windows of requests.

A chunk reader reading an object on a store keeps FETCH_AHEAD windows of requests in flight
(the store's parallel requests kept busy, as by a plain parallel download) and reads the
chunks of one window once its bytes are in, then gives them back: memory holds about
FETCH_AHEAD x FETCH_WINDOW bytes, and the bytes of one chunk whose range crosses a window's
edge.  A load under a memory bound (max_bytes) takes smaller windows, or fewer, where that
would not fit what the bound leaves (`windows_within`).  The spool holds whole pages, so
what a window holds is counted in the pages its requests touch (`paged_bytes`): many small
ranges with gaps between them hold a page or two each for a few hundred bytes.  Planning is
pure: requests and byte ranges in, groups out.
"""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Sequence
from typing import TypeVar

#: a window's requests bring in at most this many bytes (one request at least)
FETCH_WINDOW = 16 << 20
#: windows whose requests are in flight while one is read
FETCH_AHEAD = 8
#: the smallest window a load under a memory bound is read by (whole pages: the spool frees
#: whole pages)
MIN_WINDOW = 256 << 10
_PAGE = mmap.PAGESIZE  # the spool frees whole pages of this size
#: the spool holds whole pages: the windows are counted in pages (paged_bytes), the chunk
#: that crosses a window's edge in bytes, and it is one run: a page more at each of its edges
_EDGES = 2 * _PAGE

T = TypeVar("T")


def cut_at_grid(requests: Sequence[tuple[int, int]], cell: int) -> list[tuple[int, int]]:
    """`requests` cut at the multiples of `cell`, so that none crosses a cell's edge."""
    out: list[tuple[int, int]] = []
    for lo, hi in requests:
        edges = [lo, *range((lo // cell + 1) * cell, hi, cell), hi]
        out.extend(zip(edges, edges[1:]))
    return out


def page_span(lo: int, hi: int) -> tuple[int, int]:
    """[lo, hi) widened to the edges of the pages it touches: what the spool holds for it."""
    return lo // _PAGE * _PAGE, -(-hi // _PAGE) * _PAGE


def paged_bytes(ranges: Sequence[tuple[int, int]]) -> int:
    """The bytes of the whole pages `ranges` (any order, may overlap) touch, a page two of
    them share counted once: the memory the spool takes to hold them."""
    total = end = 0
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        first, last = page_span(lo, hi)
        total += max(0, last - max(first, end))
        end = max(end, last)
    return total


def windows_within(room: int, largest: int, total: int) -> tuple[int, int] | None:
    """(bytes per window, windows in flight) whose fetches, with the bytes of a chunk of
    `largest` stored bytes that crosses a window's edge, hold at most `room` bytes: FETCH_WINDOW
    and FETCH_AHEAD where they fit or where all there is to read does (`total`: the bytes of
    the pages it touches, paged_bytes), else windows of room / FETCH_AHEAD (at least
    MIN_WINDOW), as many as fit; None where not even one MIN_WINDOW does.  The requests must
    then be cut at a grid of the window's size (whole pages), so that no request holds more
    than a window, and grouped by request_windows, which counts their pages."""
    if room >= total:
        return FETCH_WINDOW, FETCH_AHEAD
    spare = room - largest - _EDGES
    if spare >= FETCH_AHEAD * FETCH_WINDOW:
        return FETCH_WINDOW, FETCH_AHEAD
    window = max(MIN_WINDOW, spare // FETCH_AHEAD // _PAGE * _PAGE)
    if window > spare:
        return None
    return window, min(FETCH_AHEAD, spare // window)


def least_room(largest: int) -> int:
    """The fewest bytes windows_within can read chunks of `largest` stored bytes through: the
    chunk with a page at each of its edges, and one MIN_WINDOW."""
    return largest + MIN_WINDOW + _EDGES


def request_windows(
    requests: Sequence[tuple[int, int]], window: int = FETCH_WINDOW
) -> list[list[tuple[int, int]]]:
    """`requests` (sorted, disjoint) in consecutive groups whose pages hold at most `window`
    bytes (paged_bytes; one request at least): a request `window` bytes or fewer within a
    grid cell of `window` bytes, whole pages, is a group by itself at most."""
    windows: list[list[tuple[int, int]]] = []
    held = end = 0  # the bytes of the pages the last group holds, and where its last page ends
    for lo, hi in requests:
        first, last = page_span(lo, hi)
        adds = last - max(first, end)  # a page the previous request holds is counted once
        if not windows or held + adds > window:
            windows.append([])
            held, adds = 0, last - first
        windows[-1].append((lo, hi))
        held += adds
        end = last
    return windows


def chunks_by_window(
    requests: Sequence[tuple[int, int]],
    windows: Sequence[Sequence[tuple[int, int]]],
    items: Sequence[tuple[tuple[int, int], T]],
) -> list[list[T]]:
    """Each item (its stored byte range, a value) in the window whose requests bring its last
    bytes in (the first, where those are held or in flight already: no request covers them);
    one list per window, at least one list."""
    starts = [lo for lo, _ in requests]
    window_of = [i for i, w in enumerate(windows) for _ in w]
    grouped: list[list[T]] = [[] for _ in windows] or [[]]
    for (lo, hi), value in items:
        j = bisect.bisect_left(starts, hi) - 1  # the last request before the range's end
        grouped[window_of[j] if j >= 0 and requests[j][1] > lo else 0].append(value)
    return grouped
