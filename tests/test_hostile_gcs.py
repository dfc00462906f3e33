"""A hostile GCS endpoint: a real HTTP server on 127.0.0.1, reached through STORAGE_EMULATOR_HOST,
whose JSON API answers each test bends (a wrong Content-Range, another generation served, an
absurd size, metadata that is not JSON or nests without end, listings that name objects outside
the prefix, repeat their page token or never end).  Every answer is refused with a ckptfmt
error naming the URL, in bounded time and memory, never wrong data or a crash."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CheckpointError, LimitError, StorageError
from ckptfmt.runs.objectrun import ObjectRun
from ckptfmt.storage import client, listing
from ckptfmt.storage.urls import parse_url

Answer = Callable[[BaseHTTPRequestHandler, dict[str, list[str]]], None]
URL = "gs://bucket/x.ckpt"


def _reply(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes = b"") -> None:
    h.send_response(status)
    for k, v in headers.items():
        h.send_header(k, v)
    h.send_header("Connection", "close")
    h.end_headers()
    h.wfile.write(body)


def _json(h: BaseHTTPRequestHandler, value: object, status: int = 200) -> None:
    body = json.dumps(value).encode()
    _reply(h, status, {"Content-Length": str(len(body)), "Content-Type": "application/json"}, body)


class HostileGCS:
    """Serves one object (`data`, generation 1) through GCS's JSON API, with answers bent by
    the `meta`, `media` and `listing` hooks."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.meta: Answer | None = None
        self.media: Answer | None = None
        self.listing: Answer | None = None
        self.seen: list[tuple[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's names
                outer.seen.append(("GET", self.path))
                parts = urlsplit(self.path)
                query = parse_qs(parts.query, keep_blank_values=True)
                if parts.path.endswith("/o"):
                    (outer.listing or outer.empty_listing)(self, query)
                elif query.get("alt") == ["media"]:
                    (outer.media or outer.honest_media)(self, query)
                else:
                    (outer.meta or outer.honest_meta)(self, query)

            def do_DELETE(self) -> None:  # noqa: N802
                outer.seen.append(("DELETE", self.path))
                _reply(self, 204, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def honest_meta(self, h: BaseHTTPRequestHandler, query: dict[str, list[str]]) -> None:
        name = unquote(urlsplit(h.path).path.rsplit("/o/", 1)[1])
        _json(h, {"name": name, "size": str(len(self.data)), "generation": "1"})

    def honest_media(self, h: BaseHTTPRequestHandler, query: dict[str, list[str]]) -> None:
        lo, hi = (int(v) for v in h.headers["Range"].split("=")[1].split("-"))
        headers = {
            "Content-Length": str(hi + 1 - lo),
            "Content-Range": f"bytes {lo}-{hi}/{len(self.data)}",
            "x-goog-generation": "1",
        }
        _reply(h, 206, headers, self.data[lo : hi + 1])

    def empty_listing(self, h: BaseHTTPRequestHandler, query: dict[str, list[str]]) -> None:
        _json(h, {"kind": "storage#objects"})

    def deletes(self) -> list[str]:
        return [p for m, p in self.seen if m == "DELETE"]


@pytest.fixture
def store(tmp_path, monkeypatch) -> Iterator[HostileGCS]:
    ckptfmt.save({"a": torch.arange(3000), "b": torch.ones(10)}, tmp_path / "x.ckpt")
    s = HostileGCS((tmp_path / "x.ckpt").read_bytes())
    s.thread.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", s.endpoint)
    try:
        yield s
    finally:
        s.server.shutdown()
        s.server.server_close()


OPTIONS = {"max_attempts": 2}


def _within(seconds: float, call: Callable[[], object]) -> BaseException:
    """The error `call` raises, which must come within `seconds`."""
    start = time.monotonic()
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - the test inspects what came
        assert time.monotonic() - start < seconds, f"took {time.monotonic() - start:.1f} s"
        return e
    raise AssertionError("no error")


def test_the_honest_store_serves_the_object(store):
    assert torch.equal(ckptfmt.load(URL, storage_options=OPTIONS)["a"], torch.arange(3000))


def test_a_wrong_content_range_is_refused(store):
    def shifted(h, query):
        lo, hi = (int(v) for v in h.headers["Range"].split("=")[1].split("-"))
        headers = {
            "Content-Length": str(hi + 1 - lo),
            "Content-Range": f"bytes {lo + 1}-{hi + 1}/{len(store.data)}",
        }
        _reply(h, 206, headers, store.data[lo : hi + 1])

    store.media = shifted
    e = _within(10, lambda: ckptfmt.load(URL, storage_options=OPTIONS))
    assert isinstance(e, StorageError) and "the store answered" in str(e) and URL in str(e), e


def test_a_store_serving_another_generation_cannot_mix_two_versions(store):
    # a server that ignores generation= and serves what is there now
    def newer(h, query):
        store.honest_media(h, query) if query.get("generation") != ["1"] else None
        lo, hi = (int(v) for v in h.headers["Range"].split("=")[1].split("-"))
        headers = {
            "Content-Length": str(hi + 1 - lo),
            "Content-Range": f"bytes {lo}-{hi}/{len(store.data)}",
            "x-goog-generation": "2",
        }
        _reply(h, 206, headers, store.data[lo : hi + 1])

    store.media = newer
    e = _within(10, lambda: ckptfmt.load(URL, storage_options=OPTIONS))
    assert isinstance(e, StorageError) and "changed while it was being read" in str(e), e
    assert all("generation=1" in p for m, p in store.seen if "alt=media" in p)


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", b"[" * 200_000 + b"]" * 200_000, b'{"size": "-5", "generation": "1"}'],
    ids=["not-json", "not-an-object", "nested-without-end", "negative-size"],
)
def test_metadata_that_is_not_an_object_description_is_refused(store, body):
    store.meta = lambda h, q: _reply(h, 200, {"Content-Length": str(len(body))}, body)
    e = _within(10, lambda: ckptfmt.load(URL, storage_options=OPTIONS))
    assert isinstance(e, StorageError) and URL in str(e), repr(e)


def test_an_absurd_size_is_refused_before_anything_is_allocated(store):
    store.meta = lambda h, q: _json(h, {"size": str(1 << 60), "generation": "1"})
    e = _within(10, lambda: ckptfmt.load(URL, storage_options=OPTIONS))
    assert isinstance(e, LimitError) and URL in str(e), e


def test_a_listing_naming_objects_outside_the_prefix_is_refused_and_nothing_deleted(store):
    store.listing = lambda h, q: _json(
        h, {"items": [{"name": "other/secret", "size": "1", "generation": "1"}]}
    )
    e = _within(10, lambda: ObjectRun("gs://bucket/run", OPTIONS).statuses())
    assert isinstance(e, StorageError) and "outside" in str(e) and "gs://bucket/run" in str(e), e
    assert store.deletes() == []


def test_a_listing_repeating_its_page_token_is_refused(store):
    store.listing = lambda h, q: _json(h, {"prefixes": ["run/step-000000001/"], "nextPageToken": "again"})
    e = _within(10, lambda: listing.child_names(parse_url("gs://bucket/run", need_key=False), OPTIONS))
    assert isinstance(e, StorageError) and "repeats a continuation token" in str(e), e


def test_an_endless_listing_body_is_refused_before_it_is_parsed(store):
    def endless(h, query):
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.end_headers()
        page = b'{"items": [' + b'{"name": "run/x", "size": "1"},' * 1000
        try:
            for _ in range((256 << 20) // len(page)):
                h.wfile.write(page)
        except OSError:
            pass  # the client hung up

    store.listing = endless
    e = _within(20, lambda: ObjectRun("gs://bucket/run", OPTIONS).statuses())
    assert (
        isinstance(e, LimitError) and str(client.MAX_LISTING_BODY) in str(e) and "gs://bucket/run" in str(e)
    ), e


def test_a_metadata_answer_that_trickles_in_is_cut_at_the_deadline(store):
    def trickle(h, query):
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        try:
            for _ in range(100):
                h.wfile.write(b" ")
                h.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass

    store.meta = trickle
    e = _within(15, lambda: ckptfmt.load(URL, storage_options={"max_attempts": 1, "deadline": 3}))
    assert isinstance(e, StorageError) and "did not arrive within" in str(e) and URL in str(e), e


def test_a_refused_request_is_named_with_gcs_reason(store):
    store.meta = lambda h, q: _json(h, {"error": {"code": 403, "errors": [{"reason": "forbidden"}]}}, 403)
    e = _within(10, lambda: ckptfmt.load(URL, storage_options=OPTIONS))
    assert isinstance(e, StorageError) and "access denied (forbidden)" in str(e), e
    assert isinstance(e, CheckpointError)
