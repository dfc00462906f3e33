"""Signed multi-file checkpoints (spec/FORMAT.md section 16.7): the SHA-256 of every file a
commit record names, and the checks a reader that demands a signature makes.

A signed commit record is an ordinary commit record (multifile.py) whose every entry, in
``files`` and in ``references``, carries the SHA-256 of that file's whole bytes, written as
a signed file (section 16) by the signer's key.  A reader given ``trusted_keys`` reads the
record with them (an unsigned record, one signed by another key or any changed byte of it
is a SignatureError), then hashes each file it is about to read and compares, before any
of the file's chunks is used.  The writers (the checkpoint manager, ``ckptfmt.dcp``,
``ckptfmt sign DIR``) take the digests here; the record is signed by ``write_commit``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from typing import Any

from ..engine.ckptdir import CheckpointDir
from ..errors import CheckpointError, LimitError, SignatureError
from ..storage.download import RemoteObject
from ..storage.pools import run_each
from . import multifile
from .signing import load_private_key, trusted_set

#: bytes hashed per read: large enough that hashlib releases the GIL and files hash in parallel
HASH_BLOCK = 8 << 20
#: files hashed at once
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))


def private_key(sign_with: Any) -> Any:
    """The Ed25519 private key object of `sign_with` (None: no signing), loaded once up front
    so that a bad key fails before anything is written."""
    return None if sign_with is None else load_private_key(sign_with)


def public_keys(trusted_keys: Any) -> list[Any] | None:
    """`trusted_keys` as a list of Ed25519 public key objects (None: no signature demanded);
    a bad key fails here, before any file is opened."""
    trusted = trusted_set(trusted_keys)
    if trusted is None:
        return None
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return [ed25519.Ed25519PublicKey.from_public_bytes(k) for k in sorted(trusted)]


def file_sha256(fd: int, length: int, path: str) -> bytes:
    """SHA-256 of bytes [0, length) of the open file `fd`; SignatureError if it is shorter."""
    h = hashlib.sha256()
    buf = bytearray(min(HASH_BLOCK, max(length, 1)))
    view = memoryview(buf)
    at = 0
    while at < length:
        n = os.preadv(fd, [view[: min(len(buf), length - at)]], at)
        if n <= 0:
            raise SignatureError(f"file ended at offset {at} while it was hashed", path=path, offset=at)
        h.update(view[:n])
        at += n
    return h.digest()


def _open(d: CheckpointDir, part: multifile.PartRecord, owner: str) -> int:
    """open_part, its failures (a missing, replaced or damaged file) reported as signature
    failures, as spec 16.4 reports those of a signed file's structure; limits stay limits."""
    try:
        return multifile.open_part(d, part, owner)
    except LimitError:
        raise
    except CheckpointError as e:
        raise SignatureError(f"not the files a trusted key signed: {e.reason}", path=owner) from e


def _hash_part(d: CheckpointDir, part: multifile.PartRecord, owner: str) -> bytes:
    fd = _open(d, part, owner)
    try:
        return file_sha256(fd, part.length, d.path_of(part.name))
    finally:
        os.close(fd)


def _each(d: CheckpointDir, parts: Sequence[multifile.PartRecord], owner: str) -> list[bytes]:
    """Every part's SHA-256, each file opened and checked as a load opens it, in parallel (at
    interpreter exit in turn); the first failure stops the rest."""
    return run_each(lambda p: _hash_part(d, p, owner), parts, HASH_THREADS, "ckptfmt-hash")


def part_with_digest(d: CheckpointDir, part: multifile.PartRecord) -> multifile.PartRecord:
    """`part` with its file's SHA-256 (a DCP rank hashes the file it has just committed)."""
    return dataclasses.replace(part, sha256=_hash_part(d, part, d.path))


def with_digests(d: CheckpointDir, record: multifile.CommitRecord) -> multifile.CommitRecord:
    """`record` with the SHA-256 of every file it names, ready to be signed."""
    parts = record.files + record.references
    shas = _each(d, parts, d.path)
    named = [dataclasses.replace(p, sha256=s) for p, s in zip(parts, shas)]
    n = len(record.files)
    return dataclasses.replace(record, files=tuple(named[:n]), references=tuple(named[n:]))


def write_signed(d: CheckpointDir, record: multifile.CommitRecord, key: Any, options: Any = None) -> None:
    """Write `record` as the signed commit record of `d` (spec 16.7); `key`: a private key, or
    `options`: save options built once with it (multifile.write_commit)."""
    multifile.write_commit(d.path, with_digests(d, record), within=d, sign_with=key, options=options)


def read_trusted(d: CheckpointDir, trusted: Any) -> multifile.CommitRecord:
    """`d`'s commit record, signed by one of `trusted` and carrying every file's SHA-256;
    SignatureError otherwise (an unsigned record, another key, a changed byte)."""
    return require_digests(multifile.read_commit(d, trusted_keys=trusted), d.path)


def require_digests(record: multifile.CommitRecord, owner: str) -> multifile.CommitRecord:
    """`record` (read with trusted keys), if every entry carries its file's SHA-256."""
    if any(p.sha256 is None for p in record.files + record.references):
        raise SignatureError("the signed commit record carries no file digests", path=owner)
    return record


def object_sha256(url: str, options: dict[str, Any], etag: str | None = None) -> tuple[bytes, str]:
    """SHA-256 of an object's whole bytes, and the version (ETag) hashed (`etag`: that
    version only, StorageError if another one is there now)."""
    remote = RemoteObject(url, options, etag=etag, fetch_index=False)
    try:
        return remote.sha256(), remote.etag
    finally:
        remote.close()


def check_object(url: str, part: multifile.PartRecord, options: dict[str, Any], etag: str | None) -> str:
    """Raise SignatureError unless version `etag` (None: the current one) of the object `url`
    has the SHA-256 the signed record gives `part`; the version checked, which a reader then
    pins its range requests to."""
    digest, checked = object_sha256(url, options, etag)
    if digest != part.sha256:
        raise SignatureError(
            f"{part.name} is not the file the signed commit record names (its SHA-256 differs)", path=url
        )
    return checked


def check_part(fd: int, d: CheckpointDir, part: multifile.PartRecord, owner: str) -> None:
    """Raise SignatureError unless the open file `fd` has the SHA-256 the signed record gives."""
    if file_sha256(fd, part.length, d.path_of(part.name)) != part.sha256:
        raise SignatureError(
            f"{part.name} is not the file the signed commit record names (its SHA-256 differs)", path=owner
        )


def open_trusted_part(d: CheckpointDir, part: multifile.PartRecord, owner: str) -> int:
    """A descriptor of the file `part` names, checked (open_part) and hashed against the
    signed record; reading through it reads the file whose digest was checked."""
    fd = _open(d, part, owner)
    try:
        check_part(fd, d, part, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_files(d: CheckpointDir, parts: Sequence[multifile.PartRecord], owner: str) -> None:
    """Raise SignatureError unless every file of `parts` has the SHA-256 the signed record gives."""
    for part, sha in zip(parts, _each(d, parts, owner)):
        if sha != part.sha256:
            raise SignatureError(
                f"{part.name} is not the file the signed commit record names (its SHA-256 differs)",
                path=owner,
            )


def check_directory(d: CheckpointDir, trusted: Any) -> multifile.CommitRecord:
    """The signed record of `d` and every file it names checked against it (verify, sign)."""
    record = read_trusted(d, trusted)
    check_files(d, record.files + record.references, d.path)
    return record
