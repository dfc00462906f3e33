"""What the stores spoken to over plain HTTP (gcs, azure) share: a requests session made for
ckptfmt's requests, and an answer's body as bodies.read_body reads it; and what s3 shares
with them: an answer's head within the operation's deadline (HeadWatch)."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from ..errors import CheckpointError
from . import alarms, client

T = TypeVar("T")


def import_requests(scheme: str) -> Any:
    try:
        import requests
    except ImportError:
        extra = {"gs": "gcs", "az": "azure"}.get(scheme, scheme)
        raise CheckpointError(f"{scheme}:// URLs need requests: pip install 'ckptfmt[{extra}]'") from None
    return requests


def new_session(options: Mapping[str, Any], scheme: str, session: Any = None) -> Any:
    """`session` (a plain requests session where None) made ready: a connection pool for
    the transfers' concurrency, requests' retries off (client.request retries), bodies not
    compressed in transit (they are read raw, bounded, within deadlines), and requests'
    and urllib3's errors counted as a request's failures."""
    requests = import_requests(scheme)
    import urllib3

    client.add_transfer_errors(requests.RequestException, urllib3.exceptions.HTTPError)
    session = requests.Session() if session is None else session
    size = max(10, 2 * client.concurrency(options))
    adapter = requests.adapters.HTTPAdapter(pool_connections=size, pool_maxsize=size, max_retries=0)
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    adapter.poolmanager.pool_classes_by_scheme = watched_pools(HTTPConnectionPool, HTTPSConnectionPool)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    session.headers["Accept-Encoding"] = "identity"
    return session


#: what this thread's requests tell as they go out: `watch`, the HeadWatch of the request it
#: is sending (send sets it), and `written`, what to call once a request is written
#: (telling_sent)
_sending = threading.local()


class HeadWatch:
    """Cuts the connection a request is sent on unless its answer's head has come within
    `timeout` seconds.  A read timeout bounds each wait for a byte, not the head: a store that
    sends its status line a byte at a time (or reads the request so) would hold the request
    for hours whatever the deadline said.  The connection is the one the pool hands the
    request (noted by watched_pools' connections as they send)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.fired = threading.Event()
        self._conn: Any = None
        # once the request is over its connection may serve another thread's: no cut after that
        self._lock = threading.Lock()
        self._over = False
        self._alarm: alarms.Alarm | None = None

    def _fire(self) -> None:
        with self._lock:
            if self._over:
                return
            self.fired.set()
            sock = getattr(self._conn, "sock", None)
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it

    def sending_on(self, conn: Any) -> None:
        """`conn` is about to send the request or read its answer's head."""
        self._conn = conn
        if self.fired.is_set():
            raise client.AnswerCut(self.missed())

    def missed(self) -> str:
        return f"the answer's head {client.missed_deadline(self.timeout, 'deadline')}"

    def __enter__(self) -> HeadWatch:
        _sending.watch = self
        self._alarm = alarms.set_alarm(self.timeout, self._fire)  # on alarms' one thread
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._over = True
        if self._alarm is not None:
            self._alarm.cancel()
        _sending.watch = None


@contextlib.contextmanager
def telling_sent(hook: Callable[[], None]) -> Iterator[None]:
    """Within the block, `hook` is called on this thread once each request it sends through a
    watched pool is written (its answer then awaited): a reader that orders its requests
    sends the next only then (storage/readahead.py's SendOrder)."""
    earlier = getattr(_sending, "written", None)
    _sending.written = hook
    try:
        yield
    finally:
        _sending.written = earlier


def _note_written() -> None:
    hook = getattr(_sending, "written", None)
    if hook is not None:
        hook()


def _note_sending(conn: Any) -> None:
    watch = getattr(_sending, "watch", None)
    if watch is not None:
        watch.sending_on(conn)


@functools.cache
def watched_pools(plain: Any, secure: Any) -> dict[str, type]:
    """The urllib3 connection pools `plain` (http) and `secure` (https), their connections
    telling this thread's HeadWatch which connection a request goes out on."""

    class Pool(plain):  # type: ignore[valid-type,misc]
        ConnectionCls = _watched(plain.ConnectionCls)

    class SecurePool(secure):  # type: ignore[valid-type,misc]
        ConnectionCls = _watched(secure.ConnectionCls)

    return {"http": Pool, "https": SecurePool}


def _watched(connection: type) -> type:
    class Watched(connection):  # type: ignore[valid-type,misc]
        def request(self, *args: Any, **kwargs: Any) -> Any:
            _note_sending(self)
            return super().request(*args, **kwargs)

        def getresponse(self, *args: Any, **kwargs: Any) -> Any:
            _note_sending(self)
            _note_written()
            return super().getresponse(*args, **kwargs)

    return Watched


def body_of(answer: Any) -> client.Body:
    """A requests answer's body as bodies.read_body reads it (client.Body)."""
    return client.Body(answer, answer.raw)


def size_of(value: object) -> object:
    """A size a store gives as a decimal string, as an int; any other value as it came
    (refused by the caller's checks)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    return value


def send(
    session: Any,
    method: str,
    url: str,
    timeouts: tuple[float, float],
    reason: Callable[[Any], str],
    **kwargs: Any,
) -> Any:
    """One request, its answer's body not yet read (streamed, never redirected: a store
    answers where it was asked), its answer's head within what remains of the operation's
    deadline (AnswerCut); AnswerError for a status of 300 or more, with the store's `reason`
    for it."""
    answer = head_within_deadline(
        lambda: session.request(method, url, timeout=timeouts, stream=True, allow_redirects=False, **kwargs),
        lambda answer: answer.close(),
    )
    if answer.status_code >= 300:
        why = reason(answer)
        answer.close()
        raise client.AnswerError(why, answer.status_code)
    return answer


def head_within_deadline(request: Callable[[], T], close: Callable[[T], None]) -> T:
    """The answer of `request()`, one request sent through a watched pool (watched_pools), whose
    head must come within what remains of the operation's deadline (AnswerCut); `close` ends
    an answer whose head came as the connection was cut (its body cannot)."""
    with HeadWatch(time_left()) as watch:
        try:
            answer = request()
        except Exception:
            if watch.fired.is_set():
                raise client.AnswerCut(watch.missed()) from None
            raise
    if watch.fired.is_set():
        close(answer)
        raise client.AnswerCut(watch.missed())
    return answer


def time_left() -> float:
    """What remains of the deadline of the operation this thread carries out."""
    budget = client.current_budget()
    return max(budget.remaining() if budget is not None else client.DEFAULT_DEADLINE, 0.001)


def read_answer(answer: Any, what: str) -> bytes:
    """The whole body of `answer`, read within what remains of the operation's deadline and
    refused above client.MAX_LISTING_BODY before it is parsed (client.read_listing)."""
    try:
        return client.read_listing(answer.raw, time_left(), what)
    finally:
        answer.close()


def read_refusal(answer: Any, limit: int = 64 * 1024) -> bytes:
    """At most `limit` bytes of a refused request's answer, read within what remains of the
    operation's deadline (one that trickles in is cut there: b"", and the status alone names
    the refusal).  A read timeout bounds each wait for a byte, not the body."""
    with client.Watchdog(answer.raw, time_left()) as dog:
        try:
            body = bytes(answer.raw.read(limit))
        except Exception:
            if not dog.fired.is_set():
                raise
    return b"" if dog.fired.is_set() else body
