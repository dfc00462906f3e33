"""Damaged files: every kind of damage is a CheckpointError, never wrong data."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt

PIN = {"CKPTFMT_FILE_ID": "0f1e2d3c4b5a69788796a5b4c3d2e1f0", "SOURCE_DATE_EPOCH": "1700000000"}


def _state():
    g = torch.Generator().manual_seed(5)
    return {
        "model": {"w": torch.randn(64, 40, generator=g), "b": torch.randn(40, generator=g).bfloat16()},
        "ints": torch.arange(3000, dtype=torch.int64),
        "step": 7,
        "name": "run-1",
    }


def _make(path, compression=None):
    old = {k: os.environ.get(k) for k in PIN}
    os.environ.update(PIN)
    try:
        ckptfmt.save(_state(), path, compression=compression, chunk_size=4096)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    return path.read_bytes()


@pytest.fixture(scope="module", params=[None, "zstd"])
def original(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("orig") / "o.ckpt"
    return _make(p, request.param)


def _load_or_error(path):
    try:
        return ckptfmt.load(path)
    except ckptfmt.CheckpointError as e:
        return e


def _assert_rejected(path, expect=ckptfmt.CheckpointError):
    result = _load_or_error(path)
    assert isinstance(result, expect), f"damage not detected by load: {result!r}"[:300]
    report = ckptfmt.verify(path)
    assert not report.ok
    return result


HS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@HS
@given(data=st.data())
def test_any_single_bit_flip_is_detected(tmp_path, original, data):
    pos = data.draw(st.integers(0, len(original) * 8 - 1))
    buf = bytearray(original)
    buf[pos // 8] ^= 1 << (pos % 8)
    p = tmp_path / "f.ckpt"
    p.write_bytes(bytes(buf))
    err = _assert_rejected(p)
    assert not isinstance(err, ckptfmt.IncompleteError) or pos // 8 < 64


@HS
@given(data=st.data())
def test_truncation_anywhere_is_incomplete(tmp_path, original, data):
    n = data.draw(st.integers(0, len(original) - 1))
    p = tmp_path / "t.ckpt"
    p.write_bytes(original[:n])
    _assert_rejected(p, ckptfmt.IncompleteError)
    assert ckptfmt.verify(p).problems[0].kind == "incomplete"


@HS
@given(garbage=st.binary(min_size=1, max_size=200))
def test_appended_garbage_is_rejected(tmp_path, original, garbage):
    p = tmp_path / "g.ckpt"
    p.write_bytes(original + garbage)
    _assert_rejected(p, ckptfmt.CorruptError)


@HS
@given(data=st.data())
def test_zero_filled_range_is_detected(tmp_path, original, data):
    start = data.draw(st.integers(0, len(original) - 1))
    length = data.draw(st.integers(1, 5000))
    end = min(len(original), start + length)
    if not any(original[start:end]):
        return  # zeroing zeros changes nothing
    p = tmp_path / "z.ckpt"
    p.write_bytes(original[:start] + bytes(end - start) + original[end:])
    _assert_rejected(p)


def _chunks(path):
    with ckptfmt.open(path) as r:
        return r._file.chunks


def test_swapped_chunks_are_detected(tmp_path):
    p = tmp_path / "s.ckpt"
    data = bytearray(_make(p))
    a, b = _chunks(p)[0], _chunks(p)[1]
    assert a.stored_len == b.stored_len == 4096
    ra, rb = bytes(data[a.offset : a.offset + 4096]), bytes(data[b.offset : b.offset + 4096])
    data[a.offset : a.offset + 4096], data[b.offset : b.offset + 4096] = rb, ra
    p.write_bytes(bytes(data))
    err = _assert_rejected(p, ckptfmt.CorruptError)
    assert err.chunk == 0 and err.key == "state['model']['w']"
    problems = ckptfmt.verify(p).problems
    assert [(x.chunk, x.key) for x in problems] == [(0, "state['model']['w']"), (1, "state['model']['w']")]
    assert problems[0].offset == a.offset and "checksum mismatch" in problems[0].message


def test_chunk_transplanted_from_another_file_is_detected(tmp_path):
    """Two saves of the same state differ only in file id; a chunk moved across fails."""
    a_path, b_path = tmp_path / "a", tmp_path / "b"
    ckptfmt.save(_state(), a_path, chunk_size=4096)
    ckptfmt.save(_state(), b_path, chunk_size=4096)
    a, b = bytearray(a_path.read_bytes()), b_path.read_bytes()
    ch = _chunks(a_path)[2]
    assert a[ch.offset : ch.offset + ch.stored_len] == b[ch.offset : ch.offset + ch.stored_len]
    # same bytes, but B's index/checksums are bound to B's file id: move A's index into B
    ia, ib = _index_region(a_path), _index_region(b_path)
    mixed = bytearray(b[: ib[0]]) + a[ia[0] :]
    path = tmp_path / "mixed"
    path.write_bytes(bytes(mixed))
    _assert_rejected(path, ckptfmt.CorruptError)


def _index_region(path):
    with ckptfmt.open(path) as r:
        return r._file.footer.index_offset, r._file.footer.index_length


def test_verify_reports_every_damaged_chunk_and_names_tensors(tmp_path):
    p = tmp_path / "v.ckpt"
    data = bytearray(_make(p))
    chunks = _chunks(p)
    for k in (1, len(chunks) - 1):
        data[chunks[k].offset + 10] ^= 0x80
    p.write_bytes(bytes(data))
    report = ckptfmt.verify(p)
    assert not report.ok and report.chunks == len(chunks)
    assert [(x.kind, x.chunk, x.key) for x in report.problems] == [
        ("corrupt", 1, "state['model']['w']"),
        ("corrupt", len(chunks) - 1, "state['ints']"),
    ]


def test_load_without_verify_skips_checksums_but_not_structure(tmp_path):
    p = tmp_path / "n.ckpt"
    data = bytearray(_make(p))
    ch = _chunks(p)[0]
    data[ch.offset] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(ckptfmt.CorruptError):
        ckptfmt.load(p)
    state = ckptfmt.load(p, verify=False)
    assert state["step"] == 7
    trunc = tmp_path / "tr.ckpt"
    trunc.write_bytes(bytes(data[:-100]))
    with pytest.raises(ckptfmt.IncompleteError):
        ckptfmt.load(trunc, verify=False)


def test_not_a_checkpoint(tmp_path):
    p = tmp_path / "x.pt"
    torch.save({"a": torch.ones(2)}, p)
    with pytest.raises(ckptfmt.UnsupportedError, match="not a ckptfmt file"):
        ckptfmt.load(p)
    empty = tmp_path / "e"
    empty.write_bytes(b"")
    with pytest.raises(ckptfmt.IncompleteError):
        ckptfmt.load(empty)


def test_open_get_reads_only_what_it_needs(tmp_path):
    p = tmp_path / "o.ckpt"
    data = bytearray(_make(p))
    ints_chunk = [c for c in _chunks(p)][-1]
    data[ints_chunk.offset] ^= 1
    p.write_bytes(bytes(data))
    with ckptfmt.open(p) as r:
        assert r.keys() == ["model", "ints", "step", "name"]
        assert torch.equal(r.get("model")["w"], _state()["model"]["w"])
        assert r.get("step") == 7
        with pytest.raises(ckptfmt.CorruptError) as info:
            r.get("ints")
        assert info.value.key == "state['ints']"
        with pytest.raises(KeyError):
            r.get("missing")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damaged=st.sets(st.integers(0, 47), max_size=48), compression=st.sampled_from([None, "zstd"]))
def test_verify_reports_exactly_the_damaged_chunks_in_order(tmp_path, damaged, compression):
    """A window that fails is checked again in halves: every damaged chunk is found, in order,
    and no sound one is blamed, whichever chunks are damaged."""
    p = tmp_path / f"h-{compression}.ckpt"
    g = torch.Generator().manual_seed(1)
    ckptfmt.save({"w": torch.randn(48 * 1024, generator=g)}, p, chunk_size=4096, compression=compression)
    chunks = _chunks(p)
    assert len(chunks) == 48
    data = bytearray(p.read_bytes())
    for k in damaged:
        data[chunks[k].offset + chunks[k].stored_len // 2] ^= 0x10
    p.write_bytes(bytes(data))
    report = ckptfmt.verify(p)
    assert [x.chunk for x in report.problems] == sorted(damaged)
    assert all(x.kind == "corrupt" for x in report.problems)


def test_load_names_the_first_damaged_chunk_whichever_thread_finds_one(tmp_path):
    """The engine checks chunks on several threads; with every chunk damaged the error is
    still the first one's, although a thread finds a small later chunk's damage long before
    another has hashed the large first chunk: the same file always gives the same message."""
    g = torch.Generator().manual_seed(1)
    state = {"big": torch.randn(1 << 20, generator=g)} | {
        f"s{i}": torch.randn(16, generator=g) for i in range(8)
    }
    p = tmp_path / "many.ckpt"
    ckptfmt.save(state, p, chunk_size=4 << 20)
    chunks = _chunks(p)
    assert chunks[0].stored_len == 4 << 20 and len(chunks) == 9
    data = bytearray(p.read_bytes())
    for ch in chunks:
        data[ch.offset] ^= 0xFF
    p.write_bytes(bytes(data))
    seen = {_load_or_error(p).chunk for _ in range(20)}
    assert seen == {0}
