"""Signed files (spec/FORMAT.md section 16): the signature block and the signed message.

Required feature bit 1 marks a file that carries, between the index's padding and the
footer, a *signature block*: a 64-byte header (magic, digest and signature algorithms, the
number of chunks, the signer's Ed25519 public key), one SHA-256 digest per chunk, the
Ed25519 signature and zero padding to a multiple of 64.  The footer's field at offset 40
(reserved in unsigned files) holds the block's length.  The signature covers a fixed
200-byte message that binds the prologue (file id, length, feature bits), the footer
(index range and checksum, block length), the SHA-256 of the index bytes and the SHA-256
of the block's header and digest table.  This module is the layout in code: no I/O, no
keys (files/signing.py holds those, and imports ``cryptography`` only when used).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from ..errors import CorruptError, UnsupportedError

BLOCK_MAGIC = b"ckptfmt-sig\x00\x00\x00\x00\x00"  # 16 bytes
DIGEST_SHA256 = 1
SIGNATURE_ED25519 = 1
DIGEST_SIZE = 32
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
HEADER_SIZE = 64
_HEADER = struct.Struct("<16sHHIQ32s")  # magic, digest alg, signature alg, reserved, chunks, public key
assert _HEADER.size == HEADER_SIZE

MESSAGE_DOMAIN = b"ckptfmt-signed-file-v1" + bytes(10)  # 32 bytes
MESSAGE_SIZE = 200
#: signed encrypted files (bits 1 and 2, section 17.8): another domain, and the SHA-256 of the
#: whole encryption block between the index's and the block's digests
ENCRYPTED_MESSAGE_DOMAIN = b"ckptfmt-signed-encrypted-file-v1"  # 32 bytes
ENCRYPTED_MESSAGE_SIZE = 232

_SHA_CONTEXT = struct.Struct("<16s16sQQQQBBB5x")  # 72 bytes, like the XXH3 chunk seed's
_SHA_DOMAIN = b"ckptfmt-sha256\x00\x00"


def block_length(nchunks: int) -> int:
    """Bytes of the signature block of a file with `nchunks` chunk records."""
    n = HEADER_SIZE + DIGEST_SIZE * nchunks + SIGNATURE_SIZE
    return (n + 63) // 64 * 64


def chunk_digest(
    file_id: bytes,
    index: int,
    offset: int,
    stored_len: int,
    raw_len: int,
    codec: int,
    filt: int,
    width: int,
    stored: bytes | memoryview,
) -> bytes:
    """A chunk's signed digest: SHA-256 of the 72-byte context, then its stored bytes."""
    h = hashlib.sha256(
        _SHA_CONTEXT.pack(_SHA_DOMAIN, file_id, index, offset, stored_len, raw_len, codec, filt, width)
    )
    h.update(stored)
    return h.digest()


@dataclass(frozen=True)
class SignatureBlock:
    digest_algorithm: int
    signature_algorithm: int
    public_key: bytes  # 32 bytes, raw Ed25519
    digests: bytes  # 32 bytes per chunk, in chunk order
    signature: bytes  # 64 bytes

    def header(self) -> bytes:
        return _HEADER.pack(
            BLOCK_MAGIC,
            self.digest_algorithm,
            self.signature_algorithm,
            0,
            len(self.digests) // DIGEST_SIZE,
            self.public_key,
        )

    def body_digest(self) -> bytes:
        """SHA-256 of the header and the digest table: what the signed message binds."""
        h = hashlib.sha256(self.header())
        h.update(self.digests)
        return h.digest()

    def pack(self) -> bytes:
        raw = self.header() + self.digests + self.signature
        n = len(self.digests) // DIGEST_SIZE
        return raw + bytes(block_length(n) - len(raw))

    def digest_of(self, k: int) -> bytes:
        return self.digests[DIGEST_SIZE * k : DIGEST_SIZE * (k + 1)]


def parse_block(raw: bytes, nchunks: int, path: str, at: int) -> SignatureBlock:
    """Check a signature block's structure (not its signature) for a file of `nchunks` chunks."""
    if len(raw) != block_length(nchunks):
        raise CorruptError(
            f"signature block is {len(raw)} bytes, {block_length(nchunks)} for {nchunks} chunks",
            path=path,
            offset=at,
        )
    magic, dalg, salg, reserved, count, key = _HEADER.unpack_from(raw)
    if magic != BLOCK_MAGIC:
        raise CorruptError("signature block magic is missing", path=path, offset=at)
    if dalg != DIGEST_SHA256:
        raise UnsupportedError(
            f"signature block names unknown digest algorithm {dalg}", path=path, offset=at + 16
        )
    if salg != SIGNATURE_ED25519:
        raise UnsupportedError(
            f"signature block names unknown signature algorithm {salg}", path=path, offset=at + 18
        )
    if reserved:
        raise CorruptError("reserved field of the signature block is not zero", path=path, offset=at + 20)
    if count != nchunks:
        raise CorruptError(
            f"signature block lists {count} chunks, the index {nchunks}", path=path, offset=at + 24
        )
    end = HEADER_SIZE + DIGEST_SIZE * nchunks
    pad = raw[end + SIGNATURE_SIZE :]
    if any(pad):
        raise CorruptError(
            "padding after the signature is not zero", path=path, offset=at + end + SIGNATURE_SIZE
        )
    return SignatureBlock(dalg, salg, key, raw[HEADER_SIZE:end], raw[end : end + SIGNATURE_SIZE])


def signed_message(
    prologue: bytes, footer: bytes, index_sha256: bytes, block: SignatureBlock, encryption_sha256: bytes = b""
) -> bytes:
    """The bytes the Ed25519 signature is over: 200 (section 16.3), or 232 for an encrypted
    file, given the SHA-256 of its whole encryption block (section 17.8)."""
    if encryption_sha256:
        msg = ENCRYPTED_MESSAGE_DOMAIN + prologue[:56] + footer[:48] + index_sha256
        msg += encryption_sha256 + block.body_digest()
        assert len(msg) == ENCRYPTED_MESSAGE_SIZE
        return msg
    msg = MESSAGE_DOMAIN + prologue[:56] + footer[:48] + index_sha256 + block.body_digest()
    assert len(msg) == MESSAGE_SIZE
    return msg
