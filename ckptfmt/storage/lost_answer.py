"""A create-only write whose answer was lost, retried and refused: by the object its own first
attempt made, or by another writer's.

A create-only request (If-None-Match: *, ifGenerationMatch=0, Azure's Put Block List with
If-None-Match) whose answer never came (a reset connection, a timeout, a 5xx) may have been
carried out all the same; the retry then finds the object that attempt made and is refused as
though another writer had made it.  S3's CompleteMultipartUpload retried after it succeeded
may instead answer that the upload is gone.  The writer tells its own object from another's
by what it still holds of it: its length, and its bytes from the start (all of an object
written by one request; part 1 of an upload in parts, which begins with a ckptfmt file's
prologue and the file id drawn for that file alone), read back pinned to the version seen.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError, StorageError
from . import client as s3
from .bodies import body_deadline, read_body
from .download import REQUEST_TIMEOUT
from .store import Store
from .urls import ObjectURL


def outcome_unknown(e: BaseException) -> bool:
    """Whether a failed attempt may have been carried out by the store: no answer at all (a
    dropped connection, a timeout, an answer cut off) or a 5xx, which a store may send after
    the write is done.  A refusal (4xx) is definite."""
    if isinstance(e, CheckpointError):
        return False
    code, status = s3.error_code(e)
    if code or status:
        return status >= 500 or status == 408 or code == "RequestTimeout"
    return not isinstance(e, ValueError)


def refused_as_made(e: BaseException, *, completing: bool) -> bool:
    """Whether the error ending a create-only write's retries is what the object its own
    earlier attempt made would answer: the condition refused, or (`completing`, S3's
    CompleteMultipartUpload) the upload gone because it was completed."""
    if completing and isinstance(e, FileNotFoundError):
        return True
    return isinstance(e, StorageError) and e.__cause__ is not None and s3.is_precondition_failed(e.__cause__)


def made_by(
    store: Store, url: ObjectURL, options: dict[str, Any], length: int, held: memoryview
) -> str | None:
    """The version of the object at `url` where it is `length` bytes long and begins with the
    bytes `held`, read back pinned to the version its HEAD names; None where it is another
    object (or none, or it changes meanwhile).  A failing store is a StorageError."""
    path = str(url)
    try:
        size, version = s3.request(path, "read back the object written", lambda: store.head(url), options)
    except FileNotFoundError:
        return None
    if size != length or not isinstance(version, str) or not version:
        return None
    if not len(held):
        return version
    budget = s3.Budget(options)
    timeout = float(options.get("request_timeout", REQUEST_TIMEOUT))
    try:
        same = budget.run(
            path,
            "read back the object written",
            lambda: _begins_with(store, url, version, held, body_deadline(timeout, budget)),
            again=lambda e: getattr(e, "ckptfmt_short", False),
        )
    except FileNotFoundError:
        return None
    except StorageError as e:
        if e.__cause__ is not None and s3.is_precondition_failed(e.__cause__):
            return None  # replaced since its HEAD: not the object this write made
        raise
    return version if same else None


def _begins_with(
    store: Store, url: ObjectURL, version: str, held: memoryview, deadline: tuple[float, str]
) -> bool:
    """One ranged GET of the object's first len(held) bytes, that version only: whether they
    are `held`."""
    reply = store.get(url, (0, len(held)), version)
    body = reply.body
    try:
        if store.pin_is_advisory and reply.version is not None and reply.version != version:
            return False  # the store served another version than the one asked for
        got_bytes = bytearray(len(held))
        timeout, option = deadline
        got, cut = read_body(body, memoryview(got_bytes), timeout)
        if got != len(held):
            why = s3.missed_deadline(timeout, option) if cut else "ended"
            short = StorageError(f"read back: the body {why} after {got} of {len(held)} bytes", path=str(url))
            short.ckptfmt_short = True  # type: ignore[attr-defined]
            raise short
        return got_bytes == held
    finally:
        body.close()
