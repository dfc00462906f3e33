"""Encrypted files (spec/FORMAT.md section 17): the encryption block, nonces, associated data.

Required feature bit 2 marks a file whose chunks (and, unless its writer opted out, index)
are AES-256-GCM ciphertext under a per-file *data key*.  Between the index's padding and the
footer lies the *encryption block*: a 64-byte header (magic, cipher, key wrap, flags, the
number of chunks, a hint of the key-encryption key, the wrapped key's length, the index
tag), the wrapped data key, and one 16-byte GCM tag per chunk.  The footer's field at offset
40 holds the block's length.  This module is that layout in code, and the AES-256-GCM of
the index and of single chunks (the reference path; the C engine does chunks in bulk) through
``cryptography``, imported only when used.  It resolves no user keys (files/encryption.py
does) and never puts key bytes into a message or a repr.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import CheckpointError, CorruptError, DecryptionError, UnsupportedError

BLOCK_MAGIC = b"ckptfmt-enc\x00\x00\x00\x00\x00"  # 16 bytes
CIPHER_AES256_GCM = 1
WRAP_KEK = 1  # AES-256-GCM under a 32-byte key-encryption key
WRAP_EXTERNAL = 2  # a key service's opaque blob
FLAG_INDEX_ENCRYPTED = 1
KEY_SIZE = 32
TAG_SIZE = 16
NONCE_SIZE = 12
HINT_SIZE = 8
WRAPPED_KEK_SIZE = NONCE_SIZE + KEY_SIZE + TAG_SIZE  # 60
MAX_WRAPPED = 1024
HEADER_SIZE = 64
# magic, cipher, key wrap, flags, chunks, hint, wrapped length, reserved, index tag
_HEADER = struct.Struct("<16sHHIQ8sII16s")
assert _HEADER.size == HEADER_SIZE

_CHUNK_AAD = struct.Struct("<16s16sQQQQBBB5x")  # 72 bytes, the XXH3 chunk seed's layout
_CHUNK_LABEL = b"ckptfmt-aes-gcm\x00"
_INDEX_AAD = struct.Struct("<16s16sQQ32s")  # 80 bytes
_INDEX_LABEL = b"ckptfmt-idx-gcm\x00"
_WRAP_LABEL = b"ckptfmt-key-wrap"  # 16 bytes
_HINT_LABEL = b"ckptfmt-kek-hint"
#: the index's nonce: eight zero bytes, then 1 (chunk nonces end in four zero bytes)
INDEX_NONCE = bytes(8) + b"\x01\x00\x00\x00"


def _align64(n: int) -> int:
    return (n + 63) // 64 * 64


def tags_offset(wrapped_len: int) -> int:
    """Where the tag table starts in the block: after the header and the padded wrapped key."""
    return HEADER_SIZE + _align64(wrapped_len)


def block_length(nchunks: int, wrapped_len: int) -> int:
    """Bytes of the encryption block of a file with `nchunks` chunks and a wrapped key of that length."""
    return _align64(tags_offset(wrapped_len) + TAG_SIZE * nchunks)


def block_length_from_header(raw: bytes) -> int | None:
    """The length an encryption block starting `raw` claims (from its chunk count and wrapped
    key length), or None when its header is too short or the wrapped key length impossible;
    the block's other fields are checked by parse_block."""
    if len(raw) < HEADER_SIZE:
        return None
    n, wlen = struct.unpack_from("<Q", raw, 24)[0], struct.unpack_from("<I", raw, 40)[0]
    if not 1 <= wlen <= MAX_WRAPPED or n > 1 << 40:
        return None
    return block_length(n, wlen)


def chunk_nonce(k: int) -> bytes:
    return struct.pack("<Q", k) + bytes(4)


def chunk_aad(
    file_id: bytes, k: int, offset: int, stored_len: int, raw_len: int, codec: int, filt: int, width: int
) -> bytes:
    return _CHUNK_AAD.pack(_CHUNK_LABEL, file_id, k, offset, stored_len, raw_len, codec, filt, width)


def index_context(file_id: bytes, index_offset: int, index_length: int, fields: bytes) -> bytes:
    """The index's associated data (80 bytes): label, file id, index range, header fields H."""
    return _INDEX_AAD.pack(_INDEX_LABEL, file_id, index_offset, index_length, fields)


def wrap_aad(file_id: bytes, fields: bytes) -> bytes:
    """Key wrap 1's associated data (64 bytes): label, file id, header fields H."""
    return _WRAP_LABEL + file_id + fields


def kek_hint(kek: bytes) -> bytes:
    """The 8 bytes that tell which key-encryption key a file was wrapped under (17.2)."""
    return hashlib.sha256(_HINT_LABEL + kek).digest()[:HINT_SIZE]


def aesgcm(key: bytes) -> Any:
    """``cryptography``'s AESGCM for a 32-byte key; a clear error where it is not installed."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise CheckpointError(
            "encrypted files need the cryptography package (pip install cryptography, or ckptfmt[signing])"
        ) from None
    return AESGCM(key)


#: makes the AES-256-GCM of a key (``encrypt``/``decrypt`` as ``cryptography``'s AESGCM) for a
#: file's small messages, the key wrap and the index: the engine chooses it and hands it down
#: (files/encryption.py: the engine's libcrypto where it has it, so that opening or saving a
#: file never imports ``cryptography``, whose first import costs a tenth of a second or more)
GcmMaker = Callable[[bytes], Any]


class TagMismatch(Exception):
    """A GCM tag did not match, from the engine's GCM where ``cryptography`` (whose InvalidTag
    it would otherwise raise) is not installed: with the engine, encrypted files need no
    ``cryptography``, and a damaged one must still be a DecryptionError."""


def invalid_tag() -> tuple[type[Exception], ...]:
    """The exceptions a failed GCM tag raises (for an except clause: evaluated only then)."""
    try:
        from cryptography.exceptions import InvalidTag
    except ImportError:
        return (TagMismatch,)
    return (TagMismatch, InvalidTag)


@dataclass(frozen=True)
class EncryptionBlock:
    cipher: int
    wrap: int
    flags: int
    nchunks: int
    hint: bytes  # 8 bytes
    wrapped: bytes  # the wrapped data key
    index_tag: bytes  # 16 bytes
    tags: bytes  # 16 bytes per chunk, in chunk order

    @property
    def index_encrypted(self) -> bool:
        return bool(self.flags & FLAG_INDEX_ENCRYPTED)

    def fields(self) -> bytes:
        """H: header bytes 16 to 47, which the index tag and key wrap 1 bind."""
        return self._header()[16:48]

    def _header(self) -> bytes:
        return _HEADER.pack(
            BLOCK_MAGIC,
            self.cipher,
            self.wrap,
            self.flags,
            self.nchunks,
            self.hint,
            len(self.wrapped),
            0,
            self.index_tag,
        )

    def pack(self) -> bytes:
        head = self._header() + self.wrapped
        head += bytes(tags_offset(len(self.wrapped)) - len(head))
        raw = head + self.tags
        return raw + bytes(block_length(self.nchunks, len(self.wrapped)) - len(raw))

    def tag_of(self, k: int) -> bytes:
        return self.tags[TAG_SIZE * k : TAG_SIZE * (k + 1)]


def parse_block(raw: bytes, path: str, at: int) -> EncryptionBlock:
    """Check an encryption block's structure (17.2); its chunk count is checked against the
    index by the caller, its tags by decryption."""
    if len(raw) < HEADER_SIZE:
        raise CorruptError(
            f"encryption block is {len(raw)} bytes, shorter than its header", path=path, offset=at
        )
    magic, cipher, wrap, flags, n, hint, wlen, reserved, index_tag = _HEADER.unpack_from(raw)
    if magic != BLOCK_MAGIC:
        raise CorruptError("encryption block magic is missing", path=path, offset=at)
    if cipher != CIPHER_AES256_GCM:
        raise UnsupportedError(f"encryption block names unknown cipher {cipher}", path=path, offset=at + 16)
    if wrap not in (WRAP_KEK, WRAP_EXTERNAL):
        raise UnsupportedError(f"encryption block names unknown key wrap {wrap}", path=path, offset=at + 18)
    if flags & ~FLAG_INDEX_ENCRYPTED:
        raise CorruptError(
            f"reserved flags of the encryption block are set ({flags:#x})", path=path, offset=at + 20
        )
    if reserved:
        raise CorruptError("reserved field of the encryption block is not zero", path=path, offset=at + 44)
    if (wrap == WRAP_KEK and wlen != WRAPPED_KEK_SIZE) or not 1 <= wlen <= MAX_WRAPPED:
        raise CorruptError(
            f"wrapped key length {wlen} is impossible for key wrap {wrap}", path=path, offset=at + 40
        )
    if wrap == WRAP_EXTERNAL and any(hint):
        raise CorruptError("key hint must be zero with key wrap 2", path=path, offset=at + 32)
    if len(raw) != block_length(n, wlen):
        raise CorruptError(
            f"encryption block is {len(raw)} bytes, {block_length(n, wlen)} for {n} chunks "
            f"and a wrapped key of {wlen} bytes",
            path=path,
            offset=at,
        )
    t = tags_offset(wlen)
    if any(raw[HEADER_SIZE + wlen : t]) or any(raw[t + TAG_SIZE * n :]):
        raise CorruptError("padding of the encryption block is not zero", path=path, offset=at)
    return EncryptionBlock(
        cipher,
        wrap,
        flags,
        n,
        hint,
        raw[HEADER_SIZE : HEADER_SIZE + wlen],
        index_tag,
        raw[t : t + TAG_SIZE * n],
    )


class Sealer(Protocol):
    """What a writer needs to encrypt one file (made by files/encryption.py from the user's key)."""

    @property
    def data_key(self) -> bytes:
        """The file's fresh 32-byte data key (the chunks are encrypted under it)."""
        ...

    def seal(self, file_id: bytes, index_offset: int, index: bytes, tags: bytes) -> tuple[bytes, bytes]:
        """The index bytes to write (its ciphertext, or itself when kept in clear) and the
        encryption block, for a file whose chunks have these tags."""
        ...


@dataclass(frozen=True)
class Opener:
    """A reader's way into encrypted files (made by files/encryption.py from the user's key)."""

    #: reads the data key out of a file's encryption block: (block, file id) -> 32 bytes, or
    #: DecryptionError
    data_key: Callable[[EncryptionBlock, bytes], bytes]
    #: the AES-256-GCM the index is opened with
    gcm: GcmMaker


def seal_index(
    gcm_of: GcmMaker,
    data_key: bytes,
    block: EncryptionBlock,
    file_id: bytes,
    index_offset: int,
    index: bytes,
) -> tuple[bytes, bytes]:
    """(index bytes to write, index tag) for a block whose other fields are final, sealed with
    the GCM `gcm_of` makes."""
    ctx = index_context(file_id, index_offset, len(index), block.fields())
    gcm = gcm_of(data_key)
    if block.index_encrypted:
        sealed = gcm.encrypt(INDEX_NONCE, index, ctx)
        return sealed[:-TAG_SIZE], sealed[-TAG_SIZE:]
    return index, gcm.encrypt(INDEX_NONCE, b"", ctx + index)


def open_index(
    gcm_of: GcmMaker,
    data_key: bytes,
    block: EncryptionBlock,
    file_id: bytes,
    index_offset: int,
    stored: bytes,
    path: str,
) -> bytes:
    """The index's plaintext, its tag checked with the GCM `gcm_of` makes (DecryptionError when
    it fails)."""
    ctx = index_context(file_id, index_offset, len(stored), block.fields())
    gcm = gcm_of(data_key)
    try:
        if block.index_encrypted:
            return bytes(gcm.decrypt(INDEX_NONCE, stored + block.index_tag, ctx))
        gcm.decrypt(INDEX_NONCE, block.index_tag, ctx + stored)
        return stored
    except invalid_tag():
        raise DecryptionError(
            "index does not match its GCM tag (the index, the encryption block's header or its index "
            "tag changed, or the key service returned another data key)",
            path=path,
            offset=index_offset,
        ) from None


def seal_chunk(
    data_key: bytes,
    file_id: bytes,
    k: int,
    offset: int,
    raw_len: int,
    codec: int,
    filt: int,
    width: int,
    payload: Any,
) -> tuple[bytes, bytes]:
    """(ciphertext, tag) of chunk k's stored bytes (the reference path of the C writer)."""
    aad = chunk_aad(file_id, k, offset, len(payload), raw_len, codec, filt, width)
    sealed = aesgcm(data_key).encrypt(chunk_nonce(k), bytes(payload), aad)
    return sealed[:-TAG_SIZE], sealed[-TAG_SIZE:]


def open_chunk(
    data_key: bytes,
    file_id: bytes,
    k: int,
    offset: int,
    raw_len: int,
    codec: int,
    filt: int,
    width: int,
    stored: Any,
    tag: bytes,
) -> bytes | None:
    """Chunk k's plaintext stored bytes, or None when its tag fails."""
    aad = chunk_aad(file_id, k, offset, len(stored), raw_len, codec, filt, width)
    try:
        return bytes(aesgcm(data_key).decrypt(chunk_nonce(k), bytes(stored) + tag, aad))
    except invalid_tag():
        return None


class KeyRequired(DecryptionError):
    """An encrypted file was opened without a key: what is in clear was checked (up to the
    encryption block's structure; with a clear index, the index too).  `block` is the block."""

    def __init__(self, message: str, block: EncryptionBlock, *, path: str) -> None:
        self.block = block
        super().__init__(message, path=path)
