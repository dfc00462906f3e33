"""The errors a chunk read raises, named for the chunk: its key, number and offset, and for a
chunk that lies in a referenced file, that file; the C engine's failure statuses turned into
the same errors (and messages) as the Python path's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from ..errors import CheckpointError, CorruptError, DecryptionError, IncompleteError, SignatureError
from ..format.index import Chunk, External
from . import native as _native
from . import zstdframes


class ChunksRead(Protocol):
    """What the errors name of the reader whose chunk failed (chunkread.ChunkReader)."""

    path: str
    chunks: list[Chunk]
    externals: list[External]

    def key_of(self, k: int) -> str: ...


SHA_MISMATCH = "chunk does not match the SHA-256 digest its signature covers (a byte changed)"
DIGEST_MISMATCH = "content digest mismatch (the decoded bytes are not the ones the index describes)"
TAG_MISMATCH = "chunk does not match its GCM tag (a byte of it or of its tag changed, or it was moved)"


def chunk_error(
    reader: ChunksRead, cls: type[CheckpointError], msg: str, k: int, key: str | None, offset: int | None
) -> CheckpointError:
    """An error about chunk k; for an external chunk the message names the file it lies in.
    `key` None: the key path of the chunk's storage, rendered now."""
    ch = reader.chunks[k]
    if key is None:
        key = reader.key_of(k)
    if ch.sha and cls in (CorruptError, IncompleteError):
        # a signature was demanded: any change to a signed chunk is a signature failure
        cls = SignatureError
    if ch.source < 0:
        return cls(msg, path=reader.path, key=key, chunk=k, offset=offset)
    ext = reader.externals[ch.source]
    return cls(
        f"external chunk {ch.number} at offset {offset} of {ext.name}: {msg}",
        path=reader.path,
        key=key,
        chunk=k,
    )


def native_error(reader: ChunksRead, status: tuple[int, int, int, int, int], ks: Sequence[int]) -> Exception:
    """The exception for a failed engine read of chunks `ks` (status as read_chunks gives it)."""
    code, err, pos, reason, value = status
    if code == _native.ERR_NOMEM or not 0 <= pos < len(ks):
        return MemoryError(f"{reader.path}: out of memory while reading chunks")
    k = ks[pos]
    key = reader.key_of(k)
    ch = reader.chunks[k]
    if code == _native.ERR_IO:
        msg = f"{os.strerror(err)} while reading chunk {k} at offset {value}"
        if ch.source < 0:
            return OSError(err, msg, reader.path)
        return OSError(
            err, f"{msg} (external chunk {ch.number} of {reader.path})", reader.externals[ch.source].name
        )
    if code == _native.ERR_SHORT:
        return chunk_error(
            reader,
            IncompleteError,
            "file ended while reading chunk (it shrank after it was opened)",
            k,
            key,
            value,
        )
    # the same messages and offsets as the reference path (read_chunk)
    off = ch.offset
    messages = {
        _native.WHY_CHECKSUM: ("checksum mismatch", off),
        _native.WHY_PADDING: ("padding after the chunk is not zero", ch.offset + ch.stored_len),
        _native.WHY_NO_SIZE: (zstdframes.NO_SIZE, off),
        _native.WHY_DECLARED: (zstdframes.declared_msg(value, ch.raw_len), off),
        _native.WHY_DECODED: (zstdframes.decoded_msg(value, ch.raw_len), off),
        _native.WHY_DIGEST: (DIGEST_MISMATCH, off),
        _native.WHY_FRAME: (zstdframes.NOT_A_FRAME, off),
        _native.WHY_WINDOW: (zstdframes.window_msg(value), off),
        _native.WHY_DICT: (zstdframes.dict_msg(value), off),
    }
    if reason == _native.WHY_SHA:
        return chunk_error(reader, SignatureError, SHA_MISMATCH, k, key, off)
    if code == _native.ERR_AUTH:
        return chunk_error(reader, DecryptionError, TAG_MISMATCH, k, key, off)
    if code == _native.ERR_CRYPTO:
        return chunk_error(
            reader, CheckpointError, "libcrypto failed, or the engine was built without it", k, key, off
        )
    msg, at = messages.get(reason, (zstdframes.UNDECODABLE, off))
    return chunk_error(reader, CorruptError, msg, k, key, at)
