"""One interface for every object store: the few requests ckptfmt makes of one (``Store``),
and the answers they give, in one shape whatever the store.

What is written once, above this interface, for every store: the retry loop, deadline and
error translation (``client``), the checks of everything an answer says (``download``,
``listing``: hostile stores), the spool, the grid of ranged reads, the order of parts.
What each store implements below it (``s3``, ``gcs``): its requests, each one attempt, its
errors raised as they come (``client.request`` retries and translates them), and its own
mechanism for each guarantee:

=====================  ==============================  =========================================
guarantee              S3 (boto3)                      GCS (JSON API)
=====================  ==============================  =========================================
version of an object   ETag                            generation
read pinned to it      ``If-Match``                    ``generation=``
create only if absent  ``If-None-Match: *``            ``ifGenerationMatch=0``
whole or nothing       multipart upload, completed     parts as objects, composed, then deleted
delete one version     ``If-Match``                    ``ifGenerationMatch``
which write made it    ``x-amz-meta-ckptfmtwrite``     ``metadata.ckptfmtwrite``
=====================  ==============================  =========================================

``backends.store_for`` gives the store of a URL's scheme; a store's module imports its
client package (boto3, requests) only when a URL of its scheme is used.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from .urls import ObjectURL

#: the name of the user metadata a create-only write stores with its object: a random token
#: drawn for that write alone, by which a write whose answer was lost tells the object its own
#: attempt made from another writer's (lost_answer.made_by).  Letters only: Azure's metadata
#: names must be identifiers, and some proxies drop headers holding underscores.
WRITE_TOKEN = "ckptfmtwrite"


class Head(NamedTuple):
    """What a HEAD of an object answers, each value as the store gave it (checked by the
    reader): its size, its version, and the write token stored with it (WRITE_TOKEN's
    metadata; None where it has none)."""

    size: object
    version: object
    token: object


@dataclass(frozen=True)
class Reply:
    """The answer to a GET, its body not yet read: what the store says it holds (each value
    as the store gave it, checked by the reader) and the body (``readinto``, ``close``;
    ``_raw_stream`` the urllib3 answer a watchdog may cut)."""

    length: object
    content_range: object
    version: object
    body: Any


@dataclass(frozen=True)
class Entry:
    """One object a listing names, its values as the store gave them (checked by the lister)."""

    key: object
    size: object
    modified: datetime.datetime | None
    version: object


@dataclass(frozen=True)
class Page:
    """One page of a listing: its objects, its "directories" (common prefixes), whether
    more follow, with the token that asks for them, and the answer's Date header as the store
    sent it (its clock when it answered; checked by the lister)."""

    entries: list[Entry]
    prefixes: list[object]
    truncated: bool
    token: object = None
    date: object = None


@dataclass(frozen=True)
class Upload:
    """An upload begun and not completed (a crashed saver's parts)."""

    key: object
    upload_id: object
    initiated: datetime.datetime | None


@dataclass(frozen=True)
class UploadPage:
    uploads: list[Upload]
    truncated: bool
    #: what asks for the next page (store-specific, compared to catch a store repeating it)
    marker: dict[str, str] = field(default_factory=dict)


class Store(Protocol):
    """The requests ckptfmt makes of an object store, each one attempt (client.request
    retries): failures are raised as the store's client raises them, a refused condition as
    one that client.is_precondition_failed recognises."""

    scheme: str
    #: what the store calls the value that names one version of an object, in messages
    version_name: str
    #: whether `get` pins the version by a condition the store may ignore (If-Match: some
    #: S3-compatible stores and proxies do) rather than by naming it in the request (GCS's
    #: generation): then only an answer that names the version it served proves which it was
    pin_is_advisory: bool
    #: whether a completed upload in parts may leave its parts behind (GCS's part objects,
    #: deleted after the compose that made the object): then an upload whose completion's
    #: answer was lost is aborted once its object is known to be there
    parts_outlive_completion: bool

    def head(self, url: ObjectURL) -> Head:
        """The object's size, version and write token, as the store gives them."""

    def get(self, url: ObjectURL, byte_range: tuple[int, int] | None, version: str | None) -> Reply:
        """Begin reading the object (bytes [lo, hi) of it, or all of it), of that version only
        (None: whichever is there)."""

    def put(
        self, url: ObjectURL, body: memoryview, *, if_absent: bool, token: str | None = None
    ) -> str | None:
        """Write the object whole in one request, only if absent where asked, `token` stored
        with it as its WRITE_TOKEN metadata where given; its version."""

    def start_upload(self, url: ObjectURL, token: str | None = None) -> str:
        """Begin an upload in parts that appears whole, or not at all, once completed (with
        `token` as its WRITE_TOKEN metadata where given: here, or by complete_upload)."""

    def put_part(self, url: ObjectURL, upload_id: str, number: int, body: memoryview) -> str:
        """Store part `number` (from 1; any order) of the upload; what completing it names."""

    def complete_upload(
        self,
        url: ObjectURL,
        upload_id: str,
        parts: dict[int, str],
        *,
        if_absent: bool,
        token: str | None = None,
    ) -> str | None:
        """Make the object of `parts` (by number) appear, only if absent where asked, with
        `token` (the one start_upload was given) as its WRITE_TOKEN metadata; its version."""

    def abort_upload(self, url: ObjectURL, upload_id: str) -> None:
        """Give up an upload: its parts are deleted."""

    def delete(self, url: ObjectURL, version: str | None) -> None:
        """Delete the object (of that version only, where given); absent is no error."""

    def delete_many(self, url: ObjectURL, keys: list[str]) -> None:
        """Delete these objects of `url`'s bucket (at most 1000); absent ones are no error."""

    def list_page(self, url: ObjectURL, prefix: str, delimiter: str | None, token: object) -> Page:
        """One page of the objects beneath `prefix` (`token`: the previous page's, or None)."""

    def list_uploads(self, url: ObjectURL, prefix: str, marker: dict[str, str]) -> UploadPage:
        """One page of the uploads begun beneath `prefix` and not completed."""


class ViewFile:
    """A read-only, seekable file over bytes in a spool (each attempt of a request re-reads it
    from its start), so an upload is sent from the spool's pages without a copy into a Python
    bytes object."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        out = bytes(self._view[self._pos : end])
        self._pos = end
        return out

    def readinto(self, buf: Any) -> int:
        target = memoryview(buf).cast("B")
        n = min(len(target), len(self._view) - self._pos)
        target[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._view))[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)
