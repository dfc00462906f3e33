"""Carrying out a load_into() plan (fillplan.py): chunk reads into targets and the bounce buffer.

`write_targets` does the writes, in three steps: chunks that land whole in a target
are read there in parallel reads of whole targets (through the bounce buffer for a file read with
trusted keys, so that only bytes checked against their signed digests reach a target); chunk ends shared with other tensors, and targets
on accelerators, go through the bounce buffer; targets laid out unlike the file get a
host copy of their storage's chunks (a `ChunkWindow`, which keeps the chunks it holds from one
piece or target to the next), then ``copy_``.  Before any target's memory is
written its key is recorded, so that a failure part way can name what may have changed
(load_into.PartialLoadError): the targets of the reads begun, not the ones still to come.  `windows` cuts a list of chunks into batches that fit the
bounce buffer; the verification pass (load_into.verify_chunks) reads through it too.
`check_equal` compares tied targets' file tensors before any write, in bounded memory.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..engine import bytesview
from ..engine import native as _native
from ..engine.batched import PreparedReads, copy_spans, prepare
from ..format import dtypes
from ..format import layout as fmt
from . import hostalloc
from .fillplan import (
    Piece,
    Plan,
    Strided,
    compare_window,
    cut_for_reading,
    narrowed,
    piece_range,
    range_bytes,
    window_bytes,
)
from .indexspace import Cut, Narrowing, boxes, is_row_major, linear, narrow, origin, unravel
from .reader import CheckpointFile
from .targets import MismatchError

#: an unsigned file's direct reads go in parallel reads of whole targets of at least this
#: many bytes: large enough that waiting for each read's last chunk costs little, small
#: enough that a failure part way names few targets that were never written
_BATCH_BYTES = 256 << 20


def alloc(f: CheckpointFile, nbytes: int) -> torch.Tensor | None:
    """A host buffer of `nbytes` for the reads (None when the plan needs none)."""
    return hostalloc.alloc_bytes(f.path, nbytes, "") if nbytes else None


def windows(
    f: CheckpointFile, chunks: list[int], buf: torch.Tensor
) -> Iterator[tuple[list[tuple[int, memoryview]], list[int]]]:
    """Batches of (chunk, its place in `buf`) for `chunks`, as many as `buf` holds, with their offsets."""
    view = bytesview.tensor_bytes(buf)
    for items, starts in _cut(f, chunks, len(view)):
        yield [(k, view[pos : pos + f.chunks[k].raw_len]) for k, pos in items], starts


def address_windows(
    f: CheckpointFile, chunks: list[int], buf: torch.Tensor
) -> Iterator[list[tuple[int, int]]]:
    """windows() with each place given as its address (the C engine's destinations): no buffer
    export per chunk.  `buf`, a CPU tensor, must outlive the reads."""
    base = buf.data_ptr()
    for items, _ in _cut(f, chunks, buf.numel() * buf.element_size()):
        yield [(k, base + pos) for k, pos in items]


def _cut(
    f: CheckpointFile, chunks: list[int], size: int
) -> Iterator[tuple[list[tuple[int, int]], list[int]]]:
    """Batches of (chunk, its offset) for `chunks` laid side by side in `size` bytes, with the offsets."""
    items: list[tuple[int, int]] = []
    starts: list[int] = []
    pos = 0
    records = f.chunks
    for k in chunks:
        n = records[k].raw_len
        if pos + n > size:
            yield items, starts
            items, starts, pos = [], [], 0
        items.append((k, pos))
        starts.append(pos)
        pos += n
    if items:
        yield items, starts


def write_targets(
    f: CheckpointFile,
    plan: Plan,
    buf: torch.Tensor | None,
    verify: bool,
    touched: dict[str, None],
    reads: PreparedReads | None = None,
) -> None:
    """Read the planned chunks into the targets; when one fails, `touched` holds the keys whose
    memory may have been written.  `reads`: plan.direct prepared (prepare_direct)."""
    # 1. chunks that land whole in a target
    if plan.direct and (f.signed or f.encrypted) and buf is not None:
        _write_direct_checked(f, plan, buf, verify, touched)
    else:
        _write_direct(f, plan, verify, touched, reads)
    # 2. chunk ends shared with other tensors, and targets on accelerators: through the bounce buffer
    if plan.pieces:
        assert buf is not None
        _write_pieces(f, plan, buf, verify, touched)
    # 3. targets laid out unlike the file: their storage's chunks in host memory, then copy_()
    # (a span larger than a window: piece by piece, each from the chunks it lies in)
    if plan.strided:
        assert buf is not None
        _fill_strided(plan, ChunkWindow(f, verify, buf), touched)


def _write_direct(
    f: CheckpointFile, plan: Plan, verify: bool, touched: dict[str, None], reads: PreparedReads | None
) -> None:
    """plan.direct read straight into the targets: parallel reads, a batch of whole targets at a
    time, so that a failure names only the targets of the batches begun.  The keys a batch writes
    are recorded only if a read fails (most loads fail nowhere), or before the steps after this
    one, which may fail."""
    begun = 0  # plan.direct's entries [0, begun) may hold new bytes
    try:
        for batch in _direct_batches(f, plan):
            begun = batch.stop
            if reads is not None:
                reads.read(batch.start, batch.stop, verify)
            else:
                f.read_into([plan.direct[i] for i in batch], verify)
    except BaseException:
        plan.touch(touched, _owners(plan, range(begun)))
        raise
    if plan.pieces or plan.strided:
        plan.touch(touched, _owners(plan, range(begun)))


def _write_direct_checked(
    f: CheckpointFile, plan: Plan, buf: torch.Tensor, verify: bool, touched: dict[str, None]
) -> None:
    """plan.direct for a file read with trusted keys (or an encrypted one): through the bounce
    buffer, each window's chunks checked against their signed digests (or GCM tags) before they
    are copied: no byte that was not signed reaches a target, even when the file changes after
    the first pass verified it."""
    done = 0
    ks = [k for k, _ in plan.direct]
    batches: Iterable[list[tuple[int, memoryview]] | list[tuple[int, int]]] = (
        address_windows(f, ks, buf) if _native.available() else (items for items, _ in windows(f, ks, buf))
    )
    for items in batches:
        f.read_into(items, verify)
        entries = range(done, done + len(items))
        done += len(items)
        plan.touch(touched, _owners(plan, entries))
        _copy_direct(f, plan, entries, [src for _, src in items])


def _write_pieces(
    f: CheckpointFile, plan: Plan, buf: torch.Tensor, verify: bool, touched: dict[str, None]
) -> None:
    """plan.pieces: their chunks read through the bounce buffer, a window at a time, and each
    piece's bytes copied into its target."""
    by_chunk: dict[int, list[Piece]] = {}
    for p in plan.pieces:
        by_chunk.setdefault(p.chunk, []).append(p)
    for items, starts in windows(f, sorted(by_chunk), buf):
        f.read_into(items, verify)
        for (k, _), at in zip(items, starts):
            for p in by_chunk[k]:
                plan.touch(touched, [p.key])
                p.dest.copy_(buf[at + p.start : at + p.end])


def _fill_strided(plan: Plan, window: ChunkWindow, touched: dict[str, None]) -> None:
    """Fill plan.strided's targets through `window`: each one's span's chunks, or its pieces'
    (Strided.pieces), then copy_(); the chunks the window holds are kept for the next target."""
    for s in plan.strided:
        before_write = functools.partial(plan.touch, touched, [s.key])
        # an inference tensor may only be written in inference mode
        with torch.inference_mode() if s.value.is_inference() else contextlib.nullcontext():
            if s.pieces is None:
                window.hold(s.sid, s.first, s.last)
                before_write()
                s.value.copy_(window.source(s.sid, s.meta))
            else:
                fill_pieces(window, s.sid, s.meta, s.value, s.pieces, before_write)


class ChunkWindow:
    """A host buffer holding consecutive chunks of one storage side by side from its start,
    kept from one read to the next: a chunk that several pieces (or targets) lie in is read
    once while they follow each other.  Given a buffer, it holds at most that; without one it
    allocates one as large as the largest range asked for (for `key`, named in a LimitError).
    `chunks_read`: every chunk read into it, each checked as it was read (CheckpointFile.read_into)."""

    def __init__(
        self, f: CheckpointFile, verify: bool, buf: torch.Tensor | None = None, key: str = ""
    ) -> None:
        self.f, self.verify, self.buf, self.key = f, verify, buf, key
        self.sid = -1  # the storage whose chunks it holds
        self.held = (0, 0)  # chunks [held[0], held[1]) of storage sid lie side by side from buf[0]
        self.chunks_read: set[int] = set()

    def hold(self, sid: int, k0: int, k1: int) -> None:
        """Have the buffer hold chunks [k0, k1) of storage `sid`, as part of the chunks it holds
        from its start: the ones already there are kept (moved to the front where the buffer
        would otherwise overflow), only the others read."""
        f = self.f
        need = range_bytes(f, k0, k1)
        if self.buf is None or self.buf.numel() < need:
            self.buf, self.held = hostalloc.alloc_bytes(f.path, need, self.key), (0, 0)
        buf = self.buf
        a, b = self.held
        if sid != self.sid or not a <= k0 < b:  # nothing of it is there: read it whole
            self._read(k0, k1, buf[:need])
            self.sid, self.held = sid, (k0, k1)
            return
        if k1 <= b:
            return
        cs = f.chunk_size  # every chunk of one storage but its last is chunk_size bytes
        if (k1 - a) * cs > buf.numel():  # no room after them: keep chunks [k0, b) at the front
            kept = buf[(k0 - a) * cs : (b - a) * cs].clone()
            buf[: kept.numel()].copy_(kept)
            a = k0
        at = (b - a) * cs
        self._read(b, k1, buf[at : at + range_bytes(f, b, k1)])
        self.held = (a, k1)

    def _read(self, k0: int, k1: int, dest: torch.Tensor) -> None:
        self.f.read_into(_place(self.f, k0, k1, dest), self.verify)
        self.chunks_read.update(range(k0, k1))

    def source(self, sid: int, m: dict[str, Any]) -> torch.Tensor:
        """File tensor `m` of storage `sid` over the buffer, which holds the chunks it lies in."""
        assert self.buf is not None and sid == self.sid
        return _source(self.f, sid, m, self.buf, self.held[0])


def fill_pieces(
    window: ChunkWindow,
    sid: int,
    m: dict[str, Any],
    dest: torch.Tensor,
    pieces: Iterable[Cut],
    before_write: Callable[[], None] | None = None,
) -> None:
    """Fill `dest` (of file tensor m's shape) from file tensor `m` of storage `sid` piece by
    piece (`pieces`, fillplan.pieces_of `m`), each piece's chunks held in `window` then
    copied: a chunk larger than a piece's span is read once, not once per piece;
    `before_write` is called before the first copy."""
    for narrowing, k0, k1 in pieces:
        window.hold(sid, k0, k1)
        if before_write is not None:
            before_write()
            before_write = None
        narrow(dest, narrowing).copy_(window.source(sid, narrowed(m, narrowing)))


def _copy_direct(
    f: CheckpointFile, plan: Plan, entries: Iterable[int], sources: Sequence[memoryview | int]
) -> None:
    """Copy the chunks of plan.direct's `entries` from `sources` (host memory, in order) into
    their places: with the C engine (addresses, as make_plan gives then) one call for all of
    them, else one by one (byte views)."""
    direct, records = plan.direct, f.chunks
    if not _native.available():
        for i, src in zip(entries, sources):
            dest = direct[i][1]
            assert isinstance(dest, memoryview) and isinstance(src, memoryview)
            dest[:] = src
        return
    spans: list[int] = []
    for i, src in zip(entries, sources):
        k, dest = direct[i]
        assert isinstance(dest, int) and isinstance(src, int)
        spans += (src, dest, records[k].raw_len)
    copy_spans(spans, _native.default_threads())


def _owners(plan: Plan, entries: Iterable[int]) -> list[str]:
    """The keys that the direct entries `entries` write, each once, in order."""
    return list(dict.fromkeys(key for i in entries for key in plan.direct_owners[i]))


def _direct_batches(f: CheckpointFile, plan: Plan) -> Iterator[range]:
    """plan.direct's entries in batches of whole targets, each one parallel read of at least
    _BATCH_BYTES (and a few chunks per engine thread); one target a batch where chunks are
    read one by one anyway (no C engine): a read stops at its first failure, so the targets
    of later batches are unchanged."""
    least = max(_BATCH_BYTES, 4 * _native.default_threads() * f.chunk_size) if _native.available() else 0
    start = size = 0
    records, owners = f.chunks, plan.direct_owners
    for i, (k, _) in enumerate(plan.direct):
        if size >= least and i > start and owners[i] != owners[i - 1]:
            yield range(start, i)
            start, size = i, 0
        size += records[k].raw_len
    if start < len(plan.direct):
        yield range(start, len(plan.direct))


def prepare_direct(f: CheckpointFile, plan: Plan, verify: bool) -> PreparedReads | None:
    """plan.direct's reads prepared once for both passes of an atomic load_into(), where they
    can be: a plan of whole chunks only, raw, of this local file, checked (verify), neither
    signed nor encrypted (those go through the bounce buffer).  Raw chunks checked only pass
    through the engine's own buffer, so the first pass never writes a target."""
    if not verify or f.signed or f.encrypted or plan.pieces or plan.strided or not plan.direct:
        return None
    records = f.chunks
    raw = fmt.CODEC_RAW
    if any(records[k].codec != raw for k, _ in plan.direct):
        return None
    direct: list[tuple[int, int]] = plan.direct  # type: ignore[assignment]  # addresses with the engine
    return prepare(f.chunk_reader, direct)  # reads prepared once, run twice


def _place(f: CheckpointFile, first: int, last: int, dest: torch.Tensor) -> list[tuple[int, memoryview]]:
    """Chunks [first, last) side by side in `dest`, each with its place there."""
    view = bytesview.tensor_bytes(dest)
    out, pos = [], 0
    for k in range(first, last):
        n = f.chunks[k].raw_len
        out.append((k, view[pos : pos + n]))
        pos += n
    return out


def _source(f: CheckpointFile, sid: int, m: dict[str, Any], buf: torch.Tensor, first: int) -> torch.Tensor:
    """File tensor `m` of storage `sid` over buf, which holds the storage's chunks from `first` on."""
    dt = dtypes.TORCH_DTYPES[m["dtype"]]
    start = (first - f.storages[sid].first_chunk) * f.chunk_size  # byte of the storage at buf[0]
    size = dt.itemsize
    offset = (m["offset"] * size - start) // size  # chunk sizes are powers of two >= 4 KiB
    t = torch.empty(0, dtype=dt).set_(buf.untyped_storage(), offset, m["shape"], m["stride"])
    return t.conj() if m["conj"] else t


def check_equal(f: CheckpointFile, plan: Plan, verify: bool) -> set[int]:
    """Tied targets whose file tensors the file holds apart (Plan.equal): each pair of tensors is
    read and compared byte for byte before any target is written; MismatchError naming both keys
    where they differ.  (Chunk checksums cannot stand in for the bytes: they are bound to their
    position in the file, spec section 4, so equal chunks have different checksums.)  Returns
    the chunks read, each checked as the verification pass would (with `verify`, its checksum;
    without, its decoding): that pass need not read them again."""
    read: set[int] = set()
    for a, b in plan.equal:
        at = _first_difference(f, a, b, verify, read)
        if at is not None:
            nbytes = a.value.numel() * a.value.element_size()
            raise MismatchError(
                f"targets {a.key!r} and {b.key!r} are the same memory, but the checkpoint holds "
                f"different values for them (from byte {at} of {nbytes}): one would be filled over "
                "the other; nothing was written",
                path=f.path,
            )
    return read


def _first_difference(f: CheckpointFile, a: Strided, b: Strided, verify: bool, read: set[int]) -> int | None:
    """The first byte, in element order, where file tensors a and b (of one dtype and shape)
    differ, or None; the chunks read added to `read`.  Tensors both laid out row-major (storage
    order is element order) are compared as byte ranges of their storages, a window at a time;
    others by their values, a box of elements at a time."""
    ma, mb = a.meta, b.meta
    shape = ma["shape"]
    if ma["conj"] == mb["conj"] and all(is_row_major(shape, m["stride"]) for m in (ma, mb)):
        return _ranges_differ(f, a, b, verify, read)
    return _values_differ(f, a, b, verify, read)


def _ranges_differ(f: CheckpointFile, a: Strided, b: Strided, verify: bool, read: set[int]) -> int | None:
    """The first byte where the storage ranges of row-major tensors a and b differ, or None: read a
    window of each at a time into one bounded buffer."""
    size = a.value.element_size()
    nbytes = a.value.numel() * size
    cs = f.chunk_size
    step = window_bytes(f, nbytes)
    half = step + cs  # a window of bytes lies in at most step / cs + 1 chunks
    buf = hostalloc.alloc_bytes(f.path, 2 * half, a.key)
    for p in range(0, nbytes, step):
        n = min(step, nbytes - p)
        x = _read_range(f, a, a.meta["offset"] * size + p, n, buf[:half], verify, read)
        y = _read_range(f, b, b.meta["offset"] * size + p, n, buf[half:], verify, read)
        at = _differ_at(x, y)
        if at is not None:
            return p + at
    return None


def _read_range(
    f: CheckpointFile, s: Strided, lo: int, n: int, dest: torch.Tensor, verify: bool, read: set[int]
) -> torch.Tensor:
    """Bytes [lo, lo + n) of the storage of `s`, read with the chunks they lie in into `dest`
    (those chunks added to `read`)."""
    cs = f.chunk_size
    first = f.storages[s.sid].first_chunk
    k0, k1 = piece_range(first, cs, lo, lo + n)
    f.read_into(_place(f, k0, k1, dest[: range_bytes(f, k0, k1)]), verify)
    read.update(range(k0, k1))
    at = lo % cs
    return dest[at : at + n]


def _values_differ(f: CheckpointFile, a: Strided, b: Strided, verify: bool, read: set[int]) -> int | None:
    """The first byte, in element order, where the values of file tensors a and b (of one dtype
    and shape, laid out differently) differ, or None; the chunks read added to `read`.

    Compared a piece of a at a time, in a's storage order: pieces of at most
    max(_SPAN_WINDOW, N / _COMPARE_PIECES) bytes of span (N: the tensor's bytes), each one's
    elements gathered box by box (boxes of at most that many bytes of elements; a piece is one
    box unless its elements overlap) into one dense host tensor, and b's elements at the same
    indices into another, each through a window of its tensor's chunks, read in pieces of
    _SPAN_WINDOW (in that tensor's storage order).  Reads: a's chunks once (once per box where a
    piece's elements overlap); b's once per piece of a at most: once where the two layouts order
    their elements alike (a slice with gaps, an offset), about _COMPARE_PIECES times where they
    do not (one the other's transpose: a 1 GiB pair reads b ~8 times, not once per 16 MiB of a,
    64 times).  Memory: the two boxes, each at most max(_SPAN_WINDOW, N / _COMPARE_PIECES), and
    the chunks of one piece of _SPAN_WINDOW of each tensor: ~N/4 for a large pair, a few tens of
    MiB up to 128 MiB.  A
    piece or box whose first element (in element order) is at or past the first difference found
    so far is skipped before its chunks are read: where a's storage order is element order, the
    comparison stops at the first."""
    size = a.value.element_size()
    shape, ndim = a.meta["shape"], len(a.meta["shape"])
    window = compare_window(a.value.numel() * size)
    limit = max(1, window // size)
    dt = dtypes.TORCH_DTYPES[a.meta["dtype"]]
    n = min(limit, a.value.numel())
    xs, ys = torch.empty(n, dtype=dt), torch.empty(n, dtype=dt)
    wa, wb = ChunkWindow(f, verify, key=a.key), ChunkWindow(f, verify, key=b.key)
    first: int | None = None  # the first differing byte found so far, in element order

    def past_first(narrowing: list[Narrowing]) -> bool:
        return first is not None and linear(origin(ndim, narrowing), shape) * size >= first

    pieces_a = (  # a's pieces as planned, where they are of that window
        a.pieces
        if a.pieces is not None and a.pieces.window == window
        else cut_for_reading(f, a.key, a.meta, size, window)
    )
    for cut, _, _ in pieces_a:
        if past_first(cut):
            continue
        pa, pb = narrowed(a.meta, cut), narrowed(b.meta, cut)
        for box in boxes(pa["shape"], limit):
            if past_first([*cut, *box]):
                continue
            ma, mb = narrowed(pa, box), narrowed(pb, box)
            x, y = (t[: math.prod(ma["shape"])].view(ma["shape"]) for t in (xs, ys))
            fill_pieces(wa, a.sid, ma, x, cut_for_reading(f, a.key, ma, size))
            whole_b = b.pieces if not cut and not box else None  # b's own pieces, as planned
            fill_pieces(
                wb, b.sid, mb, y, whole_b if whole_b is not None else cut_for_reading(f, b.key, mb, size)
            )
            at = _differ_at(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            if at is not None:
                element, byte = divmod(at, size)
                index = [o + i for o, i in zip(origin(ndim, [*cut, *box]), unravel(element, ma["shape"]))]
                at = linear(index, shape) * size + byte
                first = at if first is None else min(first, at)
    read.update(wa.chunks_read)
    read.update(wb.chunks_read)
    return first


#: _differ_at compares this many bytes at a time: its mask of differences stays this small
_COMPARE_BLOCK = 1 << 20


def _differ_at(x: torch.Tensor, y: torch.Tensor) -> int | None:
    """The first index where host byte tensors x and y (of one length) differ, or None: found a
    block at a time, each block's mask of differences searched for its first (argmax: the first
    of the largest), never a list of every difference.  Compared by numpy: torch.equal took
    2-20 ms a MiB on these machines (its thread pool on 2 busy cores), numpy 0.07 ms."""
    xs, ys = x.numpy(), y.numpy()
    for p in range(0, len(xs), _COMPARE_BLOCK):
        a, b = xs[p : p + _COMPARE_BLOCK], ys[p : p + _COMPARE_BLOCK]
        if not np.array_equal(a, b):
            return p + int(np.argmax(a != b))
    return None
