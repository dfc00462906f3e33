"""load_into() of a strided saved tensor read in pieces: the pieces are counted before any is cut,
and a layout that would take more than a few per window of its span and size is refused.

The windows are lowered (to a few KiB) so that small files show what 16 MiB windows do to large
ones.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.files import fillplan
from ckptfmt.files.indexspace import cuts
from ckptfmt.files.reader import CheckpointFile


def _hostile(tmp_path, k: int, window: int):
    """A file whose uint8 tensor 't' has shape [2] * k, every stride window + 1 (they overlap:
    each piece of `window` bytes of span holds one element), and a dense 'd' of the same values."""
    base = torch.zeros(k * (window + 1) + 1, dtype=torch.uint8)
    t = base.as_strided([2] * k, [window + 1] * k)
    p = tmp_path / "hostile.ckpt"
    ckptfmt.save({"t": t, "d": t.contiguous()}, p, chunk_size=4096, compression="zstd")
    return p


@pytest.mark.parametrize("tied", [False, True])
def test_a_layout_of_a_piece_per_element_is_refused_before_any_piece_is_cut(tmp_path, monkeypatch, tied):
    """Shape [2] * 16 with every stride one past the span window: 65,536 pieces of one byte for a
    64 KiB target (in full size, a 20 KB file and a 1 MiB target gave 10^6 pieces, minutes and
    hundreds of MiB before any read): refused at once, naming the key and the file, with nothing
    written, whether filled or compared as a tied pair."""
    window = 4096
    p = _hostile(tmp_path, 16, window)
    monkeypatch.setattr(fillplan, "_SPAN_WINDOW", window)
    x = torch.zeros([2] * 16, dtype=torch.uint8)
    target = {"d": x, "t": x} if tied else {"t": x}
    t0 = time.perf_counter()
    with pytest.raises(ckptfmt.LimitError, match=r"hostile\.ckpt: t: .*takes 65536 pieces, over the limit"):
        ckptfmt.load_into(p, target, strict=False)
    assert time.perf_counter() - t0 < 5.0  # ~0.01 s; the list of pieces took seconds
    assert not bool(x.any())


# -- ordinary layouts are never refused ----------------------------------------------------------


@st.composite
def _ordinary_views(draw: st.DrawFn) -> torch.Tensor:
    """A view of a contiguous tensor as torch's own calls make them: slices with steps,
    transposes, expands, narrows, or as_strided with nested (non-overlapping) strides and gaps."""
    shape = draw(st.lists(st.integers(1, 7), min_size=1, max_size=4))
    if draw(st.booleans()):  # as_strided: each stride at least the span of the dims inside it
        order = draw(st.permutations(range(len(shape))))
        stride = [0] * len(shape)
        span = 1
        for d in reversed(order):
            stride[d] = span * draw(st.integers(1, 3))
            span += (shape[d] - 1) * stride[d]
        offset = draw(st.integers(0, 5))
        return torch.empty(span + offset).as_strided(shape, stride, offset)
    t = torch.empty(shape)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["slice", "transpose", "expand", "narrow"]))
        d = draw(st.integers(0, t.dim() - 1))
        n = t.shape[d]
        if op == "slice":
            start = draw(st.integers(0, n - 1))
            t = t.narrow(d, start, n - start)
            idx = [slice(None)] * t.dim()
            idx[d] = slice(None, None, draw(st.integers(1, 3)))
            t = t[tuple(idx)]
        elif op == "transpose":
            t = t.transpose(d, draw(st.integers(0, t.dim() - 1)))
        elif op == "expand" and t.dim() < 5:
            t = t.unsqueeze(d)
            t = t.expand(*t.shape[:d], draw(st.integers(1, 5)), *t.shape[d + 1 :])
        elif op == "narrow":
            start = draw(st.integers(0, n - 1))
            t = t.narrow(d, start, draw(st.integers(1, n - start)))
    return t


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    p = tmp_path_factory.mktemp("pieces") / "one.ckpt"
    ckptfmt.save({"w": torch.zeros(1 << 16)}, p, chunk_size=4096)
    with CheckpointFile(p) as f:
        yield f, f.tree.nodes[dict(f.root_items())["w"]][1]["storage"]


@settings(max_examples=400, deadline=None)
@given(
    view=_ordinary_views(),
    dtype=st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.float64]),
    window=st.sampled_from([1, 8, 16, 64, 256, 4096]),
)
def test_ordinary_layouts_are_never_refused_and_their_pieces_are_counted_exactly(opened, view, dtype, window):
    """Over random views of the layouts torch makes (slices, transposes, expands, narrows, nested
    as_strided), with span windows from 1 byte to 4 KiB: pieces_of never refuses one, and its
    count, worked out before any piece is cut, is the number of pieces cut."""
    f, sid = opened
    size = torch.empty(0, dtype=dtype).element_size()
    m = {
        "shape": list(view.shape),
        "stride": list(view.stride()),
        "offset": view.storage_offset(),
        "storage": sid,
    }
    pieces = fillplan.pieces_of(f, "w", m, size, window)
    listed = list(cuts(m["shape"], m["stride"], m["offset"], max(1, window // size)))
    assert pieces.count == len(listed)
    assert sum(1 for _ in pieces) == len(listed)  # re-iterable: cut anew each time
