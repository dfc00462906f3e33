"""The C engine writes exactly the bytes the reference writer writes, at any thread count."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xxhash
from helpers import states
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.engine import batched, chunkwrite
from ckptfmt.engine import native as _native
from ckptfmt.engine.writeoptions import WriteOptions
from ckptfmt.format import layout as fmt
from ckptfmt.format.encode import encode

pytestmark = pytest.mark.skipif(not _native.built(), reason="the C engine is not built")


def _write(tmp_path, name, state, engine, threads=None, **kw):
    p = tmp_path / name
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        options = WriteOptions(**kw)
        chunkwrite.build_file(fd, encode(state), options, engine=engine, threads=threads, path=str(p))
    finally:
        os.close(fd)
    return p.read_bytes()


@pytest.fixture(autouse=True)
def _pinned(monkeypatch):
    monkeypatch.setenv("CKPTFMT_FILE_ID", "42" * 16)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    state=states(),
    compression=st.sampled_from([None, "zstd"]),
    level=st.sampled_from([None, 3, -1]),
    threads=st.sampled_from([1, 2, 3, 8]),
    chunk_size=st.sampled_from([4096, 8192, 1 << 20]),
)
def test_c_and_python_writers_are_byte_identical(tmp_path, state, compression, level, threads, chunk_size):
    if compression is None:
        level = None
    kw = dict(compression=compression, level=level, chunk_size=chunk_size)
    ref = _write(tmp_path, "py.ckpt", state, "python", **kw)
    got = _write(tmp_path, "c.ckpt", state, "c", threads=threads, **kw)
    assert got == ref


@pytest.mark.parametrize("threads", [1, 2, 5, 16])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_realistic_weights_identical_and_loadable(tmp_path, threads, compression):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=g) * 0.02
    state = {
        "w": w,
        "bf16": w.bfloat16(),
        "view": w[100:300, ::2],
        "f64": w.double()[:50],
        "c": torch.complex(w[:10], w[10:20]),
        "i": torch.arange(70000),
    }
    kw = dict(compression=compression, level=None, chunk_size=1 << 16)
    ref = _write(tmp_path, "py.ckpt", state, "python", **kw)
    got = _write(tmp_path, "c.ckpt", state, "c", threads=threads, **kw)
    assert got == ref
    back = ckptfmt.load(tmp_path / "c.ckpt")
    for k, v in state.items():
        assert torch.equal(back[k], v), k
    if compression:
        with ckptfmt.open(tmp_path / "c.ckpt") as r:
            assert any(c.filter == fmt.FILTER_SHUFFLE for c in r._file.chunks)


def test_seed_and_shuffle_match_the_reference():
    lib, ffi = _native.lib, _native.ffi
    fid = bytes(range(16))
    for args in [
        (0, 64, 8, 8, 0, 0, 0),
        (7, 1 << 40, 123, 4096, 1, 1, 2),
        (2**63, 2**64 - 64, 1, 2, 1, 0, 0),
    ]:
        assert lib.ckf_chunk_seed(ffi.new("uint8_t[16]", fid), *args) == fmt.chunk_seed(fid, *args)
    rng = np.random.default_rng(1)
    # whole blocks of 16 units (the vector loops) and every tail length (the plain loops)
    for width in (2, 3, 4, 8, 16):
        for units in (0, 1, 15, 16, 17, 31, 256, 263):
            n = units * width
            raw = rng.integers(0, 256, n, dtype=np.uint8)
            out = ffi.new("uint8_t[]", max(n, 1))
            lib.ckf_shuffle(out, ffi.from_buffer(raw), n, width)
            expect = raw.reshape(-1, width).T.tobytes()
            assert bytes(ffi.buffer(out, n)) == expect, (width, units)
            back = ffi.new("uint8_t[]", max(n, 1))
            lib.ckf_unshuffle(back, out, n, width)
            assert bytes(ffi.buffer(back, n)) == raw.tobytes(), (width, units)
            # the streaming-store variant, into an aligned and a misaligned destination
            wide = ffi.new("uint8_t[]", n + 17)
            for at in (0, 16 - int(ffi.cast("uintptr_t", wide)) % 16, 1):
                ffi.memmove(wide, bytes(n + 17), n + 17)
                lib.ckf_unshuffle_stream(wide + at, out, n, width)
                got = bytes(ffi.buffer(wide, n + 17))
                assert got[at : at + n] == raw.tobytes(), (width, units, at)
                assert got[:at] == bytes(at) and got[at + n :] == bytes(17 - at), (width, units, at)
    assert xxhash.xxh3_64_intdigest(b"x", seed=5) == xxhash.xxh3_64_intdigest(b"x", seed=5)


def test_backend_switch(monkeypatch):
    assert ckptfmt.backend() == "c"
    monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    assert ckptfmt.backend() == "python"


def test_io_error_reaches_caller_with_errno(tmp_path):
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        data = np.ones(1 << 20, dtype=np.uint8)
        with pytest.raises(OSError) as info:
            pieces = [(memoryview(data), 1)]
            _native.write_chunks(fd, bytes(16), 0, 64, pieces, WriteOptions(), 4, "/dev/full")
        assert info.value.errno == 28 and info.value.filename == "/dev/full"  # ENOSPC
        assert "chunk 0" in str(info.value)
    finally:
        os.close(fd)


def test_fallback_compressor_round_trips(tmp_path, monkeypatch):
    """Where the engine is not built, compression goes through the zstandard package."""
    monkeypatch.setattr(_native, "built", lambda: False)
    monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    state = {"w": (torch.randn(100_000) * 0.02).bfloat16()}
    ckptfmt.save(state, tmp_path / "f.ckpt", compression="zstd")
    assert torch.equal(ckptfmt.load(tmp_path / "f.ckpt")["w"], state["w"])
    assert os.path.getsize(tmp_path / "f.ckpt") < state["w"].nbytes * 0.9


def test_one_zstd_profile_for_both_engines():
    """format.py's profile and window limit are the C engine's; both write the same frames."""
    import zstandard

    from ckptfmt.engine import chunkwrite as chunkio

    lib = _native.lib
    assert fmt.ZSTD_FAST_PROFILE["min_match"] == lib.CKF_FAST_MIN_MATCH
    assert fmt.ZSTD_FAST_PROFILE["hash_log"] == lib.CKF_FAST_HASH_LOG
    assert fmt.ZSTD_WINDOW_LOG_MAX == lib.CKF_ZSTD_WINDOW_LOG_MAX
    weights = (np.random.default_rng(0).standard_normal(1 << 16) * 0.02).astype(np.float32)
    shuffled = weights.view(np.uint8).reshape(-1, 4).T.tobytes()
    ours = _native.zstd_compress(shuffled, _native.FAST_PROFILE)
    theirs = chunkio._zstandard_compressor(None).compress(shuffled)
    assert zstandard.ZstdDecompressor().decompress(theirs) == shuffled
    z = lib.ckf_zstd_version()
    if ".".join(map(str, zstandard.ZSTD_VERSION)) == f"{z // 10000}.{z // 100 % 100}.{z % 100}":
        assert ours == theirs  # the same library version: the same bytes
    else:
        assert abs(len(ours) - len(theirs)) < len(ours) // 50  # the same parameters, nearly the same size


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_checking_only_needs_no_destination_unless_the_bytes_are_used(tmp_path, compression):
    """verify hands the engine no destination for chunks it only checks; a read, or a chunk
    whose content digest is taken from the decoded bytes, still needs one."""
    from ckptfmt.files.reader import CheckpointFile

    p = tmp_path / "d.ckpt"
    ckptfmt.save({"w": torch.randn(1 << 16)}, p, compression=compression, chunk_size=1 << 16)
    with CheckpointFile(str(p)) as f:
        everything = [(k, None) for k in range(len(f.chunks))]
        f.read_into(everything, True, check_only=True)
        with pytest.raises(ValueError, match="needs a destination"):
            f.read_into(everything, True)
    raw = bytearray(p.read_bytes())
    raw[200] ^= 1  # inside the first chunk: still found without a destination
    p.write_bytes(bytes(raw))
    report = ckptfmt.verify(p)
    assert not report.ok and report.problems[0].chunk == 0


@settings(max_examples=200, deadline=None)
@given(
    src_at=st.integers(0, 63),
    dst_at=st.integers(0, 63),
    n=st.one_of(st.integers(0, 300), st.integers(0, 9 << 20)),
    threads=st.integers(1, 4),
)
def test_parallel_copy_is_exact_at_any_alignment_and_length(src_at, dst_at, n, threads):
    """Snapshot copies (streaming stores on aligned runs, plain copies at the edges) move
    exactly the bytes asked for and touch nothing around them."""
    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, src_at + n, dtype=np.uint8)
    dst = np.full(dst_at + n + 64, 0xAB, dtype=np.uint8)
    _native.copy(memoryview(dst)[dst_at : dst_at + n], memoryview(src)[src_at:], threads)
    assert np.array_equal(dst[dst_at : dst_at + n], src[src_at:])
    assert (dst[:dst_at] == 0xAB).all() and (dst[dst_at + n :] == 0xAB).all()


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.one_of(st.integers(0, 5000), st.integers(1 << 20, 3 << 20)), max_size=200),
    threads=st.integers(1, 4),
)
def test_copy_spans_moves_each_span_and_nothing_else(lengths, threads):
    """Many copies in one call (load_into's chunks): small spans in groups, large ones in
    pieces; every span lands at its place, and the gaps between the places stay as they were."""
    gap = 3
    total = sum(lengths) + gap * (len(lengths) + 1)
    src = np.random.default_rng(len(lengths)).integers(0, 256, max(total, 1), dtype=np.uint8)
    dst = np.full(max(total, 1), 0xAB, dtype=np.uint8)
    spans, expected = [], dst.copy()
    s_at = d_at = 0
    for n in lengths:
        d_at += gap
        spans += [src.ctypes.data + s_at, dst.ctypes.data + d_at, n]
        expected[d_at : d_at + n] = src[s_at : s_at + n]
        s_at += n
        d_at += n
    batched.copy_spans(spans, threads)
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize(
    "lengths",
    [
        [5, (1 << 64) - 1],  # one span whose pieces' count overflows
        [(1 << 64) - (1 << 20)] * ((1 << 16) + 1),  # each span fine, the bytes of their tasks overflow
    ],
    ids=["one-span", "many-spans"],
)
def test_copy_spans_refuses_lengths_it_cannot_plan(lengths):
    """The spans' lengths are the caller's: lengths whose pieces overflow the engine's counts
    are a LimitError with nothing copied, not a task table too small for them."""
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    spans = [v for n in lengths for v in (src.ctypes.data, dst.ctypes.data, n)]
    with pytest.raises(ckptfmt.errors.LimitError, match="more than the engine can plan"):
        batched.copy_spans(spans, 2)
    assert not dst.any()
