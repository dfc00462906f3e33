"""An answer's body read into memory of the reader's (the spool, a tensor), within a deadline."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import client as s3


def body_deadline(request_timeout: float, budget: s3.Budget) -> tuple[float, str]:
    """How long an answer's body may take, and the storage option that says so: the request's
    own deadline, or what remains of the operation's where that is sooner."""
    remaining = budget.remaining()
    if request_timeout <= remaining:
        return request_timeout, "request_timeout"
    return max(remaining, 0.001), "deadline"


def read_body(
    body: Any, views: memoryview | Iterable[memoryview], timeout: float, close: bool = True
) -> tuple[int, bool]:
    """Read an answer's `body` into `views` (one, or several filled in order) until they are
    full or the body ends, within `timeout` seconds: how many bytes came, and whether the
    deadline cut the connection.  readinto
    blocks until its buffer is full, and a body that trickles in (a byte every few seconds)
    never trips the client's read timeout, so a watchdog shuts the connection down at the
    deadline and the read returns (or fails: either way, what came and True).  Another
    exception raised meanwhile carries ckptfmt_got, the bytes that came.  close=False: the
    body is left open once `views` are full (more of it read later), closed otherwise."""
    got = 0
    full = False
    raw = getattr(body, "_raw_stream", body)
    with s3.Watchdog(raw, timeout) as dog:
        try:
            for view in [views] if isinstance(views, memoryview) else views:
                filled = 0
                while filled < len(view):
                    n = body.readinto(view[filled:])
                    if not n:
                        break
                    filled += n
                    got += n
                if filled < len(view):
                    break
            else:
                full = True
        except Exception as e:
            if not dog.fired.is_set():
                e.ckptfmt_got = got  # type: ignore[attr-defined]
                raise
        finally:
            if close or not full:
                body.close()
    return got, dog.fired.is_set()
