"""load_into() targets that share memory: what loads correctly is accepted, only what cannot is refused.

A tied model (one tensor under two keys) loads a file that stores the two keys apart when
their saved bytes are equal (compared before anything is written); views whose byte spans
clash but that share no element (interleaved views, column blocks of one weight) are each
filled with their own bytes; views that share an element, unlike the file's tensors, are
refused with nothing written.
"""

from __future__ import annotations

import itertools
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.files import fillplan, memoverlap, targets
from ckptfmt.files.reader import CheckpointFile


def _save(tmp_path, state, name="s.ckpt", **kw):
    p = tmp_path / name
    ckptfmt.save(state, p, chunk_size=4096, **kw)
    return p


class TiedLM(torch.nn.Module):
    """A language model's ends whose output layer is its embedding (tied weights)."""

    def __init__(self, vocab: int, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight


def _apart(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as a tool that stores every key as a tensor of its own writes it."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zeroed(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


# -- tied targets, the file's tensors apart ------------------------------------------------------


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("vocab", [40, 300])  # the weight in one chunk, or in several
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_tied_model_loads_a_file_that_stores_the_tied_keys_apart(tmp_path, atomic, vocab, compression):
    """The saved tensors of embed.weight and lm_head.weight are separate but byte-equal: the tied
    target takes them, filled once, and stays tied."""
    torch.manual_seed(vocab)
    src = TiedLM(vocab)
    p = _save(tmp_path, _apart(src), compression=compression)
    dst = _zeroed(TiedLM(vocab))
    report = ckptfmt.load_into(p, dst.state_dict(), atomic=atomic)
    assert report.loaded == 4 and report.missing_keys == report.unexpected_keys == []
    assert dst.lm_head.weight is dst.embed.weight
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


def _tied_pair(n: int, change: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and a copy of it, changed in one place (or not)."""
    w = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
    other = w.clone()
    if change == "last element":
        other[-1, -1] += 1.0
    elif change == "first element":
        other[0, 0] = -other[0, 0]
    elif change == "negative zero":  # equal values, different bytes: t.copy_() of each differs
        w[3, 5], other[3, 5] = 0.0, -0.0
    return w, other


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("change", ["first element", "last element", "negative zero"])
@pytest.mark.parametrize("n", [4, 300])
def test_tied_keys_whose_saved_bytes_differ_are_refused_with_nothing_written(tmp_path, atomic, change, n):
    """A tied target cannot hold two different tensors: MismatchError naming both keys and the
    first differing byte, and no target written (the others of the call included), whether the
    load is atomic or not: the bytes are compared before any write."""
    w, other = _tied_pair(n, change)
    p = _save(tmp_path, {"a": w, "b": other, "c": torch.ones(1000)})
    at = int(torch.nonzero(w.view(-1).view(torch.uint8) != other.view(-1).view(torch.uint8))[0])
    assert at // 4 == {"first element": 0, "last element": n * 64 - 1, "negative zero": 3 * 64 + 5}[change]
    x, c = torch.zeros(n, 64), torch.zeros(1000)
    with pytest.raises(
        ckptfmt.MismatchError, match=f"'a' and 'b' are the same memory, but .*from byte {at} of"
    ):
        ckptfmt.load_into(p, {"a": x, "b": x, "c": c}, atomic=atomic)
    assert not bool(x.any()) and not bool(c.any())


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("layout", ["dense", "transposed"])
def test_tied_keys_are_compared_by_their_bytes_in_any_saved_layout(tmp_path, atomic, layout):
    """NaNs of one payload are equal bytes (accepted, though NaN != NaN); a saved tensor that is
    the transpose of a contiguous one holds the same values as a contiguous copy (compared as
    values over each one's span), and a changed element there is found too."""
    w = torch.randn(70, 30)
    w[2, 3] = float("nan")
    if layout == "dense":
        same, changed = w.clone(), w.clone()
    else:
        same, changed = w.t().contiguous().t(), w.t().contiguous().t()
        assert not same.is_contiguous()
    changed[69, 0] = 5.0
    p = _save(tmp_path, {"a": w, "b": same, "c": changed})
    x = torch.zeros(70, 30)
    ckptfmt.load_into(p, {"a": x, "b": x}, strict=False, atomic=atomic)
    assert x.view(torch.int32).equal(w.view(torch.int32))
    y = torch.zeros(70, 30)
    at = int(torch.nonzero(w.reshape(-1).view(torch.uint8) != changed.reshape(-1).view(torch.uint8))[0])
    assert at // 4 == 69 * 30
    with pytest.raises(
        ckptfmt.MismatchError, match=f"'a' and 'c' are the same memory, but .*from byte {at} of"
    ):
        ckptfmt.load_into(p, {"a": y, "c": y}, strict=False, atomic=atomic)
    assert not bool(y.any())


def test_damage_in_the_second_tied_tensor_is_found_before_any_write(tmp_path):
    """The tied pair's second tensor is never written into a target, but it is read (to compare)
    and checked: a damaged chunk of it fails the load before any target changes."""
    w = torch.randn(300, 64)
    p = _save(tmp_path, {"a": w, "b": w.clone(), "c": torch.ones(1000)})
    with CheckpointFile(p) as f:
        sid = f.tree.nodes[dict(f.root_items())["b"]][1]["storage"]
        chunk = f.chunks[f.storages[sid].first_chunk + 2]
    with open(p, "r+b") as fh:
        fh.seek(chunk.offset + 100)
        b = fh.read(1)
        fh.seek(chunk.offset + 100)
        fh.write(bytes([b[0] ^ 0x10]))
    x, c = torch.zeros(300, 64), torch.zeros(1000)
    with pytest.raises(ckptfmt.CorruptError):
        ckptfmt.load_into(p, {"a": x, "b": x, "c": c})
    assert not bool(x.any()) and not bool(c.any())


@pytest.mark.parametrize("protection", ["signed", "encrypted"])
def test_tied_keys_of_a_signed_or_encrypted_file_are_compared_through_its_checks(tmp_path, protection):
    """The comparison reads both tensors as every read of such a file does (checked against the
    signed digests, or decrypted): equal ones load, different ones are refused untouched."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    w = torch.randn(300, 64)
    state = {"a": w, "b": w.clone(), "c": w + 1}
    if protection == "signed":
        key = ed25519.Ed25519PrivateKey.generate()
        p = _save(tmp_path, state, sign_with=key)
        opts: dict[str, object] = {"trusted_keys": [key.public_key()]}
    else:
        key = os.urandom(32)
        p = _save(tmp_path, state, encrypt_with=key)
        opts = {"decrypt_with": key}
    x = torch.zeros(300, 64)
    ckptfmt.load_into(p, {"a": x, "b": x}, strict=False, **opts)
    assert torch.equal(x, w)
    y = torch.zeros(300, 64)
    with pytest.raises(ckptfmt.MismatchError, match="'a' and 'c' are the same memory, but"):
        ckptfmt.load_into(p, {"a": y, "c": y}, strict=False, **opts)
    assert not bool(y.any())


# -- views whose spans clash but share no element ------------------------------------------------


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_views_and_column_blocks_are_each_filled_with_their_own_bytes(tmp_path, atomic, dtype):
    """x[::2] and x[1::2], W[:, :k] and W[:, k:], and an element in a strided view's gap overlap
    in span, never in an element: each is filled as t.copy_(saved) would, the memory between
    them left alone."""
    g = torch.Generator().manual_seed(11)
    n, rows, cols, k = 3000, 60, 90, 37
    state = {
        "even": torch.randn(n, generator=g).to(dtype),
        "odd": torch.randn(n, generator=g).to(dtype),
        "left": torch.randn(rows, k, generator=g).to(dtype),
        "right": torch.randn(rows, cols - k, generator=g).to(dtype),
        "every third": torch.randn(n, generator=g).to(dtype),
        "in a gap": torch.randn(1, generator=g).to(dtype),
    }
    p = _save(tmp_path, state)
    x, w, y = (
        torch.zeros(2 * n, dtype=dtype),
        torch.zeros(rows, cols, dtype=dtype),
        torch.zeros(3 * n, dtype=dtype),
    )
    target = {
        "even": x[::2],
        "odd": x[1::2],
        "left": w[:, :k],
        "right": w[:, k:],
        "every third": y[::3],
        "in a gap": y[7:8],
    }
    report = ckptfmt.load_into(p, target, atomic=atomic)
    assert report.loaded == len(state)
    for key, v in state.items():
        assert (
            target[key]
            .view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
            .equal(v.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        ), key
    untouched = torch.ones(3 * n, dtype=torch.bool)
    untouched[::3] = False
    untouched[7] = False
    assert not bool(y[untouched].any())


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize(
    "views",
    [
        ("x[::2]", "x[4:5]"),  # one element of the strided view
        ("W[:, :k + 1]", "W[:, k:]"),  # one column in both
        ("x[::2]", "x[::3]"),  # every sixth element in both
        ("W.t()[1]", "W[:, 1:2]"),  # a column through a transpose, and the same column
    ],
)
def test_views_that_share_an_element_are_refused_with_nothing_written(tmp_path, atomic, views):
    x, W, k = torch.zeros(600), torch.zeros(20, 30), 12
    a, b = (eval(v, {"x": x, "W": W, "k": k}) for v in views)  # noqa: S307 - the test's own literals
    p = _save(tmp_path, {"a": torch.ones(a.shape), "b": torch.full(b.shape, 2.0)})
    with pytest.raises(ckptfmt.MismatchError, match="'a' and 'b' overlap in memory|are the same memory"):
        ckptfmt.load_into(p, {"a": a, "b": b}, atomic=atomic)
    assert not bool(x.any()) and not bool(W.any())


def test_views_too_irregular_to_decide_are_refused(tmp_path, monkeypatch):
    """Where the exact test would take more than its step limit it refuses, saying why (here the
    limit is lowered to make two regular views count as irregular)."""
    x = torch.zeros(4000)
    # columns 1-2 of rows of 40 and columns 3-4 of rows of 50: x[40 r + 1] is never x[50 s + 3]
    target = {"a": x.view(100, 40)[:, 1:3], "b": x.view(80, 50)[:, 3:5]}
    p = _save(tmp_path, {"a": torch.ones(100, 2), "b": torch.ones(80, 2)})
    monkeypatch.setattr(memoverlap, "MAX_STEPS", 0)
    monkeypatch.setattr(targets, "_MARK_MAX", 0)  # pair by pair, not by marking the bytes
    monkeypatch.setattr(targets, "_MARK_SHARE", 0)
    with pytest.raises(ckptfmt.MismatchError, match="'a' and 'b' interleave in memory too irregularly"):
        ckptfmt.load_into(p, target)
    assert not bool(x.any())
    monkeypatch.undo()
    ckptfmt.load_into(p, target)
    assert bool(target["a"].eq(1).all()) and bool(target["b"].eq(1).all()) and int(x.count_nonzero()) == 360


_MARK_MAX = targets._MARK_MAX


def _strided_view(base: torch.Tensor, spec: tuple[int, int, int, int, int, int, bool]) -> torch.Tensor:
    r0, r1, rs, c0, c1, cs, transpose = spec
    v = base[r0:r1:rs, c0:c1:cs]
    return v.t() if transpose else v


_VIEW = st.tuples(
    st.integers(0, 11),
    st.integers(1, 12),
    st.integers(1, 3),
    st.integers(0, 15),
    st.integers(1, 16),
    st.integers(1, 4),
    st.booleans(),
).filter(lambda s: s[0] < s[1] and s[3] < s[4])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    views=st.lists(_VIEW, min_size=2, max_size=4),
    atomic=st.booleans(),
    pairwise=st.booleans(),
    block=st.sampled_from([4, 16, 1 << 20]),
    tags=st.sampled_from([2, 255]),
)
def test_random_strided_views_of_one_buffer_load_exactly_or_are_refused_untouched(
    tmp_path, monkeypatch, views, atomic, pairwise, block, tags
):
    """Random strided (and transposed) views of one 12x16 buffer, each saved as a tensor of its
    own: load_into fills each exactly as t.copy_(saved) would when no two share an element, and
    refuses with the buffer unchanged when two do (their bytes marked, each view's marks tested
    `block` bytes at a time, with `tags` tags: a pass per digit of the views' numbers, or pair by
    pair)."""
    monkeypatch.setattr(targets, "_MARK_BLOCK", block)
    monkeypatch.setattr(targets, "_TAGS", tags)
    monkeypatch.setattr(targets, "_MARK_MAX", 0 if pairwise else _MARK_MAX)
    monkeypatch.setattr(targets, "_MARK_SHARE", 0 if pairwise else targets._MARK_SHARE)
    rows, cols = 12, 16
    buf = torch.zeros(rows, cols)
    index = torch.arange(rows * cols).view(rows, cols)
    target = {f"v{i}": _strided_view(buf, s) for i, s in enumerate(views)}
    cells = [set(_strided_view(index, s).flatten().tolist()) for s in views]
    # distinct values per key: tied targets never hold equal bytes by chance
    state = {
        k: 1000.0 * (i + 1) + torch.arange(v.numel()).view(v.shape).float()
        for i, (k, v) in enumerate(target.items())
    }
    p = tmp_path / "views.ckpt"
    ckptfmt.save(state, p, chunk_size=4096)
    if any(a & b for a, b in itertools.combinations(cells, 2)):
        with pytest.raises(ckptfmt.MismatchError) as refused:
            ckptfmt.load_into(p, target, atomic=atomic)
        assert not bool(buf.any())
        named = re.search(r"'v(\d)' and 'v(\d)'", str(refused.value))
        assert named and cells[int(named[1])] & cells[int(named[2])], str(refused.value)  # a pair that meets
        return
    ckptfmt.load_into(p, target, atomic=atomic)
    expected = torch.zeros(rows, cols)
    for k, s in zip(target, views):
        _strided_view(expected, s).copy_(state[k])
    assert torch.equal(buf, expected)


@settings(max_examples=300, deadline=None)
@given(
    views=st.lists(
        st.tuples(
            st.integers(0, 40),
            st.sampled_from([1, 2, 4, 8]),
            st.lists(st.tuples(st.integers(1, 5), st.integers(0, 12)), max_size=3),
        ),
        min_size=2,
        max_size=2,
    )
)
def test_views_meet_agrees_with_listing_every_byte(views):
    """memoverlap.views_meet against the bytes of both views listed one by one."""
    (sa, za, da), (sb, zb, db) = views
    dims_a, dims_b = [(n, s * za) for n, s in da], [(n, s * zb) for n, s in db]

    def byte_set(start, size, dims):
        out = set()
        for ks in itertools.product(*(range(n) for n, _ in dims)):
            x = start + sum(k * u for k, (_, u) in zip(ks, dims))
            out.update(range(x, x + size))
        return out

    listed = bool(byte_set(sa, za, dims_a) & byte_set(sb, zb, dims_b))
    assert memoverlap.views_meet(sa, za, dims_a, sb, zb, dims_b) is listed


# -- a target whose own elements share memory -------------------------------------------------


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize(
    "view",
    [
        "x.as_strided((2, 2), (1, 1))",  # torch's own test: "too hard to tell"
        "x.as_strided((3, 2), (2, 4))",  # elements (0, 1) and (2, 0) are both x[4]
        "x.as_strided((2,), (0,))",  # an expanded tensor: torch's test says yes
    ],
)
def test_a_target_whose_own_elements_overlap_is_refused_with_nothing_written(tmp_path, atomic, view):
    """A strided target two of whose elements are one memory would keep only the last one written
    (a saved [[1, 2], [3, 4]] into x.as_strided((2, 2), (1, 1)) left [[1, 3], [3, 4]]): refused,
    naming the key, before anything is written."""
    x = torch.zeros(16)
    t = eval(view, {"x": x})  # noqa: S307 - the test's own literals
    p = _save(tmp_path, {"t": torch.arange(1.0, t.numel() + 1).view(t.shape), "c": torch.ones(3)})
    c = torch.zeros(3)
    with pytest.raises(ckptfmt.MismatchError, match="t: several elements of the target share memory"):
        ckptfmt.load_into(p, {"t": t, "c": c}, atomic=atomic)
    assert not bool(x.any()) and not bool(c.any())


def test_strided_targets_whose_elements_are_apart_load(tmp_path):
    """Strided views torch cannot vouch for (its test says "too hard to tell") whose elements
    are apart are filled, as t.copy_(saved) would."""
    x = torch.zeros(60)
    target = {"a": x.as_strided((3, 2), (3, 4)), "b": x.as_strided((3, 2), (12, 4), 20)}
    state = {k: torch.arange(1.0, v.numel() + 1).view(v.shape) for k, v in target.items()}
    p = _save(tmp_path, state)
    ckptfmt.load_into(p, target)
    for k, v in target.items():
        assert torch.equal(v, state[k]), k


@settings(max_examples=300, deadline=None)
@given(
    size=st.sampled_from([1, 2, 4, 8]),
    dims=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 12)), max_size=3),
)
def test_overlaps_itself_agrees_with_listing_every_byte(size, dims):
    """memoverlap.overlaps_itself against the bytes of every element listed one by one."""
    seen: set[int] = set()
    listed = False
    byte_dims = [(n, s * size) for n, s in dims]
    for ks in itertools.product(*(range(n) for n, _ in byte_dims)):
        x = sum(k * u for k, (_, u) in zip(ks, byte_dims))
        mine = set(range(x, x + size))
        listed = listed or bool(seen & mine)
        seen |= mine
    assert memoverlap.overlaps_itself(size, byte_dims) is listed


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


# -- many targets whose spans overlap ---------------------------------------------------------------


def _columns(tmp_path, cols: int = 3000):
    """A file of `cols` columns saved apart, and the columns of one zeroed weight as targets."""
    w = torch.arange(8.0 * cols).view(8, cols)
    p = tmp_path / "cols.ckpt"
    ckptfmt.save({f"c{j}": w[:, j].clone() for j in range(cols)}, p)
    target = torch.zeros(8, cols)
    return p, w, target, {f"c{j}": target[:, j] for j in range(cols)}


def test_three_thousand_column_views_are_tested_in_linear_time(tmp_path):
    """3,000 column views of one weight, every pair of them overlapping in span: their bytes are
    marked once each (not tested pair by pair, 4.5 * 10^6 pairs), so the load takes well under the
    seconds a pairwise test took; a column view twice under two keys is still refused."""
    import time

    p, w, target, views = _columns(tmp_path)
    t0 = time.perf_counter()
    ckptfmt.load_into(p, views)
    took = time.perf_counter() - t0
    assert torch.equal(target, w)
    assert took < 4.0, took  # pairwise ~17 s here; ~0.5 s marked (generous for a busy 2-core machine)
    clash = dict(views)
    clash["c7"] = target.view(-1)[8:16]  # row 0, columns 8-15: shares (0, 8) with c8
    with pytest.raises(ckptfmt.MismatchError, match="'c7' and 'c8' overlap in memory"):
        ckptfmt.load_into(p, clash, strict=False)


def test_the_pairwise_overlap_test_of_one_load_has_a_work_limit(tmp_path, monkeypatch):
    """Where the group's bytes are not marked (its span too long: here the limit is lowered), the
    pairs are tested one by one within one budget of steps for the whole load: past it the load
    is refused, saying so, with nothing written."""
    p, _, target, views = _columns(tmp_path)
    monkeypatch.setattr(targets, "_MARK_MAX", 0)
    monkeypatch.setattr(targets, "_MARK_SHARE", 0)
    with pytest.raises(ckptfmt.MismatchError, match="3000 targets overlap in span .*work limit for one load"):
        ckptfmt.load_into(p, views)
    assert not bool(target.any())
    monkeypatch.setattr(targets, "_PAIR_STEPS", 1 << 30)
    few = {k: views[k] for k in list(views)[:50]}
    ckptfmt.load_into(p, few, strict=False)
    assert torch.equal(target[:, :50], torch.arange(8.0 * 3000).view(8, 3000)[:, :50])


def test_columns_whose_span_passes_the_mark_limit_are_still_marked(tmp_path, monkeypatch):
    """A group of column views whose span is longer than the marking limit (here lowered to
    64 KiB, under the columns' 96,000 bytes; in full size a 4096 x 1100 fp32 weight) but
    is no more than twice the bytes the columns write is still tested by marking its bytes:
    loaded, not refused at the pairwise test's work limit."""
    p, w, target, views = _columns(tmp_path)
    monkeypatch.setattr(targets, "_MARK_MAX", 64 << 10)
    ckptfmt.load_into(p, views)
    assert torch.equal(target, w)


@pytest.mark.parametrize("block", [8, 1 << 20])
def test_a_clash_among_many_targets_of_one_home_names_the_target_it_meets(tmp_path, monkeypatch, block):
    """Rows of one weight (one home: they may share its bytes) and a view that meets only the
    last row: the clash names that row, found from the marked byte itself (each view's marks
    tested `block` bytes at a time), with no pairwise test of the rows before it."""
    monkeypatch.setattr(targets, "_MARK_BLOCK", block)
    w = torch.arange(64.0 * 16).view(64, 16)
    state = {"w": w, **{f"r{i}": w[i] for i in range(64)}, "x": torch.ones(4)}
    p = _save(tmp_path, state)
    target = torch.zeros(64, 16)
    views = {f"r{i}": target[i] for i in range(64)}
    views["x"] = target[63, ::4]
    tested = []
    real = targets._elements_meet
    monkeypatch.setattr(targets, "_elements_meet", lambda *a, **k: tested.append(a) or real(*a, **k))
    with pytest.raises(ckptfmt.MismatchError, match="'r63' and 'x' overlap in memory"):
        ckptfmt.load_into(p, views, strict=False)
    assert tested == [] and not bool(target.any())


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


def test_a_clash_between_homes_of_one_tag_is_found_by_the_next_digit(tmp_path, monkeypatch):
    """With two tags (instead of 255), the homes numbered 0 and 2 (the even elements of a buffer,
    and one of those elements under another key) share a tag in the first pass: their clash is
    found in the second, naming the pair; the odd elements (home 1) share no byte with either."""
    p = _save(tmp_path, {"even": torch.ones(50), "odd": torch.full((50,), 2.0), "one": torch.ones(1)})
    monkeypatch.setattr(targets, "_TAGS", 2)
    buf = torch.zeros(100)
    ckptfmt.load_into(p, {"even": buf[::2], "odd": buf[1::2]}, strict=False)
    assert torch.equal(buf[::2], torch.ones(50)) and torch.equal(buf[1::2], torch.full((50,), 2.0))
    clash = torch.zeros(100)
    with pytest.raises(ckptfmt.MismatchError, match="'even' and 'one' overlap in memory"):
        ckptfmt.load_into(p, {"even": clash[::2], "odd": clash[1::2], "one": clash[2:3]}, strict=False)
    assert not bool(clash.any())


# last in the module: the npu devices stay switched on from here to the module's end
@pytest.mark.usefixtures("npu_devices")
@pytest.mark.parametrize("atomic", [True, False])
def test_accelerator_targets_tied_apart_and_interleaved_are_filled(tmp_path, atomic):
    """On an accelerator (the test-only "npu") as on the host: a tied target whose keys the file
    stores apart with equal bytes is filled; one whose bytes differ is refused untouched;
    interleaved views are each filled."""
    w = torch.randn(300, 64)
    p = _save(
        tmp_path,
        {"a": w, "b": w.clone(), "c": w + 1, "even": torch.ones(500), "odd": torch.full((500,), 2.0)},
    )
    x = torch.zeros(300, 64, device="npu:0")
    buf = torch.zeros(1000, device="npu:0")
    ckptfmt.load_into(p, {"a": x, "b": x, "even": buf[::2], "odd": buf[1::2]}, strict=False, atomic=atomic)
    assert torch.equal(x.cpu(), w)
    assert torch.equal(buf.cpu()[::2], torch.ones(500)) and torch.equal(
        buf.cpu()[1::2], torch.full((500,), 2.0)
    )
    y = torch.zeros(300, 64, device="npu:0")
    with pytest.raises(ckptfmt.MismatchError, match="'a' and 'c' are the same memory, but"):
        ckptfmt.load_into(p, {"a": y, "c": y}, strict=False, atomic=atomic)
    assert not bool(y.cpu().any())
