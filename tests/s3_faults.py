"""A fault-injecting HTTP/1.1 proxy for the object-store tests: it sits between the client and
the test server (tests/s3_server.py) and, by rules a test sets and clears while it runs,
resets connections, answers errors, delays requests, and counts what the client sent.

The client speaks to the proxy as to the store: keep-alive connections, bodies framed by
Content-Length or chunked transfer encoding.  The proxy answers `Expect: 100-continue` itself
(and forwards the request without it), so that a rule can refuse a request before its body.

It serves every store the tests reach over HTTP: S3 (moto), GCS (fake-gcs-server) and Azure
(Azurite); tests/store_faults.py says how each store's requests look.  Rules match a request
by method (None: any) and a substring of its target, the path and query as sent
(`/bucket/key?partNumber=2&uploadId=...`), or a compiled pattern searched in it:

* `reset_on(...)`: the nth match is answered by a TCP reset (SO_LINGER 0): at once, after
  `upload_bytes` of its body went upstream (a mid-upload reset), after the answer's head and
  `download_bytes` of its body came back (a mid-download reset), or, with `answered=True`,
  after the server carried it out and answered (the client cannot tell that it happened).
* `fail_next(...)`: the next `count` matches are answered with `status` and an S3 XML error
  (500 InternalError, 503 SlowDown, 403 AccessDenied, ...) without reaching the server.
* `delay(...)`: matches wait `seconds` before they are forwarded, or until `release()`.
* `drop_header(...)`: the server's answer to the next `count` matches comes back without
  the named header (a store that leaves out an ETag, say).
* `trickle(...)`: the answers to the next `count` matches send their head and `after_bytes`
  of their body, then one byte every `interval` seconds (a stalling connection that never
  goes quiet long enough for a read timeout).
* `hide_listed(key)`: listings (S3's ListObjectsV2, GCS's objects.list, Azure's List Blobs
  answers) leave out the object `key` (a lying or lagging store); the object itself is still
  there to HEAD and GET.
* `count(method, contains)`: how many requests matched since the last `clear_counts()`;
  `ranges(contains)`: the byte ranges the matching GETs asked for.
"""

from __future__ import annotations

import io
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from s3_server import create_bucket, s3_client, storage_options

MAX_HEAD = 64 * 1024
PIECE = 256 * 1024
HOLD_LIMIT = 60.0  # seconds a held request waits at most for its release
ERROR_CODES = {
    400: ("BadRequest", "An error was injected by the test proxy."),
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


#: what a rule matches in a request's target: a substring, or a compiled pattern searched in it
Target = str | re.Pattern[str]


class Reset(Exception):
    """A rule ended the connection with a reset."""


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        return header_of(self.headers, name)


@dataclass
class Rule:
    kind: str  # "reset", "fail", "delay", "drop", "trickle", "hold"
    method: str | None
    contains: Target
    nth: int = 1  # reset: the match that fires
    remaining: int | None = None  # fail, delay: matches still to act on (None: every one)
    status: int = 500
    code: str | None = None
    body: bytes | None = None  # fail: the answer's body in place of an S3 error
    seconds: float = 0.0
    upload_bytes: int | None = None
    download_bytes: int | None = None
    answered: bool = False
    header: str = ""  # drop: the answer's header left out
    after_bytes: int = 0  # trickle: body bytes sent at full speed first
    interval: float = 1.0  # trickle: seconds between the bytes after those
    seen: int = 0
    released: threading.Event | None = None  # hold: what the held request waits for

    def at_once(self) -> bool:
        """A reset before anything is forwarded."""
        return self.upload_bytes is None and self.download_bytes is None and not self.answered

    def matches(self, req: Request) -> bool:
        return (self.method is None or self.method == req.method) and hit(self.contains, req.target)


def hit(contains: Target, target: str) -> bool:
    """Whether a request's target holds the substring `contains` (or its pattern matches)."""
    return contains.search(target) is not None if isinstance(contains, re.Pattern) else contains in target


@dataclass
class Plan:
    """What the rules decided for one request."""

    reset: Rule | None = None
    fail: Rule | None = None
    delay: float = 0.0
    dropped: set[str] = field(default_factory=set)  # answer headers left out (lower case)
    trickle: Rule | None = None
    held: threading.Event | None = None  # forwarded once set


# -- HTTP/1.1 framing ---------------------------------------------------------------------------


def read_head(rfile: BinaryIO) -> bytes | None:
    """One message head, up to and including its blank line; None at a clean end of stream."""
    lines = []
    size = 0
    while True:
        line = rfile.readline(MAX_HEAD + 1)
        if not line:
            if lines:
                raise ConnectionError("the stream ended inside a message head")
            return None
        size += len(line)
        if size > MAX_HEAD:
            raise ConnectionError("message head too long")
        if not lines and line in (b"\r\n", b"\n"):
            continue  # a blank line between messages is allowed
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def parse_headers(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    """The start line and the header fields of a message head."""
    text = head.decode("latin-1").split("\r\n")
    fields = []
    for line in text[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            fields.append((k.strip(), v.strip()))
    return text[0], fields


def encode_head(start: str, headers: list[tuple[str, str]]) -> bytes:
    return (start + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode("latin-1")


def header_of(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def copy_body(
    rfile: BinaryIO, out: socket.socket, headers: list[tuple[str, str]], limit: int | None = None
) -> bool:
    """Copy a message body framed by Content-Length or chunked encoding from rfile to out, as
    framed; raise Reset once `limit` payload bytes have gone.  False when the body has no
    framing (it runs to the end of the stream, which was copied)."""
    sent = 0

    def send(data: bytes, payload: int) -> None:
        nonlocal sent
        if limit is not None and sent + payload >= limit:
            out.sendall(data[: len(data) - payload + (limit - sent)])
            raise Reset()
        out.sendall(data)
        sent += payload

    te = (header_of(headers, "transfer-encoding") or "").lower()
    if "chunked" in te:
        while True:
            line = rfile.readline(MAX_HEAD)
            if not line.endswith(b"\n"):
                raise ConnectionError("bad chunk header")
            size = int(line.split(b";", 1)[0].strip(), 16)
            send(line, 0)
            if size == 0:
                while True:  # trailer fields, then the blank line
                    trailer = rfile.readline(MAX_HEAD)
                    if not trailer:
                        raise ConnectionError("the stream ended inside a chunked trailer")
                    send(trailer, 0)
                    if trailer in (b"\r\n", b"\n"):
                        return True
            copy_exactly(rfile, size, send, "a chunk")
            send(rfile.read(2), 0)
    length = header_of(headers, "content-length")
    if length is None:
        return False
    copy_exactly(rfile, int(length), send, "a body")
    if limit is not None and limit <= sent:
        raise Reset()
    return True


def copy_exactly(rfile: BinaryIO, n: int, send: Callable[[bytes, int], None], where: str) -> None:
    """Pass the next n bytes of rfile to send(data, payload bytes)."""
    while n:
        data = rfile.read(min(n, PIECE))
        if not data:
            raise ConnectionError(f"the stream ended inside {where}")
        send(data, len(data))
        n -= len(data)


def copy_to_end(rfile: BinaryIO, out: socket.socket) -> None:
    while data := rfile.read(PIECE):
        out.sendall(data)


def reset(sock: socket.socket) -> None:
    """Close sock with a TCP reset instead of an orderly shutdown."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def error_answer(
    req: Request, status: int, code: str | None, close: bool, body: bytes | None = None
) -> bytes:
    """An S3-style error response (its XML body, or `body`, unless the request was a HEAD)."""
    default_code, message = ERROR_CODES.get(status, ("InjectedError", "An error was injected."))
    code = code or default_code
    body = (
        body
        or (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>ckptfmt-fault-proxy</RequestId></Error>"
        ).encode()
    )
    headers = [
        ("Content-Type", "application/xml"),
        ("Content-Length", str(0 if req.method == "HEAD" else len(body))),
        ("x-amz-request-id", "ckptfmt-fault-proxy"),
    ]
    if close:
        headers.append(("Connection", "close"))
    reason = {403: "Forbidden", 500: "Internal Server Error", 503: "Slow Down"}.get(status, "Error")
    return encode_head(f"HTTP/1.1 {status} {reason}", headers) + (b"" if req.method == "HEAD" else body)


class _Sink:
    """A socket-like object that drops what is sent to it."""

    def sendall(self, data: bytes) -> None:
        pass


def copy_body_to_nowhere(rfile: BinaryIO, headers: list[tuple[str, str]], method: str, status: int) -> None:
    """Read and drop an answer's body."""
    if method == "HEAD" or status in (204, 304):
        return
    if not copy_body(rfile, _Sink(), headers):  # type: ignore[arg-type]
        while rfile.read(PIECE):
            pass


# -- the proxy ---------------------------------------------------------------------------------


class FaultProxy:
    """An HTTP/1.1 proxy on a free port of 127.0.0.1 in front of `upstream` (an endpoint URL),
    for the life of a `with` block."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = upstream
        self._upstream_addr = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._seen: list[tuple[str, str]] = []
        self._ranges: list[tuple[str, str]] = []  # (target, Range header) of GETs with one
        self._hidden: set[str] = set()  # keys listings leave out
        self._conns: set[socket.socket] = set()
        self._released = threading.Event()  # set by release(): the requests held go on
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.connections = 0  # client connections accepted (keep-alive reuses them)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self) -> dict[str, str]:
        return storage_options(self.endpoint_url)

    def client(self, max_attempts: int | None = 1) -> Any:
        """A boto3 client through the proxy, retries off unless told."""
        return s3_client(self.endpoint_url, max_attempts)

    def new_bucket(self, name: str | None = None) -> str:
        """A fresh bucket, made on the server directly (it is not counted)."""
        return create_bucket(self.upstream, name)

    # -- rules, set and cleared while the proxy runs

    def reset_on(
        self,
        method: str | None,
        contains: Target = "",
        nth: int = 1,
        *,
        upload_bytes: int | None = None,
        download_bytes: int | None = None,
        answered: bool = False,
    ) -> None:
        """Reset the connection of the nth request matching (method, contains), once."""
        self._add(
            Rule(
                "reset",
                method,
                contains,
                nth=nth,
                upload_bytes=upload_bytes,
                download_bytes=download_bytes,
                answered=answered,
            )
        )

    def fail_next(
        self,
        method: str | None,
        contains: Target = "",
        status: int = 500,
        count: int = 1,
        code: str | None = None,
        body: bytes | None = None,
    ) -> None:
        """Answer the next `count` matching requests with `status` and an S3 error body (or
        `body`), unforwarded."""
        self._add(Rule("fail", method, contains, remaining=count, status=status, code=code, body=body))

    def delay(
        self, method: str | None, contains: Target = "", seconds: float = 1.0, count: int | None = None
    ) -> None:
        """Hold matching requests `seconds` before forwarding them (the next `count`, or all)."""
        self._add(Rule("delay", method, contains, remaining=count, seconds=seconds))

    def hold(self, method: str | None, contains: Target = "") -> threading.Event:
        """Hold the next matching request, unforwarded, until the event returned is set (at
        most HOLD_LIMIT seconds: a test that fails never leaves it hanging)."""
        released = threading.Event()
        self._add(Rule("hold", method, contains, remaining=1, released=released))
        return released

    def drop_header(
        self, method: str | None, contains: Target, header: str, count: int | None = None
    ) -> None:
        """Leave `header` out of the answers to matching requests (the next `count`, or all)."""
        self._add(Rule("drop", method, contains, remaining=count, header=header.lower()))

    def trickle(
        self,
        method: str | None,
        contains: Target,
        after_bytes: int = 0,
        interval: float = 1.0,
        count: int | None = None,
    ) -> None:
        """Answers to matching requests (the next `count`, or all) send `after_bytes` of
        their body, then a byte every `interval` seconds."""
        self._add(
            Rule("trickle", method, contains, remaining=count, after_bytes=after_bytes, interval=interval)
        )

    def release(self) -> None:
        """Forward the requests delay rules are holding now, without waiting out their time
        (a test that has seen what it held them for); later ones are held as before."""
        with self._lock:
            released, self._released = self._released, threading.Event()
        released.set()

    def hide_listed(self, key: str) -> None:
        """Leave the object `key` out of every listing from now on (until clear_rules)."""
        with self._lock:
            self._hidden.add(key)

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()
            self._hidden.clear()

    def pending_rules(self) -> int:
        """Rules that have not yet fired (or, for fail/delay with a count, not used up)."""
        with self._lock:
            return len(self._rules)

    def count(self, method: str | None = None, contains: Target = "") -> int:
        """Requests seen (since clear_counts) matching method (None: any) and a target substring."""
        with self._lock:
            return sum(1 for m, t in self._seen if (method is None or m == method) and hit(contains, t))

    def requests(self) -> list[tuple[str, str]]:
        """Every (method, target) seen since clear_counts, in order of arrival."""
        with self._lock:
            return list(self._seen)

    def ranges(self, contains: Target = "") -> list[tuple[int, int]]:
        """The byte ranges [lo, hi) of the GETs seen (since clear_counts) whose target holds
        `contains`, in order of arrival."""
        with self._lock:
            asked = [r for t, r in self._ranges if hit(contains, t)]
        out = []
        for r in asked:
            lo, hi = r.removeprefix("bytes=").split("-")
            out.append((int(lo), int(hi) + 1))
        return out

    def clear_counts(self) -> None:
        with self._lock:
            self._seen.clear()
            self._ranges.clear()

    def _add(self, rule: Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _plan(self, req: Request) -> Plan:
        """Count req and decide, under the lock, what the rules do to it."""
        plan = Plan()
        with self._lock:
            self._seen.append((req.method, req.target))
            asked = req.header("range") or req.header("x-ms-range")  # Azure's own name for it
            if req.method == "GET" and asked:
                self._ranges.append((req.target, asked))
            for rule in list(self._rules):
                if not rule.matches(req):
                    continue
                rule.seen += 1
                if rule.kind == "reset" and plan.reset is None and plan.fail is None:
                    if rule.seen == rule.nth:
                        plan.reset = rule
                        self._rules.remove(rule)
                elif rule.kind == "fail" and plan.reset is None and plan.fail is None:
                    plan.fail = rule
                    self._use(rule)
                elif rule.kind == "delay":
                    plan.delay += rule.seconds
                    self._use(rule)
                elif rule.kind == "hold" and plan.held is None:
                    plan.held = rule.released
                    self._use(rule)
                elif rule.kind == "drop":
                    plan.dropped.add(rule.header)
                    self._use(rule)
                elif rule.kind == "trickle" and plan.trickle is None:
                    plan.trickle = rule
                    self._use(rule)
        return plan

    def _use(self, rule: Rule) -> None:
        if rule.remaining is not None:
            rule.remaining -= 1
            if rule.remaining <= 0:
                self._rules.remove(rule)

    # -- running

    def __enter__(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))  # the kernel picks a free port: no clash to retry
        listener.listen(64)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while self._listener is not None:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(client)
                self.connections += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        rfile = client.makefile("rb")
        upstream = Upstream(self._upstream_addr)
        try:
            while self._serve_one(client, rfile, upstream):
                pass
        except Reset:
            reset(client)
        except (OSError, ValueError, ConnectionError):
            pass
        finally:
            with self._lock:
                self._conns.discard(client)
            rfile.close()
            upstream.close()
            client.close()

    def _serve_one(self, client: socket.socket, rfile: BinaryIO, upstream: Upstream) -> bool:
        """Serve one request of a client connection; whether the connection carries another."""
        head = read_head(rfile)
        if head is None:
            return False
        start, headers = parse_headers(head)
        method, target, version = start.split(" ", 2)
        req = Request(method, target, version, headers)
        with self._lock:
            released = self._released  # before the plan: a release() from now on frees it
        plan = self._plan(req)
        if plan.delay:
            released.wait(plan.delay)
        if plan.held is not None:
            plan.held.wait(HOLD_LIMIT)
        if plan.reset is not None and plan.reset.at_once():
            raise Reset()
        expects = (req.header("expect") or "").lower() == "100-continue"
        if plan.fail is not None:
            # a client that sent `Expect` holds its body back: it is refused unsent and the
            # connection closed, as servers do; any other body is read and dropped
            if not expects:
                copy_body(rfile, _Sink(), headers)  # type: ignore[arg-type]
            client.sendall(
                error_answer(req, plan.fail.status, plan.fail.code, close=expects, body=plan.fail.body)
            )
            return not expects
        if expects:
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        up = upstream.connect()
        up.sendall(encode_head(start, [(k, v) for k, v in headers if k.lower() != "expect"]))
        copy_body(rfile, up, headers, plan.reset.upload_bytes if plan.reset is not None else None)
        client_keeps = self._relay_answer(req, upstream, client, plan.reset, plan.dropped, plan.trickle)
        return client_keeps and (req.header("connection") or "").lower() != "close"

    def _relay_answer(
        self,
        req: Request,
        upstream: Upstream,
        client: socket.socket,
        rule: Rule | None,
        dropped: set[str] = frozenset(),  # type: ignore[assignment]
        trickle: Rule | None = None,
    ) -> bool:
        """Copy the server's answer to req back to the client (as far as a reset rule lets it);
        whether the client's connection can carry another request.

        Connections are hop by hop: the server's `Connection: close` (moto's server closes
        every connection) closes the proxy's connection to it, not the client's, which stays
        open as a store's would."""
        urfile = upstream.rfile
        head = read_head(urfile)
        while head is not None and parse_headers(head)[0].split(" ", 2)[1].startswith("1"):
            head = read_head(urfile)  # an interim answer: the proxy sent its own 100 Continue
        if head is None:
            raise ConnectionError("the server closed the connection without an answer")
        start, headers = parse_headers(head)
        status = int(start.split(" ", 2)[1])
        if (header_of(headers, "connection") or "").lower() == "close":
            upstream.closing = True
        if rule is not None and rule.answered:
            copy_body_to_nowhere(urfile, headers, req.method, status)
            raise Reset()
        no_body = req.method == "HEAD" or status in (204, 304)
        framed = (
            no_body
            or header_of(headers, "content-length") is not None
            or "chunked" in (header_of(headers, "transfer-encoding") or "").lower()
        )
        kept = [(k, v) for k, v in headers if k.lower() not in ("connection", "keep-alive", *dropped)]
        limit = rule.download_bytes if rule is not None else None
        with self._lock:
            hidden = set(self._hidden)
        flavour = listing_flavour(req.target) if req.method == "GET" else None
        if hidden and flavour is not None and status == 200 and framed:
            body = _without_keys(_read_body(urfile, headers), hidden, flavour)
            kept = [(k, v) for k, v in kept if k.lower() not in ("content-length", "transfer-encoding")]
            client.sendall(encode_head(start, [*kept, ("Content-Length", str(len(body)))]) + body)
            return True
        if trickle is not None and framed and not no_body:
            body = _read_body(urfile, headers)
            kept = [(k, v) for k, v in kept if k.lower() not in ("content-length", "transfer-encoding")]
            client.sendall(encode_head(start, [*kept, ("Content-Length", str(len(body)))]))
            client.sendall(body[: trickle.after_bytes])
            for at in range(trickle.after_bytes, len(body)):
                time.sleep(trickle.interval)
                client.sendall(body[at : at + 1])  # OSError once the client has given up
            return True
        client.sendall(encode_head(start, kept if framed else [*kept, ("Connection", "close")]))
        if no_body:
            if limit is not None:
                raise Reset()
        elif framed:
            copy_body(urfile, client, headers, limit)
        else:
            copy_to_end(urfile, client)
            upstream.closing = True
        return framed


def _read_body(rfile: BinaryIO, headers: list[tuple[str, str]]) -> bytes:
    """A framed answer body, whole."""
    out = io.BytesIO()

    class _Into:
        def sendall(self, data: bytes) -> None:
            out.write(data)

    raw_headers = headers
    if "chunked" in (header_of(headers, "transfer-encoding") or "").lower():
        # decode the chunks: copy_body copies the framing as it is
        data = b""
        while True:
            size = int(rfile.readline(MAX_HEAD).split(b";", 1)[0].strip(), 16)
            if size == 0:
                while rfile.readline(MAX_HEAD) not in (b"\r\n", b"\n", b""):
                    pass
                return data
            data += rfile.read(size)
            rfile.read(2)
    copy_body(rfile, _Into(), raw_headers)  # type: ignore[arg-type]
    return out.getvalue()


#: GCS's objects.list: a GET of a bucket's /o with a query (an object's path goes on past /o/)
_GCS_LISTING = re.compile(r"^/storage/v1/b/[^/?]+/o\?")


def listing_flavour(target: str) -> str | None:
    """Which store's listing a GET of `target` asks for ("s3", "gs", "az"), None for another
    request."""
    if "list-type=2" in target:
        return "s3"
    if _GCS_LISTING.match(target):
        return "gs"
    if "comp=list" in target and "restype=container" in target:
        return "az"
    return None


def _without_keys(body: bytes, hidden: set[str], flavour: str) -> bytes:
    """A listing answer of `flavour` without the entries of the keys `hidden`."""
    if flavour == "gs":
        page = json.loads(body)
        page["items"] = [item for item in page.get("items", []) if item.get("name") not in hidden]
        return json.dumps(page).encode()
    entry, name = (rb"<Contents>.*?</Contents>", rb"<Key>(.*?)</Key>")
    if flavour == "az":
        entry, name = (rb"<Blob>.*?</Blob>", rb"<Name>(.*?)</Name>")

    def keep(m: re.Match[bytes]) -> bytes:
        key = re.search(name, m.group(0))
        return b"" if key is not None and key.group(1).decode() in hidden else m.group(0)

    return re.sub(entry, keep, body, flags=re.S)


class Upstream:
    """The proxy's connection to the server for one client connection, made again after the
    server closes it."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.addr = addr
        self.sock: socket.socket | None = None
        self.rfile: BinaryIO = io.BytesIO()
        self.closing = False

    def connect(self) -> socket.socket:
        if self.sock is not None and self.closing:
            self.close()
        if self.sock is None:
            self.sock = socket.create_connection(self.addr)
            self.rfile = self.sock.makefile("rb")
            self.closing = False
        return self.sock

    def close(self) -> None:
        self.rfile.close()
        if self.sock is not None:
            self.sock.close()
        self.sock = None
