"""The exceptions ckptfmt raises on purpose.

Every error a user can meet derives from :class:`CheckpointError`.  Errors about
the bytes of a file also derive from :class:`ValueError`; errors about objects
that cannot be stored derive from :class:`TypeError`.  Each carries the file
path and, where known, the key in the state, the chunk index and the byte
offset, and says all of it in its one-line message.
"""

from __future__ import annotations

import os


class CheckpointError(Exception):
    """Base class of every error ckptfmt raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        key: str | None = None,
        chunk: int | None = None,
        offset: int | None = None,
    ) -> None:
        self.reason = message
        self.path = os.fspath(path) if path is not None else None
        self.key = key
        self.chunk = chunk
        self.offset = offset
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.path is not None:
            where.append(self.path)
        if self.key is not None:
            where.append(self.key)
        if self.chunk is not None:
            where.append(f"chunk {self.chunk}")
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        return (": ".join(where) + ": " if where else "") + self.reason


class CorruptError(CheckpointError, ValueError):
    """The file's bytes are damaged or inconsistent (checksum, structure, sizes)."""


class IncompleteError(CheckpointError, ValueError):
    """The file ends early: a save that never finished, or a truncated copy."""


class UnsupportedError(CheckpointError, ValueError):
    """The file needs a format version, feature, codec or dtype this reader lacks,
    or is not a ckptfmt file at all."""


class LimitError(CheckpointError, ValueError):
    """A size, count or depth in the file exceeds the limits readers enforce."""


class UnsupportedObjectError(CheckpointError, TypeError):
    """An object in the state cannot be stored (raised before any byte is written)."""


class SnapshotError(CheckpointError, RuntimeError):
    """The child process writing a non-blocking save's copy-on-write snapshot ended
    before it finished (killed, or out of memory), or was not done by its deadline (then
    killed): nothing was committed."""


class DeadlineError(CheckpointError, TimeoutError):
    """A wait for work running in the background (a non-blocking save, the save in flight on
    a path, an earlier save's commit) was not over by its deadline: the timeout given, else
    twice ``ckptfmt.background.inflight.DEADLINE`` (an hour: the save's own waits end by it and
    fail the save first).  The work goes on; nothing of it was undone, and a later wait may
    find it done."""


class CheckpointWarning(UserWarning):
    """Something a user should know that does not stop the work: a skipped step directory,
    a resume from a run that differs from the current one, a failed rotation."""


class SignatureError(CheckpointError, ValueError):
    """A caller demanded a signature (``trusted_keys``) and the file does not prove it was
    signed by one of the trusted keys: it is unsigned, signed by another key, or any signed
    byte changed (its prologue, index, digest table, signature or a chunk)."""


class StorageError(CheckpointError, OSError):
    """An object store failed or refused a request (after bounded retries with backoff):
    connection lost, server errors, credentials refused, or an object that changed between
    two requests of one read.  The message names the URL and the operation."""


class ObjectExistsError(StorageError, FileExistsError):
    """An object written only if absent (a commit record, a run's state object) exists
    already: another writer created it first.  Nothing of it was replaced."""


class DecryptionError(CheckpointError, ValueError):
    """An encrypted file (spec section 17) cannot be decrypted: no key was given, the key is
    not the one it was encrypted with, or a byte that its GCM tags cover (the wrapped key, the
    index, a chunk, the encryption block's header) changed; or a key was given for a file that
    is not encrypted.  Messages never hold key material."""
