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
from typing import Any

from ..background import copysave, inflight
from ..background.inflight import SaveHandle
from ..engine.chunkwrite import Dedup, Signer, build_file
from ..engine.ckptdir import CheckpointDir
from ..engine.commit import AtomicFile
from ..errors import CheckpointError
from ..fileio import is_url
from ..format import layout as fmt
from ..format.encode import Encoded, check_chunks, check_metadata, encode
from ..format.encryption import Sealer
from ..gcpause import pausing_in_main_thread
from ..storage.client import check_options
from ..storage.upload import ObjectFile
from . import encryption
from .signing import signer


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
    """Check save()'s snapshot argument: how a non-blocking save takes its snapshot."""
    if snapshot not in ("copy", "fork"):
        raise ValueError(f"snapshot must be 'copy' or 'fork', not {snapshot!r}")


def _chunk_size_override() -> int:
    text = os.environ.get("CKPTFMT_CHUNK_SIZE")
    return int(text) if text else fmt.DEFAULT_CHUNK_SIZE


def check_chunk_size(chunk_size: int | None) -> int:
    """The chunk size to use: `chunk_size`, else CKPTFMT_CHUNK_SIZE, else the default."""
    size = _chunk_size_override() if chunk_size is None else chunk_size
    if size & (size - 1) or not fmt.MIN_CHUNK_SIZE <= size <= fmt.MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be a power of two in [{fmt.MIN_CHUNK_SIZE}, {fmt.MAX_CHUNK_SIZE}]")
    return size


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
    _within: CheckpointDir | None = None,
    _create_only: bool = False,
) -> SaveHandle:
    """Save `state` at `path` atomically; return its SaveHandle: done when blocking, after the
    snapshot with blocking=False.  ``handle.cost`` says what the save cost once it is durable
    (inflight.SaveCost), and each save logs it at INFO on the "ckptfmt" logger.

    snapshot (non-blocking saves only): "copy" copies the state into staging memory before
    returning; "fork" takes a copy-on-write snapshot by fork() and writes it from a child
    process (Linux, C engine, host memory not shared with other processes): the caller
    waits only for fork(), but each page it changes before the child is done is copied
    then, one page fault at a time.

    `_within` (ckptfmt's own callers): the open directory that holds `path`; the file is
    created, renamed and made durable beneath that descriptor, never by resolving `path`
    again (the checkpoint manager saves into a step directory it holds open and locked).

    sign_with: an Ed25519 private key (a ``cryptography`` key object, a path, or the bytes
    of a PEM or OpenSSH private key): the file is signed (spec section 16), each chunk's
    SHA-256 taken by the engine as it is written, the signature over the prologue, the
    index and every chunk's digest.  Loads given ``trusted_keys`` accept only such files.

    `_create_only` (ckptfmt's own callers, object stores): the object is created only if absent
    (If-None-Match), FileExistsError otherwise: a commit record never replaces another.

    `path` may be an object-store URL (``s3://bucket/key``), with the client's settings in
    `storage_options` (endpoint_url, region_name, aws_access_key_id, ...; boto3's AWS_*
    environment variables apply too): the file is streamed into a multipart upload as it is
    written, with bounded memory, and appears only when complete.

    encrypt_with: a key (32 bytes, a key file's path, or a key service's callable: see
    files/encryption.py): the file is encrypted (spec section 17) with AES-256-GCM under a
    fresh data key wrapped by it, each chunk by the engine as it is written (after
    compression), and the index too unless ``encrypt_index=False``; with snapshot='fork' the
    forked child encrypts the chunks.
    With sign_with too, the file is encrypted, then signed (spec 17.8): the signature binds
    the ciphertext, the encryption block and the wrapped key, and is checked without the key."""
    began = time.perf_counter()
    meta = check_save_args(compression, level, metadata)
    options = check_options(storage_options)
    seal = encryption.sealer(encrypt_with, encrypt_index)
    sign = signer(sign_with)
    check_snapshot(snapshot)
    target = os.fspath(path)
    if is_url(target) and _within is not None:
        raise ValueError("an object-store URL is not saved within a local directory")
    if is_url(target) and not blocking and snapshot == "fork":
        raise ValueError(f"{target}: snapshot='fork' writes local files only; use snapshot='copy'")
    size = check_chunk_size(chunk_size)
    inflight.raise_unobserved()
    inflight.wait_for_path(target)
    handle = write_state(
        state,
        target,
        compression=compression,
        level=level,
        metadata=meta,
        chunk_size=size,
        blocking=blocking,
        snapshot=snapshot,
        within=_within,
        sign=sign,
        storage_options=options,
        create_only=_create_only,
        seal=seal,
    )
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
    *,
    compression: str | None,
    level: int | None,
    metadata: dict[str, str],
    chunk_size: int,
    blocking: bool,
    dedup: Dedup | None = None,
    snapshot: str = "copy",
    within: CheckpointDir | None = None,
    sign: Signer | None = None,
    storage_options: dict[str, Any] | None = None,
    create_only: bool = False,
    seal: Sealer | None = None,
) -> SaveHandle:
    """Encode and commit `state` at `target` (arguments already checked, earlier saves waited
    for), beneath the open directory `within` when given (AtomicFile); an object-store URL
    through an ObjectFile."""
    encoded = encode(state)  # fails on unsupported objects before any I/O
    check_chunks(encoded, chunk_size)
    if is_url(target):
        return _write_object(
            encoded,
            target,
            storage_options or {},
            compression=compression,
            level=level,
            metadata=metadata,
            chunk_size=chunk_size,
            blocking=blocking,
            dedup=dedup,
            sign=sign,
            create_only=create_only,
            seal=seal,
        )
    if not blocking:
        return copysave.save_async(
            encoded,
            target,
            compression=compression,
            level=level,
            metadata=metadata,
            chunk_size=chunk_size,
            dedup=dedup,
            snapshot=snapshot,
            within=within,
            sign=sign,
            seal=seal,
        )
    try:
        with AtomicFile(target, within) as f:
            length = build_file(
                f.fd,
                encoded,
                compression=compression,
                level=level,
                metadata=metadata,
                chunk_size=chunk_size,
                path=target,
                dedup=dedup,
                sign=sign,
                seal=seal,
            )
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


def _write_object(
    encoded: Encoded,
    url: str,
    options: dict[str, Any],
    *,
    compression: str | None,
    level: int | None,
    metadata: dict[str, str],
    chunk_size: int,
    blocking: bool,
    dedup: Dedup | None,
    sign: Signer | None,
    create_only: bool = False,
    seal: Sealer | None = None,
) -> SaveHandle:
    """Write `encoded` as the object at `url`: the engine writes into the upload's spool,
    which sends each part once complete; committed whole, or aborted."""
    out = ObjectFile(url, options, object_capacity(encoded, chunk_size), if_absent=create_only)
    if not blocking:
        return copysave.save_async(
            encoded,
            url,
            compression=compression,
            level=level,
            metadata=metadata,
            chunk_size=chunk_size,
            dedup=dedup,
            sign=sign,
            seal=seal,
            output=out,
        )
    with out:
        length = build_file(
            out.fd,
            encoded,
            compression=compression,
            level=level,
            metadata=metadata,
            chunk_size=chunk_size,
            path=url,
            dedup=dedup,
            sign=sign,
            seal=seal,
            on_written=out.written,
            batch_bytes=OBJECT_BATCH_BYTES,
        )
        out.commit()
    handle = done_handle(url, length)
    handle.version = out.etag
    return handle


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint once any save in flight on it has finished."""
    inflight.wait_for_path(path)
    os.unlink(path)
