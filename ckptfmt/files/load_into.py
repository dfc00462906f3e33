"""load_into(): fill existing tensors in place, like load_state_dict(strict=...).

Every tensor of the target is matched by key path with the checkpoint; all
shapes and dtypes are checked before anything is modified.  Non-tensor values
are set in mutable containers.  Targets on the "meta" device have no memory:
the loaded tensor replaces them in their container.

How bytes reach a target
------------------------
A target whose memory is laid out like the file's tensor (the same strides,
dense, the same conjugate bit) receives the tensor's byte range of the file's
storage: chunks that lie wholly inside that range are read straight into the
target's memory; the one or two chunks at its ends (when the tensor shares its
storage with others, or the target is a view into a larger buffer) are read
into a small bounce buffer and only their overlapping bytes are copied.  Any
other target (transposed, strided, another conjugate bit, an accelerator
tensor laid out differently) is filled with ``copy_`` from a host copy of the
chunks its elements lie in.  Only a target's own bytes are ever written: the
rest of a flat buffer it is a view of is left alone.

All or nothing (``atomic=True``, the default)
-------------------------------------------
load_into() works in two passes.  The first reads every chunk the targets need
into a bounded, reused bounce buffer and checks it (checksum, padding, decoding,
content digest), loads the new objects that replace values and meta targets,
and allocates every buffer the second pass uses; nothing of the caller's is
written.  The second pass reads the chunks again, verified again, into the
targets.  Its cost is a second read of the data: about twice the time when the
file is in memory (tmpfs, page cache), less on disk, where the second read
mostly finds the file in the page cache the first one filled (unless the file
is larger than free memory).  Peak extra memory stays a few chunks.

The guarantee: when load_into() raises, no target was modified, for every
problem the file has when load_into() starts (damaged or missing chunks,
truncation, undecodable data, a referenced file missing or replaced), for every
mismatch between file and targets, and for every error while reading or
allocating during the first pass.  What it cannot promise is the second pass:
if the file's bytes change, or a read fails, after they were verified, the
second pass detects it (with verify=True) but the targets written before that
point keep their new values.  That case raises :class:`PartialLoadError`, which
lists the keys that may hold new values; the other targets are unchanged.  A
change of the file's size or modification time between the start of
load_into() and the end of the first pass is caught before anything is written
(:class:`FileChangedError`).  Renaming another file over the path, or deleting
it, while load_into() runs changes nothing: the open file is read to the end.
ckptfmt itself never writes into an existing checkpoint, so the second-pass
case needs another program writing into the file in place, or a read error on
the second read.  With verify=False neither pass checks checksums, so such a
change can go unnoticed.

``atomic=False`` is the single-pass path: chunks go straight into the targets
and are checked there, so an error found part way leaves the targets written so
far with new values (and a damaged chunk's bytes in its target).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..background import inflight
from ..engine import bytesview
from ..engine import native as _native
from ..errors import CheckpointError
from ..format import dtypes, tree
from ..format.decode import decode_key
from ..gcpause import pausing_in_main_thread
from .reader import CheckpointFile


class MismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the target: keys, shapes or dtypes differ."""


class FileChangedError(CheckpointError):
    """The file changed while load_into() verified it; no target was modified."""


class PartialLoadError(CheckpointError):
    """load_into() failed after it began writing into the targets.

    The file was verified first, so this means its bytes changed, or could not be
    read again, after that.  `modified_keys` may hold new values; every other target
    is unchanged.  The error that stopped the load is the ``__cause__``.
    """

    def __init__(self, message: str, *, path: str, modified_keys: list[str]) -> None:
        super().__init__(message, path=path)
        self.modified_keys = modified_keys


@dataclass
class LoadReport:
    """What load_into() found, like the result of load_state_dict()."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    loaded: int = 0


#: the bounce buffer holds at most this many bytes (or one chunk, when chunks are larger) ...
_WINDOW_MAX = 64 << 20
#: ... and at most 1/_WINDOW_SHARE of the bytes being loaded (at least one chunk)
_WINDOW_SHARE = 24


def _before_write(f: CheckpointFile) -> None:
    """Called between the passes of an atomic load (tests replace it to change the file there)."""


def _stamp(f: CheckpointFile) -> tuple[int, ...]:
    """What says the open file's bytes changed: its size and modification time.  (Not its change
    time: renaming another file over the path, as every save does, changes that of the old one.)"""
    st = os.fstat(f._fd)
    return (st.st_size, st.st_mtime_ns)


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _target_items(obj: Any, prefix: str) -> Iterator[tuple[str, Any, Any, Any]]:
    """(dotted key, container, key in container, value) for every leaf of the target."""
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return
    for k, v in items:
        path = _join(prefix, k)
        if isinstance(v, (dict, list, tuple)) and not isinstance(v, torch.Size):
            yield from _target_items(v, path)
        else:
            yield path, obj, k, v


def _file_items(f: CheckpointFile, i: int, prefix: str) -> Iterator[tuple[str, int]]:
    node = f.tree.nodes[i]
    if node[0] in ("dict", "odict"):
        for k, v in node[1]:
            key = decode_key(f.tree, k, f.path)
            yield from _file_items(f, v, _join(prefix, key))
    elif node[0] in ("list", "tuple"):
        for n, j in enumerate(node[1]):
            yield from _file_items(f, j, _join(prefix, n))
    else:
        yield prefix, i


@pausing_in_main_thread
def load_into(
    path: str | os.PathLike[str],
    state: Any,
    *,
    strict: bool = True,
    verify: bool = True,
    atomic: bool = True,
) -> LoadReport:
    """Fill the tensors of `state` from the checkpoint at `path`; return missing/unexpected keys.

    Raises MismatchError before modifying anything when a shape or dtype differs,
    or (with strict=True) when keys are missing or unexpected.

    With atomic=True (the default) the file is verified before any target is
    written: when load_into() raises, every target is unchanged, except after a
    change to the file (or a read error) between its verification and the second
    read, which raises PartialLoadError naming the keys that may hold new values.
    atomic=False reads once, straight into the targets: faster, but an error
    found part way leaves the targets filled so far with new values.
    """
    inflight.wait_for_path(path)
    with CheckpointFile(path) as f:
        return fill_from_node(f, f.tree.root, state, strict=strict, verify=verify, atomic=atomic)


def _tensor_problem(key: str, value: torch.Tensor, node: list[Any], container: Any) -> str | None:
    if node[0] != "tensor":
        return f"{key}: the checkpoint holds a {node[0]}, the target a tensor"
    m = node[1]
    if list(value.shape) != m["shape"]:
        return f"{key}: shape mismatch: checkpoint {m['shape']}, target {list(value.shape)}"
    if dtypes.TORCH_DTYPES[m["dtype"]] != value.dtype:
        return (
            f"{key}: dtype mismatch: checkpoint {m['dtype']}, target "
            f"{dtypes.TORCH_NAMES.get(value.dtype, str(value.dtype))}"
        )
    # targets load_into() could not write: found now, not half way through the writes
    if value.is_meta:
        if isinstance(container, tuple):
            return f"{key}: a meta tensor inside a tuple cannot be replaced"
        return None
    if value.numel() > 1 and torch._debug_has_internal_overlap(value) == 1:
        return f"{key}: several elements of the target share memory (an expanded tensor?)"
    return None


def _key_problems(report: LoadReport) -> str:
    """The first few missing and unexpected keys, for a strict load's error."""
    parts = []
    for what, keys in (("missing", report.missing_keys), ("unexpected", report.unexpected_keys)):
        if keys:
            parts.append(f"{what} keys {keys[:5]}" + ("..." if len(keys) > 5 else ""))
    return "; ".join(parts)


def fill_from_node(
    f: CheckpointFile, top: int, state: Any, *, strict: bool, verify: bool, atomic: bool = True
) -> LoadReport:
    """load_into() for the subtree of node `top` of an open file: key paths are relative to it."""
    in_file = dict(_file_items(f, top, ""))
    targets = list(_target_items(state, ""))
    report = LoadReport()
    target_keys = set()
    problems = []
    for key, container, _, value in targets:
        target_keys.add(key)
        i = in_file.get(key)
        if i is None:
            report.missing_keys.append(key)
            continue
        if isinstance(value, torch.Tensor):
            problem = _tensor_problem(key, value, f.tree.nodes[i], container)
            if problem:
                problems.append(problem)
    report.unexpected_keys = [k for k in in_file if k not in target_keys]
    if problems:
        raise MismatchError(
            problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""), path=f.path
        )
    if strict and (report.missing_keys or report.unexpected_keys):
        raise MismatchError(_key_problems(report), path=f.path)
    plan = _plan(f, targets, in_file, report)
    with torch.no_grad():
        if atomic:
            _fill_atomic(f, plan, verify)
        else:
            buf = _alloc(f, plan.buffer_bytes(f))
            _write(f, plan, buf, verify, {})
            for container, ckey, i in plan.replace:
                container[ckey] = f.load_subtree(i, None, verify)
    return report


# -- the plan: which chunk bytes go where -----------------------------------------------------


@dataclass
class _Piece:
    """Bytes [start, end) of a chunk that belong in a target (a copy through the bounce buffer)."""

    chunk: int
    start: int
    end: int
    dest: torch.Tensor  # uint8, end - start bytes of the target's memory (any device)
    key: str


@dataclass
class _Strided:
    """A target laid out unlike the file: chunks [first, last) of its storage, then copy_()."""

    key: str
    value: torch.Tensor
    meta: dict[str, Any]
    sid: int
    first: int
    last: int


@dataclass
class _Plan:
    direct: list[tuple[int, memoryview]] = field(default_factory=list)  # chunk -> its place in a target
    direct_keys: list[str] = field(default_factory=list)
    pieces: list[_Piece] = field(default_factory=list)
    strided: list[_Strided] = field(default_factory=list)
    replace: list[tuple[Any, Any, int]] = field(default_factory=list)  # (container, key, node)
    aliases: dict[str, list[str]] = field(default_factory=dict)  # key -> later keys, the same memory

    def touch(self, touched: dict[str, None], keys: list[str]) -> None:
        """Record `keys` (and the keys naming the same memory) as about to be written."""
        for key in keys:
            touched[key] = None
            touched.update(dict.fromkeys(self.aliases.get(key, ())))

    def chunks(self) -> list[int]:
        """Every chunk the writes read, in file order."""
        ks = {k for k, _ in self.direct} | {p.chunk for p in self.pieces}
        for s in self.strided:
            ks.update(range(s.first, s.last))
        return sorted(ks)

    def span_bytes(self, f: CheckpointFile) -> int:
        return max((_range_bytes(f, s.first, s.last) for s in self.strided), default=0)

    def window(self, f: CheckpointFile, needed: int) -> int:
        """The bounce buffer for pieces and the verification pass: a few chunks, bounded."""
        cs = f.chunk_size
        threads = _native.default_threads() if _native.available() else 1
        n = min(2 * threads, _WINDOW_MAX // cs, needed // (_WINDOW_SHARE * cs))
        return max(1, n) * cs

    def buffer_bytes(self, f: CheckpointFile, verifying: bool = False) -> int:
        """One host buffer serves the verification pass, the pieces and the strided spans."""
        chunks = self.chunks()
        needed = sum(f.chunks[k].raw_len for k in chunks)
        window = self.window(f, needed) if (verifying and chunks) or self.pieces else 0
        return max(window, self.span_bytes(f))


def _range_bytes(f: CheckpointFile, first: int, last: int) -> int:
    return sum(f.chunks[k].raw_len for k in range(first, last))


def _bytes_of(value: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over a dense target's memory: [data_ptr, data_ptr + nbytes)."""
    size = value.element_size()
    return torch.empty(0, dtype=torch.uint8, device=value.device).set_(
        value.untyped_storage(), value.storage_offset() * size, (value.numel() * size,), (1,)
    )


def _dense(shape: list[int], stride: list[int]) -> bool:
    """The elements fill exactly numel consecutive slots (no gaps, no overlap)."""
    expected = 1
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


def _same_bytes(value: torch.Tensor, m: dict[str, Any]) -> bool:
    """The target's memory is the file tensor's byte range, byte for byte."""
    return (
        not value.is_neg()
        and value.is_conj() == bool(m["conj"])
        and all(a == b for a, b, n in zip(value.stride(), m["stride"], m["shape"]) if n != 1)
        and _dense(m["shape"], m["stride"])
    )


def _plan(
    f: CheckpointFile, targets: list[tuple[str, Any, Any, Any]], in_file: dict[str, int], report: LoadReport
) -> _Plan:
    plan = _Plan()
    cs = f.chunk_size
    seen: dict[tuple[Any, ...], str] = {}
    direct_seen: set[tuple[int, int]] = set()
    for key, container, ckey, value in targets:
        i = in_file.get(key)
        if i is None:
            continue
        if not isinstance(value, torch.Tensor):
            if not isinstance(container, tuple):
                plan.replace.append((container, ckey, i))
                report.loaded += 1
            continue
        report.loaded += 1
        m = f.tree.nodes[i][1]
        if value.is_meta:
            plan.replace.append((container, ckey, i))
            continue
        if value.numel() == 0:
            continue
        sid = m["storage"]
        same = (
            value.device,
            value.data_ptr(),
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
            value.is_conj(),
            value.is_neg(),
            sid,
            m["offset"],
            tuple(m["stride"]),
            m["conj"],
        )
        if same in seen:  # the same memory from the same bytes (tied weights): once is enough
            plan.aliases.setdefault(seen[same], []).append(key)
            continue
        seen[same] = key
        rec = f.storages[sid]
        size = value.element_size()
        if _same_bytes(value, m):
            lo = m["offset"] * size
            hi = lo + value.numel() * size
            raw = _bytes_of(value)
            view = bytesview.tensor_bytes(raw) if value.device.type == "cpu" else None
            in_direct = False
            for j in range(lo // cs, (hi - 1) // cs + 1):
                k = rec.first_chunk + j
                c0 = j * cs
                c1 = c0 + f.chunks[k].raw_len
                a, b = max(lo, c0), min(hi, c1)
                if view is not None and (a, b) == (c0, c1):
                    where = (k, raw.data_ptr() + c0 - lo)
                    if where not in direct_seen:  # else another target reads it into this memory
                        direct_seen.add(where)
                        plan.direct.append((k, view[c0 - lo : c1 - lo]))
                    in_direct = True
                else:
                    plan.pieces.append(_Piece(k, a - c0, b - c0, raw[a - lo : b - lo], key))
            if in_direct:
                plan.direct_keys.append(key)
        else:
            lo = m["offset"] * size
            hi = (m["offset"] + sum((n - 1) * st for n, st in zip(m["shape"], m["stride"])) + 1) * size
            first, last = rec.first_chunk + lo // cs, rec.first_chunk + (hi - 1) // cs + 1
            plan.strided.append(_Strided(key, value, m, sid, first, last))
    plan.strided.sort(key=lambda s: (s.first, -s.last))
    return plan


# -- the passes -------------------------------------------------------------------------------


def _alloc(f: CheckpointFile, nbytes: int) -> torch.Tensor | None:
    return f._alloc(nbytes, "") if nbytes else None


def _windows(
    f: CheckpointFile, chunks: list[int], buf: torch.Tensor
) -> Iterator[tuple[list[tuple[int, memoryview]], list[int]]]:
    """Batches of (chunk, its place in `buf`) for `chunks`, as many as `buf` holds, with their offsets."""
    view = bytesview.tensor_bytes(buf)
    items: list[tuple[int, memoryview]] = []
    starts: list[int] = []
    pos = 0
    for k in chunks:
        n = f.chunks[k].raw_len
        if pos + n > len(view):
            yield items, starts
            items, starts, pos = [], [], 0
        items.append((k, view[pos : pos + n]))
        starts.append(pos)
        pos += n
    if items:
        yield items, starts


def verify_chunks(
    f: CheckpointFile, chunks: list[int], verify: bool, buf: torch.Tensor | None = None
) -> None:
    """Read and check `chunks` through a bounce buffer (`buf`, or one of a few chunks); write nothing else.

    With verify=False the checksums are skipped but every chunk is still read and
    decoded, so truncation and undecodable data are found.
    """
    if not chunks:
        return
    if buf is None:
        needed = sum(f.chunks[k].raw_len for k in chunks)
        buf = f._alloc(_Plan().window(f, needed), "")
    # check only: the caller reads the chunks again into their places (no readahead advice,
    # as in ChunkReader: the kernel's own keeps up with reads in file order)
    for items, _ in _windows(f, chunks, buf):
        f.read_into(items, verify, check_only=True)


def verify_subtree(f: CheckpointFile, top: int, verify: bool = True) -> None:
    """verify_chunks() for every chunk of every storage under node `top` (bounded memory)."""
    chunks = [
        k
        for sid in tree.storages_under(f.tree, top)
        for k in range(f.storages[sid].first_chunk, f.storages[sid].first_chunk + f.storages[sid].n_chunks)
    ]
    verify_chunks(f, chunks, verify)


def _fill_atomic(f: CheckpointFile, plan: _Plan, verify: bool) -> None:
    # pass 1: everything that can fail, nothing of the caller's written
    stamp = _stamp(f)
    replaced = [(container, ckey, f.load_subtree(i, None, verify)) for container, ckey, i in plan.replace]
    buf = _alloc(f, plan.buffer_bytes(f, verifying=True))
    if buf is not None:
        verify_chunks(f, plan.chunks(), verify, buf)
    if _stamp(f) != stamp:
        raise FileChangedError(
            "the file was modified while load_into() verified it (its size or times changed); "
            "no target was written",
            path=f.path,
        )
    _before_write(f)
    # pass 2: the writes
    touched: dict[str, None] = {}
    try:
        _write(f, plan, buf, verify, touched)
    except Exception as e:
        if not touched:
            raise  # it failed before the first byte reached a target
        keys = list(touched)
        raise PartialLoadError(
            f"the second read failed after load_into() verified the file (it changed, or could not be "
            f"read again): {e}; {len(keys)} target(s) may already hold new values, the others are "
            "unchanged: " + ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else ""),
            path=f.path,
            modified_keys=keys,
        ) from e
    for container, ckey, value in replaced:
        container[ckey] = value


def _write(
    f: CheckpointFile, plan: _Plan, buf: torch.Tensor | None, verify: bool, touched: dict[str, None]
) -> None:
    """Read the planned chunks into the targets; `touched` collects keys before their memory is written."""
    # 1. chunks that land whole in a target: one parallel read
    if plan.direct:
        plan.touch(touched, plan.direct_keys)
        f.read_into(plan.direct, verify)
    # 2. chunk ends shared with other tensors, and targets on accelerators: through the bounce buffer
    if plan.pieces:
        assert buf is not None
        by_chunk: dict[int, list[_Piece]] = {}
        for p in plan.pieces:
            by_chunk.setdefault(p.chunk, []).append(p)
        for items, starts in _windows(f, sorted(by_chunk), buf):
            f.read_into(items, verify)
            for (k, _), at in zip(items, starts):
                for p in by_chunk[k]:
                    plan.touch(touched, [p.key])
                    p.dest.copy_(buf[at + p.start : at + p.end])
    # 3. targets laid out unlike the file: their storage's chunks in host memory, then copy_()
    loaded: tuple[int, int, int] | None = None  # (storage, first, last) now in buf
    for s in plan.strided:
        assert buf is not None
        if loaded is None or not (loaded[0] == s.sid and loaded[1] <= s.first and s.last <= loaded[2]):
            n = _range_bytes(f, s.first, s.last)
            f.read_into(_place(f, s.first, s.last, buf[:n]), verify)
            loaded = (s.sid, s.first, s.last)
        plan.touch(touched, [s.key])
        # an inference tensor may only be written in inference mode
        with torch.inference_mode() if s.value.is_inference() else contextlib.nullcontext():
            s.value.copy_(_source(f, s, buf, loaded[1]))


def _place(f: CheckpointFile, first: int, last: int, dest: torch.Tensor) -> list[tuple[int, memoryview]]:
    view = bytesview.tensor_bytes(dest)
    out, pos = [], 0
    for k in range(first, last):
        n = f.chunks[k].raw_len
        out.append((k, view[pos : pos + n]))
        pos += n
    return out


def _source(f: CheckpointFile, s: _Strided, buf: torch.Tensor, first: int) -> torch.Tensor:
    """The file's tensor over buf, which holds its storage's chunks from `first` on."""
    m = s.meta
    dt = dtypes.TORCH_DTYPES[m["dtype"]]
    start = (first - f.storages[s.sid].first_chunk) * f.chunk_size  # byte of the storage at buf[0]
    size = torch.empty(0, dtype=dt).element_size()
    offset = (m["offset"] * size - start) // size  # chunk sizes are powers of two >= 4 KiB
    t = torch.empty(0, dtype=dt).set_(buf.untyped_storage(), offset, m["shape"], m["stride"])
    return t.conj() if m["conj"] else t
