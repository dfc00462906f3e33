"""The S3 client behind every object-store URL, and the translation of its failures.

One boto3 client per distinct set of storage options, shared by the threads of this process
(boto3 clients are thread-safe; sessions are not, so a client is made once under a lock).
Credentials, region and endpoint follow boto3's own conventions: ``AWS_*`` environment
variables, ``~/.aws`` files and instance roles work as users expect; ``storage_options``
overrides them per call.

Retries are made here, in one place (botocore's own are off): an operation (one request,
or one ranged read, or one page of a listing) is tried at most ``max_attempts`` times, with
exponential backoff, on throttling, 5xx answers, dropped connections and answers that miss
their deadline, all within one deadline (storage option ``deadline``, environment variable
CKPTFMT_STORAGE_DEADLINE, 300 s by default) that covers every attempt and wait; the error
says what was tried for how long.  No socket wait is longer than the deadline (connect and
read timeouts are capped by it), and a listing's answer is read within what remains of it
and refused above MAX_LISTING_BODY bytes before it is parsed.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from ..errors import CheckpointError, LimitError, StorageError

#: what storage_options may hold: boto3 client arguments and ckptfmt's own tuning
CLIENT_OPTIONS = (
    "endpoint_url",
    "region_name",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "profile_name",
)
TUNING_OPTIONS = (
    "max_attempts",
    "concurrency",
    "part_size",
    "connect_timeout",
    "read_timeout",
    "addressing_style",
    "request_size",
    "request_timeout",
    "deadline",
)
_ALIASES = {"region": "region_name", "endpoint": "endpoint_url", "profile": "profile_name"}

DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_CONCURRENCY = 8
#: seconds one operation may take, all its attempts and backoff included (storage option
#: deadline; the environment variable CKPTFMT_STORAGE_DEADLINE where the option is not given)
DEFAULT_DEADLINE = 300.0
DEADLINE_VARIABLE = "CKPTFMT_STORAGE_DEADLINE"
#: the answer to one listing request (a page of at most 1000 keys of at most 1 KiB each, as
#: XML) is refused above this many bytes, before it is parsed
MAX_LISTING_BODY = 16 << 20
#: the operations whose answers are read by the listing guard (_guard_listings)
LISTING_OPERATIONS = ("ListObjectsV2", "ListMultipartUploads")

_clients: dict[tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]], Any] = {}
_lock = threading.Lock()

T = TypeVar("T")


def check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """storage_options as a plain dict with aliases resolved; ValueError on unknown names."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"storage_options must be a dict, not {type(options).__name__}")
    out: dict[str, Any] = {}
    for name, value in options.items():
        name = _ALIASES.get(name, name)
        if name not in CLIENT_OPTIONS and name not in TUNING_OPTIONS:
            known = ", ".join(sorted(CLIENT_OPTIONS + TUNING_OPTIONS + tuple(_ALIASES)))
            raise ValueError(f"unknown storage option {name!r}; known: {known}")
        out[name] = value
    for name in ("max_attempts", "concurrency"):
        if name in out and (type(out[name]) is not int or not 1 <= out[name] <= 64):
            raise ValueError(f"storage option {name} must be an int from 1 to 64, not {out[name]!r}")
    for name in ("part_size", "request_size"):
        if name in out and (type(out[name]) is not int or not 1 << 20 <= out[name] <= 5 << 30):
            raise ValueError(
                f"storage option {name} must be an int of bytes from 1 MiB to 5 GiB, not {out[name]!r}"
            )
    for name in ("request_timeout", "deadline", "read_timeout", "connect_timeout"):
        if name in out and (type(out[name]) not in (int, float) or not 0 < out[name] <= 86400):
            raise ValueError(
                f"storage option {name} must be seconds above 0, at most a day, not {out[name]!r}"
            )
    return out


def deadline(options: Mapping[str, Any]) -> float:
    """Seconds one operation may take, every attempt included (storage option deadline, else
    CKPTFMT_STORAGE_DEADLINE, else DEFAULT_DEADLINE); ValueError for a variable that is not
    seconds."""
    if "deadline" in options:
        return float(options["deadline"])
    text = os.environ.get(DEADLINE_VARIABLE)
    if text is None:
        return DEFAULT_DEADLINE
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400:
        raise ValueError(f"{DEADLINE_VARIABLE} must be seconds above 0, at most a day, not {text!r}")
    return value


def concurrency(options: Mapping[str, Any]) -> int:
    """How many requests one transfer keeps in flight."""
    return int(options.get("concurrency", DEFAULT_CONCURRENCY))


def _import_boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise CheckpointError("object-store URLs need boto3: pip install 'ckptfmt[s3]'") from None
    return boto3


def client_for(options: Mapping[str, Any]) -> Any:
    """The shared boto3 S3 client for these (checked) options."""
    # boto3 reads AWS_* variables when the client is made: a change to them makes a new one
    environment = tuple(
        sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_") or k == DEADLINE_VARIABLE)
    )
    cache_key = (tuple(sorted((k, repr(v)) for k, v in options.items())), environment)
    with _lock:
        found = _clients.get(cache_key)
        if found is None:
            found = _clients[cache_key] = _new_client(options)
        return found


def _new_client(options: Mapping[str, Any]) -> Any:
    boto3 = _import_boto3()
    from botocore.config import Config

    session = boto3.session.Session(profile_name=options.get("profile_name"))
    limit = deadline(options)
    config = Config(
        # one attempt: ckptfmt retries (Budget), under the operation's deadline
        retries={"mode": "standard", "total_max_attempts": 1},
        max_pool_connections=max(10, 2 * concurrency(options)),
        connect_timeout=min(options.get("connect_timeout", 10), limit),
        read_timeout=min(options.get("read_timeout", 60), limit),
        # payload checksums only where the operation demands them: ours cover every byte
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # "path" for stores reached by address (MinIO, Ceph); botocore's "auto" otherwise
        s3={"addressing_style": options.get("addressing_style", "auto")},
    )
    kwargs = {k: options[k] for k in CLIENT_OPTIONS if k in options and k != "profile_name"}
    client = session.client("s3", config=config, **kwargs)
    _guard_listings(client)
    return client


def error_code(e: BaseException) -> tuple[str, int]:
    """A botocore ClientError's S3 error code and HTTP status ("", 0 for other errors)."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return code, int(status) if isinstance(status, int) else 0


_MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}


def translate(e: BaseException, url: str, operation: str, budget: Budget | None = None) -> BaseException:
    """The error a user sees for a failed request: FileNotFoundError for a missing object or
    bucket, StorageError (naming the URL and the operation, and what `budget` tried) for
    everything else."""
    code, status = error_code(e)
    if code in _MISSING or status == 404:
        return FileNotFoundError(errno.ENOENT, f"{operation}: no such object or bucket", url)
    if code in _DENIED or status == 403:
        return StorageError(f"{operation}: access denied ({code or status}): check the credentials", path=url)
    if code == "PreconditionFailed" or status == 412:
        return StorageError(f"{operation}: the object changed while it was being read", path=url)
    tried = f" after {budget.tried()}" if budget is not None else ""
    if code:
        return StorageError(f"{operation} failed{tried}: {code} (HTTP {status})", path=url)
    kind = type(e).__name__
    return StorageError(f"{operation} failed{tried}: {kind}: {e}", path=url)


class Budget:
    """One operation's attempts and deadline: `retry` says whether another attempt may go
    (after its backoff, which it sleeps), `remaining` how long the current one may wait."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.attempts = int(options.get("max_attempts", DEFAULT_MAX_ATTEMPTS))
        self.deadline = deadline(options)
        self.started = time.monotonic()
        self.attempt = 1

    def remaining(self) -> float:
        return max(0.0, self.deadline - (time.monotonic() - self.started))

    def retry(self) -> bool:
        """Whether to try again: attempts left, and time left after the backoff (slept here)."""
        if self.attempt >= self.attempts:
            return False
        pause = min(2.0, 0.05 * 2**self.attempt) * random.uniform(0.5, 1.0)
        if self.remaining() <= pause:
            return False
        time.sleep(pause)
        self.attempt += 1
        return True

    def tried(self) -> str:
        """What was tried, for an error: attempts, time, and the options that bound them."""
        return (
            f"{self.attempt} attempt(s) in {time.monotonic() - self.started:.1f} s (storage options "
            f"max_attempts {self.attempts}, deadline {self.deadline:g} s)"
        )


#: the budget of the operation the current thread is carrying out (read by the listing guard)
_current = threading.local()


def retryable(e: BaseException) -> bool:
    """Whether another attempt may succeed: throttling, a 5xx answer, or no answer at all (a
    dropped connection, a timeout, an answer cut off at its deadline).  A 4xx answer, and an
    answer that cannot be parsed, would come again."""
    code, status = error_code(e)
    if code or status:
        return status >= 500 or status == 429 or code in ("SlowDown", "Throttling", "RequestTimeout")
    return not isinstance(e, ValueError)


def request(url: str, operation: str, call: Callable[[], T], options: Mapping[str, Any] | None = None) -> T:
    """Run one client call, translating its failure; what may succeed when tried again is
    tried again within the operation's Budget (the only retries: botocore's are off), by
    the storage `options` (None: the defaults)."""
    budget = Budget(options or {})
    while True:
        _current.budget = budget
        try:
            return call()
        except LimitError as e:
            if e.path is None:  # from the listing guard, which knows no URL
                raise LimitError(f"{operation}: {e.reason}", path=url) from None
            raise
        except (CheckpointError, FileNotFoundError):
            raise
        except transfer_errors() as e:
            if not retryable(e) or not budget.retry():
                raise translate(e, url, operation, budget) from e
        finally:
            _current.budget = None


def transfer_errors() -> tuple[type[BaseException], ...]:
    """What a request can fail with: botocore's errors, socket errors, and ValueError, which
    botocore raises for an answer it cannot parse (a date in a header or a listing that is
    not one)."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError, OSError, ValueError)


def is_precondition_failed(e: BaseException) -> bool:
    code, status = error_code(e)
    return code == "PreconditionFailed" or status == 412


# -- answers read within a deadline ----------------------------------------------------------


class AnswerCut(OSError):
    """An answer's body did not arrive within its deadline: the connection was cut."""


def missed_deadline(timeout: float, option: str, detail: str = "") -> str:
    """How an answer that its deadline cut off is described in errors."""
    return f"did not arrive within {timeout:g} s (storage option {option}{detail})"


def cut_connection(raw: Any) -> None:
    """End the connection a urllib3 answer `raw` is read from, so that a read blocked on it
    returns (shutting the socket down wakes a thread waiting in recv; closing it may not)."""
    sock = getattr(getattr(raw, "connection", None), "sock", None)
    if isinstance(sock, socket.socket):
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return
        except OSError:
            pass
    raw.close()


class Watchdog:
    """Cuts the connection of `raw` (cut_connection) unless stopped within `timeout` seconds;
    `fired` says whether it did."""

    def __init__(self, raw: Any, timeout: float) -> None:
        self.fired = threading.Event()
        self._raw = raw
        self._timer = threading.Timer(timeout, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired.set()
        cut_connection(self._raw)

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def read_listing(raw: Any, timeout: float) -> bytes:
    """The body of a listing's answer `raw` (urllib3, not yet read), read whole within
    `timeout` seconds and refused above MAX_LISTING_BODY bytes (LimitError) before it is
    parsed: AnswerCut when the deadline cut it."""
    limit = MAX_LISTING_BODY
    declared = getattr(raw, "headers", {}).get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raw.close()
        raise LimitError(f"a listing's answer of {declared} bytes is above the limit {limit}")
    pieces: list[bytes] = []
    got = 0
    with Watchdog(raw, timeout) as dog:
        try:
            for piece in _pieces(raw):
                got += len(piece)
                if got > limit:
                    raise LimitError(f"a listing's answer is above the limit of {limit} bytes")
                pieces.append(piece)
        except LimitError:
            raw.close()
            raise
        except Exception:
            if not dog.fired.is_set():
                raise
    if dog.fired.is_set():
        raw.close()
        raise AnswerCut(f"a listing's answer {missed_deadline(timeout, 'deadline', f'; {got} bytes came')}")
    return b"".join(pieces)


def _pieces(raw: Any) -> Iterator[bytes]:
    while True:
        piece = raw.read(64 * 1024)
        if not piece:
            return
        yield piece


class _Bytes:
    """What botocore reads an answer's content from (its raw.stream())."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **kwargs: Any) -> Iterator[bytes]:
        yield self._data


def _guard_listings(client: Any) -> None:
    """Have `client` send listing requests itself (botocore's before-send event) and read
    their answers with read_listing: within what remains of the operation's deadline, and
    bounded before botocore parses them (it would read a body of any length, at any pace)."""
    from botocore.awsrequest import AWSResponse

    session = client._endpoint.http_session  # botocore's own: its pool, proxies and TLS

    def send(request: Any, **kwargs: Any) -> Any:
        budget: Budget | None = getattr(_current, "budget", None)
        timeout = budget.remaining() if budget is not None else DEFAULT_DEADLINE
        request.stream_output = True  # the body is read here, not by the session
        answer = session.send(request)
        body = read_listing(answer.raw, max(timeout, 0.001))
        return AWSResponse(answer.url, answer.status_code, answer.headers, _Bytes(body))

    for name in LISTING_OPERATIONS:
        client.meta.events.register(f"before-send.s3.{name}", send)
