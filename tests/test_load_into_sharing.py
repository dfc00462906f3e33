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
from ckptfmt.files import memoverlap, targets
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
