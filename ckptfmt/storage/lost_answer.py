"""A create-only write whose answer was lost, retried and refused: by the object its own first
attempt made, or by another writer's.

A create-only request (If-None-Match: *, ifGenerationMatch=0, Azure's Put Block List with
If-None-Match) whose answer never came (a reset connection, a timeout, a 5xx) may have been
carried out all the same; the retry then finds the object that attempt made and is refused as
though another writer had made it.  S3's CompleteMultipartUpload retried after it succeeded
may instead answer that the upload is gone.  The writer tells its own object from another's
by the token it drew for this write alone and stored with the object as user metadata
(store.WRITE_TOKEN: S3's Metadata, GCS's metadata, Azure's x-ms-meta-*), read back by a HEAD
within what is left of the write's deadline; then by the object's length and its bytes from
the start (all of an object written by one request; part 1 of an upload in parts), read back
pinned to the version that HEAD names.  The bytes alone prove nothing: the file id in the
prologue is pinned where files are made reproducible (CKPTFMT_FILE_ID), and two writers of one
step may write the same first part and length.  An object with no token, or another, is not
this write's, whatever its bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CheckpointError, StorageError
from . import client as s3
from .bodies import body_deadline, read_body
from .download import REQUEST_TIMEOUT
from .rangedgets import tag_value
from .store import Store
from .urls import ObjectURL

READ_BACK = "read back the object written"

T = TypeVar("T")


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


#: the attribute an error ending a write's retries carries its earlier failed attempts in
_ATTEMPTS = "_ckptfmt_failed_attempts"


def note_attempts(e: BaseException, attempts: list[BaseException]) -> None:
    """Keep on `e`, the error ending a write's retries, how each earlier attempt failed: one
    that got no answer may have been carried out though the last was refused."""
    setattr(e, _ATTEMPTS, tuple(attempts))


def failed_attempts(e: BaseException) -> tuple[BaseException, ...]:
    """The failed attempts note_attempts kept on `e` (none where it kept nothing)."""
    got = getattr(e, _ATTEMPTS, ())
    return got if isinstance(got, tuple) else ()


def refused_as_made(e: BaseException, *, completing: bool) -> bool:
    """Whether the error ending a create-only write's retries is what the object its own
    earlier attempt made would answer: the condition refused, or (`completing`, S3's
    CompleteMultipartUpload) the upload gone because it was completed."""
    if completing and isinstance(e, FileNotFoundError):
        return True
    return isinstance(e, StorageError) and e.__cause__ is not None and s3.is_precondition_failed(e.__cause__)


def made_by(
    store: Store,
    url: ObjectURL,
    options: dict[str, Any],
    write: s3.Budget,
    operation: str,
    length: int,
    held: memoryview,
    token: str,
) -> str | None:
    """The version of the object at `url` where it carries this write's `token`, is `length`
    bytes long and begins with the bytes `held`, read back pinned to the version its HEAD
    names, within what is left of the write's Budget `write`; None where it is another object
    (or none, or it changes meanwhile).  A read-back that fails, or finds no time left, is a
    StorageError saying the write's outcome is unknown."""
    try:
        head = _read_back(url, options, write, operation, lambda budget: store.head(url))
    except FileNotFoundError:
        return None
    size, version, found = head
    if found != token or size != length or not isinstance(version, str) or not version:
        return None
    if not len(held):
        return version
    timeout = float(options.get("request_timeout", REQUEST_TIMEOUT))
    try:
        same = _read_back(
            url,
            options,
            write,
            operation,
            lambda budget: _begins_with(store, url, version, held, body_deadline(timeout, budget)),
            again=lambda e: getattr(e, "ckptfmt_short", False),
        )
    except FileNotFoundError:
        return None
    except StorageError as e:
        if e.__cause__ is not None and s3.is_precondition_failed(e.__cause__):
            return None  # replaced since its HEAD: not the object this write made
        raise
    return version if same else None


def _read_back(
    url: ObjectURL,
    options: dict[str, Any],
    write: s3.Budget,
    operation: str,
    attempt: Callable[[s3.Budget], T],
    again: Callable[[CheckpointError], bool] | None = None,
) -> T:
    """`attempt(budget)`, a request of the read-back, retried within what is left of the write's
    deadline (not a deadline of its own on top of it); its failure a StorageError saying the
    write's outcome is unknown, naming the write's deadline where that ran out."""
    path = str(url)
    if write.remaining() <= 0:
        raise _unknown(url, operation, write, None)
    budget = _rest_of(write, options)
    try:
        return budget.run(path, READ_BACK, lambda: attempt(budget), again=again)
    except FileNotFoundError:
        raise
    except CheckpointError as e:  # a store's failure, or an answer refused (too large, cut off)
        if e.__cause__ is not None and s3.is_precondition_failed(e.__cause__):
            raise  # the object changed: made_by tells that apart
        raise _unknown(url, operation, write, e) from e


def _rest_of(write: s3.Budget, options: dict[str, Any]) -> s3.Budget:
    """A Budget of fresh attempts ending with the write's deadline: its errors say what was
    tried against the deadline the user set, not against a remainder of it."""
    budget = s3.Budget(options)
    budget.started, budget.deadline = write.started, write.deadline
    return budget


def _unknown(url: ObjectURL, operation: str, write: s3.Budget, cause: CheckpointError | None) -> StorageError:
    """The error of a write whose outcome cannot be told: no answer came, and the object there
    could not be read back (the write's deadline spent, or the read-back failed)."""
    if cause is None or write.remaining() <= 0:  # the request's own failure is the cause
        why = f"the write's deadline of {write.deadline:g} s (storage option deadline) ran out"
    else:
        why = cause.reason
    return StorageError(
        f"{operation}: no answer came for the write of {url} and the object there could not be "
        f"read back to tell whether it is this write's: {why}",
        path=str(url),
    )


def _begins_with(
    store: Store, url: ObjectURL, version: str, held: memoryview, deadline: tuple[float, str]
) -> bool:
    """One ranged GET of the object's first len(held) bytes, that version only: whether they
    are `held`."""
    reply = store.get(url, (0, len(held)), version)
    body = reply.body
    try:
        if store.pin_is_advisory:
            # a pin the store may ignore: only an answer naming the version it served proves it
            if reply.version is None:
                raise StorageError(
                    f"read back: the answer names no {store.version_name} (the version it served)",
                    path=str(url),
                )
            if tag_value(reply.version) != tag_value(version):
                return False  # another version than the one asked for: replaced since its HEAD
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
