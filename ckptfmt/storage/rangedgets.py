"""Ranged GETs of one version of an object: each answer's head checked (the range asked for,
of the size and version first seen), its body read within the request's deadline, a body cut
or dropped resumed from the byte it reached, within one Budget (attempts and deadline).

storage/download.py's RemoteObject decides what is asked for and where the bytes go (the
spool, a load's tensors); this module makes the requests and checks what comes back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import CheckpointError, StorageError
from . import client as s3
from .bodies import body_deadline, read_body
from .store import Store
from .urls import ObjectURL

#: views that hold a request's bytes from a given one on, in order, given how many of its
#: bytes came already
Where = Callable[[int], Iterable[memoryview]]


def tag_value(etag: object) -> object:
    """An ETag as compared between answers: a weak marker and the quotes, which a proxy may
    add or drop, set aside."""
    if not isinstance(etag, str):
        return etag
    return etag.removeprefix("W/").strip('"')


class RangedGets:
    """The GETs of byte ranges of the object `url` of `size` bytes at version `etag`, named
    `path` in errors; each answer's body within `timeout` seconds (request_timeout)."""

    def __init__(self, store: Store, url: ObjectURL, path: str, size: int, etag: str, timeout: float) -> None:
        self.store = store
        self.url = url
        self.path = path
        self.size = size
        self.etag = etag
        self.timeout = timeout

    def get(
        self, lo: int, hi: int, where: Where, budget: s3.Budget, failed: Callable[[], None] | None = None
    ) -> None:
        """Fetch [lo, hi) into the views `where` gives once an answer's head is in, resuming
        after a dropped connection or a body cut at its deadline from the byte it reached,
        within `budget` (attempts and deadline); `failed` called as each failed attempt ends,
        before the next one's backoff."""
        got = 0

        def attempt() -> None:
            self._get_once(lo + got, hi, functools.partial(where, got), budget)

        def attempt_failed(e: BaseException) -> None:
            nonlocal got
            got += getattr(e, "ckptfmt_got", 0)
            if failed is not None:
                failed()

        budget.run(self.path, f"read bytes {lo}-{hi - 1}", attempt, again=_not_final, failed=attempt_failed)

    def _get_once(
        self, lo: int, hi: int, where: Callable[[], Iterable[memoryview]], budget: s3.Budget
    ) -> int:
        reply = self.open(lo, hi)  # the budget carried by Budget.run
        try:
            views = where()
        except BaseException:
            reply.body.close()
            raise
        return self.read(reply.body, lo, hi, views, budget)

    def open(self, lo: int, hi: int) -> Any:
        """The store's answer to a GET of [lo, hi), its head checked (range, version); its body
        unread.  The caller carries the operation's budget (client.carrying)."""
        what = f"read bytes {lo}-{hi - 1}"
        reply = self.store.get(self.url, (lo, hi), self.etag)
        expected = f"bytes {lo}-{hi - 1}/{self.size}"
        if reply.content_range != expected or reply.length != hi - lo:
            reply.body.close()
            raise StorageError(
                f"{what}: the store answered {reply.content_range!r} for {expected!r}", path=self.path
            )
        if reply.version is None and self.store.pin_is_advisory:
            # If-Match was the only pin, and nothing shows the store heeded it: a store that
            # ignores it and names no ETag could serve cells of a newer object of the same size
            reply.body.close()
            unpinned = StorageError(
                f"{what}: the store's answer names no {self.store.version_name}: which version of "
                "the object it served cannot be told",
                path=self.path,
            )
            unpinned.ckptfmt_final = True  # type: ignore[attr-defined]  # a store that names none never will
            raise unpinned
        served = self.etag if reply.version is None else reply.version
        if tag_value(served) != tag_value(self.etag):
            # a store that ignores If-Match (some S3-compatible ones do) serves the new version
            reply.body.close()
            raise StorageError(f"{what}: the object changed while it was being read", path=self.path)
        return reply

    def read(
        self, body: Any, lo: int, hi: int, views: Iterable[memoryview], budget: s3.Budget, close: bool = True
    ) -> int:
        """Read bytes [lo, hi) of an answer's `body` into `views` within the request's deadline
        (close: the body closed after); a short or cut body is a StorageError carrying the bytes
        that came (ckptfmt_got)."""
        timeout, option = body_deadline(self.timeout, budget)
        got, cut = read_body(body, views, timeout, close)
        if got != hi - lo:
            why = (
                f"the answer {s3.missed_deadline(timeout, option, f'; {got} of its bytes came')}"
                if cut
                else f"the body ended after {got} bytes"
            )
            short = StorageError(f"read bytes {lo}-{hi - 1}: {why}", path=self.path)
            short.ckptfmt_got = got  # type: ignore[attr-defined]
            raise short
        return got


def _not_final(e: CheckpointError) -> bool:
    """Whether another GET may succeed where this one's answer was refused here (a range, a
    version or a body not as asked for): all but those marked final (a store that names no
    version never will)."""
    return not getattr(e, "ckptfmt_final", False)
