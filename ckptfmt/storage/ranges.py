"""Byte ranges of an object: the requests that fetch them (cut at a grid of cells, near
neighbours merged), what is left of them once others are held, the pages they hold in the
spool, and the memory their bytes go to when a request fills several buffers in order."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from ..engine.fetchplan import cut_at_grid
from .spool import PAGE

#: adjacent ranges closer than this are fetched in one request
MERGE_GAP = 64 * 1024
#: one request asks for at most this much (storage option request_size): larger ranges are
#: split so they run in parallel; 8-16 MiB is the usual advice for S3, and every request
#: costs a round trip (and, on some servers, a pass over the whole object)
REQUEST_BYTES = 16 * (1 << 20)

Range = tuple[int, int]


def plan_requests(
    ranges: Sequence[Range], max_bytes: int = REQUEST_BYTES, gap: int = MERGE_GAP
) -> list[Range]:
    """The requests that fetch `ranges` (half-open): sorted, near neighbours merged, long
    stretches cut at the multiples of `max_bytes` (the grid), so none crosses a cell."""
    return cut_at_grid(merge_ranges(ranges, gap), max_bytes)


def merge_ranges(ranges: Sequence[Range], gap: int = 0) -> list[Range]:
    """`ranges` sorted, empty ones dropped, those overlapping or closer than `gap` joined."""
    merged: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if merged and lo <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def subtract_ranges(ranges: Sequence[Range], held: Sequence[Range]) -> list[Range]:
    """The parts of `ranges` outside `held` (sorted and disjoint, as merge_ranges gives)."""
    out: list[Range] = []
    for lo, hi in merge_ranges(ranges):
        i = max(0, bisect.bisect_right(held, (lo, lo)) - 1)
        while lo < hi and i < len(held) and held[i][0] < hi:
            a, b = held[i]
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
            i += 1
        if lo < hi:
            out.append((lo, hi))
    return out


def overlaps(ranges: Sequence[Range], r: Range) -> bool:
    """Whether `r` overlaps any of `ranges` (sorted and disjoint, as merge_ranges gives)."""
    i = bisect.bisect_left(ranges, (r[1], r[1]))  # the first range starting at or after r's end
    return i > 0 and ranges[i - 1][1] > r[0]


def page_edges(r: Range, taken: Sequence[Range], size: int) -> Range:
    """Range `r` given back, widened to the edges of the pages it ends in where nothing else
    of those pages is held or in flight (`taken`, sorted and disjoint): the spool frees only
    whole pages, and a page two ranges share would otherwise stay once both are given back."""
    lo, hi = r
    floor, ceil = grid_cells(lo, hi, PAGE, size)
    if floor < lo and not overlaps(taken, (floor, lo)):
        lo = floor
    if hi < ceil and not overlaps(taken, (hi, ceil)):
        hi = ceil
    return lo, hi


def grid_cells(lo: int, hi: int, cell: int, size: int) -> Range:
    """[lo, hi) widened to the edges of the grid cells it touches, within [0, size)."""
    return lo // cell * cell, min(size, -(-hi // cell) * cell)


def views_after(views: Sequence[memoryview], skip: int) -> list[memoryview]:
    """`views` (bytes in order) less their first `skip` bytes: where a resumed body goes."""
    out = []
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        out.append(v[skip:])
        skip = 0
    return out


def routed(
    r: Range, targets: Sequence[tuple[int, memoryview]], spool: Callable[[int, int], memoryview]
) -> tuple[list[memoryview], list[Range]]:
    """Where the bytes of request `r` go, in order: the parts of `targets` ((offset, memory),
    sorted, disjoint; empty ones take no byte) within it, each cut once, and `spool`'s memory
    for the gaps between them (returned too), made to their size."""
    lo, hi = r
    i = max(0, bisect.bisect_right(targets, lo, key=lambda t: t[0]) - 1)
    while i > 0 and not len(targets[i][1]):  # an empty target inside the one that holds lo
        i -= 1
    views: list[memoryview] = []
    gaps: list[Range] = []
    at = lo  # where the bytes placed so far end
    for start, view in targets[i:]:
        if start >= hi:
            break
        a, b = max(lo, start), min(hi, start + len(view))
        if a >= b:
            continue
        if a > at:
            gaps.append((at, a))
            views.append(spool(at, a))
        views.append(view[a - start : b - start])
        at = b
    if at < hi:
        gaps.append((at, hi))
        views.append(spool(at, hi))
    return views, gaps
