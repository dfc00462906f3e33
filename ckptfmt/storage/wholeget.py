"""A small object read whole by one GET into a spool: a commit record, where a HEAD and
ranged GETs would cost more requests than its bytes (download.RemoteObject reads large ones)."""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError, LimitError, StorageError
from . import client as s3
from .backends import store_for
from .bodies import body_deadline, read_body
from .download import REQUEST_TIMEOUT
from .spool import Spool
from .store import Store
from .urls import ObjectURL, parse_url


def fetch_whole(url: str, options: dict[str, Any], limit: int, what: str = "the object") -> Spool:
    """The object `url` read whole by one GET into a spool: for a small object read in full
    (a commit record), where a HEAD and ranged GETs would cost more requests than its bytes.
    LimitError (naming it `what`) before its body is read when it is over `limit` bytes;
    FileNotFoundError when absent; a dropped connection, an error the store may not make
    again or a body that misses its deadline (storage option request_timeout) is tried
    again, within one Budget (attempts and deadline)."""
    u = parse_url(url)
    store = store_for(u, options)
    timeout = float(options.get("request_timeout", REQUEST_TIMEOUT))
    budget = s3.Budget(options)
    return budget.run(
        url,
        "read",
        lambda: _fetch_whole_once(store, u, url, limit, what, body_deadline(timeout, budget)),
        again=_body_was_short,
    )


def _body_was_short(e: CheckpointError) -> bool:
    """Whether another GET may succeed where this one's answer was refused: only a body that
    ended early or missed its deadline (an object over the limit, or an answer without its
    size, would come again)."""
    return isinstance(e, StorageError) and getattr(e, "ckptfmt_short", False)


def _fetch_whole_once(
    store: Store, u: ObjectURL, url: str, limit: int, what: str, deadline: tuple[float, str]
) -> Spool:
    reply = store.get(u, None, None)
    body = reply.body
    timeout, option = deadline
    try:
        size = reply.length
        if type(size) is not int or size < 0:
            raise StorageError("the store's answer lacks the object's size", path=url)
        if size > limit:
            raise LimitError(f"{what} is {size} bytes, above the limit {limit}", path=url)
        spool = Spool(u.key.rsplit("/", 1)[-1], size)
        try:
            with spool.view(0, size) as view:
                got, cut = read_body(body, view, timeout) if size else (0, False)
            if got != size:
                why = s3.missed_deadline(timeout, option) if cut else "ended"
                short = StorageError(f"read: the body {why} after {got} of {size} bytes", path=url)
                short.ckptfmt_short = True  # type: ignore[attr-defined]
                raise short
        except BaseException:
            spool.close()
            raise
        return spool
    finally:
        body.close()
