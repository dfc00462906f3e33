"""Signing files and checking their signatures (spec/FORMAT.md section 16): keys and Ed25519.

Keys are Ed25519 keys in the encodings the ``cryptography`` package reads: PEM (PKCS#8
private keys, SubjectPublicKeyInfo public keys), OpenSSH (``-----BEGIN OPENSSH PRIVATE
KEY-----``, ``ssh-ed25519 AAAA...``), given as a path, as the file's bytes or text, or as a
``cryptography`` key object.  ``cryptography`` is imported only when a key is used, so
loading unsigned files never imports it.  Nothing here writes a key into a message.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..engine import native as _native
from ..errors import CheckpointError, SignatureError
from ..fileio import open_regular
from ..format import layout as fmt
from ..format import signing

if TYPE_CHECKING:
    from ..engine.writeoptions import Signer
    from ..format.index import Authenticator, Index

KeyLike = Any  # a path, PEM/OpenSSH bytes, or a cryptography Ed25519 key object


def _key_bytes(key: Any, what: str) -> bytes:
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, str) and key.lstrip().startswith(("-----BEGIN", "ssh-")):
        return key.encode()  # the key's text itself, never a path: an error would print it
    if isinstance(key, (str, os.PathLike)):
        # a key path is opened as every file a reader is given: a FIFO or device is refused
        # unopened instead of blocking the load
        fd = open_regular(os.fspath(key))
        try:
            return os.pread(fd, 1 << 20, 0)
        finally:
            os.close(fd)
    raise TypeError(f"{what} must be a path, the bytes of a PEM or OpenSSH key, or a cryptography key object")


def load_private_key(key: KeyLike) -> Any:
    """An Ed25519PrivateKey from a key object, a path or the bytes of a PEM / OpenSSH private key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    data = _key_bytes(key, "sign_with")
    obj: Any
    try:
        if data.lstrip().startswith(b"-----BEGIN OPENSSH PRIVATE KEY"):
            obj = serialization.load_ssh_private_key(data, password=None)
        else:
            obj = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        # the library's message names the encoding, never the key's bytes
        raise ValueError(
            f"sign_with: not an unencrypted PEM or OpenSSH private key ({type(e).__name__})"
        ) from None
    if not isinstance(obj, ed25519.Ed25519PrivateKey):
        raise ValueError(f"sign_with: an Ed25519 key is needed, not {type(obj).__name__}")
    return obj


def load_public_key(key: KeyLike) -> bytes:
    """The raw 32 bytes of an Ed25519 public key given as a key object (public or private),
    a path, or the bytes of a PEM public key or an OpenSSH ``ssh-ed25519`` line."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    if isinstance(key, ed25519.Ed25519PrivateKey):
        key = key.public_key()
    if not isinstance(key, ed25519.Ed25519PublicKey):
        data = _key_bytes(key, "trusted_keys entry")
        try:
            if data.lstrip().startswith(b"ssh-"):
                key = serialization.load_ssh_public_key(data)
            else:
                key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            raise ValueError(f"trusted_keys: not a PEM or OpenSSH public key ({type(e).__name__})") from None
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise ValueError(f"trusted_keys: an Ed25519 key is needed, not {type(key).__name__}")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def trusted_set(trusted_keys: Any) -> frozenset[bytes] | None:
    """The raw public keys a caller trusts, or None when no signature is demanded."""
    if trusted_keys is None:
        return None
    if isinstance(trusted_keys, (str, bytes, bytearray, os.PathLike)) or not isinstance(
        trusted_keys, Iterable
    ):
        trusted_keys = [trusted_keys]
    keys = frozenset(load_public_key(k) for k in trusted_keys)
    if not keys:
        raise ValueError(
            "trusted_keys is empty: no file could be accepted (pass None to demand no signature)"
        )
    return keys


def check(index: Index, trusted: frozenset[bytes], path: str) -> Index:
    """Check the signature of a file's validated index against the trusted keys; return the
    index with each chunk's signed digest attached (checked as each chunk is read).
    SignatureError when the file is unsigned, signed by another key, or its signature fails."""
    block = index.signature
    if block is None or not index.prologue.required_features & fmt.FEATURE_SIGNED:
        raise SignatureError("file is not signed, and a signature by a trusted key is required", path=path)
    check_signature(
        trusted, path, index.prologue, index.footer, index.index_sha256, block, index.encryption_sha256
    )
    chunks = [ch._replace(sha=block.digest_of(k)) for k, ch in enumerate(index.chunks)]
    return dataclasses.replace(index, chunks=chunks)


def check_signature(
    trusted: frozenset[bytes],
    path: str,
    prologue: fmt.Prologue,
    footer: fmt.Footer,
    index_sha256: bytes,
    block: signing.SignatureBlock,
    encryption_sha256: bytes = b"",
) -> None:
    """Check a signature block's key and signature (section 16.4; with the SHA-256 of an
    encryption block, the message of section 17.8).  SignatureError when either fails."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric import ed25519

    if block.public_key not in trusted:
        raise SignatureError(
            f"file is signed by key {fingerprint(block.public_key)}, which is not among the trusted keys",
            path=path,
        )
    msg = signing.signed_message(prologue.pack(), footer.pack(), index_sha256, block, encryption_sha256)
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(block.public_key).verify(block.signature, msg)
    except InvalidSignature:
        what = ", encryption block" if encryption_sha256 else ""
        raise SignatureError(
            f"signature does not match the file (its prologue, index{what} or digest table changed, "
            "or the signature)",
            path=path,
        ) from None


def authenticator(trusted: frozenset[bytes] | None, path: str) -> Authenticator | None:
    """What the index parser calls to check a signed encrypted file before any key is used."""
    if trusted is None:
        return None

    def authenticate(
        prologue: fmt.Prologue,
        footer: fmt.Footer,
        index_sha256: bytes,
        block: signing.SignatureBlock,
        enc: bytes,
    ) -> None:
        check_signature(trusted, path, prologue, footer, index_sha256, block, enc)

    return authenticate


def fingerprint(public_key: bytes) -> str:
    """A short name of a public key for messages: SHA256:<first 16 hex digits> of its raw bytes."""
    import hashlib

    return "SHA256:" + hashlib.sha256(public_key).hexdigest()[:16]


def sign_block(
    private_key: Any,
    prologue: bytes,
    footer: bytes,
    index_sha256: bytes,
    digests: bytes,
    encryption_sha256: bytes = b"",
) -> bytes:
    """The signature block of a file whose prologue, footer and index (and encryption block,
    whose SHA-256 is given for an encrypted file) are final."""
    from cryptography.hazmat.primitives import serialization

    pub = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    unsigned = signing.SignatureBlock(
        signing.DIGEST_SHA256, signing.SIGNATURE_ED25519, pub, digests, bytes(64)
    )
    sig = private_key.sign(
        signing.signed_message(prologue, footer, index_sha256, unsigned, encryption_sha256)
    )
    return dataclasses.replace(unsigned, signature=sig).pack()


def signer(sign_with: Any) -> Signer | None:
    """The signature-block maker for save()'s `sign_with` (None: an unsigned file); the key
    is loaded, and the engine checked for libcrypto, before anything is written."""
    if sign_with is None:
        return None
    key = load_private_key(sign_with)
    if _native.available() and not _native.crypto_available():
        raise CheckpointError(
            "signing needs the C engine built with OpenSSL's libcrypto (libssl-dev); this one was built without it"
        )

    def sign(prologue: bytes, footer: bytes, index_sha256: bytes, digests: bytes, enc_sha256: bytes) -> bytes:
        return sign_block(key, prologue, footer, index_sha256, digests, enc_sha256)

    return sign
