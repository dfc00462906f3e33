"""The index space of a strided tensor: cut into pieces of bounded span, narrowed, positions.

A strided tensor is (shape, strides, offset) over the elements of a storage.  `cuts` cuts its
index space into pieces whose spans (first element to last, in the storage) are at most a
window of elements, in storage order; `count_cuts` says how many pieces that makes without
making any.  A contiguous tensor's pieces are boxes of at most that many elements in row-major
order (`boxes`).  A piece is a list of narrowings (dim, start, stop), applied one after
another (`narrow`).  Used by load_into's plan and reads (fillplan.py, fillreads.py), its
overlap marks (targets.py) and DCP's regions (dcp/regions.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

#: (dim, start, stop): one narrowing of a piece
Narrowing = tuple[int, int, int]
#: a piece: its narrowings, and a range [lo, hi) (of its storage's elements, or of chunks)
Cut = tuple[list[Narrowing], int, int]


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """The strides of a contiguous (row-major) tensor of `shape`."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def is_row_major(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether `stride` lays out the elements of `shape` as a contiguous tensor's would (a
    dimension of one element has no step, whatever its stride)."""
    want = contiguous_strides(shape)
    return all(s == w or n == 1 for n, s, w in zip(shape, stride, want))


class _Layout:
    """The dimensions of a strided tensor longer than 1, largest stride first, with the span of
    each suffix of them: what the cut recursion walks."""

    def __init__(self, shape: Sequence[int], stride: Sequence[int]) -> None:
        self.shape, self.stride = shape, stride
        self.order = sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: -stride[d])
        self.inner = [1] * (len(self.order) + 1)  # inner[i]: the span, in elements, of dims order[i:]
        for i in range(len(self.order) - 1, -1, -1):
            d = self.order[i]
            self.inner[i] = self.inner[i + 1] + (shape[d] - 1) * stride[d]

    def per_run(self, level: int, w: int) -> int:
        """Indices of dimension order[level] one piece takes, where the dims inside fit `w`."""
        st = self.stride[self.order[level]]
        return self.shape[self.order[level]] if st == 0 else (w - self.inner[level + 1]) // st + 1


def cuts(shape: Sequence[int], stride: Sequence[int], offset: int, w: int) -> Iterator[Cut]:
    """A strided tensor cut into pieces whose spans are at most `w` elements (or one element
    each), in storage order of the outermost dimension, each with the elements [lo, hi) of the
    storage its span covers: its dimensions taken largest stride first, a dimension whose inner
    span fits the window is cut into runs of as many indices as fit, one whose inner span does
    not into single indices, cut further.  A span within the window is one piece."""
    return _cuts(_Layout(shape, stride), max(1, w), 0, offset, [])


def _cuts(lay: _Layout, w: int, level: int, base: int, narrowing: list[Narrowing]) -> Iterator[Cut]:
    inner = lay.inner
    if inner[level] <= w:
        yield narrowing, base, base + inner[level]
        return
    d = lay.order[level]
    n, st, rest = lay.shape[d], lay.stride[d], inner[level + 1]
    if rest > w:
        for i in range(n):
            yield from _cuts(lay, w, level + 1, base + i * st, [*narrowing, (d, i, i + 1)])
        return
    per = lay.per_run(level, w)
    for i in range(0, n, per):
        j = min(n, i + per)
        yield [*narrowing, (d, i, j)], base + i * st, base + (j - 1) * st + rest


def count_cuts(shape: Sequence[int], stride: Sequence[int], w: int) -> int:
    """How many pieces `cuts` makes, in closed form (a product down the dimensions that do not
    fit, the runs of the first that does): nothing is cut, whatever the count."""
    lay, w = _Layout(shape, stride), max(1, w)
    count = 1
    for level in range(len(lay.order)):
        if lay.inner[level] <= w:
            return count
        n = lay.shape[lay.order[level]]
        if lay.inner[level + 1] > w:
            count *= n
            continue
        per = lay.per_run(level, w)
        return count * -(-n // per)
    return count


def boxes(shape: Sequence[int], limit: int) -> Iterator[list[Narrowing]]:
    """`shape`'s index space cut into boxes of at most `limit` elements (or one element each), in
    row-major order: the cuts of a contiguous tensor of that shape."""
    for narrowing, _, _ in cuts(shape, contiguous_strides(shape), 0, limit):
        yield narrowing


def narrow(t: torch.Tensor, narrowing: list[Narrowing]) -> torch.Tensor:
    """Tensor `t` narrowed to a piece."""
    for d, i, j in narrowing:
        t = t.narrow(d, i, j - i)
    return t


def origin(ndim: int, narrowing: list[Narrowing]) -> list[int]:
    """The index of the first element (in row-major order) of a piece cut by `narrowing`."""
    out = [0] * ndim
    for d, i, _ in narrowing:
        out[d] += i
    return out


def linear(index: Sequence[int], shape: Sequence[int]) -> int:
    """The row-major position of `index` in `shape`."""
    out = 0
    for i, n in zip(index, shape):
        out = out * n + i
    return out


def unravel(position: int, shape: Sequence[int]) -> list[int]:
    """The index at row-major `position` of `shape`."""
    out = []
    for n in reversed(shape):
        position, i = divmod(position, n)
        out.append(i)
    return out[::-1]
