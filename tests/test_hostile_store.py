"""A hostile object store: a real HTTP server on 127.0.0.1 whose answers each test chooses
(a wrong Content-Range, a body longer or shorter than promised, no ETag, an absurd size,
listings that name keys outside the prefix or never end).  Every answer is refused with a
ckptfmt error naming the URL, in bounded time and memory, never wrong data or a crash."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CheckpointError, LimitError, StorageError
from ckptfmt.runs.objectrun import ObjectRun

Answer = Callable[[BaseHTTPRequestHandler], None]


def _reply(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes = b"") -> None:
    h.send_response(status)
    for k, v in headers.items():
        h.send_header(k, v)
    h.send_header("Connection", "close")
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)


class HostileStore:
    """Serves one object's bytes (`data`) with answers bent by `bend` hooks."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.head: Answer | None = None
        self.get: Answer | None = None
        self.listing: Answer | None = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's names
                (outer.head or outer.honest_head)(self)

            def do_GET(self) -> None:  # noqa: N802
                if "list-type" in parse_qs(urlsplit(self.path).query):
                    (outer.listing or outer.empty_listing)(self)
                else:
                    (outer.get or outer.honest_get)(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def honest_head(self, h: BaseHTTPRequestHandler) -> None:
        _reply(h, 200, {"Content-Length": str(len(self.data)), "ETag": '"v1"'})

    def ranged(self, h: BaseHTTPRequestHandler) -> tuple[int, int]:
        lo, hi = h.headers["Range"].split("=")[1].split("-")
        return int(lo), int(hi) + 1

    def honest_get(self, h: BaseHTTPRequestHandler) -> None:
        lo, hi = self.ranged(h)
        headers = {"Content-Length": str(hi - lo), "Content-Range": f"bytes {lo}-{hi - 1}/{len(self.data)}"}
        _reply(h, 206, headers | {"ETag": '"v1"'}, self.data[lo:hi])

    def empty_listing(self, h: BaseHTTPRequestHandler) -> None:
        body = b'<?xml version="1.0"?><ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>'
        _reply(h, 200, {"Content-Length": str(len(body)), "Content-Type": "application/xml"}, body)

    @property
    def options(self) -> dict[str, object]:
        return {
            "endpoint_url": f"http://127.0.0.1:{self.server.server_address[1]}",
            "region_name": "us-east-1",
            "aws_access_key_id": "k",
            "aws_secret_access_key": "s",
            "max_attempts": 2,
            "addressing_style": "path",
        }


@pytest.fixture
def store(tmp_path) -> Iterator[HostileStore]:
    ckptfmt.save({"a": torch.arange(3000), "b": torch.ones(10)}, tmp_path / "x.ckpt")
    s = HostileStore((tmp_path / "x.ckpt").read_bytes())
    s.thread.start()
    yield s
    s.server.shutdown()
    s.server.server_close()


URL = "s3://bucket/x.ckpt"


def test_the_honest_store_loads(store):
    assert torch.equal(ckptfmt.load(URL, storage_options=store.options)["a"], torch.arange(3000))


def test_a_wrong_content_range_is_refused(store):
    def shifted(h):
        lo, hi = store.ranged(h)
        lo2 = max(0, lo - 64)
        headers = {
            "Content-Length": str(hi - lo),
            "Content-Range": f"bytes {lo2}-{lo2 + hi - lo - 1}/{len(store.data)}",
        }
        _reply(h, 206, headers, store.data[lo2 : lo2 + hi - lo])

    store.get = shifted
    with pytest.raises(StorageError, match="the store answered") as e:
        ckptfmt.load(URL, storage_options=store.options)
    assert URL in str(e.value)


def test_a_short_body_is_retried_then_refused(store):
    def short(h):
        lo, hi = store.ranged(h)
        headers = {"Content-Length": str(hi - lo), "Content-Range": f"bytes {lo}-{hi - 1}/{len(store.data)}"}
        _reply(h, 206, headers, store.data[lo : hi - 7])  # promises more than it sends, then closes

    store.get = short
    with pytest.raises(StorageError) as e:
        ckptfmt.load(URL, storage_options=store.options)
    assert URL in str(e.value)


def test_a_whole_object_instead_of_a_range_is_refused(store):
    store.get = lambda h: _reply(h, 200, {"Content-Length": str(len(store.data))}, store.data)
    with pytest.raises(StorageError, match="the store answered None"):
        ckptfmt.load(URL, storage_options=store.options)


def test_a_missing_etag_or_size_is_refused(store):
    store.head = lambda h: _reply(h, 200, {"Content-Length": str(len(store.data))})
    with pytest.raises(StorageError, match="lacks the object's size or ETag"):
        ckptfmt.load(URL, storage_options=store.options)


def test_an_absurd_size_is_refused_before_anything_is_allocated(store):
    store.head = lambda h: _reply(h, 200, {"Content-Length": str(1 << 60), "ETag": '"v1"'})
    with pytest.raises(LimitError, match="above the limit"):
        ckptfmt.load(URL, storage_options=store.options)


def test_bytes_that_differ_from_what_was_saved_fail_their_checksum(store):
    def flipped(h):
        lo, hi = store.ranged(h)
        body = bytearray(store.data[lo:hi])
        if lo <= 100 < hi:
            body[100 - lo] ^= 1
        headers = {"Content-Length": str(hi - lo), "Content-Range": f"bytes {lo}-{hi - 1}/{len(store.data)}"}
        _reply(h, 206, headers, bytes(body))

    store.get = flipped
    with pytest.raises(ckptfmt.CorruptError, match="checksum"):
        ckptfmt.load(URL, storage_options=store.options)


def test_an_empty_object_is_not_a_checkpoint(store):
    store.data = b""
    with pytest.raises(CheckpointError):
        ckptfmt.load(URL, storage_options=store.options)


def _listing(keys: list[str], truncated: bool = False, token: str | None = None) -> Answer:
    contents = "".join(f"<Contents><Key>{k}</Key><Size>1</Size></Contents>" for k in keys)
    more = f"<NextContinuationToken>{token}</NextContinuationToken>" if token else ""
    body = (
        f'<?xml version="1.0"?><ListBucketResult><IsTruncated>{str(truncated).lower()}</IsTruncated>'
        f"{more}{contents}</ListBucketResult>"
    ).encode()
    return lambda h: _reply(
        h, 200, {"Content-Length": str(len(body)), "Content-Type": "application/xml"}, body
    )


def test_a_listing_outside_the_prefix_is_refused(store):
    store.listing = _listing(["run/step-000000001/COMMIT", "other/step-000000002/COMMIT"])
    with pytest.raises(StorageError, match="outside"):
        ObjectRun("s3://bucket/run", store.options).statuses()


def test_a_truncated_listing_without_a_token_is_refused(store):
    store.listing = _listing(["run/step-000000001/COMMIT"], truncated=True)
    with pytest.raises(StorageError, match="continuation"):
        ObjectRun("s3://bucket/run", store.options).statuses()


def test_names_that_are_not_steps_are_ignored(store):
    store.listing = _listing(["run/step-x/COMMIT", "run/../COMMIT", "run/COMMIT", "run/step-000000001/"])
    assert ObjectRun("s3://bucket/run", store.options).statuses() == []
