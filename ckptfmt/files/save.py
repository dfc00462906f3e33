"""save() and remove(): the writing side of the public API.

A save runs in two steps.  First the whole state is encoded into nodes and
storages (encode.encode), so an object that cannot be stored fails before any
byte is written.  Then the file is written to a temp sibling and committed
(engine/commit.py, spec section 10): blocking saves here, through chunkwrite.build_file;
non-blocking ones snapshot the state into staging memory and write it on a
background thread (background/copysave.py).

"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..background import inflight
from ..background.inflight import SaveHandle
from ..engine.chunkwrite import build_file
from ..engine.ckptdir import CheckpointDir
from ..engine.commit import AtomicFile
from ..engine.writeoptions import WriteOptions
from ..errors import CheckpointError, UnsupportedError
from ..fileio import is_url
from ..format import layout as fmt
from ..format.encode import Encoded, check_chunks, check_metadata, encode
from ..gcpause import pausing_in_main_thread
from ..storage.client import check_options
from . import encryption
from .signing import signer

if TYPE_CHECKING:
    from ..background import forksave


def check_save_args(compression: str | None, level: int | None, metadata: object) -> dict[str, str]:
    """Check save()'s compression, level and metadata; return the metadata as a plain dict."""
    if compression not in (None, "zstd"):
        raise ValueError(f"compression must be None or 'zstd', not {compression!r}")
    if level is not None:
        if compression is None:
            raise ValueError("level is only meaningful with compression='zstd'")
        if type(level) is not int or not -7 <= level <= 22:
            raise ValueError(f"zstd level must be an int from -7 to 22, not {level!r}")
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(
        type(k) is str and type(v) is str for k, v in metadata.items()
    ):
        raise TypeError("metadata must be a dict of str to str")
    check_metadata(metadata)  # a reader's limits: entries and value lengths
    return dict(metadata)


def check_snapshot(snapshot: object) -> None:
    """Check save()'s snapshot argument: how a non-blocking save takes its snapshot, "copy" or
    "fork" (UnsupportedError otherwise: a fork snapshot taken earlier comes to ckptfmt's own
    save path in FileSaveOptions.staged, never through this keyword)."""
    if not (isinstance(snapshot, str) and snapshot in ("copy", "fork")):
        raise UnsupportedError(f"snapshot must be 'copy' or 'fork', not {snapshot!r}")


def _chunk_size_override() -> int:
    text = os.environ.get("CKPTFMT_CHUNK_SIZE")
    return int(text) if text else fmt.DEFAULT_CHUNK_SIZE


def check_chunk_size(chunk_size: int | None) -> int:
    """The chunk size to use: `chunk_size`, else CKPTFMT_CHUNK_SIZE, else the default."""
    size = _chunk_size_override() if chunk_size is None else chunk_size
    if size & (size - 1) or not fmt.MIN_CHUNK_SIZE <= size <= fmt.MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be a power of two in [{fmt.MIN_CHUNK_SIZE}, {fmt.MAX_CHUNK_SIZE}]")
    return size


@dataclass(frozen=True)
class FileSaveOptions:
    """save()'s keywords, checked once (`save_options`): how the file's bytes are written
    (`write`, taken whole by the engine's writers), whether the call waits (`blocking`), how a
    non-blocking save takes its snapshot, and the object-store client's settings.
    `staged`: for ckptfmt's own callers only (`staged_by`), a fork snapshot taken before the
    save was planned, whose child writes the file (DCP's fork stager)."""

    write: WriteOptions
    blocking: bool = True
    snapshot: str = "copy"
    storage_options: dict[str, Any] = field(default_factory=dict)
    staged: forksave.ForkSnapshot | None = None


def staged_by(options: FileSaveOptions, staged: forksave.ForkSnapshot | None) -> FileSaveOptions:
    """`options` for a save whose chunks the child of `staged` writes (forksave.take_snapshot:
    non-blocking, by fork); `options` themselves when `staged` is None."""
    if staged is None:
        return options
    return replace(options, blocking=False, snapshot="fork", staged=staged)


def save_options(
    *,
    compression: str | None = None,
    level: int | None = None,
    metadata: dict[str, str] | None = None,
    blocking: bool = True,
    chunk_size: int | None = None,
    snapshot: str = "copy",
    sign_with: Any = None,
    storage_options: dict[str, Any] | None = None,
    encrypt_with: Any = None,
    encrypt_index: bool = True,
) -> FileSaveOptions:
    """Check save()'s keywords (the same names and defaults) and make them one value."""
    meta = check_save_args(compression, level, metadata)
    options = check_options(storage_options)
    seal = encryption.sealer(encrypt_with, encrypt_index)
    sign = signer(sign_with)
    check_snapshot(snapshot)
    size = check_chunk_size(chunk_size)
    write = WriteOptions(compression, level, size, meta, sign=sign, seal=seal)
    return FileSaveOptions(write, blocking, snapshot, options)


def save(
    state: object,
    path: str | os.PathLike[str],
    *,
    compression: str | None = None,
    level: int | None = None,
    metadata: dict[str, str] | None = None,
    blocking: bool = True,
    chunk_size: int | None = None,
    snapshot: str = "copy",
    sign_with: Any = None,
    storage_options: dict[str, Any] | None = None,
    encrypt_with: Any = None,
    encrypt_index: bool = True,
) -> SaveHandle:
    """Save `state` at `path` atomically; return its SaveHandle: done when blocking, after the
    snapshot with blocking=False.  ``handle.cost`` says what the save cost once it is durable
    (inflight.SaveCost), and each save logs it at INFO on the "ckptfmt" logger.

    snapshot (non-blocking saves only): "copy" copies the state into staging memory before
    returning; "fork" takes a copy-on-write snapshot by fork() and writes it from a child
    process (Linux, C engine, host memory not shared with other processes): the caller
    waits only for fork(), but each page it changes before the child is done is copied
    then, one page fault at a time.  The child encrypts and signs the chunks as asked; to
    an object-store URL it writes the whole file into memory, which is then uploaded.

    sign_with: an Ed25519 private key (a ``cryptography`` key object, a path, or the bytes
    of a PEM or OpenSSH private key): the file is signed (spec section 16), each chunk's
    SHA-256 taken by the engine as it is written, the signature over the prologue, the
    index and every chunk's digest.  Loads given ``trusted_keys`` accept only such files.

    `path` may be an object-store URL (``s3://bucket/key``), with the client's settings in
    `storage_options` (endpoint_url, region_name, aws_access_key_id, ...; boto3's AWS_*
    environment variables apply too): the file is streamed into a multipart upload as it is
    written, with bounded memory, and appears only when complete.

    encrypt_with: a key (32 bytes, a key file's path, or a key service's callable: see
    files/encryption.py): the file is encrypted (spec section 17) with AES-256-GCM under a
    fresh data key wrapped by it, each chunk by the engine as it is written (after
    compression), and the index too unless ``encrypt_index=False``.
    With sign_with too, the file is encrypted, then signed (spec 17.8): the signature binds
    the ciphertext, the encryption block and the wrapped key, and is checked without the key."""
    began = time.perf_counter()
    options = save_options(
        compression=compression,
        level=level,
        metadata=metadata,
        blocking=blocking,
        chunk_size=chunk_size,
        snapshot=snapshot,
        sign_with=sign_with,
        storage_options=storage_options,
        encrypt_with=encrypt_with,
        encrypt_index=encrypt_index,
    )
    return save_file(state, path, options, began=began)


def save_file(
    state: object,
    path: str | os.PathLike[str],
    options: FileSaveOptions,
    *,
    within: CheckpointDir | None = None,
    create_only: bool = False,
    began: float | None = None,
) -> SaveHandle:
    """save() for ckptfmt's own callers, its keywords already checked into `options`.

    `within`: the open directory that holds `path`; the file is created, renamed and made
    durable beneath that descriptor, never by resolving `path` again (the checkpoint manager
    saves into a step directory it holds open and locked).
    `create_only` (object stores): the object is created only if absent (If-None-Match),
    FileExistsError otherwise: a commit record never replaces another.
    `began`: when the save began (its cost is counted from there; default now)."""
    began = time.perf_counter() if began is None else began
    target = os.fspath(path)
    if is_url(target) and within is not None:
        raise ValueError("an object-store URL is not saved within a local directory")
    inflight.raise_unobserved()
    inflight.wait_for_path(target)
    handle = write_state(state, target, options, within=within, create_only=create_only)
    return handle._returning(began)


def done_handle(path: str, nbytes: int) -> SaveHandle:
    """The handle of a blocking save whose file of `nbytes` bytes is durable at `path` now."""
    handle = SaveHandle(path)
    handle._durable_now(nbytes)
    handle._observed = True  # its outcome is the caller's already
    handle._finish(None)
    return handle


@pausing_in_main_thread
def write_state(
    state: object,
    target: str,
    options: FileSaveOptions,
    *,
    within: CheckpointDir | None = None,
    create_only: bool = False,
) -> SaveHandle:
    """Encode and commit `state` at `target` as `options` say (checked already, earlier saves
    waited for), beneath the open directory `within` when given (AtomicFile); an object-store
    URL through an ObjectFile, created only if absent with `create_only`."""
    encoded = encode(state)  # fails on unsupported objects before any I/O
    write = options.write
    check_chunks(encoded, write.chunk_size)
    if is_url(target):
        return _write_object(encoded, target, options, create_only)
    if not options.blocking:
        from ..background import copysave  # staging memory is torch's: a blocking save needs none

        return copysave.save_async(
            encoded, target, write, snapshot=options.snapshot, staged=options.staged, within=within
        )
    try:
        with AtomicFile(target, within) as f:
            length = build_file(f.fd, encoded, write, path=target)
            f.commit()
        return done_handle(target, length)
    except CheckpointError:
        raise
    except OSError as e:
        if e.filename is None:
            raise type(e)(e.errno, e.strerror, target) from e
        raise


#: an object upload's writer hands over this many bytes at a time (what its spool holds
#: beyond the parts in flight)
OBJECT_BATCH_BYTES = 64 << 20


def object_capacity(encoded: Encoded, chunk_size: int) -> int:
    """An upper bound of the file's length: every chunk stored raw and padded, the largest
    index and signature or encryption block a file may have (the spool is sparse: bounds cost nothing)."""
    data = sum(
        fmt.align_up(p.nbytes) + fmt.ALIGNMENT * (p.nbytes // chunk_size + 1) for p in encoded.storages
    )
    blocks = fmt.MAX_SIGNATURE_BLOCK + fmt.MAX_ENCRYPTION_BLOCK
    tail = fmt.Limits.MAX_INDEX_BYTES + blocks + fmt.FOOTER_SIZE + 2 * fmt.ALIGNMENT
    return fmt.PROLOGUE_SIZE + data + tail


def _write_object(encoded: Encoded, url: str, options: FileSaveOptions, create_only: bool) -> SaveHandle:
    """Write `encoded` as the object at `url`: the engine writes into the upload's spool,
    which sends each part once complete; committed whole, or aborted."""
    from ..storage.upload import ObjectFile  # its store clients: a local save needs none

    write = options.write
    capacity = object_capacity(encoded, write.chunk_size)
    out = ObjectFile(url, options.storage_options, capacity, if_absent=create_only)
    if not options.blocking:
        from ..background import copysave

        return copysave.save_async(
            encoded, url, write, snapshot=options.snapshot, staged=options.staged, output=out
        )
    with out:
        length = build_file(
            out.fd, encoded, write, path=url, on_written=out.written, batch_bytes=OBJECT_BATCH_BYTES
        )
        out.commit()
    handle = done_handle(url, length)
    handle.version = out.etag
    return handle


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint once any save in flight on it has finished."""
    inflight.wait_for_path(path)
    os.unlink(path)
