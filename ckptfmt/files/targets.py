"""Matching a checkpoint's entries against the live state load_into() fills.

Both sides are flattened to dotted key paths ("model.layers.0.weight"): the file's
entries from its checked tree, the target's leaves from its dicts, lists and tuples.
`match` pairs them and checks, before anything is read or written, that every target
tensor has the shape and dtype of its entry and can be written (no overlapping
elements, no meta tensor inside a tuple), and that no two targets share a byte of memory,
which would leave one holding the other's values, unless they share it as the file's tensors
share their storage, or are one tensor under several keys (tied weights) whose entries hold
the same values (`_share`).  What it finds is the caller's `LoadReport`,
like load_state_dict()'s result; a mismatch, or with strict=True a missing or
unexpected key, is a `MismatchError`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from ..format import dtypes
from ..format.decode import decode_key
from .indexspace import boxes, narrow, unravel
from .memoverlap import Budget, overlaps_itself, views_meet
from .reader import CheckpointFile

#: one leaf of the target: (dotted key, its container, its key in the container, the value)
Target = tuple[str, Any, Any, Any]


class MismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the target: keys, shapes or dtypes differ."""


@dataclass
class LoadReport:
    """What load_into() found, like the result of load_state_dict()."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    loaded: int = 0


@dataclass
class Matched:
    """The target's leaves, the file's entries by dotted key, and what the match found."""

    targets: list[Target]
    in_file: dict[str, int]
    report: LoadReport
    #: position in `targets` -> (chunk, address): the targets that take one whole chunk of the
    #: file as they are (by position: several targets may share a dotted key)
    whole: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: the targets that share memory (tied weights filled once; their bytes compared first)
    sharing: Sharing = field(default_factory=lambda: Sharing())
    #: the tensor targets with elements, by device: where each one's elements start
    spans: list[_Spans] = field(default_factory=list)

    def addresses(self) -> dict[int, int]:
        """Position in `targets` -> the address of its first element, for every tensor target
        with elements (meta ones aside): the addresses the match took, not asked again."""
        out: dict[int, int] = {}
        for spans in self.spans:
            out.update(zip(spans.positions, spans.starts))
        return out


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def target_leaves(obj: Any, prefix: str = "") -> list[Target]:
    """(dotted key, container, key in container, value) for every leaf of the target, built
    without a generator per container."""
    out: list[Target] = []
    _add_target_leaves(obj, prefix, out)
    return out


def _add_target_leaves(obj: Any, prefix: str, out: list[Target]) -> None:
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return
    add = out.append
    for k, v in items:
        # a top-level str key is its own path: the same object, its hash already computed
        path = _join(prefix, k) if prefix or type(k) is not str else k
        if isinstance(v, (dict, list, tuple)) and not isinstance(v, torch.Size):
            _add_target_leaves(v, path, out)
        else:
            add((path, obj, k, v))


def file_entries(f: CheckpointFile, i: int, prefix: str = "") -> dict[str, int]:
    """Dotted key -> node for every leaf under node i of the file's tree (the last of several
    leaves under one dotted key), built without a generator per container."""
    out: dict[str, int] = {}
    _add_file_entries(f, i, prefix, out)
    return out


def _add_file_entries(f: CheckpointFile, i: int, prefix: str, out: dict[str, int]) -> None:
    nodes = f.tree.nodes
    node = nodes[i]
    if node[0] in ("dict", "odict"):
        for k, v in node[1]:
            name = nodes[k]
            key = name[1] if name[0] == "str" else decode_key(f.tree, k, f.path)
            path = _join(prefix, key) if prefix or type(key) is not str else key
            if nodes[v][0] == "tensor":  # a leaf: no call of its own
                out[path] = v
            else:
                _add_file_entries(f, v, path, out)
    elif node[0] in ("list", "tuple"):
        for n, j in enumerate(node[1]):
            _add_file_entries(f, j, _join(prefix, n), out)
    else:
        out[prefix] = i


def _tensor_problem(key: str, value: torch.Tensor, node: list[Any], container: Any) -> str | None:
    """Why target tensor `value` cannot take node's tensor, or None."""
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
    # a contiguous tensor's elements never share memory: the overlap check only for the others
    if value.numel() > 1 and not value.is_contiguous():
        return _self_overlap_problem(key, value)
    return None


def _self_overlap_problem(key: str, value: torch.Tensor) -> str | None:
    """Why target `value` cannot be written because two of its own elements share memory, or
    None.  torch's own test answers "yes" or "no" for the easy layouts and "too hard to tell"
    (2) for every other strided view: those are decided exactly (memoverlap.overlaps_itself)."""
    quick = torch._debug_has_internal_overlap(value)
    if quick == 0:
        return None
    size = value.element_size()
    meets = (
        True
        if quick == 1
        else overlaps_itself(size, [(n, st * size) for n, st in zip(value.shape, value.stride())])
    )
    if meets is None:
        return f"{key}: the target's strides are too irregular to tell whether its elements share memory"
    if meets:
        return f"{key}: several elements of the target share memory (an expanded or overlapping strided view)"
    return None


def byte_span(value: torch.Tensor) -> tuple[int, int]:
    """The bytes [start, end) of memory that tensor `value` (of at least one element) can write:
    from its first element to the end of its last (a strided view's gaps included)."""
    start = value.data_ptr()
    if value.is_contiguous():
        return start, start + value.numel() * value.element_size()
    last = sum((n - 1) * st for n, st in zip(value.shape, value.stride()))
    return start, start + (last + 1) * value.element_size()


@dataclass
class _Spans:
    """The bytes each target tensor of one device writes, in parallel lists (by position)."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)


#: targets whose spans overlap: (position, start, end) each, in order of start, then end
Group = list[tuple[int, int, int]]


def _clash_groups(spans: _Spans) -> list[Group]:
    """The targets whose spans overlap (or are identical), in groups of two or more that may
    share memory, each in order of its spans' starts.  Sorted by (start, end), a span overlaps
    an earlier one exactly when it starts before the furthest end so far."""
    starts = np.frombuffer(array("q", spans.starts), dtype=np.int64)
    ends = np.frombuffer(array("q", spans.ends), dtype=np.int64)
    order = np.lexsort((ends, starts))  # stable: identical spans stay in target order
    starts, ends = starts[order], ends[order]
    joins = starts[1:] < np.maximum.accumulate(ends)[:-1]  # sorted span k + 1 joins k's group
    if not joins.any():
        return []
    pos = spans.positions
    cuts = np.flatnonzero(~joins) + 1
    return [
        [(pos[k], s, e) for k, s, e in zip(g.tolist(), gs.tolist(), ge.tolist())]
        for g, gs, ge in zip(np.split(order, cuts), np.split(starts, cuts), np.split(ends, cuts))
        if len(g) > 1
    ]


def same_layout(value: torch.Tensor, m: dict[str, Any]) -> bool:
    """Target `value` lays out its elements as file tensor `m` does: the same strides on
    every dimension longer than 1, the file's conjugate bit and no negative bit of its own."""
    return (
        not value.is_neg()
        and value.is_conj() == bool(m["conj"])
        and strides_agree(value.stride(), m["stride"], m["shape"])
    )


def strides_agree(a: Sequence[int], b: Sequence[int], shape: Sequence[int]) -> bool:
    """Strides a and b lay out elements of `shape` alike: equal on every dimension longer than 1
    (a dimension of one element has no step, whatever its stride)."""
    return all(x == y for x, y, n in zip(a, b, shape) if n != 1)


def _home(value: torch.Tensor, m: dict[str, Any], start: int) -> tuple[Any, ...] | None:
    """Where target `value` (its first element at `start`) puts the storage of its file tensor
    `m`: (storage, dtype, the address its element 0 would have), or None when its elements do
    not sit as the storage puts them (strides other than the file's, or a conjugate or negative
    bit of its own).  Targets of one home write each byte of memory from the same byte of the file."""
    if not same_layout(value, m):
        return None
    return (m["storage"], value.dtype, start - m["offset"] * value.element_size())


def _file_view(m: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two file tensors of one dtype and shape the same values without reading them."""
    return m["storage"], m["offset"], tuple(m["stride"]), m["conj"]


@dataclass
class Sharing:
    """What the overlap check found of targets that share memory (`_share`)."""

    #: position -> the position of a target that is the same memory, laid out alike, whose
    #: file tensor holds the same values: it alone is filled (tied weights)
    aliases: dict[int, int] = field(default_factory=dict)
    #: (position, position) of tied targets whose file tensors are not one view of one storage:
    #: their bytes are compared before anything is written (fillreads.check_equal)
    equal: list[tuple[int, int]] = field(default_factory=list)
    #: whether any targets' spans overlap: else each target's memory is its own
    found: bool = False


#: a group of overlapping spans at most this long is tested by marking its bytes (linear) ...
_MARK_MAX = 16 << 20
#: ... or at most this many times its targets' own bytes: the marks then grow only with bytes
#: the load writes anyway, while a hostile sparse group (a few elements far apart) goes pair by pair
_MARK_SHARE = 2
#: the steps the pairwise tests of one load may take together (memoverlap.Budget): a few
#: undecided pairs, or some 10^5 easy ones
_PAIR_STEPS = 1 << 20
#: the tags a byte's mark can take when marked (0: no target wrote it)
_TAGS = 255
#: _foreign_mark tests this many marks at a time: its masks stay this small
_MARK_BLOCK = 1 << 20


def _share(
    f: CheckpointFile,
    in_file: dict[str, int],
    targets: list[Target],
    spans: _Spans,
    sharing: Sharing,
    budget: Budget,
) -> str | None:
    """Why targets that share memory cannot all be filled, or None, recording in `sharing` the
    tied targets.  Targets whose spans are apart need nothing more.  Among those whose spans
    overlap, the same memory laid out alike under several keys (tied weights) is filled once,
    from the first key's tensor, when the file's tensors are provably the same values: one view
    of one storage, or (checked by reading, before any write) equal bytes.  The others may share
    bytes only as the file's tensors share their storage (`_home`: a row and its weight, a
    weight and its transpose, a flat buffer and its views), which writes each shared byte from
    the same byte of the file; any other pair must share no byte at all (interleaved views,
    column blocks of one weight), decided exactly: by marking the bytes of a group whose spans
    together are short (`_marked_problem`), else pair by pair (memoverlap.views_meet) within
    `budget`, the steps all pairs of the load may take."""
    if len(spans.starts) < 2:
        return None
    nodes = f.tree.nodes
    for group in _clash_groups(spans):
        sharing.found = True
        metas = {p: nodes[in_file[targets[p][0]]][1] for p, _, _ in group}
        kept = _tie(targets, group, metas, sharing)
        problem = _clash_problem(targets, kept, metas, budget) if len(kept) > 1 else None
        if problem:
            return problem
    return None


def _tie(targets: list[Target], group: Group, metas: dict[int, dict[str, Any]], sharing: Sharing) -> Group:
    """The targets of `group` that are filled: each the first of the targets that are the same
    memory laid out alike; the later ones recorded as its aliases, with a comparison of their
    file tensors' bytes where those are not one view of one storage."""
    first: dict[tuple[Any, ...], int] = {}
    kept: Group = []
    for p, s, e in group:
        v = targets[p][3]
        q = first.setdefault((s, e, v.dtype, v.shape, v.stride(), v.is_conj(), v.is_neg()), p)
        if q == p:
            kept.append((p, s, e))
            continue
        sharing.aliases[p] = q
        if _file_view(metas[p]) != _file_view(metas[q]):
            sharing.equal.append((q, p))
    return kept


def _clash_problem(
    targets: list[Target], kept: Group, metas: dict[int, dict[str, Any]], budget: Budget
) -> str | None:
    """Why the filled targets of one group of overlapping spans cannot all be filled, or None:
    one home for all of them (a storage of the file and its views) is fine at once; else each
    pair whose spans overlap must have one home or share no byte."""
    homes = [_home(targets[p][3], metas[p], s) for p, s, _ in kept]
    if homes[0] is not None and homes.count(homes[0]) == len(homes):
        return None
    if _marked(targets, kept):
        return _marked_problem(targets, kept, homes)
    active: list[int] = []  # the targets so far whose spans reach past the current start
    for i, (p, s, e) in enumerate(kept):
        active = [j for j in active if kept[j][2] > s]
        for j in active:
            if homes[j] is not None and homes[j] == homes[i]:
                continue
            meet = _elements_meet(targets[kept[j][0]][3], kept[j][1], targets[p][3], s, budget)
            if meet is None and budget.spent:
                return (
                    f"{len(kept)} targets overlap in span (from {targets[kept[0][0]][0]!r} on): testing "
                    "each pair for a shared byte went past the overlap test's work limit for one load; "
                    "refused rather than risk filling one over another (load them in smaller groups)"
                )
            if meet is not False:
                first, second = sorted((kept[j][0], p))  # named in the target's order
                return _overlap_message(targets[first][0], targets[second][0], kept[j][1:] == (s, e), meet)
        active.append(i)
    return None


def _marked(targets: list[Target], kept: Group) -> bool:
    """Whether the group `kept` is tested by marking its bytes: its span is at most _MARK_MAX
    bytes, or at most _MARK_SHARE times the bytes its targets write."""
    span = max(e for _, _, e in kept) - kept[0][1]
    if span <= _MARK_MAX:
        return True
    own = sum(targets[p][3].numel() * targets[p][3].element_size() for p, _, _ in kept)
    return span <= _MARK_SHARE * own


def _marked_problem(targets: list[Target], kept: Group, homes: list[tuple[Any, ...] | None]) -> str | None:
    """_clash_problem for a group whose spans together are short (`_marked`): each byte of the
    span gets a one-byte mark, the tag of the home of the last target that wrote it, through a
    view of each target's bytes over the marks; a target that finds a mark other than none and
    its own home's tag shares that byte with a target of another home (targets of one home may
    share bytes).  The tags are the digits of the homes' numbers in base _TAGS, one pass over
    the targets per digit (one pass for up to _TAGS homes, two up to _TAGS ** 2): two homes
    differ in some digit, so a byte that two homes write is found in that digit's pass.  The
    target that wrote the byte is then found by marking again (`_last_writer`).

    Memory: one byte per byte of the span, at most max(_MARK_MAX, _MARK_SHARE x the bytes the
    targets write), and the masks of _MARK_BLOCK bytes of one target at a time.  Time: linear in
    the targets' bytes per pass.  Exact."""
    base = kept[0][1]
    numbers: dict[Any, int] = {}
    ids = [
        numbers.setdefault(h if h is not None else ("alone", i), len(numbers)) for i, h in enumerate(homes)
    ]
    marks = torch.zeros(max(e for _, _, e in kept) - base, dtype=torch.uint8)
    writers = [(targets[p][3], s - base) for p, s, _ in kept]  # each target and its first mark
    digit = 1
    while True:
        tags = [i // digit % _TAGS + 1 for i in ids]
        for i, tag in enumerate(tags):
            mine = _mark_view(marks, *writers[i])
            at = _foreign_mark(mine, tag)
            if at is not None:
                j = _last_writer(marks, writers, tags, i, at)
                first, second = sorted((kept[j][0], kept[i][0]))  # named in the target's order
                return _overlap_message(
                    targets[first][0], targets[second][0], kept[j][1:] == kept[i][1:], True
                )
            mine.fill_(tag)
        digit *= _TAGS
        if digit >= len(numbers):
            return None
        marks.zero_()


def _mark_view(marks: torch.Tensor, v: torch.Tensor, at: int) -> torch.Tensor:
    """The bytes of target `v` over the marks, its first byte at `at`: one mark per byte
    of each element (the last dimension)."""
    size = v.element_size()
    return marks.as_strided((*v.shape, size), (*(st * size for st in v.stride()), 1), at)


def _foreign_mark(mine: torch.Tensor, tag: int) -> int | None:
    """The place in the marks of the first byte of view `mine` (in its element order, a block of
    _MARK_BLOCK bytes at a time) marked other than 0 and `tag`, or None."""
    for block in (narrow(mine, box) for box in boxes(mine.shape, _MARK_BLOCK)):
        bad = block.ne(0)
        bad &= block.ne(tag)
        if bool(bad.any()):
            index = unravel(int(bad.reshape(-1).view(torch.uint8).argmax()), block.shape)
            return int(block.storage_offset()) + sum(i * st for i, st in zip(index, block.stride()))
    return None


def _last_writer(
    marks: torch.Tensor, writers: list[tuple[torch.Tensor, int]], tags: list[int], i: int, at: int
) -> int:
    """The target before target `i` that last marked mark `at` (a mark of another home, found by
    `i`): the marks of targets [0, i) made again, mark `at` cleared before each."""
    marks.zero_()
    last = -1
    for j in range(i):
        marks[at] = 0
        _mark_view(marks, *writers[j]).fill_(tags[j])
        if int(marks[at]):
            last = j
    assert last >= 0, "a foreign mark has a writer before the target that found it"
    return last


def _elements_meet(
    a: torch.Tensor, start_a: int, b: torch.Tensor, start_b: int, budget: Budget
) -> bool | None:
    """Whether target tensors a and b, their first elements at start_a and start_b, share a byte
    of memory (None: undecided)."""
    sa, sb = a.element_size(), b.element_size()
    return views_meet(
        start_a,
        sa,
        [(n, st * sa) for n, st in zip(a.shape, a.stride())],
        start_b,
        sb,
        [(n, st * sb) for n, st in zip(b.shape, b.stride())],
        budget,
    )


def _overlap_message(a: str, b: str, same_span: bool, meet: bool | None) -> str:
    if meet is None:
        return (
            f"targets {a!r} and {b!r} interleave in memory too irregularly to tell whether they share "
            "bytes, and not as the checkpoint's tensors share their storage: refused rather than risk "
            "filling one over the other (load them one at a time)"
        )
    if same_span:
        return (
            f"targets {a!r} and {b!r} are the same memory but not laid out alike, nor as one tensor of "
            "the checkpoint (tied weights): one would be filled over the other"
        )
    return (
        f"targets {a!r} and {b!r} overlap in memory, not as the checkpoint's tensors share their "
        "storage: each would be filled over the other's values (load overlapping views one at a "
        "time, or as the one tensor they view)"
    )


def _key_problems(report: LoadReport) -> str:
    """The first few missing and unexpected keys, for a strict load's error."""
    parts = []
    for what, keys in (("missing", report.missing_keys), ("unexpected", report.unexpected_keys)):
        if keys:
            parts.append(f"{what} keys {keys[:5]}" + ("..." if len(keys) > 5 else ""))
    return "; ".join(parts)


#: a file tensor's layout that a contiguous target can take as its bytes stand: (torch dtype,
#: shape, bytes, whether the dtype is complex), or None; keyed by (dtype name, *shape, *stride)
Layout = tuple[torch.dtype, tuple[int, ...], int, bool] | None


def _layout(m: dict[str, Any]) -> Layout:
    """The layout of file tensor `m` (of no offset and no conjugate bit) if a contiguous target
    of its dtype and shape holds its bytes exactly as the file does (row-major strides), else
    None: what `m`'s dtype, shape and strides alone decide.  Dims of size 1 count too: a stride
    the file gives them other than row-major's is left to the general planning, which compares
    strides one by one."""
    dt = dtypes.TORCH_DTYPES.get(m["dtype"])
    shape, stride = m["shape"], m["stride"]
    if dt is None or len(stride) != len(shape):
        return None
    expected = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if st != expected:
            return None
        expected *= n
    return dt, tuple(shape), expected * dt.itemsize, dt.is_complex


def _whole_place(
    value: torch.Tensor, m: dict[str, Any], rec: Any, layouts: dict[tuple[Any, ...], Layout]
) -> int:
    """The address where target `value`, a contiguous CPU tensor, takes file tensor `m` whole, or
    0: the commonest target of all, with no problem to report, dense in the file's layout (the
    same dtype and shape, no negative or conjugate bit of its own) and the whole of its storage
    `rec`, which is one chunk: that chunk is read straight into the target's memory.  A state
    of many small tensors repeats a few layouts: each is worked out once (`layouts`), and the
    target is asked only its dtype, shape and bits (its strides follow: it is contiguous, and
    the layout is row-major)."""
    if rec.n_chunks != 1 or m["offset"] or m["conj"]:
        return 0
    key = (m["dtype"], *m["shape"], *m["stride"])  # unambiguous: as many strides as dims (validate.py)
    try:
        lay = layouts[key]
    except KeyError:
        lay = layouts[key] = _layout(m)
    if lay is None:
        return 0
    if (
        value.dtype is not lay[0]
        or rec.nbytes != lay[2]
        or value.shape != lay[1]
        or value.is_neg()
        or (lay[3] and value.is_conj())
    ):
        return 0
    return value.data_ptr()  # never 0: the target has elements (its layout's bytes match rec's, >= 1)


def match(f: CheckpointFile, top: int, state: Any, *, strict: bool) -> Matched:
    """Pair the leaves of `state` with the entries under node `top`; MismatchError before any read.

    The commonest targets (_whole_place) are recognised in the same look as their checks, and
    their place recorded in `Matched.whole` by their position among the targets: a state of
    many small tensors is mostly cache misses on the tensors, so each is looked at once."""
    in_file = file_entries(f, top)
    targets = target_leaves(state)
    report = LoadReport()
    problems = []
    whole: dict[int, tuple[int, int]] = {}
    layouts: dict[tuple[Any, ...], Layout] = {}
    nodes, records = f.tree.nodes, f.storages
    tensor = torch.Tensor
    missing = report.missing_keys
    cpu = _Spans()
    elsewhere: dict[torch.device, _Spans] = {}  # accelerator targets: by device
    starts, ends, positions = cpu.starts, cpu.ends, cpu.positions
    for pos, (key, container, _, value) in enumerate(targets):
        i = in_file.get(key)
        if i is None:
            missing.append(key)
            continue
        if isinstance(value, tensor):
            node = nodes[i]
            if node[0] == "tensor" and value.is_cpu and value.is_contiguous():
                m = node[1]
                rec = records[m["storage"]]
                address = _whole_place(value, m, rec, layouts)
                if address:
                    whole[pos] = (rec.first_chunk, address)
                    starts.append(address)
                    ends.append(address + rec.nbytes)  # its layout's bytes: its own (_whole_place)
                    positions.append(pos)
                    continue
            problem = _tensor_problem(key, value, node, container)
            if problem:
                problems.append(problem)
            elif not value.is_meta and value.numel():
                _add_span(cpu if value.is_cpu else elsewhere.setdefault(value.device, _Spans()), pos, value)
    target_keys = {t[0] for t in targets}
    report.unexpected_keys = [k for k in in_file if k not in target_keys]
    if problems:
        raise MismatchError(
            problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""), path=f.path
        )
    by_device = [cpu, *elsewhere.values()]
    sharing = _sharing(f, in_file, targets, by_device)
    if strict and (report.missing_keys or report.unexpected_keys):
        raise MismatchError(_key_problems(report), path=f.path)
    return Matched(targets, in_file, report, whole, sharing, by_device)


def _add_span(spans: _Spans, pos: int, value: torch.Tensor) -> None:
    """Record the bytes that target tensor `value` (at `pos` among the targets) writes."""
    start, end = byte_span(value)
    spans.starts.append(start)
    spans.ends.append(end)
    spans.positions.append(pos)


def _sharing(
    f: CheckpointFile, in_file: dict[str, int], targets: list[Target], by_device: list[_Spans]
) -> Sharing:
    """What the targets' shared memory asks for (`_share`, device by device, within one budget of
    pairwise steps for the load); MismatchError where it cannot be filled."""
    sharing = Sharing()
    budget = Budget(_PAIR_STEPS)
    for spans in by_device:
        problem = _share(f, in_file, targets, spans, sharing, budget)
        if problem:
            raise MismatchError(problem, path=f.path)
    return sharing
