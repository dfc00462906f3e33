"""load_into() of strided tensors read piece by piece: a file tensor larger than the read window
filled in pieces counted before any is cut, tied pairs in two layouts compared piece by piece,
and the memory load_into may take (hostile layouts, tied pairs in two layouts, the marks of
column halves whose spans overlap).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_load_into_sharing import _save

import ckptfmt
from ckptfmt.files import fillplan, targets
from ckptfmt.files.reader import CheckpointFile

# -- strided file tensors read piece by piece -----------------------------------------------------


@pytest.mark.parametrize("atomic", [True, False])
def test_strided_file_tensors_larger_than_a_window_are_filled_piece_by_piece(tmp_path, monkeypatch, atomic):
    """With the span window lowered to one chunk, strided file tensors (a transposed weight, every
    seventh element of a buffer, a tied pair saved in two layouts) are read piece by piece into
    their targets, exactly as t.copy_(saved) would, and a tied pair that differs is found at the
    right byte."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(90, 70, generator=g)
    base = torch.randn(7 * 900, generator=g)
    changed = w.clone()
    changed[40, 3] = 9.0
    state = {
        "t": w.t().contiguous().t(),  # saved with strides (1, 90)
        "every7": base[::7],
        "a": w,
        "b": w.t().contiguous().t(),
        "c": changed.t().contiguous().t(),
    }
    p = _save(tmp_path, state)
    monkeypatch.setattr(fillplan, "_SPAN_WINDOW", 4096)
    t, every7, x = torch.zeros(90, 70), torch.zeros(900), torch.zeros(90, 70)
    ckptfmt.load_into(p, {"t": t, "every7": every7, "a": x, "b": x}, strict=False, atomic=atomic)
    assert torch.equal(t, w) and torch.equal(every7, base[::7]) and torch.equal(x, w)
    y = torch.zeros(90, 70)
    with pytest.raises(
        ckptfmt.MismatchError,
        match=f"'a' and 'c' are the same memory, but .*from byte {(40 * 70 + 3) * 4} of",
    ):
        ckptfmt.load_into(p, {"a": y, "c": y}, strict=False, atomic=atomic)
    assert not bool(y.any())


@pytest.mark.parametrize("atomic", [True, False])
def test_tied_keys_in_two_layouts_are_compared_box_by_box(tmp_path, monkeypatch, atomic):
    """With the span window lowered to 1 KiB (boxes of 256 elements), a tied pair of a transposed
    save and a contiguous one is compared box by box in the first one's storage order (column by
    column), and the first difference in element order is named although that order meets a
    later one first; an expanded tensor (one element under 5000 indices, a span of one element)
    against a dense one is compared box by box too, either way round."""
    w = torch.randn(40, 30)
    changed = w.clone()
    changed[3, 0], changed[0, 5] = 7.0, 8.0  # column order meets (3, 0) first, element order (0, 5)
    ones, twos = torch.ones(5000), torch.ones(5000)
    twos[4000] = 2.0  # 1.0 and 2.0 differ from their third byte on
    state = {"a": w.t().contiguous().t(), "b": w, "c": changed, "e": torch.ones(1).expand(5000)}
    p = _save(tmp_path, {**state, "ones": ones, "twos": twos})
    monkeypatch.setattr(fillplan, "_SPAN_WINDOW", 1024)
    x = torch.zeros(40, 30)
    ckptfmt.load_into(p, {"a": x, "b": x}, strict=False, atomic=atomic)
    assert torch.equal(x, w)
    y = torch.zeros(40, 30)
    with pytest.raises(
        ckptfmt.MismatchError, match=f"'a' and 'c' are the same memory, but .*from byte {5 * 4} of"
    ):
        ckptfmt.load_into(p, {"a": y, "c": y}, strict=False, atomic=atomic)
    assert not bool(y.any())
    for keys in (["e", "ones"], ["ones", "e"]):
        z = torch.zeros(5000)
        ckptfmt.load_into(p, dict.fromkeys(keys, z), strict=False, atomic=atomic)
        assert torch.equal(z, ones)
    for keys in (["e", "twos"], ["twos", "e"]):
        z = torch.zeros(5000)
        with pytest.raises(
            ckptfmt.MismatchError, match=f"the same memory, but .*from byte {4000 * 4 + 2} of"
        ):
            ckptfmt.load_into(p, dict.fromkeys(keys, z), strict=False, atomic=atomic)
        assert not bool(z.any())


def _laid_out(t: torch.Tensor, order: list[int], gaps: bool) -> torch.Tensor:
    """`t`'s values in a storage laid out in dimension order `order` (outermost first), every
    other element of the innermost one skipped with `gaps`."""
    inverse = [order.index(d) for d in range(t.dim())]
    moved = t.permute(order)
    if gaps:
        room = torch.zeros(*moved.shape[:-1], 2 * moved.shape[-1])[..., ::2]
        return room.copy_(moved).permute(inverse)
    return moved.contiguous().permute(inverse)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    orders=st.tuples(st.permutations(range(3)), st.permutations(range(3))),
    gaps=st.booleans(),
    window=st.sampled_from([16, 64, 256, 4096]),
    changes=st.lists(st.integers(0, 10**6), max_size=2),
)
def test_tied_pairs_in_random_layouts_are_compared_exactly(
    tmp_path, monkeypatch, shape, orders, gaps, window, changes
):
    """A tied pair saved in two dimension orders (the second with gaps or not), compared box by
    box in the first one's storage order under span windows of 16 B to 4 KiB: equal values
    load; changed ones are refused naming the first differing byte in element order (whatever
    order the boxes meet them in), nothing written."""
    monkeypatch.setattr(fillplan, "_SPAN_WINDOW", window)
    w = torch.arange(1.0, 1.0 + torch.Size(shape).numel()).view(shape)
    other = w.clone()
    for c in changes:
        other.view(-1)[c % other.numel()] += 0.5
    order_a, order_b = ([d for d in order if d < len(shape)] for order in orders)
    p = tmp_path / "pair.ckpt"
    ckptfmt.save(
        {"a": _laid_out(w, order_a, False), "b": _laid_out(other, order_b, gaps)}, p, chunk_size=4096
    )
    x = torch.zeros(shape)
    differ = torch.nonzero(w.reshape(-1).view(torch.uint8) != other.reshape(-1).view(torch.uint8))
    if not differ.numel():
        ckptfmt.load_into(p, {"a": x, "b": x})
        assert torch.equal(x, w)
        return
    with pytest.raises(
        ckptfmt.MismatchError, match=f"'a' and 'b' are the same memory, but .*from byte {int(differ[0])} of"
    ):
        ckptfmt.load_into(p, {"a": x, "b": x})
    assert not bool(x.any())


def _chunks_of(path, key: str) -> range:
    """The chunks of the storage of file tensor `key`."""
    with CheckpointFile(path) as f:
        sid = f.tree.nodes[targets.file_entries(f, f.tree.root)[key]][1]["storage"]
        rec = f.storages[sid]
        return range(rec.first_chunk, rec.first_chunk + rec.n_chunks)


def _count_chunk_reads(monkeypatch) -> dict[int, int]:
    """Every chunk read from here on (by the engine's batched reads or a chunk reader), counted."""
    from ckptfmt.engine import batched, chunkread

    counts: dict[int, int] = {}

    def count(ks) -> None:
        for k in ks:
            counts[k] = counts.get(k, 0) + 1

    real_read_into, real_read = chunkread.ChunkReader.read_into, batched.PreparedReads.read
    monkeypatch.setattr(
        chunkread.ChunkReader,
        "read_into",
        lambda self, items, *a, **kw: count([k for k, _ in items]) or real_read_into(self, items, *a, **kw),
    )
    monkeypatch.setattr(
        batched.PreparedReads,
        "read",
        lambda self, lo, hi, *a, **kw: count(self._numbers[lo:hi]) or real_read(self, lo, hi, *a, **kw),
    )
    return counts


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("layout", ["dense", "transposed"])
def test_an_atomic_load_reads_the_compared_chunks_once_before_writing(
    tmp_path, monkeypatch, compression, layout
):
    """An atomic load of a tied pair stored apart: the comparison reads and checks both tensors'
    chunks, and the verification pass does not read them again: the first key's chunks are read
    twice (compared, then written), the second's once (compared), an untied target's twice
    (checked, then written)."""
    w = torch.randn(300, 64)
    second = w.clone() if layout == "dense" else w.t().contiguous().t()
    p = _save(tmp_path, {"a": w, "b": second, "c": torch.randn(300, 64)}, compression=compression)
    counts = _count_chunk_reads(monkeypatch)
    x, c = torch.zeros(300, 64), torch.zeros(300, 64)
    ckptfmt.load_into(p, {"a": x, "b": x, "c": c})
    assert torch.equal(x, w)
    read = {key: [counts.get(k, 0) for k in _chunks_of(p, key)] for key in "abc"}
    assert len(read["a"]) > 1, read
    assert read == {"a": [2] * len(read["a"]), "b": [1] * len(read["b"]), "c": [2] * len(read["c"])}


@pytest.mark.parametrize("atomic", [True, False])
def test_a_strided_target_read_in_pieces_is_planned_once(tmp_path, monkeypatch, atomic):
    """A transposed save filled into a contiguous target, its span larger than the (lowered) span
    window: its pieces are counted and bounded once, when the load is planned, and every pass
    (sizing the buffer, the check, the writes) uses that plan; so are a tied pair's when the
    first of them is that target (the comparison cuts only parts of the second anew, box by
    box)."""
    w = torch.randn(90, 70)
    p = _save(tmp_path, {"t": w.t().contiguous().t(), "u": w.clone()})
    monkeypatch.setattr(fillplan, "_SPAN_WINDOW", 4096)
    planned = []
    real = fillplan.pieces_of
    monkeypatch.setattr(
        fillplan,
        "pieces_of",  # the whole tensor's pieces (a part of one has a shape of its own)
        lambda f, key, m, *a: (m["shape"] == [90, 70] and planned.append(key)) or real(f, key, m, *a),
    )
    t = torch.zeros(90, 70)
    ckptfmt.load_into(p, {"t": t}, atomic=atomic, strict=False)
    assert torch.equal(t, w) and planned == ["t"]
    planned.clear()
    x = torch.zeros(90, 70)
    ckptfmt.load_into(p, {"t": x, "u": x}, atomic=atomic)
    assert torch.equal(x, w) and planned == ["t", "u"], planned  # each once


def _transposed_pair(tmp_path, change_first: bool = False):
    """A 256 x 256 fp32 weight (256 KiB, 64 chunks of 4 KiB) saved as it is ('a') and as the
    transpose of a contiguous copy ('b'), the latter's first element changed or not."""
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(8))
    other = w.t().contiguous().t()
    if change_first:
        other[0, 0] += 1.0
    return _save(tmp_path, {"a": w, "b": other}), w


def test_a_tied_pair_against_its_transpose_reads_the_second_a_bounded_number_of_times(tmp_path, monkeypatch):
    """With the span window lowered to one chunk, the first tensor is still compared in about 8
    pieces (of an eighth of its bytes each), not one per window (64): each chunk of the
    transposed second one, whose every chunk each piece needs, is read at most 8 + 1 times."""
    p, w = _transposed_pair(tmp_path)
    monkeypatch.setattr(fillplan, "_SPAN_WINDOW", 4096)
    counts = _count_chunk_reads(monkeypatch)
    x = torch.zeros(256, 256)
    ckptfmt.load_into(p, {"a": x, "b": x})
    assert torch.equal(x, w)
    reads_of_b = [counts.get(k, 0) for k in _chunks_of(p, "b")]
    assert len(reads_of_b) == 64 and 1 <= max(reads_of_b) <= fillplan._COMPARE_PIECES + 1, reads_of_b


def test_a_tied_pair_differing_at_its_first_byte_reads_only_the_first_piece(tmp_path, monkeypatch):
    """The first tensor laid out in element order, the transposed second differing at byte 0:
    the pieces of the first after the one holding that byte are skipped before their chunks are
    read (its first piece's 8 chunks read, not all 64), and the second is read once."""
    p, _ = _transposed_pair(tmp_path, change_first=True)
    monkeypatch.setattr(fillplan, "_SPAN_WINDOW", 4096)
    counts = _count_chunk_reads(monkeypatch)
    x = torch.zeros(256, 256)
    with pytest.raises(ckptfmt.MismatchError, match="'a' and 'b' are the same memory, but .*from byte 0 of"):
        ckptfmt.load_into(p, {"a": x, "b": x})
    assert not bool(x.any())
    chunks_a = _chunks_of(p, "a")
    assert [counts.get(k, 0) for k in chunks_a] == [1] * 8 + [0] * 56, counts
    assert [counts.get(k, 0) for k in _chunks_of(p, "b")] == [1] * 64, counts


_PEAK_CHILD = r"""
import gc, json, sys, torch, ckptfmt
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
path, keys, shape = sys.argv[1], sys.argv[2].split(","), json.loads(sys.argv[3])
columns = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
x = torch.zeros(shape)
state = {k: x for k in keys} if columns is None else {k: x[:, a:b] for k, (a, b) in zip(keys, columns)}
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
try:
    ckptfmt.load_into(path, state, strict=False)
    error = None
except ckptfmt.MismatchError as e:
    error = str(e)
print(json.dumps({"extra": status("VmHWM") - before, "error": error}))
"""


def _load_into_peak(path, keys: list[str], shape: list[int], columns: list[list[int]] | None = None) -> dict:
    """The memory one load_into(path, {key: one tensor of `shape` for each of keys}) adds at its
    peak, in a fresh process (VmHWM after the peak is reset), and the MismatchError it raised.
    With `columns`, key i is the column block [a, b) = columns[i] of that tensor instead."""
    import json
    import subprocess
    import sys

    args = [str(path), ",".join(keys), json.dumps(shape)] + ([json.dumps(columns)] if columns else [])
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


# Sanitizers add allocations of their own: memory budgets are checked in the normal build only.
@pytest.mark.skipif(bool(os.environ.get("CKPTFMT_SANITIZED")), reason="memory budgets need the normal build")
def test_a_hostile_strided_tensor_costs_a_few_chunks_not_its_span(tmp_path):
    """A small zstd file whose tensor 'b' is two elements 128 MiB apart (a view of a storage of
    zeros): filling an 8-byte target from it, or comparing it with the tied 'a', holds a few
    chunks (of 4 MiB), not the 128 MiB between its elements."""
    n = 1 << 25
    p = tmp_path / "hostile.ckpt"
    ckptfmt.save({"a": torch.zeros(2), "b": torch.zeros(n + 1).as_strided((2,), (n,))}, p, compression="zstd")
    assert p.stat().st_size < (1 << 20)
    for keys in (["b"], ["a", "b"]):
        res = _load_into_peak(p, keys, [2])
        assert res["error"] is None and res["extra"] < (32 << 20), (keys, res)


@pytest.mark.skipif(bool(os.environ.get("CKPTFMT_SANITIZED")), reason="memory budgets need the normal build")
def test_reporting_where_tied_tensors_differ_holds_no_index_per_difference(tmp_path):
    """Tied tensors of 32 MiB that differ in every byte: finding the first difference adds no
    list of every differing byte's index (8 bytes each, 256 MiB here) to the comparison's two
    windows (of one 32 MiB chunk each here)."""
    w = torch.randn(8 << 20, generator=torch.Generator().manual_seed(3))
    p = tmp_path / "big.ckpt"
    ckptfmt.save({"a": w, "b": w.view(torch.int32).bitwise_not().view(torch.float32)}, p, chunk_size=32 << 20)
    del w
    res = _load_into_peak(p, ["a", "b"], [8 << 20])
    assert "'a' and 'b' are the same memory, but" in res["error"] and "from byte 0 of" in res["error"], res
    assert res["extra"] < (200 << 20), res


@pytest.mark.skipif(bool(os.environ.get("CKPTFMT_SANITIZED")), reason="memory budgets need the normal build")
def test_tied_tensors_in_two_layouts_are_compared_in_bounded_memory(tmp_path):
    """A tied 64 MiB weight saved once as it is and once as the transpose of a contiguous copy:
    the comparison holds a box of each (16 MiB) and the chunks of a piece of each, not a copy of
    each whole tensor (128 MiB)."""
    w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(4))
    p = tmp_path / "big.ckpt"
    ckptfmt.save({"a": w, "b": w.t().contiguous().t()}, p)
    del w
    res = _load_into_peak(p, ["a", "b"], [4096, 4096])
    assert res["error"] is None and res["extra"] < (100 << 20), res


@pytest.mark.skipif(bool(os.environ.get("CKPTFMT_SANITIZED")), reason="memory budgets need the normal build")
def test_marking_the_column_halves_of_a_large_weight_holds_a_byte_per_byte(tmp_path):
    """The two column halves of a 64 MiB weight, their spans overlapping over 64 MiB (past the
    16 MiB marking limit, within twice their bytes): marked with one byte per byte of the span and
    tested a block at a time (64 MiB and a few MiB), not two bytes per byte and masks of each
    half's size (128 MiB and more)."""
    w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(6))
    p = tmp_path / "halves.ckpt"
    ckptfmt.save({"l": w[:, :2048].clone(), "r": w[:, 2048:].clone()}, p)
    del w
    res = _load_into_peak(p, ["l", "r"], [4096, 4096], [[0, 2048], [2048, 4096]])
    assert res["error"] is None and res["extra"] < (100 << 20), res
