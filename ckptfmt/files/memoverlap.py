"""Whether two strided views of memory share a byte, decided exactly without listing elements.

A view is the address of its first element, its element size and, per dimension, an extent
and a stride in bytes.  Views whose byte spans clash may still share no byte: interleaved
views (``x[::2]`` and ``x[1::2]``), a weight's column blocks (``W[:, :k]`` and ``W[:, k:]``).
Element x of one view (of `size_a` bytes) and element y of the other (`size_b`) share a byte
exactly when x - y lies in [1 - size_a, size_b - 1], and the differences x - y form the set
c + sum(k_d * u_d) over 0 <= k_d <= m_d (the other view's dimensions taken backwards, so that
every u_d is positive).  Dimensions of one stride, and a dimension whose stride is a multiple
of a smaller one that its range leaves no gap in, merge into one exactly (`_merged`): the two
cases above become one dimension each.  What remains is searched largest stride first, each
branch cut where the values left (a multiple of the rest's common divisor, up to their reach)
cannot hit the interval.  Views of regular layouts take a few steps; an irregular pair that
would take more than MAX_STEPS is left undecided (None), for the caller to refuse.  A caller
testing many pairs passes a `Budget`, the steps all its tests may take together.

A view overlaps itself (`overlaps_itself`) when two distinct index tuples share a byte: their
difference sum(k_d * u_d) has some k_d != 0; taking the first nonzero k_d positive (the pair
swapped otherwise) leaves one search of the same kind per dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd

#: (extent, stride in bytes) of one dimension of a view
Dim = tuple[int, int]

#: the candidates the search may try before it gives up (None): far beyond any regular layout
MAX_STEPS = 1 << 16


class Budget:
    """The steps that several tests may take together: each test is charged its steps and
    PER_TEST more (its own cost, however few steps it takes).  Once it is spent, a test is
    undecided (None) without a step, and `spent` says why."""

    PER_TEST = 16

    def __init__(self, steps: int) -> None:
        self.left = steps
        self.spent = False


def views_meet(
    start_a: int,
    size_a: int,
    dims_a: Sequence[Dim],
    start_b: int,
    size_b: int,
    dims_b: Sequence[Dim],
    budget: Budget | None = None,
) -> bool | None:
    """Whether view a and view b share a byte: True, False, or None when undecided (past
    MAX_STEPS, or past what is left of `budget`)."""
    c = start_a - start_b
    ranges: dict[int, int] = {}  # stride -> the largest multiple k of it that a difference takes
    for n, u in dims_a:
        if n > 1 and u:
            ranges[u] = ranges.get(u, 0) + n - 1
    for n, u in dims_b:  # -j * u over j in [0, n) is -(n - 1) * u + k * u over k in [0, n)
        if n > 1 and u:
            c -= (n - 1) * u
            ranges[u] = ranges.get(u, 0) + n - 1
    dims = _merged(sorted(ranges.items()))
    if budget is None:
        return _hits(c, 1 - size_a, size_b - 1, dims, MAX_STEPS)[0]
    if budget.left <= 0:
        budget.spent = True
        return None
    limit = min(MAX_STEPS, budget.left)
    result, steps = _hits(c, 1 - size_a, size_b - 1, dims, limit)
    budget.left -= steps + budget.PER_TEST
    if result is None and limit < MAX_STEPS:
        budget.spent = True  # undecided for want of the budget, not by the test's own limit
    return result


def overlaps_itself(size: int, dims: Sequence[Dim]) -> bool | None:
    """Whether two distinct elements of a view (elements of `size` bytes; `dims` its extents and
    byte strides) share a byte: True, False, or None when undecided (past MAX_STEPS)."""
    live = [(n, u) for n, u in dims if n > 1]
    if any(u == 0 for _, u in live):
        return True
    undecided = False
    for d, (n, u) in enumerate(live):
        # k_d in [1, n - 1] (the first nonzero one), every later k_e in [-(n_e - 1), n_e - 1]
        c = u
        ranges: dict[int, int] = {}
        if n > 2:
            ranges[u] = n - 2
        for ne, ue in live[d + 1 :]:
            c -= (ne - 1) * ue
            ranges[ue] = ranges.get(ue, 0) + 2 * (ne - 1)
        found, _ = _hits(c, 1 - size, size - 1, _merged(sorted(ranges.items())), MAX_STEPS)
        if found:
            return True
        undecided = undecided or found is None
    return None if undecided else False


def _merged(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(stride, largest k) pairs in ascending stride, merged where their sums leave no gap: k1 * u
    + k2 * (r * u) over k1 <= m1, k2 <= m2 takes every multiple of u up to m1 + r * m2 when the
    step r * u is at most one past the first's reach ((m1 + 1) * u)."""
    out: list[tuple[int, int]] = []
    for u, m in dims:
        if out:
            u0, m0 = out[-1]
            if u % u0 == 0 and u // u0 <= m0 + 1:
                out[-1] = (u0, m0 + (u // u0) * m)
                continue
        out.append((u, m))
    return out


def _hits(c: int, lo: int, hi: int, dims: list[tuple[int, int]], limit: int) -> tuple[bool | None, int]:
    """Whether c + sum(k_d * u_d), 0 <= k_d <= m_d, takes a value in [lo, hi] (`dims`: (u, m) in
    ascending u), None after `limit` candidates; with the candidates tried."""
    dims = dims[::-1]  # the largest stride first: it leaves the fewest candidates
    n = len(dims)
    reach = [0] * (n + 1)  # reach[i]: the largest sum of dims[i:]
    common = [0] * (n + 1)  # common[i]: every sum of dims[i:] is a multiple of it
    for i in range(n - 1, -1, -1):
        u, m = dims[i]
        reach[i] = reach[i + 1] + u * m
        common[i] = gcd(common[i + 1], u)
    steps = 0
    stack = [(0, c)]
    while stack:
        i, c = stack.pop()
        if i == n:
            if lo <= c <= hi:
                return True, steps
            continue
        # the sum still to add lies in [lo - c, hi - c], in [0, reach[i]], and is a multiple of common[i]
        a, b = max(lo - c, 0), min(hi - c, reach[i])
        g = common[i]
        if a > b or -(-a // g) * g > b:
            continue
        u, m = dims[i]
        first = max(0, -(-(lo - c - reach[i + 1]) // u))
        last = min(m, (hi - c) // u)
        if first > last:
            continue
        steps += last - first + 1
        if steps > limit:
            return None, steps
        stack.extend((i + 1, c + k * u) for k in range(first, last + 1))
    return False, steps
