"""What every object store's requests share: storage options, one retry loop, one deadline
per operation, and the translation of failures into ckptfmt's errors.

The stores themselves (``s3``: boto3; ``gcs``: Google's JSON API) make single attempts and
raise their clients' errors; ``Budget.run`` is the only place that retries (the clients' own
retries are off): an operation (one request, or one ranged read, or one page of a listing)
is tried at most ``max_attempts`` times, with exponential backoff, on throttling, 5xx
answers, dropped connections and answers that miss their deadline, all within one deadline
(storage option ``deadline``, environment variable CKPTFMT_STORAGE_DEADLINE, 300 s by
default) that covers every attempt and wait; the error says what was tried for how long.
No socket wait is longer than the deadline (connect and read timeouts are capped by it),
and a listing's answer is read within what remains of it and refused above
MAX_LISTING_BODY bytes before it is parsed (``read_listing``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from ..errors import CheckpointError, LimitError, StorageError
from . import alarms

#: what storage_options may hold for each scheme: its client's arguments ...
STORE_OPTIONS: dict[str, tuple[str, ...]] = {
    "s3": (
        "endpoint_url",
        "region_name",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "profile_name",
        "addressing_style",
    ),
    # token: a service account's JSON key file, or "anon" (no credentials: public buckets)
    "gs": ("token",),
    # credential: an Azure AD credential (azure-core's get_token), e.g. azure-identity's;
    # anon: unsigned requests (public containers), as adlfs's
    "az": ("connection_string", "account_name", "account_key", "sas_token", "credential", "anon"),
}
CLIENT_OPTIONS = tuple(dict.fromkeys(name for names in STORE_OPTIONS.values() for name in names))
#: ... and ckptfmt's own tuning, for every store
TUNING_OPTIONS = (
    "max_attempts",
    "concurrency",
    "part_size",
    "connect_timeout",
    "read_timeout",
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
#: seconds to wait for a connection, and for each piece of an answer (storage options
#: connect_timeout, read_timeout), capped by the deadline
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0
#: the answer to one listing request (a page of at most 1000 keys of at most 1 KiB each, as
#: XML or JSON) is refused above this many bytes, before it is parsed
MAX_LISTING_BODY = 16 << 20

#: the errors the stores in use raise for a failed request (each store adds its client's)
_transfer_errors: tuple[type[BaseException], ...] = ()
_errors_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child keeps the error kinds (its clients' classes are its own too); the lock
    may have been held by a thread of the parent's at the fork."""
    global _errors_lock
    _errors_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)

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


def timeouts(options: Mapping[str, Any]) -> tuple[float, float]:
    """The connect and read timeouts of one request, neither above the deadline."""
    limit = deadline(options)
    connect = float(options.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT))
    return min(connect, limit), min(float(options.get("read_timeout", DEFAULT_READ_TIMEOUT)), limit)


class AnswerError(Exception):
    """A store's answer refusing a request (an HTTP status of 300 or more), for stores whose
    client raises nothing of its own: the store's error code (reason) and the status."""

    def __init__(self, code: str, status: int, message: str = "") -> None:
        super().__init__(f"{code} (HTTP {status}){': ' + message if message else ''}")
        self.code = code
        self.status = status


def add_transfer_errors(*kinds: type[BaseException]) -> None:
    """Count `kinds` among the errors a request can fail with (a store's client's own)."""
    global _transfer_errors
    with _errors_lock:
        _transfer_errors = tuple(dict.fromkeys(_transfer_errors + kinds))


def error_code(e: BaseException) -> tuple[str, int]:
    """A store's error code and HTTP status for a refused request ("", 0 for other errors):
    an AnswerError's, or a botocore ClientError's."""
    if isinstance(e, AnswerError):
        return e.code, e.status
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return code, int(status) if isinstance(status, int) else 0


_MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound", "notFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}


#: a URL's query in an error's text (requests names the URL it failed on): it may carry a
#: secret, an Azure SAS token's signature
_QUERY = re.compile(r"(?<=[\w/.~%-])\?[^\s'\"()<>]+")
#: a JWT, the form of Azure AD's (and other OAuth) bearer tokens
_JWT = re.compile(r"eyJ[\w-]*\.[\w-]+\.[\w-]*")
#: the characters of a client's or credential's own error that a message quotes at most
MAX_QUOTED = 300


def quoted(text: str, limit: int = MAX_QUOTED) -> str:
    """A client's or credential's error `text` as ckptfmt's messages quote it: every URL's
    query (an Azure SAS token) and every bearer token (a JWT) left out, on one line, at most
    `limit` characters (a token endpoint's answer may be megabytes)."""
    text = _JWT.sub("<token hidden>", _QUERY.sub("?<query hidden>", text))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def cause(e: BaseException) -> BaseException | None:
    """What ckptfmt's error for `e` is raised from: `e`, unless its text, or that of any error
    it was raised from or while handling (urllib3's, naming the URL), holds what quoted()
    leaves out: a traceback prints a cause and the whole chain behind it."""
    links, seen = [e], set()
    while links:
        link = links.pop()
        if id(link) in seen:  # a chain may loop back on itself
            continue
        seen.add(id(link))
        text = str(link)
        if _QUERY.search(text) is not None or _JWT.search(text) is not None:
            return None
        links.extend(x for x in (link.__cause__, link.__context__) if x is not None)
    return e


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
    return StorageError(f"{operation} failed{tried}: {kind}: {quoted(str(e))}", path=url)


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

    def run(
        self,
        url: str,
        operation: str,
        attempt: Callable[[], T],
        *,
        again: Callable[[CheckpointError], bool] | None = None,
        failed: Callable[[BaseException], None] | None = None,
    ) -> T:
        """The one retry loop: `attempt()` (one try at `operation` on `url`, carrying this
        budget) made until it returns, tried again only while retry() allows another attempt
        and only when another may succeed: a request's failure that retryable() says may not
        recur, or an error of ckptfmt's own about an answer that `again` says another answer
        could avoid (None: none could).  What ends it is raised: ckptfmt's errors and
        FileNotFoundError as they are (a LimitError that names no URL given `url`), the
        others translated (StorageError or FileNotFoundError naming `url`, `operation` and
        what was tried).  `failed(error)` is called as each failed attempt ends, before
        retry() decides on and sleeps the next one's backoff."""
        while True:
            try:
                with carrying(self):
                    return attempt()
            except transfer_errors() as e:
                if failed is not None:
                    failed(e)
                if isinstance(e, CheckpointError):
                    if again is not None and again(e) and self.retry():
                        continue
                    if isinstance(e, LimitError) and e.path is None:  # the listing guard's
                        raise LimitError(f"{operation}: {e.reason}", path=url) from None
                    raise
                if isinstance(e, FileNotFoundError):
                    raise
                if not retryable(e) or not self.retry():
                    raise translate(e, url, operation, self) from cause(e)

    def tried(self) -> str:
        """What was tried, for an error: attempts, time, and the options that bound them."""
        return (
            f"{self.attempt} attempt(s) in {time.monotonic() - self.started:.1f} s (storage options "
            f"max_attempts {self.attempts}, deadline {self.deadline:g} s)"
        )


#: the budget of the operation the current thread is carrying out (read by the stores, for
#: the deadline of a listing's answer)
_current = threading.local()


def current_budget() -> Budget | None:
    """The Budget of the operation this thread is carrying out, if any."""
    return getattr(_current, "budget", None)


@contextlib.contextmanager
def carrying(budget: Budget) -> Iterator[None]:
    """`budget` is the current_budget of this thread within the block: an operation that
    keeps its own Budget (a ranged read resumed) carries it to the requests it makes, whose
    answers' heads and refusals' bodies are read within what remains of it."""
    earlier = current_budget()
    _current.budget = budget
    try:
        yield
    finally:
        _current.budget = earlier


def retryable(e: BaseException) -> bool:
    """Whether another attempt may succeed: throttling, a 5xx answer, or no answer at all (a
    dropped connection, a timeout, an answer cut off at its deadline).  A 4xx answer, and an
    answer that cannot be parsed, would come again."""
    code, status = error_code(e)
    if code or status:
        return status >= 500 or status in (408, 429) or code in ("SlowDown", "Throttling", "RequestTimeout")
    return not isinstance(e, ValueError)


def request(url: str, operation: str, call: Callable[[], T], options: Mapping[str, Any] | None = None) -> T:
    """Run one client call, translating its failure; what may succeed when tried again is
    tried again within the operation's Budget (Budget.run: the only retries, botocore's are
    off), by the storage `options` (None: the defaults)."""
    return Budget(options or {}).run(url, operation, call)


def transfer_errors() -> tuple[type[BaseException], ...]:
    """What a request can fail with: the errors of the stores' clients in use, AnswerError,
    socket errors, and ValueError, which clients raise for an answer they cannot parse (a
    date in a header or a listing that is not one)."""
    return (*_transfer_errors, AnswerError, OSError, ValueError)


def is_precondition_failed(e: BaseException) -> bool:
    """Whether a store refused a request's condition (Azure answers a create-only write of a
    blob that exists with 409 BlobAlreadyExists)."""
    code, status = error_code(e)
    return code in ("PreconditionFailed", "BlobAlreadyExists") or status == 412


# -- answers read within a deadline ----------------------------------------------------------


class AnswerCut(OSError):
    """An answer's body did not arrive within its deadline: the connection was cut."""


def missed_deadline(timeout: float, option: str, detail: str = "") -> str:
    """How an answer that its deadline cut off is described in errors."""
    return f"did not arrive within {timeout:g} s (storage option {option}{detail})"


def cut_connection(raw: Any) -> None:
    """End the connection a urllib3 answer `raw` is read from, so that a read blocked on it
    returns (shutting the socket down wakes a thread waiting in recv; closing it may not)."""
    sock = _socket_of(raw)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return
        except OSError:
            pass
    raw.close()


def _socket_of(raw: Any) -> socket.socket | None:
    """The socket a urllib3 answer is read from: its connection's, or, where the connection
    let go of it (an answer that ends the connection: http.client detaches the socket and
    the answer's buffered reader alone holds it), the one beneath that reader."""
    sock = getattr(getattr(raw, "connection", None), "sock", None)
    if isinstance(sock, socket.socket):
        return sock
    reader = getattr(getattr(raw, "_fp", None), "fp", None)  # http.client's answer's file
    sock = getattr(getattr(reader, "raw", None), "_sock", None)  # socket.SocketIO's socket
    return sock if isinstance(sock, socket.socket) else None


class Body:
    """An answer's body as bodies.read_body reads it: ``readinto``, ``close``, and the urllib3
    answer (``_raw_stream``) its watchdog cuts.  `body` is the client's body object (a
    requests answer, botocore's StreamingBody), closed with it; `raw` the urllib3 answer
    beneath.

    urllib3's readinto reads into a fresh bytes object and copies that into the buffer
    given (and http.client's read(n) allocates its own n bytes first): two copies of every
    byte into freshly faulted memory, which bounded loads on fast stores.  Where the body is
    a plain one (a length, not chunked, nothing read yet), it is read straight
    from http.client's answer into the buffer instead: one copy, no allocation.  Its length
    is checked by the caller (bodies.read_body reads until the buffer is full and refuses
    a short body), as urllib3 would check it."""

    def __init__(self, body: Any, raw: Any) -> None:
        self._body = body
        self._raw_stream = raw
        # the fallback: the client's own readinto where it has one (botocore's translates
        # urllib3's errors), else urllib3's
        self._readinto: Callable[[Any], int] = (
            _plain_readinto(raw) or getattr(body, "readinto", None) or raw.readinto
        )

    def readinto(self, view: memoryview) -> int:
        return int(self._readinto(view))

    def close(self) -> None:
        self._body.close()


def _plain_readinto(raw: Any) -> Callable[[Any], int] | None:
    """http.client's readinto beneath the urllib3 answer `raw`, where nothing stands between
    it and the bytes (a declared length, not chunked, nothing buffered or read by urllib3
    yet); None otherwise (read through urllib3 then).  Bodies are read as they came either
    way (the stores' clients ask urllib3 not to decode them, and ckptfmt asks for no
    encoding): a body whose length is not the range's is refused before it is read."""
    import http.client

    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse) or fp.chunked or fp.length is None:
        return None
    buffered = getattr(raw, "_decoded_buffer", None)
    if getattr(raw, "_fp_bytes_read", None) != 0 or buffered is None or len(buffered) != 0:
        return None
    return fp.readinto


class Watchdog:
    """Cuts the connection of `raw` (cut_connection) unless stopped within `timeout` seconds;
    `fired` says whether it did.  The alarm is kept by alarms' one thread, not a thread of
    its own: every ranged GET sets one."""

    def __init__(self, raw: Any, timeout: float) -> None:
        self.fired = threading.Event()
        self._raw = raw
        self._timeout = timeout
        self._alarm: alarms.Alarm | None = None

    def _fire(self) -> None:
        self.fired.set()
        cut_connection(self._raw)

    def __enter__(self) -> Watchdog:
        self._alarm = alarms.set_alarm(self._timeout, self._fire)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._alarm is not None:
            self._alarm.cancel()


def read_listing(raw: Any, timeout: float, what: str = "a listing's answer") -> bytes:
    """The body of a listing's answer `raw` (or of another answer to be parsed whole, named
    `what` in errors; urllib3, not yet read), read whole within `timeout` seconds and refused
    above MAX_LISTING_BODY bytes (LimitError) before it is parsed: AnswerCut when the deadline
    cut it."""
    limit = MAX_LISTING_BODY
    declared = getattr(raw, "headers", {}).get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raw.close()
        raise LimitError(f"{what} of {declared} bytes is above the limit {limit}")
    pieces: list[bytes] = []
    got = 0
    with Watchdog(raw, timeout) as dog:
        try:
            for piece in _pieces(raw):
                got += len(piece)
                if got > limit:
                    raise LimitError(f"{what} is above the limit of {limit} bytes")
                pieces.append(piece)
        except LimitError:
            raw.close()
            raise
        except Exception:
            if not dog.fired.is_set():
                raise
    if dog.fired.is_set():
        raw.close()
        raise AnswerCut(f"{what} {missed_deadline(timeout, 'deadline', f'; {got} bytes came')}")
    return b"".join(pieces)


def _pieces(raw: Any) -> Iterator[bytes]:
    while True:
        piece = raw.read(64 * 1024)
        if not piece:
            return
        yield piece
