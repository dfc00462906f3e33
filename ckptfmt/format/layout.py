"""Byte-level constants and structures of the ckptfmt container (spec/FORMAT.md).

This module is the spec in code: the prologue and footer layouts, the checksum
contexts, the codec and filter ids and the reader limits.  It does no I/O.
Numbers that come from a file are checked here before anything uses them.
"""

from __future__ import annotations

import re
import struct

import xxhash

from ..errors import CorruptError, IncompleteError, LimitError, UnsupportedError
from .frozen import Frozen

# -- identity ---------------------------------------------------------------

#: First 8 bytes of every ckptfmt file.  The high byte and the CR LF / SUB / LF
#: sequence catch 7-bit and text-mode transfers, as PNG's signature does.
MAGIC = b"\x89CKF\r\n\x1a\n"
#: Last 8 bytes of every complete ckptfmt file.
END_MAGIC = b"\x89CKFEND\n"

FORMAT_MAJOR = 1
FORMAT_MINOR = 0

#: Required feature bit 0: external chunks and content digests (spec section 12).
FEATURE_EXTERNAL = 1 << 0
#: Required feature bit 1: a signature block between the index and the footer (section 16).
FEATURE_SIGNED = 1 << 1
#: Required feature bit 2: encrypted chunks and index, an encryption block before the footer (section 17).
FEATURE_ENCRYPTED = 1 << 2
#: Required feature bits this reader understands.
KNOWN_REQUIRED_FEATURES = FEATURE_EXTERNAL | FEATURE_SIGNED | FEATURE_ENCRYPTED

PROLOGUE_SIZE = 64
FOOTER_SIZE = 64
#: Every chunk and the index start at a multiple of this; padding is zero bytes.
ALIGNMENT = 64

_PROLOGUE = struct.Struct("<8sHHI16sQQQQ")  # 64 bytes, checksum last
_FOOTER = struct.Struct("<QQQ16sQQ8s")  # 64 bytes
assert _PROLOGUE.size == PROLOGUE_SIZE and _FOOTER.size == FOOTER_SIZE

# -- chunks -------------------------------------------------------------------

CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd"}

FILTER_NONE = 0
FILTER_SHUFFLE = 1
FILTER_NAMES = {FILTER_NONE: "none", FILTER_SHUFFLE: "shuffle"}
SHUFFLE_WIDTHS = (2, 4, 8, 16)

#: A zstd frame cannot expand more than this: its densest block, an RLE block,
#: holds at most 128 KiB in 4 bytes.  Chunks claiming more are rejected before
#: any buffer is allocated, so memory use is bounded by the file's size.
ZSTD_MAX_RATIO = 32768
#: Frames needing a window above 2**ZSTD_WINDOW_LOG_MAX bytes are rejected (spec section 3).
ZSTD_WINDOW_LOG_MAX = 27
#: The default compression profile: zstd level 1 with the fast strategy, minimum match 7 and
#: a 2**8-entry hash table.  Shuffled floating-point data compresses through the Huffman
#: coding of its sign/exponent bytes, hardly through matches, so this keeps level 1's ratio
#: at about twice its speed.  The C engine uses the same numbers (csrc/ckptfmt.h, checked
#: by tests/test_engine.py), so both engines write identical frames.
ZSTD_FAST_PROFILE = {"level": 1, "min_match": 7, "hash_log": 8}

DEFAULT_CHUNK_SIZE = 4 << 20
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 1 << 30

_CHUNK_CONTEXT = struct.Struct("<16s16sQQQQBBB5x")  # 72 bytes
_INDEX_CONTEXT = struct.Struct("<16s16sQQ")  # 48 bytes
_CHUNK_DOMAIN = b"ckptfmt-chunk\x00\x00\x00"
_INDEX_DOMAIN = b"ckptfmt-index\x00\x00\x00"


class Limits:
    """Bounds a reader enforces before it allocates anything a file asks for."""

    #: bytes of the JSON index (the index is parsed in memory)
    MAX_INDEX_BYTES = 256 << 20
    #: nesting of containers in the object tree
    MAX_DEPTH = 256
    #: bytes of one string, of one bytes value, hex digits of one int
    MAX_STRING_BYTES = 16 << 20
    #: dimensions of one tensor or array
    MAX_RANK = 64
    #: elements of one tensor or array (2**48: far beyond any single device)
    MAX_NUMEL = 1 << 48
    #: bytes of one storage
    MAX_STORAGE_BYTES = 1 << 50
    #: entries in the node, storage and chunk tables
    MAX_NODES = 1 << 24
    MAX_STORAGES = 1 << 24
    MAX_CHUNKS = 1 << 24
    #: entries of the user metadata
    MAX_METADATA_ENTRIES = 1 << 16
    #: files an incremental checkpoint refers to (each may be opened while reading)
    MAX_EXTERNALS = 4096
    #: keys of one dict with the same Python hash (an int key k * (2**61 - 1) hashes like 0):
    #: rebuilding a dict costs time quadratic in the number of keys that share a hash
    MAX_KEY_COLLISIONS = 64
    #: a torch.Size dimension is a C int64
    MAX_SIZE_DIM = (1 << 63) - 1


#: Memory a reader may need for the index (measured with tracemalloc, CPython 3.11's json
#: and this reader's tables, tests/test_hardening.py): per byte of index, and per JSON
#: array, object or member (counted as the '[', '{' and ':' bytes, an upper bound).  The
#: costliest JSON, nested empty arrays, takes 46 bytes per byte; ckptfmt's indexes 8 to 15.
INDEX_MEMORY_PER_BYTE = 16
INDEX_MEMORY_PER_CONTAINER = 96


def index_memory_bound(raw: bytes) -> int:
    """An upper bound of the memory parsing and holding the index `raw` takes: the bytes, the
    decoded text (4 bytes a character unless ASCII), json's objects and the reader's tables.
    Computed before json builds anything, in one pass over the bytes per counted character."""
    n = len(raw)
    text = n if raw.isascii() else 4 * n
    containers = raw.count(b"[") + raw.count(b"{") + raw.count(b":")
    return n + text + INDEX_MEMORY_PER_BYTE * n + INDEX_MEMORY_PER_CONTAINER * containers


#: bounds of a signature block's length (section 16): no chunks, and Limits.MAX_CHUNKS chunks
MIN_SIGNATURE_BLOCK = 128
MAX_SIGNATURE_BLOCK = 128 + 32 * Limits.MAX_CHUNKS
#: bounds of an encryption block's length (section 17.1): header, wrapped key, tags
MIN_ENCRYPTION_BLOCK = 128
MAX_ENCRYPTION_BLOCK = 64 + 1024 + 16 * Limits.MAX_CHUNKS


def align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


# -- checksums ----------------------------------------------------------------


def chunk_seed(
    file_id: bytes,
    index: int,
    offset: int,
    stored_len: int,
    raw_len: int,
    codec: int,
    filt: int,
    width: int,
) -> int:
    """Seed of a chunk's XXH3-64: binds the checksum to file, position and layout."""
    ctx = _CHUNK_CONTEXT.pack(_CHUNK_DOMAIN, file_id, index, offset, stored_len, raw_len, codec, filt, width)
    return xxhash.xxh3_64_intdigest(ctx)


def content_digest(data: bytes | memoryview) -> bytes:
    """A chunk's content digest (section 12): XXH3-128, seed 0, of its raw bytes, as the
    16 bytes of xxHash's canonical (big-endian) form; the index writes them as 32 hex digits."""
    return xxhash.xxh3_128_digest(data)


#: One name in a reference path: no leading dot, so "." and "..", hidden files and
#: the temp files of unfinished saves (section 10) can never be referenced.
_REF_NAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
#: a file name a reference or a commit record may use (spec sections 12 and 13)
REF_NAME_RE = re.compile(_REF_NAME)
#: A reference path (section 12): NAME, DIR/NAME, ../NAME or ../DIR/NAME.
REF_PATH_RE = re.compile(rf"(?:\.\./)?(?:{_REF_NAME}/)?{_REF_NAME}")


def index_seed(file_id: bytes, offset: int, length: int) -> int:
    return xxhash.xxh3_64_intdigest(_INDEX_CONTEXT.pack(_INDEX_DOMAIN, file_id, offset, length))


def index_checksum(file_id: bytes, offset: int, data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=index_seed(file_id, offset, len(data)))


# -- prologue and footer ------------------------------------------------------


class Prologue(Frozen):
    """The first 64 bytes of a file (spec section 2), checked (parse_prologue)."""

    __slots__ = ("major", "minor", "file_id", "file_length", "required_features", "optional_features")
    major: int
    minor: int
    file_id: bytes
    file_length: int
    required_features: int
    optional_features: int

    def __init__(
        self,
        major: int,
        minor: int,
        file_id: bytes,
        file_length: int,
        required_features: int,
        optional_features: int,
    ) -> None:
        self._set(major, minor, file_id, file_length, required_features, optional_features)

    def pack(self) -> bytes:
        head = _PROLOGUE.pack(
            MAGIC,
            self.major,
            self.minor,
            0,
            self.file_id,
            self.file_length,
            self.required_features,
            self.optional_features,
            0,
        )[:56]
        return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


class Footer(Frozen):
    """The last 64 bytes of a file (spec section 7), checked (parse_footer)."""

    __slots__ = ("index_offset", "index_length", "index_checksum", "file_id", "signature_length")
    index_offset: int
    index_length: int
    index_checksum: int
    file_id: bytes
    #: signed files (required feature bit 1): the signature block's length (offset 40);
    #: encrypted files (bit 2): the encryption block's length, in the same field; signed
    #: encrypted files (bits 1 and 2): both blocks' lengths together (section 17.8)
    signature_length: int

    def __init__(
        self,
        index_offset: int,
        index_length: int,
        index_checksum: int,
        file_id: bytes,
        signature_length: int = 0,
    ) -> None:
        self._set(index_offset, index_length, index_checksum, file_id, signature_length)

    def pack(self) -> bytes:
        head = _FOOTER.pack(
            self.index_offset,
            self.index_length,
            self.index_checksum,
            self.file_id,
            self.signature_length,
            0,
            END_MAGIC,
        )[:48]
        return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + END_MAGIC


def parse_prologue(raw: bytes, actual_size: int, path: str) -> Prologue:
    """Check the first 64 bytes against the actual file size; raise the right error.

    The order matters: bytes 0 to 9 (magic and major version) are the only ones frozen
    across major versions, so a file of another major version is *unsupported* whatever
    its other bytes hold, even when it is shorter than this version's prologue.
    """
    if not any(raw):
        raise IncompleteError(
            f"file is {actual_size} bytes, shorter than the {PROLOGUE_SIZE}-byte prologue "
            "(an unfinished save or a truncated copy)"
            if len(raw) < PROLOGUE_SIZE
            else "prologue is all zero bytes: the save that wrote this file did not finish",
            path=path,
            offset=None if len(raw) < PROLOGUE_SIZE else 0,
        )
    head = raw[: len(MAGIC)]
    if head != MAGIC[: len(head)]:
        raise UnsupportedError(f"not a ckptfmt file (starts with {head.hex()})", path=path)
    if len(raw) >= 10:
        (major,) = struct.unpack_from("<H", raw, 8)
        if major != FORMAT_MAJOR:
            minor = struct.unpack_from("<H", raw, 10)[0] if len(raw) >= 12 else 0
            raise UnsupportedError(
                f"format version {major}.{minor} is not supported (this reader reads {FORMAT_MAJOR}.x)",
                path=path,
            )
    if len(raw) < PROLOGUE_SIZE:
        raise IncompleteError(
            f"file is {actual_size} bytes, shorter than the {PROLOGUE_SIZE}-byte prologue "
            "(an unfinished save or a truncated copy)",
            path=path,
        )
    (_, major, minor, flags, file_id, length, req, opt, check) = _PROLOGUE.unpack(raw)
    if xxhash.xxh3_64_intdigest(raw[:56]) != check:
        raise CorruptError("prologue checksum mismatch", path=path, offset=0)
    if flags != 0:
        raise CorruptError(f"reserved prologue flags are {flags:#x}, must be zero", path=path, offset=12)
    unknown = req & ~KNOWN_REQUIRED_FEATURES
    if unknown:
        raise UnsupportedError(f"file requires unknown features {unknown:#x}", path=path, offset=40)
    if req & FEATURE_EXTERNAL and req & FEATURE_SIGNED:
        raise UnsupportedError(
            "file sets feature bits 0 and 1 (signed files with external chunks are not defined in this version)",
            path=path,
            offset=40,
        )
    if length < PROLOGUE_SIZE + FOOTER_SIZE or length % ALIGNMENT:
        raise CorruptError(f"recorded file length {length} is impossible", path=path, offset=32)
    if actual_size < length:
        raise IncompleteError(
            f"file is {actual_size} bytes but its prologue records {length}: truncated",
            path=path,
        )
    if actual_size > length:
        raise CorruptError(
            f"{actual_size - length} bytes of trailing data after the recorded end at {length}",
            path=path,
            offset=length,
        )
    return Prologue(major, minor, file_id, length, req, opt)


def parse_footer(raw: bytes, prologue: Prologue, path: str) -> Footer:
    at = prologue.file_length - FOOTER_SIZE
    if len(raw) != FOOTER_SIZE:
        raise IncompleteError("file shrank while its footer was read", path=path, offset=at)
    (ioff, ilen, icheck, file_id, reserved, check, end) = _FOOTER.unpack(raw)
    if end != END_MAGIC:
        raise CorruptError("footer magic is missing", path=path, offset=at + 56)
    if xxhash.xxh3_64_intdigest(raw[:48]) != check:
        raise CorruptError("footer checksum mismatch", path=path, offset=at)
    if file_id != prologue.file_id:
        raise CorruptError(
            "footer belongs to another file (file id differs from the prologue)", path=path, offset=at + 24
        )
    signed = prologue.required_features & FEATURE_SIGNED
    encrypted = prologue.required_features & FEATURE_ENCRYPTED
    if reserved != 0 and not signed and not encrypted:
        raise CorruptError("reserved footer field is not zero", path=path, offset=at + 40)
    if signed and encrypted:  # section 17.8: the encryption block, then the signature block
        if (
            reserved < MIN_SIGNATURE_BLOCK + MIN_ENCRYPTION_BLOCK
            or reserved > MAX_SIGNATURE_BLOCK + MAX_ENCRYPTION_BLOCK
            or reserved % ALIGNMENT
        ):
            raise CorruptError(
                f"encryption and signature blocks' length {reserved} is impossible", path=path, offset=at + 40
            )
    elif signed and (
        reserved < MIN_SIGNATURE_BLOCK or reserved > MAX_SIGNATURE_BLOCK or reserved % ALIGNMENT
    ):
        raise CorruptError(f"signature block length {reserved} is impossible", path=path, offset=at + 40)
    elif encrypted and (
        reserved < MIN_ENCRYPTION_BLOCK or reserved > MAX_ENCRYPTION_BLOCK or reserved % ALIGNMENT
    ):
        raise CorruptError(f"encryption block length {reserved} is impossible", path=path, offset=at + 40)
    if ilen > Limits.MAX_INDEX_BYTES:
        raise LimitError(
            f"index of {ilen} bytes exceeds the limit of {Limits.MAX_INDEX_BYTES}", path=path, offset=at + 8
        )
    if ioff < PROLOGUE_SIZE or ioff % ALIGNMENT or ilen == 0 or align_up(ioff + ilen) + reserved != at:
        raise CorruptError(
            f"index range [{ioff}, {ioff + ilen}) does not end where the "
            + ("encryption block" if encrypted else "signature block" if signed else "footer")
            + f" starts ({at - reserved})",
            path=path,
            offset=at,
        )
    return Footer(ioff, ilen, icheck, file_id, reserved)
