"""Generates the malicious-file corpus: one minimal file per attack or damage class.

    python tests/corpus/make_corpus.py      (rewrites tests/corpus/*.ckpt and expected.json)

Every file has valid checksums wherever the attack does not concern them, so the
reader's structural checks, not the checksums, must catch it (an attacker can
recompute XXH3).  expected.json maps each file to the error class it must raise.

The ext_* cases are incremental files (required feature bit 0) whose external chunks
name side files written alongside: ext_base.ref (a valid file with content digests)
and ext_garbage.ref (not a ckptfmt file).  Side files end in .ref, not .ckpt, so the
corpus tests do not take them for cases.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from typing import Any

import xxhash
import zstandard

HERE = os.path.dirname(os.path.abspath(__file__))
FID = bytes.fromhex("c0ffee00" * 4)
MAGIC = b"\x89CKF\r\n\x1a\n"
END = b"\x89CKFEND\n"


def a64(n: int) -> int:
    return (n + 63) // 64 * 64


def chunk_check(
    fid: bytes, k: int, off: int, stored: bytes, raw_len: int, codec: int, filt: int, width: int
) -> str:
    ctx = (
        b"ckptfmt-chunk\0\0\0"
        + fid
        + struct.pack("<QQQQBBB5x", k, off, len(stored), raw_len, codec, filt, width)
    )
    return f"{xxhash.xxh3_64_intdigest(stored, seed=xxhash.xxh3_64_intdigest(ctx)):016x}"


def tensor_node(storage: int = 0, **kw: Any) -> list[Any]:
    meta = {
        "dtype": "float32",
        "shape": [4],
        "stride": [1],
        "offset": 0,
        "storage": storage,
        "requires_grad": False,
        "param": False,
        "conj": False,
    }
    meta.update(kw)
    return ["tensor", meta]


def base_index() -> dict[str, Any]:
    return {
        "chunk_size": 4096,
        "producer": {"ckptfmt": "corpus"},
        "source_devices": ["cpu"],
        "metadata": {},
        "storages": [[16, "cpu"]],
        "chunks": None,  # filled by build() unless given
        "nodes": [["str", "w"], tensor_node(), ["dict", [[0, 1]]]],
    }


RAW16 = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)


def build(
    index: dict[str, Any] | None = None,
    payloads: list[tuple[bytes, int, int, int, int]] | None = None,
    *,
    index_bytes: bytes | None = None,
    fid: bytes = FID,
    major: int = 1,
    flags: int = 0,
    required: int = 0,
    mutate_chunks: Callable[[list[list[Any]]], None] | None = None,
    data_override: Callable[[bytearray], None] | None = None,
    footer_ilen: int | None = None,
    footer_fid: bytes | None = None,
    length_delta: int = 0,
    trailing: bytes = b"",
    block: bytes = b"",
    footer_block_len: int | None = None,
) -> bytes:
    """Lay out payloads (stored, raw_len, codec, filter, width) and seal the file; `block`: a
    signature block (spec section 16) between the index's padding and the footer, whose length
    the footer records (or `footer_block_len`)."""
    index = base_index() if index is None else index
    payloads = [(RAW16, 16, 0, 0, 0)] if payloads is None else payloads
    data = bytearray(64)
    records = []
    for k, (stored, raw_len, codec, filt, width) in enumerate(payloads):
        off = len(data)
        data += stored
        data += bytes(a64(len(data)) - len(data))
        records.append(
            [
                off,
                len(stored),
                raw_len,
                codec,
                filt,
                width,
                chunk_check(fid, k, off, stored, raw_len, codec, filt, width),
            ]
        )
    if index.get("chunks") is None:
        index["chunks"] = records
    if mutate_chunks:
        mutate_chunks(index["chunks"])
    if data_override:
        data_override(data)
    ioff = len(data)
    blob = index_bytes if index_bytes is not None else json.dumps(index, separators=(",", ":")).encode()
    data += blob
    data += bytes(a64(len(data)) - len(data))
    data += block
    ilen = len(blob) if footer_ilen is None else footer_ilen
    iseed = xxhash.xxh3_64_intdigest(b"ckptfmt-index\0\0\0" + fid + struct.pack("<QQ", ioff, len(blob)))
    head = struct.pack(
        "<QQQ16sQ",
        ioff,
        ilen,
        xxhash.xxh3_64_intdigest(blob, seed=iseed),
        footer_fid or fid,
        len(block) if footer_block_len is None else footer_block_len,
    )
    data += head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + END
    length = len(data) + length_delta
    pro = struct.pack("<8sHHI16sQQQ", MAGIC, major, 0, flags, fid, length, required, 0)
    data[:64] = pro + struct.pack("<Q", xxhash.xxh3_64_intdigest(pro))
    return bytes(data) + trailing


# -- incremental files (spec section 12) ---------------------------------------

FID_BASE = bytes.fromhex("ba5e0000" * 4)


def digest(raw: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(raw)


def ext_index(externals: list[Any], chunks: list[Any] | None = None) -> dict[str, Any]:
    """base_index() with the `externals` member between storages and chunks."""
    i = base_index()
    return {
        **{k: i[k] for k in ("chunk_size", "producer", "source_devices", "metadata", "storages")},
        "externals": externals,
        "chunks": chunks,
        "nodes": i["nodes"],
    }


def ext_base() -> bytes:
    """The referenced file: RAW16 as its one local chunk, with its digest."""
    return build(ext_index([]), fid=FID_BASE, required=1, mutate_chunks=lambda c: c[0].append(digest(RAW16)))


def ext_record(
    number: int = 0, offset: int = 64, entry: int = 0, check_number: int | None = None
) -> list[Any]:
    """An external record naming chunk `number` of ext_base.ref (checksum bound to `check_number`)."""
    n = number if check_number is None else check_number
    check = chunk_check(FID_BASE, n, offset, RAW16, 16, 0, 0, 0)
    return [offset, 16, 16, 0, 0, 0, check, digest(RAW16), entry, number]


def ext_file(
    externals: list[Any] | None = None,
    record: list[Any] | None = None,
    **kw: Any,
) -> bytes:
    """A file whose one chunk is external, in ext_base.ref unless told otherwise."""
    if externals is None:
        externals = [["ext_base.ref", FID_BASE.hex(), len(ext_base())]]
    return build(ext_index(externals, [record or ext_record()]), [], required=1, **kw)


def ref(path: str, fid: bytes = FID_BASE, length: int | None = None) -> list[Any]:
    return [path, fid.hex(), len(ext_base()) if length is None else length]


#: files the ext_* cases refer to, written next to them
SIDE_FILES: dict[str, Callable[[], bytes]] = {
    "ext_base.ref": ext_base,
    "ext_garbage.ref": lambda: b"GGUF" + bytes(1020),
}


def idx(**changes: Any) -> dict[str, Any]:
    i = base_index()
    i.update(changes)
    return i


def zstd(raw: bytes, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=content_size).compress(raw)


def zstd_frame(fhd: int, *fields: bytes) -> bytes:
    """A standard zstd frame: magic, frame header descriptor, header fields, then one RLE block of
    4096 zero bytes (the last block).  RFC 8878 section 3.1.1."""
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + b"".join(fields) + bytes([0x03, 0x80, 0x00]) + b"\x00"


def zstd_window(window_log: int) -> bytes:
    """4096 raw bytes in a frame that is not single-segment and declares a 2**window_log window."""
    # descriptor: content size in 2 bytes (+256), no single segment; window exponent = log - 10
    return zstd_frame(0x40, bytes([(window_log - 10) << 3]), struct.pack("<H", 4096 - 256))


def zstd_legacy_v07() -> bytes:
    """A zstd v0.7 (pre-1.0, magic 0xFD2FB527) frame of 4096 zero bytes: single segment, content
    size in 2 bytes, one RLE block, the end block.  libzstd built with legacy support decodes it."""
    return (
        struct.pack("<I", 0xFD2FB527)
        + bytes([0x60])
        + struct.pack("<H", 4096 - 256)
        + bytes([0x80, 0x10, 0x00, 0x00])
        + bytes([0xC0, 0x00, 0x00])
    )


def zstd_case(stored: bytes, raw_len: int = 4096) -> bytes:
    return build(
        idx(
            storages=[[raw_len, "cpu"]],
            nodes=[["str", "w"], tensor_node(shape=[raw_len // 4]), ["dict", [[0, 1]]]],
        ),
        [(stored, raw_len, 1, 0, 0)],
    )


def colliding_keys_nodes(n: int) -> list[Any]:
    """A dict of n int keys k * (2**61 - 1): all have Python hash 0."""
    nodes: list[Any] = []
    for k in range(1, n + 1):
        nodes += [["int", format(k * (2**61 - 1), "x")], ["none"]]
    return nodes + [["dict", [[2 * i, 2 * i + 1] for i in range(n)]]]


def deep_list_nodes(depth: int) -> list[Any]:
    nodes: list[Any] = [["none"]]
    for i in range(depth):
        nodes.append(["list", [i]])
    return nodes


def sig_block(
    n: int = 1,
    magic: bytes = b"ckptfmt-sig" + bytes(5),
    dalg: int = 1,
    salg: int = 1,
    count: int | None = None,
) -> bytes:
    """A signature block (spec section 16) for n chunks, zero digests and signature: its
    structure alone, which every reader checks (the signature only a reader requiring one)."""
    head = struct.pack("<16sHHIQ32s", magic, dalg, salg, 0, n if count is None else count, bytes(32))
    raw = head + bytes(32 * n) + bytes(64)
    return raw + bytes(a64(len(raw)) - len(raw))


def enc_block(
    n: int = 1,
    magic: bytes = b"ckptfmt-enc" + bytes(5),
    cipher: int = 1,
    wrap: int = 1,
    flags: int = 1,
    count: int | None = None,
    hint: bytes = b"\x01" * 8,
    wlen: int = 60,
    reserved: int = 0,
    pad: bytes = b"",
) -> bytes:
    """An encryption block (spec section 17.2) for n chunks with zero wrapped key and tags: its
    structure alone, which every reader checks before it asks for a key; `pad` replaces the
    first bytes of the padding after the wrapped key."""
    head = struct.pack(
        "<16sHHIQ8sII16s",
        magic,
        cipher,
        wrap,
        flags,
        n if count is None else count,
        hint,
        wlen,
        reserved,
        bytes(16),
    )
    raw = bytearray(head + bytes(wlen))
    raw += bytes(a64(len(raw)) - len(raw))
    raw[64 + wlen : 64 + wlen + len(pad)] = pad
    raw += bytes(16 * n)
    return bytes(raw + bytes(a64(len(raw)) - len(raw)))


CASES: dict[str, tuple[str, Callable[[], bytes]]] = {
    # structure of the container
    "not_ckptfmt": ("UnsupportedError", lambda: b"GGUF" + bytes(200)),
    "empty": ("IncompleteError", lambda: b""),
    "zero_prologue": ("IncompleteError", lambda: bytes(4096)),
    "truncated_mid_data": ("IncompleteError", lambda: build()[:100]),
    "trailing_bytes": ("CorruptError", lambda: build(trailing=b"PK\x03\x04 smuggled payload")),
    "file_length_not_aligned": ("CorruptError", lambda: build(length_delta=-3)),
    "major_version_2": ("UnsupportedError", lambda: build(major=2)),
    "reserved_prologue_flags": ("CorruptError", lambda: build(flags=1)),
    "unknown_required_feature": ("UnsupportedError", lambda: build(required=1 << 5)),
    # signed files (spec section 16)
    "signed_and_external": ("UnsupportedError", lambda: build(required=3, block=sig_block())),
    "signed_without_block": ("CorruptError", lambda: build(required=2)),
    "signed_block_length_huge": ("CorruptError", lambda: build(required=2, footer_block_len=1 << 40)),
    "signed_block_length_for_other_count": ("CorruptError", lambda: build(required=2, block=sig_block(3))),
    "signed_block_count_mismatch": ("CorruptError", lambda: build(required=2, block=sig_block(count=2))),
    "signed_block_bad_magic": ("CorruptError", lambda: build(required=2, block=sig_block(magic=bytes(16)))),
    "signed_block_unknown_digest": ("UnsupportedError", lambda: build(required=2, block=sig_block(dalg=2))),
    "signed_block_unknown_signature": (
        "UnsupportedError",
        lambda: build(required=2, block=sig_block(salg=9)),
    ),
    "unsigned_with_block": ("CorruptError", lambda: build(block=sig_block())),
    # encrypted files (spec section 17): the block's structure is checked before any key is asked for
    # bits 1 and 2 (spec 17.8): an encryption block alone is too short for both blocks
    "encrypted_and_signed": ("CorruptError", lambda: build(required=6, block=enc_block())),
    # bits 0 and 2 (spec 17.9), the index in clear but lacking the externals member bit 0
    # requires: a load without the key is refused for the key, verify finds the index corrupt
    "encrypted_and_external": ("DecryptionError", lambda: build(required=5, block=enc_block(flags=0))),
    "encrypted_without_block": ("CorruptError", lambda: build(required=4)),
    "encrypted_block_length_huge": ("CorruptError", lambda: build(required=4, footer_block_len=1 << 40)),
    "encrypted_block_bad_magic": (
        "CorruptError",
        lambda: build(required=4, block=enc_block(magic=bytes(16))),
    ),
    "encrypted_block_unknown_cipher": (
        "UnsupportedError",
        lambda: build(required=4, block=enc_block(cipher=2)),
    ),
    "encrypted_block_unknown_wrap": ("UnsupportedError", lambda: build(required=4, block=enc_block(wrap=3))),
    "encrypted_block_reserved_flag": ("CorruptError", lambda: build(required=4, block=enc_block(flags=3))),
    "encrypted_block_reserved_field": (
        "CorruptError",
        lambda: build(required=4, block=enc_block(reserved=1)),
    ),
    "encrypted_block_wrapped_length": ("CorruptError", lambda: build(required=4, block=enc_block(wlen=59))),
    "encrypted_block_for_other_count": ("CorruptError", lambda: build(required=4, block=enc_block(count=5))),
    "encrypted_block_padding": ("CorruptError", lambda: build(required=4, block=enc_block(pad=b"\x01"))),
    "encrypted_block_service_with_hint": (
        "CorruptError",
        lambda: build(required=4, block=enc_block(wrap=2, wlen=100)),
    ),
    "unencrypted_with_block": ("CorruptError", lambda: build(block=enc_block())),
    "footer_other_file_id": ("CorruptError", lambda: build(footer_fid=bytes(16))),
    "index_length_huge": ("LimitError", lambda: build(footer_ilen=2**64 - 1)),
    "index_length_past_footer": ("CorruptError", lambda: build(footer_ilen=10**6)),
    # the index
    "index_not_utf8": ("CorruptError", lambda: build(index_bytes=b'{"chunk_size":\xff\xfe}')),
    "index_not_json": ("CorruptError", lambda: build(index_bytes=b"{not json")),
    "index_trailing_json": (
        "CorruptError",
        lambda: build(index_bytes=json.dumps(base_index() | {"chunks": []}).encode() + b" []"),
    ),
    "index_duplicate_field": (
        "CorruptError",
        lambda: build(index_bytes=b'{"chunk_size":4096,"chunk_size":4096}'),
    ),
    "index_json_nesting_bomb": ("LimitError", lambda: build(index_bytes=b"[" * 200000 + b"]" * 200000)),
    "index_float_literal": ("CorruptError", lambda: build(idx(chunk_size=4096.0))),
    "index_huge_int_literal": ("CorruptError", lambda: build(idx(chunk_size=10**30))),
    "index_missing_field": ("CorruptError", lambda: build(index_bytes=b'{"chunk_size":4096}')),
    "invalid_utf8_in_string": (
        "CorruptError",
        lambda: build(
            index_bytes=json.dumps(base_index() | {"chunks": []}).encode().replace(b'"w"', b'"\xc3\x28"')
        ),
    ),
    "chunk_size_not_power_of_two": ("CorruptError", lambda: build(idx(chunk_size=5000))),
    "chunk_size_huge": ("LimitError", lambda: build(idx(chunk_size=1 << 40))),
    "metadata_too_many_entries": (
        "LimitError",
        lambda: build(idx(metadata={f"k{i}": "" for i in range(70000)})),
    ),
    # chunks and data layout
    "chunk_offset_outside_file": (
        "CorruptError",
        lambda: build(mutate_chunks=lambda c: c[0].__setitem__(0, 1 << 40)),
    ),
    "chunks_overlap": (
        "CorruptError",
        lambda: build(
            idx(
                storages=[[16, "cpu"], [16, "cpu"]],
                nodes=[
                    ["str", "a"],
                    tensor_node(0),
                    ["str", "b"],
                    tensor_node(1),
                    ["dict", [[0, 1], [2, 3]]],
                ],
            ),
            [(RAW16, 16, 0, 0, 0), (RAW16, 16, 0, 0, 0)],
            mutate_chunks=lambda c: c[1].__setitem__(0, 64),
        ),
    ),
    "hole_between_chunks": (
        "CorruptError",
        lambda: build(
            idx(
                storages=[[16, "cpu"], [16, "cpu"]],
                nodes=[
                    ["str", "a"],
                    tensor_node(0),
                    ["str", "b"],
                    tensor_node(1),
                    ["dict", [[0, 1], [2, 3]]],
                ],
            ),
            [(RAW16, 16, 0, 0, 0), (RAW16 + bytes(64), 16, 0, 0, 0)],
            mutate_chunks=lambda c: c[1].__setitem__(1, 16),
        ),
    ),
    "nonzero_padding": ("CorruptError", lambda: build(data_override=lambda d: d.__setitem__(100, 0x41))),
    "chunk_count_mismatch": ("CorruptError", lambda: build(mutate_chunks=lambda c: c.append(list(c[0])))),
    "raw_length_lie": ("CorruptError", lambda: build(mutate_chunks=lambda c: c[0].__setitem__(2, 4096))),
    "zeroed_checksum": ("CorruptError", lambda: build(mutate_chunks=lambda c: c[0].__setitem__(6, "0" * 16))),
    "missing_checksum": ("CorruptError", lambda: build(mutate_chunks=lambda c: c[0].pop())),
    "checksum_not_hex": (
        "CorruptError",
        lambda: build(mutate_chunks=lambda c: c[0].__setitem__(6, "zz" * 8)),
    ),
    "transplanted_chunk": (
        "CorruptError",
        lambda: build(
            mutate_chunks=lambda c: c[0].__setitem__(6, chunk_check(b"\1" * 16, 0, 64, RAW16, 16, 0, 0, 0))
        ),
    ),
    "unknown_codec": ("UnsupportedError", lambda: build(mutate_chunks=lambda c: c[0].__setitem__(3, 7))),
    "unknown_filter": ("UnsupportedError", lambda: build(mutate_chunks=lambda c: c[0].__setitem__(4, 9))),
    "raw_chunk_with_filter": ("CorruptError", lambda: build(payloads=[(RAW16, 16, 0, 1, 4)])),
    # compression
    "zstd_bomb_ratio": (
        "CorruptError",
        lambda: build(
            idx(
                chunk_size=1 << 30,
                storages=[[1 << 30, "cpu"]],
                nodes=[["str", "w"], tensor_node(shape=[1 << 28]), ["dict", [[0, 1]]]],
            ),
            [(zstd(bytes(1 << 16))[:8], 1 << 30, 1, 0, 0)],
        ),
    ),
    "zstd_size_lie": (
        "CorruptError",
        lambda: build(
            idx(
                storages=[[4096, "cpu"]], nodes=[["str", "w"], tensor_node(shape=[1024]), ["dict", [[0, 1]]]]
            ),
            [(zstd(bytes(2048)), 4096, 1, 0, 0)],
        ),
    ),
    "zstd_no_content_size": (
        "CorruptError",
        lambda: build(
            idx(
                storages=[[4096, "cpu"]], nodes=[["str", "w"], tensor_node(shape=[1024]), ["dict", [[0, 1]]]]
            ),
            [(zstd(bytes(4096), content_size=False), 4096, 1, 0, 0)],
        ),
    ),
    "zstd_garbage": (
        "CorruptError",
        lambda: build(
            idx(
                storages=[[4096, "cpu"]], nodes=[["str", "w"], tensor_node(shape=[1024]), ["dict", [[0, 1]]]]
            ),
            [(b"\x28\xb5\x2f\xfd" + b"\xff" * 60, 4096, 1, 0, 0)],
        ),
    ),
    "zstd_trailing_frame": (
        "CorruptError",
        lambda: build(
            idx(
                storages=[[4096, "cpu"]], nodes=[["str", "w"], tensor_node(shape=[1024]), ["dict", [[0, 1]]]]
            ),
            [(zstd(bytes(4096)) + zstd(bytes(4096)), 4096, 1, 0, 0)],
        ),
    ),
    # zstd frames the format refuses (spec section 3), the same way in both engines
    "zstd_window_too_large": ("CorruptError", lambda: zstd_case(zstd_window(28))),
    "zstd_legacy_frame": ("CorruptError", lambda: zstd_case(zstd_legacy_v07())),
    "zstd_skippable_frame": (
        "CorruptError",
        lambda: zstd_case(struct.pack("<II", 0x184D2A50, 4) + bytes(4)),
    ),
    "zstd_dictionary_id": (
        "CorruptError",
        # single segment, 2-byte content size, 1-byte dictionary id 7
        lambda: zstd_case(zstd_frame(0x61, b"\x07", struct.pack("<H", 4096 - 256))),
    ),
    "zstd_bad_content_checksum": (
        "CorruptError",
        lambda: zstd_case(zstd_frame(0x64, struct.pack("<H", 4096 - 256)) + b"\xde\xad\xbe\xef"),
    ),
    "zstd_truncated_header": ("CorruptError", lambda: zstd_case(b"\x28\xb5\x2f\xfd\x40")),
    "shuffle_width_invalid": (
        "CorruptError",
        lambda: build(
            idx(
                storages=[[4096, "cpu"]], nodes=[["str", "w"], tensor_node(shape=[1024]), ["dict", [[0, 1]]]]
            ),
            [(zstd(bytes(4096)), 4096, 1, 1, 3)],
        ),
    ),
    # tensors and storages
    "storage_huge": ("LimitError", lambda: build(idx(storages=[[1 << 60, "cpu"]]))),
    "storage_unused": (
        "CorruptError",
        lambda: build(idx(storages=[[16, "cpu"], [16, "cpu"]]), [(RAW16, 16, 0, 0, 0), (RAW16, 16, 0, 0, 0)]),
    ),
    "storage_bad_device": ("CorruptError", lambda: build(idx(storages=[[16, "../../etc"]]))),
    # torch.device("cuda:300") is cuda:44: an index torch cannot hold must not load as another device
    "storage_device_index_wraps": ("CorruptError", lambda: build(idx(storages=[[16, "cuda:300"]]))),
    "storage_device_index_128": ("CorruptError", lambda: build(idx(storages=[[16, "cuda:128"]]))),
    "storage_device_leading_zero": ("CorruptError", lambda: build(idx(storages=[[16, "cuda:01"]]))),
    "device_node_index_wraps": (
        "CorruptError",
        lambda: build(idx(storages=[], nodes=[["device", "cuda:300"]]), []),
    ),
    "tensor_dtype_not_a_string": (
        "CorruptError",
        lambda: build(idx(nodes=[["str", "w"], tensor_node(dtype=["float32"]), ["dict", [[0, 1]]]])),
    ),
    "shape_numel_overflow": (
        "LimitError",
        lambda: build(
            idx(
                nodes=[["str", "w"], tensor_node(shape=[1 << 40, 1 << 40], stride=[0, 0]), ["dict", [[0, 1]]]]
            )
        ),
    ),
    "shape_negative": (
        "CorruptError",
        lambda: build(idx(nodes=[["str", "w"], tensor_node(shape=[-4]), ["dict", [[0, 1]]]])),
    ),
    "rank_huge": (
        "LimitError",
        lambda: build(
            idx(nodes=[["str", "w"], tensor_node(shape=[1] * 100, stride=[1] * 100), ["dict", [[0, 1]]]])
        ),
    ),
    "stride_rank_mismatch": (
        "CorruptError",
        lambda: build(idx(nodes=[["str", "w"], tensor_node(stride=[1, 1]), ["dict", [[0, 1]]]])),
    ),
    "tensor_past_storage": (
        "CorruptError",
        lambda: build(idx(nodes=[["str", "w"], tensor_node(offset=1), ["dict", [[0, 1]]]])),
    ),
    "stride_past_storage": (
        "CorruptError",
        lambda: build(
            idx(nodes=[["str", "w"], tensor_node(shape=[2], stride=[1 << 47]), ["dict", [[0, 1]]]])
        ),
    ),
    "unknown_dtype": (
        "UnsupportedError",
        lambda: build(idx(nodes=[["str", "w"], tensor_node(dtype="float128"), ["dict", [[0, 1]]]])),
    ),
    "requires_grad_on_int": (
        "CorruptError",
        lambda: build(
            idx(nodes=[["str", "w"], tensor_node(dtype="int32", requires_grad=True), ["dict", [[0, 1]]]])
        ),
    ),
    "tensor_extra_field": (
        "CorruptError",
        lambda: build(idx(nodes=[["str", "w"], tensor_node(pickle="cos\nsystem\n"), ["dict", [[0, 1]]]])),
    ),
    "ndarray_size_mismatch": (
        "CorruptError",
        lambda: build(
            idx(
                nodes=[
                    ["str", "w"],
                    ["ndarray", {"dtype": "<f8", "shape": [4], "order": "C", "storage": 0}],
                    ["dict", [[0, 1]]],
                ]
            )
        ),
    ),
    "ndarray_object_dtype": (
        "UnsupportedError",
        lambda: build(
            idx(
                nodes=[
                    ["str", "w"],
                    ["ndarray", {"dtype": "|O8", "shape": [2], "order": "C", "storage": 0}],
                    ["dict", [[0, 1]]],
                ]
            )
        ),
    ),
    # the object tree
    "tree_depth_bomb": ("LimitError", lambda: build(idx(storages=[], nodes=deep_list_nodes(300)), [])),
    "node_two_parents": (
        "CorruptError",
        lambda: build(idx(storages=[], nodes=[["none"], ["list", [0, 0]]]), []),
    ),
    "node_forward_reference": (
        "CorruptError",
        lambda: build(idx(storages=[], nodes=[["list", [1]], ["list", [0]]]), []),
    ),
    "node_orphan": ("CorruptError", lambda: build(idx(storages=[], nodes=[["none"], ["none"]]), [])),
    "node_unknown_kind": (
        "UnsupportedError",
        lambda: build(idx(storages=[], nodes=[["pickle", "cos\nsystem\n"]]), []),
    ),
    "node_table_empty": ("CorruptError", lambda: build(idx(storages=[], nodes=[]), [])),
    "dict_key_unhashable": (
        "CorruptError",
        lambda: build(idx(storages=[], nodes=[["list", []], ["none"], ["dict", [[0, 1]]]]), []),
    ),
    "dict_duplicate_key": (
        "CorruptError",
        lambda: build(
            idx(
                storages=[],
                nodes=[["str", "a"], ["none"], ["str", "a"], ["none"], ["dict", [[0, 1], [2, 3]]]],
            ),
            [],
        ),
    ),
    "int_not_canonical_hex": ("CorruptError", lambda: build(idx(storages=[], nodes=[["int", "0x10"]]), [])),
    "float_bad_hex": ("CorruptError", lambda: build(idx(storages=[], nodes=[["float", "3ff0"]]), [])),
    "bytes_bad_base64": ("CorruptError", lambda: build(idx(storages=[], nodes=[["bytes", "!!!"]]), [])),
    "npscalar_wrong_size": (
        "CorruptError",
        lambda: build(idx(storages=[], nodes=[["npscalar", "<f8", "AAAA"]]), []),
    ),
    "string_not_a_string": ("CorruptError", lambda: build(idx(storages=[], nodes=[["str", 5]]), [])),
    "dtype_node_not_a_string": ("CorruptError", lambda: build(idx(storages=[], nodes=[["dtype", []]]), [])),
    "size_dim_beyond_int64": (
        "CorruptError",
        lambda: build(idx(storages=[], nodes=[["size", ["8000000000000000"]]]), []),
    ),
    # two equal keys of 5000 decimal digits: the message must not repr() them (ValueError)
    "dict_duplicate_huge_int_key": (
        "CorruptError",
        lambda: build(
            idx(
                storages=[],
                nodes=[
                    ["int", "f" * 4200],
                    ["none"],
                    ["int", "f" * 4200],
                    ["none"],
                    ["dict", [[0, 1], [2, 3]]],
                ],
            ),
            [],
        ),
    ),
    # 20000 int keys with one Python hash: rebuilding the dict would take minutes
    "dict_keys_hash_collide": (
        "LimitError",
        lambda: build(idx(storages=[], nodes=colliding_keys_nodes(20000)), []),
    ),
    # incremental files: external chunks and content digests (section 12)
    "ext_absolute_path": ("CorruptError", lambda: ext_file([ref("/etc/passwd")])),
    "ext_path_two_levels_up": ("CorruptError", lambda: ext_file([ref("../../ext_base.ref")])),
    "ext_path_hidden": ("CorruptError", lambda: ext_file([ref(".ext_base.ref")])),
    "ext_path_dot_component": ("CorruptError", lambda: ext_file([ref("./ext_base.ref")])),
    "ext_path_temp_file": ("CorruptError", lambda: ext_file([ref(".x.ckpt.ckptfmt-tmp.1.ab")])),
    "ext_wrong_file_id": ("CorruptError", lambda: ext_file([ref("ext_base.ref", fid=b"\1" * 16)])),
    "ext_wrong_length": (
        "CorruptError",
        lambda: ext_file([ref("ext_base.ref", length=len(ext_base()) + 64)]),
    ),
    "ext_self_reference": ("CorruptError", lambda: ext_file([ref("ext_base.ref", fid=FID)])),
    "ext_missing_file": ("IncompleteError", lambda: ext_file([ref("ext_missing.ref")])),
    "ext_not_ckptfmt": ("CorruptError", lambda: ext_file([ref("ext_garbage.ref", length=1024)])),
    "ext_points_at_itself": ("CorruptError", lambda: ext_file([ref("ext_points_at_itself.ckpt")])),
    "ext_chunk_outside_data": ("CorruptError", lambda: ext_file(record=ext_record(offset=192))),
    "ext_chunk_past_file": ("CorruptError", lambda: ext_file(record=ext_record(offset=1 << 40))),
    "ext_transplanted_chunk": ("CorruptError", lambda: ext_file(record=ext_record(number=3, check_number=0))),
    "ext_digest_mismatch": (
        "CorruptError",
        lambda: ext_file(record=ext_record()[:7] + [digest(b"other")] + [0, 0]),
    ),
    "ext_entry_out_of_range": ("CorruptError", lambda: ext_file(record=ext_record(entry=1))),
    "ext_unused_entry": (
        "CorruptError",
        lambda: ext_file([ref("ext_base.ref"), ["other.ref", "ab" * 16, 1024]]),
    ),
    "ext_duplicate_path": (
        "CorruptError",
        lambda: ext_file([ref("ext_base.ref"), ["ext_base.ref", "ab" * 16, 1024]]),
    ),
    "ext_too_many_externals": (
        "LimitError",
        lambda: ext_file([ref("ext_base.ref")] + [[f"f{i}", f"{i:032x}", 1024] for i in range(1, 4097)]),
    ),
    "ext_record_without_digest": (
        "CorruptError",
        lambda: build(ext_index([]), required=1),
    ),
    "ext_member_without_feature_bit": ("CorruptError", lambda: build(ext_index([]))),
    "ext_feature_bit_without_member": (
        "CorruptError",
        lambda: build(required=1, mutate_chunks=lambda c: c[0].append(digest(RAW16))),
    ),
    "ext_local_digest_mismatch": (
        "CorruptError",
        lambda: build(ext_index([]), required=1, mutate_chunks=lambda c: c[0].append(digest(b"x"))),
    ),
    "ext_digest_not_hex": (
        "CorruptError",
        lambda: build(ext_index([]), required=1, mutate_chunks=lambda c: c[0].append("Z" * 32)),
    ),
}


def main() -> None:
    expected = {}
    for old in os.listdir(HERE):
        if old.endswith((".ckpt", ".ref")):
            os.unlink(os.path.join(HERE, old))
    for name, make in SIDE_FILES.items():
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(make())
    for name, (err, make) in CASES.items():
        with open(os.path.join(HERE, f"{name}.ckpt"), "wb") as f:
            f.write(make())
        expected[f"{name}.ckpt"] = err
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(expected)} files")


if __name__ == "__main__":
    main()
