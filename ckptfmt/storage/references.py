"""The objects an incremental checkpoint on a store refers to (spec 12.3 on a store, 13.7).

A reference path (``NAME``, ``DIR/NAME``, ``../NAME`` or ``../DIR/NAME``, checked by the
index parser) is resolved against the referencing object's prefix as a path is against a
directory, so it reaches at most the prefix above: never another bucket, never a key the
grammar does not allow.  Each referenced object is read through a RemoteObject whose ranges
are pinned to the ETag it had when opened; the chunk reader asks for that object's fetcher
to bring chunk bytes in before it reads them.  Of its own structure only what the chunk
reader checks is fetched (its prologue, footer and tag table): never its index, which the
referencing file's index stands in for, so a referenced object's claims about its index
cost nothing to read.  The version an object is first opened at is the one it is read at
for as long as the referencing file is open (an object replaced meanwhile is refused, not
mixed in), and callers may ask for it (`version_of`) without a request of their own.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any

from ..errors import CorruptError
from . import client
from .download import RemoteObject
from .urls import ObjectURL, parse_url

#: storage operations an object's opening (open_ref) makes one after another, each within the
#: storage deadline: its look-up, its ends, its tag table, and an ask again for bytes whose
#: request was never sent (RemoteObject.wait)
OPENING_OPERATIONS = 4


def resolve(prefix: ObjectURL, rel: str) -> ObjectURL:
    """The object `rel` names from the prefix `prefix` (a reference path, already checked
    against the grammar): the same bucket, and a key without empty, '.' or '..' segments."""
    key = posixpath.normpath(posixpath.join(prefix.key.strip("/"), rel))
    if key in (".", "..") or key.startswith(("../", "/")):
        raise CorruptError(f"the reference {rel!r} leads above the bucket", path=str(prefix))
    return prefix.with_key(key)


class ObjectReferences:
    """The objects referenced from one object-store prefix, opened on demand; owns them all."""

    def __init__(self, prefix: str, options: dict[str, Any], etags: dict[str, str] | None = None) -> None:
        """`etags`: the versions some references must be read at (by reference path): those
        a caller checked before (a signed record's digests)."""
        self.path = prefix
        self.url = parse_url(prefix, need_key=False)
        self.options = options
        self.etags = etags or {}
        #: the version each object was first opened at (by reference path): opened again
        #: (closed to keep few open), it is read at that version or refused
        self._versions: dict[str, str] = {}
        self._objects: dict[int, RemoteObject] = {}  # by the descriptor handed out

    def open_ref(self, rel: str) -> int:
        """A descriptor of the spool of the object `rel` names (FileNotFoundError when there
        is none); its bytes come in through fetcher_of(descriptor)."""
        remote = RemoteObject(
            str(resolve(self.url, rel)),
            self.options,
            etag=self.etags.get(rel) or self._versions.get(rel),
            fetch_index=False,
        )
        try:
            remote.fetch_structure(tag_table=True)
            fd = remote.dup_fd()
        except BaseException:
            remote.close()
            raise
        self._versions.setdefault(rel, remote.etag)
        self._objects[fd] = remote
        return fd

    def version_of(self, rel: str) -> str | None:
        """The version the object `rel` names is read at, once it was opened (else None)."""
        return self._versions.get(rel)

    def fetcher_of(self, fd: int) -> RemoteObject | None:
        return self._objects.get(fd)

    def opening_time(self) -> float:
        """Seconds an open_ref may take: its storage operations, one after another, each
        within the storage deadline (OPENING_OPERATIONS)."""
        return OPENING_OPERATIONS * client.deadline(self.options)

    def release(self, fd: int) -> None:
        """Close descriptor `fd` open_ref gave and the object it reads (its spool)."""
        remote = self._objects.pop(fd, None)
        os.close(fd)
        if remote is not None:
            remote.close()

    def close(self) -> None:
        while self._objects:
            self._objects.popitem()[1].close()
