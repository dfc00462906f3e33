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
would take more than MAX_STEPS is left undecided (None), for the caller to refuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd

#: (extent, stride in bytes) of one dimension of a view
Dim = tuple[int, int]

#: the candidates the search may try before it gives up (None): far beyond any regular layout
MAX_STEPS = 1 << 16


def views_meet(
    start_a: int, size_a: int, dims_a: Sequence[Dim], start_b: int, size_b: int, dims_b: Sequence[Dim]
) -> bool | None:
    """Whether view a and view b share a byte: True, False, or None when undecided."""
    c = start_a - start_b
    ranges: dict[int, int] = {}  # stride -> the largest multiple k of it that a difference takes
    for n, u in dims_a:
        if n > 1 and u:
            ranges[u] = ranges.get(u, 0) + n - 1
    for n, u in dims_b:  # -j * u over j in [0, n) is -(n - 1) * u + k * u over k in [0, n)
        if n > 1 and u:
            c -= (n - 1) * u
            ranges[u] = ranges.get(u, 0) + n - 1
    return _hits(c, 1 - size_a, size_b - 1, _merged(sorted(ranges.items())))


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


def _hits(c: int, lo: int, hi: int, dims: list[tuple[int, int]]) -> bool | None:
    """Whether c + sum(k_d * u_d), 0 <= k_d <= m_d, takes a value in [lo, hi] (`dims`: (u, m) in
    ascending u); None after MAX_STEPS candidates."""
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
                return True
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
        if steps > MAX_STEPS:
            return None
        stack.extend((i + 1, c + k * u) for k in range(first, last + 1))
    return False
