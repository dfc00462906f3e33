"""Encrypting files and opening them (spec/FORMAT.md section 17): the user's keys.

A key (``save(..., encrypt_with=K)``, ``load(..., decrypt_with=K)``) is one of:

* 32 bytes: a key-encryption key (KEK); the file's data key is wrapped under it with
  AES-256-GCM (key wrap 1);
* a path to a *key file*: a regular file holding exactly 32 bytes, or exactly 64 hex digits
  optionally followed by one line feed (anything else is refused); the KEK it holds, as above;
* a callable (a key service, key wrap 2): on save called once per file as ``K(data_key)``
  with the fresh 32-byte data key, returning the wrapped blob (bytes, 1 to 1024); on read
  called as ``K(blob)``, returning the 32-byte data key.

No key bytes, data key bytes or wrapped blobs ever reach a message, a repr or a log: errors
name the key only by its 8-byte hint (17.2), which is public in the file anyway.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine import native as _native
from ..errors import CheckpointError, CorruptError, DecryptionError, UnsupportedError
from ..fileio import open_regular
from ..format import encryption as enc
from ..format.encryption import KeyRequired

__all__ = [
    "UNCHECKED_CLEAR_INDEX",
    "UNCHECKED_ENCRYPTED_INDEX",
    "UNCHECKED_SIGNED_CLEAR_INDEX",
    "UNCHECKED_SIGNED_ENCRYPTED_INDEX",
    "KeyRequired",
    "load_key",
    "opener",
    "sealer",
]

#: what verify() without the key leaves unchecked (spec 17.6), by whether the index is encrypted
UNCHECKED_ENCRYPTED_INDEX = (
    "encrypted file checked without its key: the prologue, footer, encryption block and the index's "
    "checksum were checked; the index, the chunks and every GCM tag were not (pass the key: decrypt_with, --decrypt-key)"
)
UNCHECKED_CLEAR_INDEX = (
    "encrypted file checked without its key: its structure, index and each chunk's checksum over the "
    "ciphertext were checked; the GCM tags, zstd frames and contents were not (pass the key: decrypt_with, --decrypt-key)"
)

#: verify() of a signed encrypted file with trusted keys and without its data key (17.8)
UNCHECKED_SIGNED_ENCRYPTED_INDEX = (
    "signed encrypted file checked without its key: the signature (over the prologue, footer, encrypted "
    "index, encryption block and digest table) was checked; the index, the chunks' digests and every GCM "
    "tag were not (pass the key: decrypt_with, --decrypt-key)"
)
UNCHECKED_SIGNED_CLEAR_INDEX = (
    "signed encrypted file checked without its key: the signature, structure, index and each chunk's "
    "checksum and signed SHA-256 over the ciphertext were checked; the GCM tags, zstd frames and "
    "contents were not (pass the key: decrypt_with, --decrypt-key)"
)

#: a key file is at most this long: 64 hex digits and a line feed
_KEY_FILE_MAX = 65
_HEX = frozenset(string.hexdigits)


@dataclass(frozen=True)
class Key:
    """A resolved user key: a KEK (key wrap 1) or a key service's callable (key wrap 2)."""

    kek: bytes = field(default=b"", repr=False)
    service: Callable[[bytes], bytes] | None = field(default=None, repr=False)

    @property
    def hint(self) -> bytes:
        return enc.kek_hint(self.kek) if self.kek else bytes(enc.HINT_SIZE)

    def __repr__(self) -> str:
        return f"Key(hint={self.hint.hex()})" if self.kek else "Key(service)"


def load_key(key: Any, what: str) -> Key:
    """Resolve `key` (see the module's docstring); `what` names the argument in messages."""
    if callable(key):
        return Key(service=key)
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        if len(raw) != enc.KEY_SIZE:
            raise ValueError(f"{what}: a key is 32 bytes, not {len(raw)}")
        return Key(kek=raw)
    if isinstance(key, str) and len(key) == 64 and _HEX.issuperset(key):
        # never opened as a path: an error would print the key
        raise ValueError(f"{what}: a str is a key file's path; for a key in hex pass bytes.fromhex(...)")
    if isinstance(key, (str, os.PathLike)):
        return Key(kek=read_key_file(os.fspath(key), what))
    raise TypeError(f"{what} must be 32 bytes, a key file's path or a callable (a key service)")


def read_key_file(path: str, what: str) -> bytes:
    """The KEK a key file holds: exactly 32 bytes, or 64 hex digits and at most one line feed."""
    try:
        fd = open_regular(path)  # a FIFO or device is refused unopened
    except UnsupportedError as e:
        raise UnsupportedError(f"{what}: the key file given is {e.reason}") from None
    except OSError as e:
        # the text given may be a key mistyped as a path (base64, hex with a line feed or a
        # typo): it is never repeated in the message
        raise type(e)(e.errno, f"{what}: cannot open the key file given (the path is not shown)") from None
    try:
        data = os.pread(fd, _KEY_FILE_MAX + 1, 0)
    finally:
        os.close(fd)
    if len(data) == enc.KEY_SIZE:
        return data
    text = data[:-1] if data.endswith(b"\n") else data
    if len(text) == 64 and all(chr(c) in _HEX for c in text):
        return bytes.fromhex(text.decode("ascii"))
    raise ValueError(
        f"{what}: key file {path} holds {len(data)} bytes; a key file holds 32 bytes, "
        "or 64 hex digits and at most one line feed"
    )


def generate_key_file(path: str) -> None:
    """Write a new random KEK to `path` as 64 hex digits and a line feed, readable by the owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_bytes(enc.KEY_SIZE).hex().encode("ascii") + b"\n")
    finally:
        os.close(fd)


def require_engine_crypto() -> None:
    """Encrypted files on the C engine need it built with libcrypto: say so before any work."""
    if _native.available() and not _native.crypto_available():
        raise CheckpointError(
            "encrypted files need the C engine built with OpenSSL's libcrypto (libssl-dev); this one "
            "was built without it (CKPTFMT_BACKEND=python encrypts in Python)"
        )


class FileSealer:
    """Encrypts one file (format.encryption.Sealer): a fresh data key, wrapped at the end."""

    def __init__(self, key: Key, encrypt_index: bool, data_key: bytes | None = None) -> None:
        """`data_key`: only for reproducible test vectors; a save always draws a fresh one."""
        self._key = key
        self._encrypt_index = encrypt_index
        self._data_key = secrets.token_bytes(enc.KEY_SIZE) if data_key is None else data_key

    def __repr__(self) -> str:
        return f"FileSealer({self._key!r}, encrypt_index={self._encrypt_index})"

    @property
    def data_key(self) -> bytes:
        return self._data_key

    @property
    def key(self) -> Key:
        """The user's key the data key is wrapped under."""
        return self._key

    def seal(self, file_id: bytes, index_offset: int, index: bytes, tags: bytes) -> tuple[bytes, bytes]:
        nchunks = len(tags) // enc.TAG_SIZE
        flags = enc.FLAG_INDEX_ENCRYPTED if self._encrypt_index else 0
        if self._key.service is not None:
            wrapped = _service_wrap(self._key.service, self._data_key)
            block = enc.EncryptionBlock(
                enc.CIPHER_AES256_GCM, enc.WRAP_EXTERNAL, flags, nchunks, bytes(8), wrapped, bytes(16), tags
            )
        else:
            draft = enc.EncryptionBlock(
                enc.CIPHER_AES256_GCM,
                enc.WRAP_KEK,
                flags,
                nchunks,
                self._key.hint,
                bytes(enc.WRAPPED_KEK_SIZE),
                bytes(16),
                tags,
            )
            nonce = secrets.token_bytes(enc.NONCE_SIZE)
            sealed = small_gcm(self._key.kek).encrypt(
                nonce, self._data_key, enc.wrap_aad(file_id, draft.fields())
            )
            block = _with(draft, wrapped=nonce + sealed)
        stored, index_tag = enc.seal_index(small_gcm, self._data_key, block, file_id, index_offset, index)
        return stored, _with(block, index_tag=index_tag).pack()


def small_gcm(key: bytes) -> Any:
    """The AES-256-GCM of a file's key wrap and index: the engine's libcrypto where it has it
    (a save or a load then never imports ``cryptography``: its import alone costs about as
    much as encrypting a few hundred MiB), else ``cryptography``'s."""
    if _native.crypto_available():
        return _native.EngineGCM(key)
    return enc.aesgcm(key)


def _with(block: enc.EncryptionBlock, **changes: Any) -> enc.EncryptionBlock:
    return dataclasses.replace(block, **changes)


def _service_wrap(service: Callable[[bytes], bytes], data_key: bytes) -> bytes:
    try:
        wrapped = service(data_key)
    except Exception as e:  # the service's own failure: its type only, its text may hold the key
        raise CheckpointError(
            f"encrypt_with: the key service failed to wrap the data key ({type(e).__name__})"
        ) from None
    if not isinstance(wrapped, (bytes, bytearray)) or not 1 <= len(wrapped) <= enc.MAX_WRAPPED:
        raise CheckpointError(
            f"encrypt_with: the key service must return 1 to {enc.MAX_WRAPPED} bytes for a data key"
        )
    return bytes(wrapped)


def sealer(encrypt_with: Any, encrypt_index: bool = True) -> FileSealer | None:
    """save()'s encryption of one file from `encrypt_with` (None: not encrypted); the key is
    resolved, and the engine checked for libcrypto, before anything is written."""
    if encrypt_with is None:
        return None
    key = load_key(encrypt_with, "encrypt_with")
    require_engine_crypto()
    small_gcm(bytes(enc.KEY_SIZE))  # the key wrap's and index's GCM there (cryptography without the engine)
    return FileSealer(key, encrypt_index)


def save_and_read_keys(encrypt_with: Any, decrypt_with: Any) -> tuple[Any, Any]:
    """The keys a writer that also reads back (a run, a trainer) saves and reads with, checked
    before anything is written: reading defaults to `encrypt_with`, except for a key service,
    whose wrapping callable cannot unwrap."""
    if encrypt_with is None:
        return None, decrypt_with
    sealer(encrypt_with)  # a bad key, or an engine without libcrypto, fails here
    if decrypt_with is None and callable(encrypt_with):
        raise ValueError("a key service encrypts: give the callable that unwraps as decrypt_with")
    return encrypt_with, encrypt_with if decrypt_with is None else decrypt_with


def run_keys(encrypt_with: Any, decrypt_with: Any, what: str) -> tuple[Any, Any]:
    """save_and_read_keys for a writer that reads its own saves back with `decrypt_with` (a
    run's commits, its newest step, the next incremental save's base): a key that encrypts
    must then read too, so a different decrypt_with (meant for older saves under another key)
    is refused here, not by the first commit.  `what` names the writer in the message."""
    encrypt, decrypt = save_and_read_keys(encrypt_with, decrypt_with)
    if encrypt is not None and not callable(encrypt):
        if (
            callable(decrypt)
            or load_key(decrypt, "decrypt_with").kek != load_key(encrypt, "encrypt_with").kek
        ):
            raise ValueError(
                f"{what} reads back the checkpoints it writes: decrypt_with must be the key of encrypt_with "
                "(or left out); a run's key cannot change within the run: start a new run under the new key "
                "(load the old one with the old key, save under the new)"
            )
    return encrypt, decrypt


def opener(decrypt_with: Any) -> enc.Opener | None:
    """The reader's way into encrypted files (None without a key): the data key of a file's
    encryption block, and the GCM its index is opened with (small_gcm)."""
    if decrypt_with is None:
        return None
    key = load_key(decrypt_with, "decrypt_with")
    require_engine_crypto()

    def open_block(block: enc.EncryptionBlock, file_id: bytes) -> bytes:
        return unwrap(key, block, file_id)

    return enc.Opener(open_block, small_gcm)


def unwrap(key: Key, block: enc.EncryptionBlock, file_id: bytes) -> bytes:
    """The data key of a file, unwrapped with the user's key; DecryptionError when it cannot be."""
    if key.service is not None:
        try:
            data_key = key.service(block.wrapped)
        except Exception as e:  # the service's own failure: its type only, never its text
            raise DecryptionError(
                f"the key service failed to unwrap the data key ({type(e).__name__})"
            ) from None
        if not isinstance(data_key, (bytes, bytearray)) or len(data_key) != enc.KEY_SIZE:
            raise DecryptionError("the key service did not return a 32-byte data key")
        return bytes(data_key)
    if block.wrap != enc.WRAP_KEK:
        raise DecryptionError(
            "file's data key was wrapped by a key service: decrypt_with must be its callable"
        )
    if block.hint != key.hint:
        raise DecryptionError(
            f"file was encrypted under another key (key hint {block.hint.hex()}, the key given has {key.hint.hex()})"
        )
    nonce, sealed = block.wrapped[: enc.NONCE_SIZE], block.wrapped[enc.NONCE_SIZE :]
    try:
        return bytes(small_gcm(key.kek).decrypt(nonce, sealed, enc.wrap_aad(file_id, block.fields())))
    except enc.invalid_tag():
        raise DecryptionError(
            "wrapped data key does not match its GCM tag (the wrapped key or the encryption block's header changed)"
        ) from None


def unwraps(key: Key, block: enc.EncryptionBlock) -> bool:
    """Whether `key` unwraps the data key of a file with encryption block `block`, as far as the
    block says: a KEK the one its hint names, a key service any data key a key service wrapped."""
    if key.service is not None:
        return block.wrap == enc.WRAP_EXTERNAL
    return block.wrap == enc.WRAP_KEK and block.hint == key.hint


def ciphertext_problems(f: Any) -> list[CheckpointError]:
    """Without the key, a file with a clear index: each chunk's XXH3 checksum (over its
    ciphertext) and zero padding, one problem per damaged chunk (17.6)."""
    import xxhash

    from ..errors import IncompleteError, SignatureError
    from ..fileio import pread_exact
    from ..format import layout as fmt
    from ..format import signing

    problems: list[CheckpointError] = []
    for k, ch in enumerate(f.chunks):
        data = pread_exact(f._fd, ch.offset, ch.stored_len + ch.pad)
        if len(data) != ch.stored_len + ch.pad:
            problems.append(
                IncompleteError("file ended while reading chunk", path=f.path, chunk=k, offset=ch.offset)
            )
            break
        seed = fmt.chunk_seed(
            f.prologue.file_id, k, ch.offset, ch.stored_len, ch.raw_len, ch.codec, ch.filter, ch.width
        )
        bad = SignatureError if ch.sha else CorruptError  # a signature was demanded (17.8)
        if xxhash.xxh3_64_intdigest(data[: ch.stored_len], seed=seed) != ch.checksum:
            problems.append(bad("checksum mismatch", path=f.path, chunk=k, offset=ch.offset))
        elif ch.sha and ch.sha != signing.chunk_digest(
            f.prologue.file_id,
            k,
            ch.offset,
            ch.stored_len,
            ch.raw_len,
            ch.codec,
            ch.filter,
            ch.width,
            data[: ch.stored_len],
        ):
            problems.append(
                SignatureError(
                    "chunk does not match its signed SHA-256", path=f.path, chunk=k, offset=ch.offset
                )
            )
        elif any(data[ch.stored_len :]):
            at = ch.offset + ch.stored_len
            problems.append(bad("padding after the chunk is not zero", path=f.path, chunk=k, offset=at))
    return problems
