"""The bytes on disk are the ones spec/FORMAT.md describes, computed independently here."""

from __future__ import annotations

import json
import struct

import torch
import xxhash
import zstandard

import ckptfmt

FILE_ID = bytes(range(16))


def _save(tmp_path, monkeypatch, state, **kw):
    monkeypatch.setenv("CKPTFMT_FILE_ID", FILE_ID.hex())
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764460800")
    p = tmp_path / "f.ckpt"
    ckptfmt.save(state, p, **kw)
    return p.read_bytes()


def _parse(data: bytes):
    """A minimal reader written from the spec alone."""
    assert data[:8] == b"\x89CKF\r\n\x1a\n"
    major, minor, flags = struct.unpack_from("<HHI", data, 8)
    assert (major, minor, flags) == (1, 0, 0)
    assert data[16:32] == FILE_ID
    length, req, opt, check = struct.unpack_from("<QQQQ", data, 32)
    assert length == len(data) and length % 64 == 0 and req == opt == 0
    assert check == xxhash.xxh3_64_intdigest(data[:56])
    foot = data[-64:]
    ioff, ilen, icheck = struct.unpack_from("<QQQ", foot)
    assert foot[24:40] == FILE_ID and foot[40:48] == bytes(8) and foot[56:] == b"\x89CKFEND\n"
    assert struct.unpack_from("<Q", foot, 48)[0] == xxhash.xxh3_64_intdigest(foot[:48])
    assert (ioff + ilen + 63) // 64 * 64 == length - 64
    index = data[ioff : ioff + ilen]
    seed = xxhash.xxh3_64_intdigest(b"ckptfmt-index\0\0\0" + FILE_ID + struct.pack("<QQ", ioff, ilen))
    assert icheck == xxhash.xxh3_64_intdigest(index, seed=seed)
    assert not any(data[ioff + ilen : length - 64])
    return json.loads(index), ioff


def _chunk_bytes(data: bytes, index: dict, k: int) -> bytes:
    off, slen, rlen, codec, filt, width, check = index["chunks"][k]
    ctx = b"ckptfmt-chunk\0\0\0" + FILE_ID + struct.pack("<QQQQBBB5x", k, off, slen, rlen, codec, filt, width)
    stored = data[off : off + slen]
    assert int(check, 16) == xxhash.xxh3_64_intdigest(stored, seed=xxhash.xxh3_64_intdigest(ctx))
    if codec == 0:
        return stored
    raw = zstandard.ZstdDecompressor().decompress(stored)
    if filt == 1:
        n = rlen // width
        raw = bytes(raw[j * n + i] for i in range(n) for j in range(width))
    return raw


def test_worked_example_matches_spec(tmp_path, monkeypatch):
    data = _save(tmp_path, monkeypatch, {"w": torch.tensor([1.0, 2.0]), "step": 7})
    index, ioff = _parse(data)
    assert ioff == 128 and len(data) == 704
    assert index["chunks"] == [[64, 8, 8, 0, 0, 0, "842bbfe4c9565e46"]]
    assert index["nodes"][-1] == ["dict", [[0, 1], [2, 3]]]
    assert _chunk_bytes(data, index, 0) == struct.pack("<2f", 1.0, 2.0)
    assert list(index) == [
        "chunk_size",
        "producer",
        "source_devices",
        "metadata",
        "storages",
        "chunks",
        "nodes",
    ]


def test_shuffled_zstd_chunks_match_spec(tmp_path, monkeypatch):
    t = torch.arange(4096, dtype=torch.float32).bfloat16()
    data = _save(tmp_path, monkeypatch, {"t": t}, compression="zstd", chunk_size=4096)
    index, _ = _parse(data)
    chunks = index["chunks"]
    assert len(chunks) == 2 and all(c[3] == 1 and c[4] == 1 and c[5] == 2 for c in chunks)
    raw = b"".join(_chunk_bytes(data, index, k) for k in range(2))
    assert raw == bytes(t.view(torch.uint8).numpy())
    prev_end = 64
    for off, slen, *_ in chunks:  # placement rule: each chunk at align64(previous end)
        assert off == (prev_end + 63) // 64 * 64
        assert not any(data[prev_end:off])
        prev_end = off + slen
