"""Signing an existing file (``ckptfmt sign``) without re-encoding its data (spec 16.5).

The signed file is written as a new file through the commit protocol (spec section 10):
its data section, and the index, are copied from the original with ``copy_file_range``
(a reflink on filesystems that share extents, an in-kernel copy elsewhere: the bytes
never pass through this process), then the signature block, the footer and, last, the
prologue are written, the whole result is checked as a load with the signing key as the
only trusted key would check it, and only then renamed over the original.  The file id
and so every chunk's XXH3 checksum are unchanged; an existing signature is replaced.
The new file keeps the original's permission bits, and its owner and group where this
process may set them.  A path that is a symbolic link signs the file the link names (the
link is resolved once; that file is read and replaced beneath its directory) and the link
is kept.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from typing import Any

from ..background import inflight
from ..engine.chunkwrite import write_signed_tail
from ..engine.ckptdir import CheckpointDir
from ..engine.commit import AtomicFile
from ..errors import DecryptionError, UnsupportedError
from ..fileio import pread_exact
from ..format import encryption as layout_encryption
from ..format import layout as fmt
from ..format import signing as layout_signing
from .encryption import KeyRequired, ciphertext_problems
from .reader import CheckpointFile
from .signing import load_private_key, signer


def _copy_range(src: int, dst: int, length: int) -> None:
    """Copy bytes [0, length) of src to dst in the kernel (copy_file_range), else by pread/pwrite."""
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(src, dst, min(length - done, 1 << 30), done, done)
            if n == 0:
                raise OSError(errno.EIO, "the file ended while it was copied")
            done += n
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
    while done < length:
        buf = os.pread(src, min(length - done, 64 << 20), done)
        if not buf:
            raise OSError(errno.EIO, "the file ended while it was copied")
        os.pwrite(dst, buf, done)
        done += len(buf)


def _digests(fd: int, f: CheckpointFile, threads: int) -> list[bytes]:
    """Each chunk's signed digest (SHA-256 over its context and stored bytes), read from `fd`."""
    from ..storage.pools import run_each

    fid = f.prologue.file_id

    def one(k: int) -> bytes:
        ch = f.chunks[k]
        stored = pread_exact(fd, ch.offset, ch.stored_len)
        if len(stored) != ch.stored_len:
            raise OSError(errno.EIO, "the file ended while its chunks were read")
        return layout_signing.chunk_digest(
            fid, k, ch.offset, ch.stored_len, ch.raw_len, ch.codec, ch.filter, ch.width, stored
        )

    # hashlib releases the GIL; at interpreter exit the chunks are hashed here, in turn
    return run_each(one, range(len(f.chunks)), threads, "ckptfmt-sign")


def sign_file(path: str | os.PathLike[str], key: Any, *, decrypt_with: Any = None) -> None:
    """Sign the ckptfmt file at `path` with the Ed25519 private key `key` (spec section 16).

    The file's structure is checked first, and the signed result completely (every chunk's
    checksum and signed digest) before it replaces the original: a damaged file is never
    signed.  The signed file keeps the original's mode (and owner, where permitted); a
    symbolic link at `path` is kept and the file it names is signed.  UnsupportedError for an
    incremental file (external chunks).

    An encrypted file is signed over its ciphertext and encryption block (spec 17.8), without
    its data key when its index is in clear; an encrypted index holds the chunks' places, so
    signing one needs `decrypt_with` (the key is used to read the index, never to re-encrypt)."""
    from ..engine import native as _native

    target = os.fspath(path)
    private = load_private_key(key)
    sign = signer(private)
    assert sign is not None
    # a link is resolved once and the file it names signed beneath its directory: the link
    # stays a link (replacing it with the signed file would cut it from the file it named)
    real = os.path.realpath(target)
    inflight.wait_for_path(target)
    inflight.wait_for_path(real)
    with contextlib.ExitStack() as stack:
        try:
            d, f = stack.enter_context(_open_to_sign(target, real, decrypt_with))
        except KeyRequired:  # only an encrypted index asks for a key here
            raise DecryptionError(
                "file's index is encrypted, and the chunks' places are in it: pass its key "
                "(decrypt_with, --decrypt-key) to sign it",
                path=target,
            ) from None
        if f.prologue.required_features & fmt.FEATURE_EXTERNAL:
            raise UnsupportedError(
                "signing files with external chunks (incremental checkpoints) is not defined in this version",
                path=target,
            )
        ioff, ilen = f.footer.index_offset, f.footer.index_length
        blob = pread_exact(f._fd, ioff, ilen)  # as stored: the ciphertext of an encrypted index
        enc_block = _encryption_block(f)
        if len(blob) != ilen:
            raise OSError(errno.EIO, "the file ended while its index was read", target)
        with AtomicFile(real, within=d) as out:
            _copy_range(f._fd, out.fd, ioff + ilen)
            copy = out.open_for_reading()
            try:
                # the digests are taken of the copy: the bytes the signature will vouch for
                shas = _digests(copy, f, _native.default_threads())
            except BaseException:
                os.close(copy)
                raise
            required = f.prologue.required_features & fmt.FEATURE_ENCRYPTED
            write_signed_tail(out.fd, f.prologue.file_id, ioff, bytes(blob), required, enc_block, sign, shas)
            # the result, checked as a load that trusts only this key would: every chunk's
            # checksum, padding, frame and signed digest (CheckpointFile owns `copy` now)
            with CheckpointFile(
                target,
                fd=copy,
                trusted_keys=[private.public_key()],
                decrypt_with=decrypt_with,
                ciphertext_only=True,
            ) as check:
                problems = (
                    ciphertext_problems(check)
                    if check.encrypted and decrypt_with is None
                    else check.iter_chunk_problems()
                )
                for problem in problems:
                    raise problem
            _keep_owner_and_mode(out.fd, os.fstat(f._fd))
            out.commit()


def _encryption_block(f: CheckpointFile) -> bytes:
    """An encrypted file's encryption block as it lies in the file (kept as it is: the
    signature binds it, wrapped key and tags included), else b""."""
    enc = f.index.encryption
    if enc is None:
        return b""
    at = fmt.align_up(f.footer.index_offset + f.footer.index_length)
    n = layout_encryption.block_length(enc.nchunks, len(enc.wrapped))
    raw = pread_exact(f._fd, at, n)
    if len(raw) != n:
        raise OSError(errno.EIO, "the file ended while its encryption block was read", f.path)
    return bytes(raw)


@contextlib.contextmanager
def _open_to_sign(
    target: str, real: str, decrypt_with: Any = None
) -> Iterator[tuple[CheckpointDir, CheckpointFile]]:
    """The directory of the file `real` names and the file, opened beneath it (`target` names
    it in messages); an encrypted file's clear index is read without its key."""
    with (
        CheckpointDir.open(os.path.dirname(real)) as d,
        CheckpointFile(
            target,
            fd=d.open_file(os.path.basename(real)),
            within=d,
            decrypt_with=decrypt_with,
            ciphertext_only=True,
        ) as f,
    ):
        yield d, f


def _keep_owner_and_mode(fd: int, original: os.stat_result) -> None:
    """Give the new file the original's owner and group where this process may, and its
    permission bits (after the owner: a change of owner clears the set-id bits)."""
    try:
        os.fchown(fd, original.st_uid, original.st_gid)
    except PermissionError:
        try:
            os.fchown(fd, -1, original.st_gid)  # a member of the group may still keep that
        except PermissionError:
            pass
    os.fchmod(fd, stat.S_IMODE(original.st_mode))
