"""The plan of a load_into(): which chunk bytes go where, computed before any is read.

A target whose memory is laid out like the file's tensor (the same strides,
dense, the same conjugate bit) receives the tensor's byte range of the file's
storage: chunks that lie wholly inside that range are read straight into the
target's memory (`Plan.direct`); the one or two chunks at its ends (when the
tensor shares its storage with others, or the target is a view into a larger
buffer) are read into a small bounce buffer and only their overlapping bytes are
copied (`Piece`).  Any other target (transposed, strided, another conjugate bit,
an accelerator tensor laid out differently) is filled with ``copy_`` from a host
copy of the chunks its elements lie in (`Strided`); a file tensor whose span (first element to
last) is larger than _SPAN_WINDOW is read in pieces of at most that span (`Pieces`, counted
and bounded once per target and kept on its entry as `Strided.pieces`), each piece's elements
copied from a window of its chunks: a strided tensor of a hostile file, two elements a GiB
apart, costs two chunks, not a GiB, and one whose strides overlap into a piece per element is
refused (`pieces_of`).  Only a target's own bytes
are ever written: the rest of a flat buffer it is a view of is left alone.
Values that are not tensors, and meta tensors, which have no memory, are replaced
in their container by what the file holds (`Plan.replace`).

Tied targets (one tensor under several keys, found by targets.match) are filled
once, through the first key; where the file holds their tensors apart, the pair is
listed (`Plan.equal`) for its bytes to be compared before anything is written.

The plan also sizes the one host buffer the reads go through (`Plan.buffer_bytes`).
fillreads.py carries the plan out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import bytesview
from ..engine import native as _native
from ..errors import LimitError
from .indexspace import Cut, Narrowing, count_cuts, cuts
from .reader import CheckpointFile
from .targets import Matched, same_layout

#: the bounce buffer holds at most this many bytes (or one chunk, when chunks are larger) ...
_WINDOW_MAX = 64 << 20
#: ... and at most 1/_WINDOW_SHARE of the bytes being loaded (at least one chunk)
_WINDOW_SHARE = 24
#: a strided file tensor whose span is larger is read in pieces of at most this span
_SPAN_WINDOW = 16 << 20

#: a strided file tensor is refused when cutting it makes more pieces than this many per window
#: of its span and of its elements (plus _PIECES_SLACK): the layouts of slices, transposes,
#: expands, narrows and nested as_strided make at most 1.5 past the slack (200,000 random ones
#: tried; tests/test_load_into_pieces.py checks random ones against it); only strides that
#: overlap (a hostile file) make more, up to one piece per element
_PIECES_PER_WINDOW = 6
_PIECES_SLACK = 16
#: a tied pair in two layouts is compared in about this many pieces of the first tensor (each of
#: at least _SPAN_WINDOW bytes of span): the second is read about this many times at most
_COMPARE_PIECES = 8


@dataclass
class Piece:
    """Bytes [start, end) of a chunk that belong in a target (a copy through the bounce buffer)."""

    chunk: int
    start: int
    end: int
    dest: torch.Tensor  # uint8, end - start bytes of the target's memory (any device)
    key: str


@dataclass
class Strided:
    """A target laid out unlike the file: chunks [first, last) of its storage, then copy_()."""

    key: str
    value: torch.Tensor
    meta: dict[str, Any]
    sid: int
    first: int
    last: int
    #: None: the span is read whole (at most _SPAN_WINDOW bytes); else its pieces (pieces_of),
    #: counted and bounded once here for every pass that reads or sizes them
    pieces: Pieces | None = None


@dataclass
class Plan:
    """Where each chunk the targets need goes, and which values are replaced instead."""

    #: chunk -> its place in a target: its address with the C engine (chunkrecords.read_chunks,
    #: native.copy_spans), a byte view without
    direct: list[tuple[int, memoryview | int]] = field(default_factory=list)
    direct_owners: list[list[str]] = field(default_factory=list)  # per direct entry: the keys it writes
    pieces: list[Piece] = field(default_factory=list)
    strided: list[Strided] = field(default_factory=list)
    replace: list[tuple[Any, Any, int]] = field(default_factory=list)  # (container, key, node)
    aliases: dict[str, list[str]] = field(default_factory=dict)  # key -> later keys, the same memory
    #: tied targets whose file tensors are not one view of one storage: the spans of both file
    #: tensors, their values compared before any target is written (fillreads.check_equal)
    equal: list[tuple[Strided, Strided]] = field(default_factory=list)

    def touch(self, touched: dict[str, None], keys: list[str]) -> None:
        """Record `keys` (and the keys naming the same memory) as about to be written."""
        for key in keys:
            touched[key] = None
            touched.update(dict.fromkeys(self.aliases.get(key, ())))

    def chunks(self, f: CheckpointFile) -> list[int]:
        """Every chunk the writes read, in file order: of a strided target read in pieces, only
        the chunks its pieces lie in (two elements a GiB apart: two chunks, not a GiB's)."""
        ks = {k for k, _ in self.direct} | {p.chunk for p in self.pieces}
        for s in self.strided:
            if s.pieces is None:
                ks.update(range(s.first, s.last))
            else:
                for _, k0, k1 in s.pieces:
                    ks.update(range(k0, k1))
        return sorted(ks)

    def span_bytes(self, f: CheckpointFile) -> int:
        """The largest host copy a strided target needs (its span's chunks, or its largest piece's)."""
        return max((span_read_bytes(f, s) for s in self.strided), default=0)

    def buffer_bytes(self, f: CheckpointFile, verifying: bool = False) -> int:
        """One host buffer serves the verification pass, the pieces and the strided spans."""
        chunks = self.chunks(f)
        needed = sum(f.chunks[k].raw_len for k in chunks)
        window = window_bytes(f, needed) if (verifying and chunks) or self.pieces else 0
        return max(window, self.span_bytes(f))


def window_bytes(f: CheckpointFile, needed: int) -> int:
    """The bounce buffer for pieces and the verification pass: a few chunks, bounded."""
    cs = f.chunk_size
    threads = _native.default_threads() if _native.available() else 1
    n = min(2 * threads, _WINDOW_MAX // cs, needed // (_WINDOW_SHARE * cs))
    return max(1, n) * cs


def span_elements(m: dict[str, Any]) -> int:
    """The elements of its storage that file tensor `m` spans, from its first to its last."""
    return sum((n - 1) * st for n, st in zip(m["shape"], m["stride"])) + 1


def span_read_bytes(f: CheckpointFile, s: Strided) -> int:
    """The host memory that reading strided target `s` needs: its span's chunks, or the chunks
    of its largest piece."""
    if s.pieces is None:
        return range_bytes(f, s.first, s.last)
    return s.pieces.largest() * f.chunk_size


class Pieces:
    """File tensor `m` (elements of `size` bytes) cut into pieces whose spans are at most
    `window` bytes (indexspace.cuts), each with the chunks [k0, k1) of its storage that its
    span lies in.  Cut anew at each iteration, never listed: a tensor with a span of a TiB has
    some 10^5 pieces, a list of them some 100 MiB.  `count` is known before any is cut."""

    def __init__(self, f: CheckpointFile, m: dict[str, Any], size: int, window: int, count: int) -> None:
        self.f, self.m, self.size, self.window, self.count = f, m, size, window, count
        self._largest: int | None = None

    def __iter__(self) -> Iterator[Cut]:
        f, m, size = self.f, self.m, self.size
        first, cs = f.storages[m["storage"]].first_chunk, f.chunk_size
        for cut, lo, hi in cuts(m["shape"], m["stride"], m["offset"], self.window // size):
            yield (cut, *piece_range(first, cs, lo * size, hi * size))

    def __len__(self) -> int:
        return self.count

    def largest(self) -> int:
        """The chunks of the piece that lies in the most of them (worked out once)."""
        if self._largest is None:
            self._largest = max(k1 - k0 for _, k0, k1 in self)
        return self._largest


def pieces_of(f: CheckpointFile, key: str, m: dict[str, Any], size: int, window: int | None = None) -> Pieces:
    """File tensor `m` of target `key` (elements of `size` bytes) in pieces of at most `window`
    bytes of span (_SPAN_WINDOW by default); LimitError, before any piece is cut, where that makes more than
    _PIECES_PER_WINDOW pieces per window of its span and of its elements (+ _PIECES_SLACK).

    What the bound buys: each piece costs a read of its chunks and a copy (~150 us on these
    machines), so a file whose strides overlap (shape [2] * 20, every stride 16 MiB + 1: a
    20 KB file, 10^6 pieces of one byte for a 1 MiB target, minutes) is refused at once; a
    tensor that passes costs a few pieces per 16 MiB of the storage it spans or of the target it
    fills, time that grows with the bytes of the file and of the target, never with a layout."""
    window = _SPAN_WINDOW if window is None else window
    w = max(1, window // size)
    count = count_cuts(m["shape"], m["stride"], w)
    numel = math.prod(m["shape"])
    bound = _PIECES_PER_WINDOW * (span_elements(m) + numel) // w + _PIECES_SLACK
    if count > bound:
        raise LimitError(
            f"the saved tensor's strides overlap so that reading it {window} bytes of span at a time "
            f"takes {count} pieces, over the limit of {bound} for its span and size: refused as a "
            "hostile layout",
            path=f.path,
            key=key,
        )
    return Pieces(f, m, size, window, count)


def cut_for_reading(
    f: CheckpointFile, key: str, m: dict[str, Any], size: int, window: int | None = None
) -> Iterable[Cut]:
    """File tensor `m` of target `key` as pieces_of cuts it, or its whole span as one piece where
    that is at most `window` bytes (_SPAN_WINDOW by default)."""
    span = span_elements(m) * size
    if span > (_SPAN_WINDOW if window is None else window):
        return pieces_of(f, key, m, size, window)
    lo = m["offset"] * size
    return [([], *piece_range(f.storages[m["storage"]].first_chunk, f.chunk_size, lo, lo + span))]


def compare_window(nbytes: int) -> int:
    """The span of the pieces in which the first of a tied pair of `nbytes` bytes each, laid out
    unlike the second, is compared (fillreads._values_differ): at most _COMPARE_PIECES of them,
    so that the second is read at most about that many times, each at least _SPAN_WINDOW."""
    return max(_SPAN_WINDOW, nbytes // _COMPARE_PIECES)


def piece_range(first: int, cs: int, lo: int, hi: int) -> tuple[int, int]:
    """The chunks [k0, k1) that bytes [lo, hi) of a storage whose first chunk is `first` lie in
    (chunks of `cs` bytes)."""
    return first + lo // cs, first + (hi - 1) // cs + 1


def narrowed(m: dict[str, Any], narrowing: list[Narrowing]) -> dict[str, Any]:
    """File tensor `m` narrowed to a piece (indexspace.cuts): its offset and shape changed."""
    shape = list(m["shape"])
    offset = m["offset"]
    for d, i, j in narrowing:
        shape[d] = j - i
        offset += i * m["stride"][d]
    return {**m, "shape": shape, "offset": offset}


def range_bytes(f: CheckpointFile, first: int, last: int) -> int:
    """Bytes of chunks [first, last) once decoded."""
    return sum(f.chunks[k].raw_len for k in range(first, last))


def dense(shape: list[int], stride: list[int]) -> bool:
    """The elements fill exactly numel consecutive slots (no gaps, no overlap)."""
    expected = 1
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


def _same_bytes(value: torch.Tensor, m: dict[str, Any]) -> bool:
    """The target's memory is the file tensor's byte range, byte for byte."""
    if value.is_contiguous() and tuple(m["stride"]) == value.stride():  # the common case, at once
        return not value.is_neg() and value.is_conj() == m["conj"]
    return same_layout(value, m) and dense(m["shape"], m["stride"])


def make_plan(f: CheckpointFile, matched: Matched) -> Plan:
    """The plan for matched targets (targets.match); counts each target loaded in its report.
    The targets match found to take one whole chunk each (`Matched.whole`, by position) go
    straight into plan.direct; tied targets (`Matched.sharing`) are filled once, through the
    first of them, after their file tensors' bytes are compared where the file holds them apart
    (`Plan.equal`)."""
    plan = Plan()
    targets, whole, sharing = matched.targets, matched.whole, matched.sharing
    if whole and len(whole) == len(targets) and not sharing.found and _native.available():
        plan.direct = list(whole.values())  # each at an address of its own: no spans overlap
        plan.direct_owners = [[t[0]] for t in targets]  # whole holds every position, in order
        matched.report.loaded += len(plan.direct)
        return plan
    in_file, nodes = matched.in_file, f.tree.nodes
    aliases = sharing.aliases
    addresses = matched.addresses()
    direct_seen: dict[tuple[int, int], int] = {}  # (chunk, address) -> its entry in plan.direct
    # without the engine, chunks go to byte views of the targets (_plan_tensor), not addresses
    whole = whole if _native.available() else {}
    loaded = 0  # added to the report at the end
    strided_at: dict[int, Strided] = {}  # position -> its entry in plan.strided
    tensor = torch.Tensor
    for pos, (key, container, ckey, value) in enumerate(targets):
        place = whole.get(pos)
        if place is not None and pos not in aliases:
            loaded += 1
            _add_direct(plan, direct_seen, place, key, place[1])
            continue
        i = in_file.get(key)
        if i is None:
            continue
        if not isinstance(value, tensor):
            if not isinstance(container, tuple):
                plan.replace.append((container, ckey, i))
                loaded += 1
            continue
        loaded += 1
        first = aliases.get(pos)
        if first is not None:  # the same memory from the same values (tied weights): once is enough
            plan.aliases.setdefault(targets[first][0], []).append(key)
        elif value.is_meta:  # no memory: replaced by the loaded tensor
            plan.replace.append((container, ckey, i))
        elif value.numel():
            s = _plan_tensor(f, plan, direct_seen, key, value, nodes[i][1], addresses[pos])
            if s is not None:
                strided_at[pos] = s
    matched.report.loaded += loaded
    # a tied pair's first target, when strided, is compared through the entry that fills it
    plan.equal = [(_tied(f, matched, a, strided_at), _tied(f, matched, b, {})) for a, b in sharing.equal]
    plan.strided.sort(key=lambda s: (s.first, -s.last))
    return plan


def _tied(f: CheckpointFile, matched: Matched, pos: int, planned: dict[int, Strided]) -> Strided:
    """The span of the file tensor of target `pos`, a tied target whose values are compared: its
    entry in `planned` (by position) where it has one, else worked out here."""
    s = planned.get(pos)
    if s is not None:
        return s
    key, _, _, value = matched.targets[pos]
    return span_of(f, key, value, f.tree.nodes[matched.in_file[key]][1])


def _add_direct(
    plan: Plan,
    direct_seen: dict[tuple[int, int], int],
    where: tuple[int, int],
    key: str,
    place: memoryview | int,
) -> None:
    """Chunk where[0] read straight to address where[1] (`place`: that address, or a byte view of
    it without the engine) for `key`, or `key` added to the owners of the same read planned for
    an earlier target (targets that share memory as the file's tensors share their storage)."""
    entry = direct_seen.get(where)
    if entry is not None:
        plan.direct_owners[entry].append(key)
    else:
        direct_seen[where] = len(plan.direct)
        plan.direct.append((where[0], place))
        plan.direct_owners.append([key])


def span_of(f: CheckpointFile, key: str, value: torch.Tensor, m: dict[str, Any]) -> Strided:
    """Target `value` filled from file tensor `m` by copy_(): the chunks `m` lies in, from its
    first element to its last, and its pieces where that span is larger than _SPAN_WINDOW."""
    cs, size, rec = f.chunk_size, value.element_size(), f.storages[m["storage"]]
    span = span_elements(m) * size
    lo = m["offset"] * size
    pieces = pieces_of(f, key, m, size) if span > _SPAN_WINDOW else None
    return Strided(key, value, m, m["storage"], *piece_range(rec.first_chunk, cs, lo, lo + span), pieces)


def _plan_tensor(
    f: CheckpointFile,
    plan: Plan,
    direct_seen: dict[tuple[int, int], int],
    key: str,
    value: torch.Tensor,
    m: dict[str, Any],
    base: int,
) -> Strided | None:
    """Plan one tensor target with elements, the first of them at address `base`: chunks read
    straight into it, pieces through the bounce buffer, or a strided copy (its entry returned)."""
    if not _same_bytes(value, m):
        s = span_of(f, key, value, m)
        plan.strided.append(s)
        return s
    numel, size = value.numel(), value.element_size()
    cs, chunks, rec = f.chunk_size, f.chunks, f.storages[m["storage"]]
    lo = m["offset"] * size
    hi = lo + numel * size
    on_cpu = value.is_cpu
    raw = None if on_cpu and _native.available() else bytesview.elements_as_uint8(value)
    view = bytesview.tensor_bytes(raw) if on_cpu and raw is not None else None
    for j in range(lo // cs, (hi - 1) // cs + 1):
        k = rec.first_chunk + j
        c0 = j * cs
        c1 = c0 + chunks[k].raw_len
        if on_cpu and lo <= c0 and c1 <= hi:  # the whole chunk lies in the target
            # the engine writes raw_len bytes there, all inside the target's elements
            at = base + c0 - lo
            _add_direct(plan, direct_seen, (k, at), key, at if view is None else view[c0 - lo : c1 - lo])
        else:
            a, b = max(lo, c0), min(hi, c1)
            if raw is None:
                raw = bytesview.elements_as_uint8(value)
            plan.pieces.append(Piece(k, a - c0, b - c0, raw[a - lo : b - lo], key))
    return None
