"""A hostile object store: a real HTTP server on 127.0.0.1 whose answers each test chooses
(a wrong Content-Range, a body longer or shorter than promised, no ETag, an absurd size,
listings that name keys outside the prefix or never end).  Every answer is refused with a
ckptfmt error naming the URL, in bounded time and memory, never wrong data or a crash."""

from __future__ import annotations

import datetime
import email.utils
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CheckpointError, LimitError, StorageError
from ckptfmt.runs.objectrun import ObjectRun
from ckptfmt.runs.steps import step_dirname
from ckptfmt.storage import listing
from ckptfmt.storage.urls import parse_url

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
        self.uploads: Answer | None = None
        #: every request as (method, path with query), in the order they came
        self.seen: list[tuple[str, str]] = []
        #: the objects PUT and not deleted since (path: when), which listed_with_puts lists
        self.puts: dict[str, str] = {}
        #: how far the store's clock, stamping what is PUT, is behind this host's
        self.behind = datetime.timedelta(0)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def date_time_string(self, timestamp: float | None = None) -> str:
                return email.utils.format_datetime(outer.now(), usegmt=True)  # the store's clock

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's names
                outer.seen.append(("HEAD", self.path))
                (outer.head or outer.honest_head)(self)

            def do_GET(self) -> None:  # noqa: N802
                outer.seen.append(("GET", self.path))
                query = parse_qs(urlsplit(self.path).query, keep_blank_values=True)
                if "list-type" in query:
                    (outer.listing or outer.empty_listing)(self)
                elif "uploads" in query:
                    (outer.uploads or outer.no_uploads)(self)
                else:
                    (outer.get or outer.honest_get)(self)

            def do_DELETE(self) -> None:  # noqa: N802
                outer.seen.append(("DELETE", self.path))
                outer.puts.pop(urlsplit(self.path).path, None)
                _reply(self, 204, {})

            def do_PUT(self) -> None:  # noqa: N802
                outer.seen.append(("PUT", self.path))
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.puts[urlsplit(self.path).path] = _stamp(outer.now())
                _reply(self, 200, {"ETag": '"p1"'})

            def do_POST(self) -> None:  # noqa: N802
                outer.seen.append(("POST", self.path))
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = b'<?xml version="1.0"?><DeleteResult></DeleteResult>'
                _reply(self, 200, {"Content-Length": str(len(body)), "Content-Type": "application/xml"}, body)

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

    def no_uploads(self, h: BaseHTTPRequestHandler) -> None:
        body = b'<?xml version="1.0"?><ListMultipartUploadsResult><IsTruncated>false</IsTruncated></ListMultipartUploadsResult>'
        _reply(h, 200, {"Content-Length": str(len(body)), "Content-Type": "application/xml"}, body)

    def now(self) -> datetime.datetime:
        """The store's clock."""
        return datetime.datetime.now(datetime.timezone.utc) - self.behind

    def listed_with_puts(self, keys: list[str], modified: str, etag: str, show_puts: bool = True) -> Answer:
        """A listing of those of `keys` (written at `modified`, as `etag`) beneath the prefix
        asked for, and of the objects PUT and not deleted since, as they were written (a
        cleaner reads the store's clock so: a marker of its own put and listed), unless
        `show_puts` is False (a listing that lags behind every PUT)."""

        def answer(h: BaseHTTPRequestHandler) -> None:
            prefix = parse_qs(urlsplit(h.path).query).get("prefix", [""])[0]
            put = [(p.removeprefix("/bucket/"), when) for p, when in self.puts.items()] if show_puts else []
            contents = [(k, modified) for k in keys] + put
            _listing_of([(k, w) for k, w in contents if k.startswith(prefix)], etag)(h)

        return answer

    def deletes(self) -> list[tuple[str, str]]:
        """The requests that delete something (DELETE, and POST ?delete of many keys)."""
        return [(m, p) for m, p in self.seen if m in ("DELETE", "POST")]

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
        lo2 = lo - 64 if lo >= 64 else lo + 64  # a load's first range may start at 0
        headers = {
            "Content-Length": str(hi - lo),
            "Content-Range": f"bytes {lo2}-{lo2 + hi - lo - 1}/{len(store.data)}",
        }
        _reply(h, 206, headers | {"ETag": '"v1"'}, store.data[lo2 : lo2 + hi - lo])

    store.get = shifted
    with pytest.raises(StorageError, match="the store answered") as e:
        ckptfmt.load(URL, storage_options=store.options)
    assert URL in str(e.value)


def test_a_short_body_is_retried_then_refused(store):
    def short(h):
        lo, hi = store.ranged(h)
        headers = {"Content-Length": str(hi - lo), "Content-Range": f"bytes {lo}-{hi - 1}/{len(store.data)}"}
        # promises more than it sends, then closes
        _reply(h, 206, headers | {"ETag": '"v1"'}, store.data[lo : hi - 7])

    store.get = short
    with pytest.raises(StorageError, match="the body ended after") as e:
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


@pytest.mark.parametrize("verify", [True, False])
def test_ranged_answers_without_an_etag_are_refused_not_mixed_with_another_version(store, tmp_path, verify):
    """A store that ignores If-Match and names no ETag in its ranged answers serves the cells of
    a newer object of the same size: nothing then shows which version each cell is.  Unverified,
    the load returned a tensor made of both versions."""
    ckptfmt.save({"a": torch.arange(3 << 18), "b": torch.ones(10)}, tmp_path / "old.ckpt")
    store.data = (tmp_path / "old.ckpt").read_bytes()
    ckptfmt.save({"a": torch.arange(3 << 18) + 1, "b": torch.ones(10)}, tmp_path / "new.ckpt")
    newer = (tmp_path / "new.ckpt").read_bytes()
    assert len(newer) == len(store.data)

    def replaced(h):
        lo, hi = store.ranged(h)
        if lo == 0 or hi == len(store.data):  # the ends, the index among them: the old version
            store.honest_get(h)
            return
        headers = {"Content-Length": str(hi - lo), "Content-Range": f"bytes {lo}-{hi - 1}/{len(newer)}"}
        _reply(h, 206, headers, newer[lo:hi])  # no ETag: the new version's bytes

    store.get = replaced
    options = store.options | {"request_size": 1 << 20}
    with pytest.raises(StorageError, match="names no ETag"):
        ckptfmt.load(URL, storage_options=options, verify=verify)


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
        _reply(h, 206, headers | {"ETag": '"v1"'}, bytes(body))

    store.get = flipped
    with pytest.raises(ckptfmt.CorruptError, match="checksum"):
        ckptfmt.load(URL, storage_options=store.options)


def test_an_empty_object_is_not_a_checkpoint(store):
    store.data = b""
    with pytest.raises(CheckpointError):
        ckptfmt.load(URL, storage_options=store.options)


def _stamp(when: datetime.datetime) -> str:
    """`when` as S3 writes a time in an answer's XML body."""
    return when.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _listing(
    keys: list[str],
    truncated: bool = False,
    token: str | None = None,
    modified: str | None = None,
    etag: str | None = None,
) -> Answer:
    return _listing_of([(k, modified) for k in keys], etag, truncated, token)


def _listing_of(
    keys: list[tuple[str, str | None]], etag: str | None, truncated: bool = False, token: str | None = None
) -> Answer:
    """A listing of (key, written at) of `keys`, each as version `etag`."""
    tag = f"<ETag>&quot;{etag}&quot;</ETag>" if etag else ""
    contents = "".join(
        f"<Contents><Key>{k}</Key><Size>1</Size>"
        + (f"<LastModified>{when}</LastModified>" if when else "")
        + f"{tag}</Contents>"
        for k, when in keys
    )
    more = f"<NextContinuationToken>{token}</NextContinuationToken>" if token else ""
    body = (
        f'<?xml version="1.0"?><ListBucketResult><IsTruncated>{str(truncated).lower()}</IsTruncated>'
        f"{more}{contents}</ListBucketResult>"
    ).encode()
    return lambda h: _reply(
        h, 200, {"Content-Length": str(len(body)), "Content-Type": "application/xml"}, body
    )


def _pages(keys: list[str], per: int = 1000) -> Answer:
    """`keys` listed as S3 does, at most `per` (MaxKeys' default) a page, each page but the last
    naming the next by its continuation token."""

    def answer(h: BaseHTTPRequestHandler) -> None:
        token = parse_qs(urlsplit(h.path).query).get("continuation-token", ["0"])[0]
        start = int(token)
        end = start + per
        more = end < len(keys)
        _listing(keys[start:end], truncated=more, token=str(end) if more else None)(h)

    return answer


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


def _within(seconds: float, call: Callable[[], object]) -> BaseException | None:
    """Run `call` on a thread and return what it raised (None if nothing); fail the test when
    it has not finished in `seconds` (the thread is left to the store's shutdown)."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            call()
        except BaseException as e:
            box[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    return box[0]


def test_a_listing_that_repeats_its_continuation_token_is_refused(store):
    # a store (or a proxy) answering "more to come" with the same token forever
    store.listing = _listing(["run/step-000000001/COMMIT"], truncated=True, token="again")
    e = _within(10, lambda: ObjectRun("s3://bucket/run", store.options).statuses())
    assert isinstance(e, StorageError) and "repeats" in str(e), e
    assert "s3://bucket/run" in str(e)


def test_an_endless_listing_is_bounded(store, monkeypatch):
    # fresh tokens forever, each page naming the same keys: refused once the listing names
    # more entries than any run holds
    monkeypatch.setattr(listing, "MAX_LISTED", 50)
    pages = iter(range(10**9))
    store.listing = lambda h: _listing(
        ["run/step-000000001/COMMIT"], truncated=True, token=f"t{next(pages)}"
    )(h)
    e = _within(10, lambda: ObjectRun("s3://bucket/run", store.options).statuses())
    assert isinstance(e, LimitError) and "entries" in str(e), e
    assert "s3://bucket/run" in str(e)
    e = _within(10, lambda: listing.child_names(parse_url("s3://bucket/run"), store.options))
    assert isinstance(e, LimitError), e


STALE = "2000-01-01T00:00:00.000Z"


def test_cleanup_keeps_a_step_whose_record_the_listing_left_out(store):
    # the listing names step 1's state but not its COMMIT (a lying or lagging store), all
    # written long ago: a complete step looks like a crashed saver's leftover
    store.listing = store.listed_with_puts(["run/step-000000001/state.ckpt"], STALE, "v1")
    store.get = lambda h: _reply(h, 404, {})  # a record gone between a HEAD and its GET: no references
    ObjectRun("s3://bucket/run", store.options).cleanup()
    assert store.deletes() == []
    # where the record is truly absent, the leftover goes once the store's time is proven (a
    # marker of the cleaner's own put, listed, deleted): the versions listed, never a record
    store.head = lambda h: _reply(h, 404, {}) if h.path.endswith("/COMMIT") else store.honest_head(h)
    ObjectRun("s3://bucket/run", store.options).cleanup()
    deleted = [p for m, p in store.deletes()]
    assert deleted[-1] == "/bucket/run/step-000000001/state.ckpt"
    assert all(p.startswith("/bucket/run/CLOCK/ARCHIVING.") for p in deleted[:-1]) and not store.puts


def test_cleanup_deletes_nothing_by_age_where_the_store_proves_no_time(store):
    # a leftover written long ago, no record; but the listing never shows the marker the
    # cleaner put to read the store's clock (a lagging or lying listing): no store time is
    # proven, so nothing is aged, and only the cleaner's own marker is deleted
    store.head = lambda h: _reply(h, 404, {}) if h.path.endswith("/COMMIT") else store.honest_head(h)
    store.listing = store.listed_with_puts(["run/step-000000001/state.ckpt"], STALE, "v1", show_puts=False)
    ObjectRun("s3://bucket/run", store.options).cleanup()
    deleted = [p for m, p in store.deletes()]
    assert deleted == [p for p in deleted if p.startswith("/bucket/run/CLOCK/ARCHIVING.")] != []
    assert not store.puts


def test_a_pass_on_a_host_whose_clock_is_ahead_aborts_only_uploads_begun_before_it(store):
    # a copy that died in step 2 (its marker this process's, no longer in use) left an upload
    # begun a minute ago; a newcomer's upload there began just now, after the pass listed the
    # prefix.  An archive pass on a host whose clock is 25 hours ahead of the store's removes
    # the prefix and aborts the first upload only: uploads' starts, stamped by the store, are
    # compared with the pass's start by the store's clock (a marker of the pass's own), not
    # by this host's, by which both began long before the pass
    from ckptfmt.runs.objectnames import copy_marker

    store.behind = datetime.timedelta(hours=25)

    step = "run/step-000000002"
    store.head = lambda h: _reply(h, 404, {}) if h.path.endswith("/COMMIT") else store.honest_head(h)
    store.listing = store.listed_with_puts([f"{step}/{copy_marker()}", f"{step}/state.ckpt"], STALE, "v1")

    ago = {"dead": datetime.timedelta(minutes=1), "newcomer": datetime.timedelta(0)}
    store.uploads = _uploads_begun(store, f"{step}/state.ckpt", ago)
    run = ObjectRun("s3://bucket/run", store.options)
    assert run.remove_interrupted_copies(older_than=datetime.timedelta(0)) == [2]
    aborted = [p for m, p in store.deletes() if "uploadId=" in p]
    assert len(aborted) == 1 and "uploadId=dead" in aborted[0], aborted


def test_removing_a_dead_copys_prefix_aborts_no_upload_younger_than_the_bound(store):
    # the prefix of a copy that died holds an old object and an upload begun a minute ago by
    # the store's clock: a plain saver on another host, under way in that step (an upload not
    # yet complete is no listed object, so nothing the removal looks at shows it), keeps its
    # upload; only one begun more than the bound (24 hours) before the store's time goes
    from ckptfmt.runs.objectnames import copy_marker

    step = "run/step-000000002"
    store.head = lambda h: _reply(h, 404, {}) if h.path.endswith("/COMMIT") else store.honest_head(h)
    store.listing = store.listed_with_puts([f"{step}/{copy_marker()}", f"{step}/state.ckpt"], STALE, "v1")
    ago = {"live": datetime.timedelta(minutes=1), "crashed": datetime.timedelta(days=2)}
    store.uploads = _uploads_begun(store, f"{step}/rank-00000.ckpt", ago)
    assert ObjectRun("s3://bucket/run", store.options).remove_interrupted_copies() == [2]
    aborted = [p for m, p in store.deletes() if "uploadId=" in p]
    assert len(aborted) == 1 and "uploadId=crashed" in aborted[0], aborted


def test_a_cleanup_on_a_host_whose_clock_is_ahead_aborts_no_live_saver_upload(store):
    # a saver on another host began a multipart upload a minute ago, a crashed one two days
    # ago, by the store's clock, which is 25 hours behind this host's (its Date too): by this
    # host's clock both are past the cleanup's bound of 24 hours; by the store's time, which a
    # marker of the cleaner's own proves, only the crashed saver's upload is, and only it goes
    store.behind = datetime.timedelta(hours=25)
    store.listing = store.listed_with_puts([], STALE, "v1")

    ago = {"crashed": datetime.timedelta(days=2), "live": datetime.timedelta(minutes=1)}
    store.uploads = _uploads_begun(store, "run/step-000000002/state.ckpt", ago)
    ObjectRun("s3://bucket/run", store.options).cleanup()
    aborted = [p for m, p in store.deletes() if "uploadId=" in p]
    assert len(aborted) == 1 and "uploadId=crashed" in aborted[0], aborted
    assert not store.puts  # the cleaner's marker is gone


def test_a_save_never_deletes_a_step_whose_record_the_listing_left_out(store):
    store.listing = _listing(["run/step-000000001/state.ckpt"], modified=STALE)
    manager = ckptfmt.CheckpointManager("s3://bucket/run", storage_options=store.options)
    with pytest.raises(CheckpointError, match="commit record"):
        manager.save(1, {"w": torch.ones(3)})
    assert store.deletes() == []


def test_a_store_ignoring_if_match_cannot_mix_two_versions(store, tmp_path):
    # the object is replaced by another save of the same size after the reader's HEAD; a store
    # that ignores If-Match answers the later ranges from the new version, under its new ETag
    # (3 MiB: a load makes several requests, in cells of 1 MiB)
    ckptfmt.save({"a": torch.arange(3 << 18), "b": torch.ones(10)}, tmp_path / "x.ckpt")
    store.data = (tmp_path / "x.ckpt").read_bytes()
    ckptfmt.save({"a": torch.arange(3 << 18) + 1, "b": torch.ones(10)}, tmp_path / "y.ckpt")
    newer = (tmp_path / "y.ckpt").read_bytes()
    assert len(newer) == len(store.data)
    served = iter(range(10**9))

    def replaced(h):
        lo, hi = store.ranged(h)
        data, etag = (store.data, '"v1"') if next(served) == 0 else (newer, '"v2"')
        headers = {"Content-Length": str(hi - lo), "Content-Range": f"bytes {lo}-{hi - 1}/{len(data)}"}
        _reply(h, 206, headers | {"ETag": etag}, data[lo:hi])

    store.get = replaced
    with pytest.raises(StorageError, match="changed while it was being read") as e:
        ckptfmt.load(URL, storage_options=store.options | {"request_size": 1 << 20})
    assert URL in str(e.value)


def test_cleanup_aborts_only_uploads_of_the_runs_steps(s3_bucket):
    # a run at the bucket's root, or with other things beneath its prefix: another program's
    # multipart upload there is not a crashed saver's leftover of this run
    import datetime

    from s3_server import s3_client

    bucket, options = s3_bucket
    c = s3_client(options["endpoint_url"])
    for key in ("step-000000003/state.ckpt", "uploads/video.mp4", "run/step-000000001/state.ckpt"):
        c.create_multipart_upload(Bucket=bucket, Key=key)
    ObjectRun(f"s3://{bucket}", options).cleanup(older_than=datetime.timedelta(hours=1))
    left = sorted(u["Key"] for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", []))
    assert left == ["run/step-000000001/state.ckpt", "uploads/video.mp4"]


def test_an_uploaded_part_answered_without_an_etag_is_a_storage_error(s3_faults):
    # a multipart upload whose part answers lack the ETag the completion must name: a
    # StorageError naming the URL (it was a KeyError), and no object, no upload left behind
    bucket = s3_faults.new_bucket()
    url = f"s3://{bucket}/x.ckpt"
    s3_faults.drop_header("PUT", "partNumber=2", "ETag")
    state = {"w": torch.arange(6 << 20, dtype=torch.int32)}  # 24 MiB: parts of 8 MiB
    options = s3_faults.storage_options() | {"part_size": 8 << 20}
    with pytest.raises(StorageError, match="no ETag") as e:
        ckptfmt.save(state, url, storage_options=options)
    assert url in str(e.value)
    c = s3_faults.client()
    assert "Contents" not in c.list_objects_v2(Bucket=bucket)
    assert not c.list_multipart_uploads(Bucket=bucket).get("Uploads")


@pytest.mark.parametrize("when", ["2000-01-01T00:00:00", "2000-01-01T00:00:00+05:00", "not a time"])
def test_listing_times_of_any_form_never_crash_cleanup(store, when):
    # a time without a zone (botocore then gives a naive datetime), with another zone, or
    # none it can parse: cleanup compares them to now, or leaves the step alone
    store.head = lambda h: _reply(h, 404, {}) if h.path.endswith("/COMMIT") else store.honest_head(h)
    store.listing = _listing(["run/step-000000001/state.ckpt"], modified=when)
    e = _within(20, lambda: ObjectRun("s3://bucket/run", store.options).cleanup())
    assert e is None or isinstance(e, CheckpointError), repr(e)


def test_an_unreadable_header_in_a_ranged_answer_is_a_storage_error(store):
    # botocore parses Last-Modified; one it cannot parse raised a plain ValueError mid-load
    def garbled(h):
        lo, hi = store.ranged(h)
        headers = {"Content-Length": str(hi - lo), "Content-Range": f"bytes {lo}-{hi - 1}/{len(store.data)}"}
        _reply(h, 206, headers | {"ETag": '"v1"', "Last-Modified": "not a time"}, store.data[lo:hi])

    store.get = garbled
    with pytest.raises(StorageError) as e:
        ckptfmt.load(URL, storage_options=store.options)
    assert URL in str(e.value)


def _uploads_begun(store: HostileStore, key: str, ago: dict[str, datetime.timedelta]) -> Answer:
    """A ListMultipartUploads answer naming uploads of `key`, by id, each begun as long `ago` by
    the store's clock as it answers."""

    def answer(h: BaseHTTPRequestHandler) -> None:
        now = store.now()
        ups = "".join(
            f"<Upload><Key>{key}</Key><UploadId>{who}</UploadId><Initiated>{_stamp(now - t)}</Initiated></Upload>"
            for who, t in ago.items()
        )
        body = f'<?xml version="1.0"?><ListMultipartUploadsResult>{ups}</ListMultipartUploadsResult>'.encode()
        _reply(h, 200, {"Content-Length": str(len(body)), "Content-Type": "application/xml"}, body)

    return answer


def _uploads(keys: list[str], next_marker: str | None = None) -> Answer:
    """A ListMultipartUploads answer naming uploads of `keys` begun long ago; truncated, with
    `next_marker` as its next key marker, when one is given."""
    ups = "".join(
        f"<Upload><Key>{k}</Key><UploadId>u-{k}</UploadId><Initiated>{STALE}</Initiated></Upload>"
        for k in keys
    )
    more = (
        f"<IsTruncated>true</IsTruncated><NextKeyMarker>{next_marker}</NextKeyMarker>"
        f"<NextUploadIdMarker>u-{next_marker}</NextUploadIdMarker>"
        if next_marker
        else "<IsTruncated>false</IsTruncated>"
    )
    body = (
        f'<?xml version="1.0"?><ListMultipartUploadsResult>{more}{ups}</ListMultipartUploadsResult>'.encode()
    )
    return lambda h: _reply(
        h, 200, {"Content-Length": str(len(body)), "Content-Type": "application/xml"}, body
    )


def test_cleanup_reads_every_page_of_uploads(store):
    # a crashed saver's upload on the second page of the listing of uploads is aborted too
    def paged(h):
        first = "key-marker" not in parse_qs(urlsplit(h.path).query)
        if first:
            _uploads(["run/step-000000001/state.ckpt"], next_marker="run/step-000000001/state.ckpt")(h)
        else:
            _uploads(["run/step-000000002/state.ckpt"])(h)

    store.uploads = paged
    store.listing = store.listed_with_puts([], STALE, "v1")  # the store's time proven by the cleaner's marker
    ObjectRun("s3://bucket/run", store.options).cleanup()
    aborted = sorted(p for m, p in store.deletes() if "uploadId=" in p)
    assert len(aborted) == 2 and "step-000000002" in aborted[1], aborted


def test_a_listing_of_uploads_that_never_ends_is_refused(store):
    store.uploads = _uploads([], next_marker="run/step-000000001/state.ckpt")
    e = _within(10, lambda: ObjectRun("s3://bucket/run", store.options).cleanup())
    assert isinstance(e, StorageError) and "repeats" in str(e), e


def test_verify_of_a_run_on_a_refusing_store_is_exit_2_naming_the_url(s3_faults, monkeypatch):
    # `ckptfmt verify s3://bucket/run` whose listing is refused: an error line and exit 2,
    # as `ls` and a file's verify give, not a traceback
    from cli_runner import run_cli

    options = s3_faults.storage_options()
    bucket = s3_faults.new_bucket()
    url = f"s3://{bucket}/run"
    ckptfmt.CheckpointManager(url, storage_options=options).save(1, {"w": torch.zeros(3)})
    for name, var in (
        ("endpoint_url", "AWS_ENDPOINT_URL"),
        ("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
        ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
    ):
        monkeypatch.setenv(var, options[name])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3_faults.fail_next("GET", "list-type", status=403, code="AccessDenied", count=50)
    out = run_cli("verify", url, rc=2)
    assert url in out.stdout + out.stderr and "access denied" in out.stdout + out.stderr
    res = json.loads(run_cli("verify", url, "--json", rc=2).stdout)
    assert [f["status"] for f in res["files"]] == ["unreadable"]


def _endless_listing(declared: int | None) -> Answer:
    """A listing's answer that never ends (declaring `declared` bytes, or no length at all):
    XML of fake keys, written until the client hangs up (or 256 MiB: the test's own bound)."""

    def answer(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/xml")
        if declared is not None:
            h.send_header("Content-Length", str(declared))
        h.send_header("Connection", "close")
        h.end_headers()
        page = b"".join(
            b"<Contents><Key>run/step-000000001/COMMIT</Key><Size>1</Size></Contents>" for _ in range(1000)
        )
        h.wfile.write(b'<?xml version="1.0"?><ListBucketResult><IsTruncated>false</IsTruncated>')
        try:
            for _ in range((256 << 20) // len(page)):
                h.wfile.write(page)
        except OSError:
            pass  # the client hung up

    return answer


@pytest.mark.parametrize("declared", [None, 10 << 30], ids=["no-length", "declares-10-GiB"])
def test_an_endless_listing_body_is_refused_before_it_is_parsed(store, declared):
    # the body is read to at most MAX_LISTING_BODY bytes: an answer that never ends (held whole
    # before, 1.5 GiB and growing) is a LimitError naming the URL, in bounded time and memory
    from ckptfmt.storage import client

    store.listing = _endless_listing(declared)
    e = _within(20, lambda: ObjectRun("s3://bucket/run", store.options).statuses())
    assert isinstance(e, LimitError) and str(client.MAX_LISTING_BODY) in str(e), repr(e)
    assert "s3://bucket/run" in str(e)


def test_empty_pages_with_fresh_tokens_forever_are_bounded(store):
    # every page empty and "more to come", each with a new token: refused after the pages a
    # run can plausibly fill (MAX_PAGES), not after 65 536 requests
    pages = iter(range(10**9))
    store.listing = lambda h: _listing([], truncated=True, token=f"t{next(pages)}")(h)
    e = _within(60, lambda: ObjectRun("s3://bucket/run", store.options).statuses())
    assert isinstance(e, LimitError) and "pages" in str(e), e
    assert len(store.seen) <= listing.MAX_PAGES + 1


def test_latest_reads_a_bounded_number_of_records_of_a_listing_full_of_fake_ones(store):
    # 20 000 steps whose COMMIT the listing names and whose records are junk: latest() reads
    # at most MAX_CANDIDATES of them, newest first, then says why it stopped
    from ckptfmt.runs import objectrun

    keys = [f"run/{step_dirname(s)}/COMMIT" for s in range(1, 20_001)]
    store.listing = _pages(keys)
    store.get = lambda h: _reply(h, 200, {"Content-Length": "4", "ETag": '"j"'}, b"junk")
    manager = ckptfmt.CheckpointManager("s3://bucket/run", storage_options=store.options)
    with pytest.warns(ckptfmt.CheckpointWarning, match="step-000020000"):
        e = _within(60, manager.latest)
    assert isinstance(e, LimitError) and "MAX_CANDIDATES" in str(e), e
    gets = [p for m, p in store.seen if m == "GET" and p.endswith("/COMMIT")]
    assert len(gets) == objectrun.MAX_CANDIDATES
    assert gets[0].endswith("/step-000020000/COMMIT")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        manager.load()


def test_statuses_read_a_bounded_number_of_records_of_a_listing_full_of_fake_ones(store):
    # ls, rotation and a save's preparation judge every step: of 20 000 steps whose COMMIT the
    # listing names, the newest MAX_STATUS_RECORDS records are read (one GET each), the older
    # steps are reported unread, and a save's cleanup deletes none of them
    from ckptfmt.runs import objectrun

    keys = [f"run/{step_dirname(s)}/COMMIT" for s in range(1, 20_001)]
    store.listing = _pages(keys)
    store.get = lambda h: _reply(h, 200, {"Content-Length": "4", "ETag": '"j"'}, b"junk")
    run = ObjectRun("s3://bucket/run", store.options)
    statuses = run.statuses()
    assert len(statuses) == 20_000
    gets = [p for m, p in store.seen if m == "GET" and p.endswith("/COMMIT")]
    assert len(gets) == 1024 == objectrun.MAX_STATUS_RECORDS  # 20 000 before the bound
    assert gets[0].endswith("/step-000020000/COMMIT")
    unread = [s for s in statuses if s.unread]
    assert [s.step for s in unread] == list(range(1, 20_001 - objectrun.MAX_STATUS_RECORDS))
    assert all(s.info is None and "MAX_STATUS_RECORDS" in (s.problem or "") for s in unread)
    assert all(s.damaged for s in statuses if not s.unread)


@pytest.mark.parametrize("date", ["this host's", "far future"])
def test_a_cleanup_on_a_fast_host_aborts_no_live_upload_whatever_the_listings_date(store, date):
    # the store stamps objects and uploads 25 hours behind this host's clock; the Date of its
    # answers comes from another clock (a gateway agreeing with this host's, or a hostile one
    # in 2100): no Date lets an upload begun a minute ago by the store's clock look a day old
    def date_time_string(h: BaseHTTPRequestHandler, timestamp: float | None = None) -> str:
        if date == "far future":
            return "Fri, 01 Jan 2100 00:00:00 GMT"
        return email.utils.format_datetime(datetime.datetime.now(datetime.timezone.utc), usegmt=True)

    store.behind = datetime.timedelta(hours=25)
    store.server.RequestHandlerClass.date_time_string = date_time_string  # type: ignore[method-assign]
    store.listing = store.listed_with_puts([], STALE, "v1")
    ago = {"crashed": datetime.timedelta(days=2), "live": datetime.timedelta(minutes=1)}
    store.uploads = _uploads_begun(store, "run/step-000000002/state.ckpt", ago)
    ObjectRun("s3://bucket/run", store.options).cleanup()
    aborted = [p for m, p in store.deletes() if "uploadId=" in p]
    assert len(aborted) == 1 and "uploadId=crashed" in aborted[0], aborted


def test_a_cleanup_proves_no_time_where_every_upload_is_young_by_any_store_time(store):
    # an upload begun a minute ago by a store whose clock agrees with this host's: young by
    # every store time believed, so the cleaner puts no marker to read the store's clock
    store.listing = store.listed_with_puts([], STALE, "v1")
    store.uploads = _uploads_begun(
        store, "run/step-000000002/state.ckpt", {"live": datetime.timedelta(minutes=1)}
    )
    ObjectRun("s3://bucket/run", store.options).cleanup()
    assert [m for m, _ in store.seen if m in ("PUT", "DELETE", "POST")] == []


def test_a_saves_commit_aborts_no_live_upload_on_a_fast_host(store):
    # a step's commit on a store aborts the crashed uploads of its prefix (ObjectPlace
    # remove_leftovers): by the store's time that its record's Last-Modified proves, not by
    # this host's clock 25 hours ahead of the store's
    from ckptfmt.runs.stepplace import StepPlace
    from ckptfmt.storage.urls import parse_url

    store.behind = datetime.timedelta(hours=25)
    written = (datetime.datetime.now(datetime.timezone.utc) - store.behind).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    store.listing = store.listed_with_puts(["run/step-000000002/COMMIT"], written, "v1")
    ago = {"crashed": datetime.timedelta(days=2), "live": datetime.timedelta(minutes=1)}
    store.uploads = _uploads_begun(store, "run/step-000000002/state.ckpt", ago)
    StepPlace(parse_url("s3://bucket/run/step-000000002"), store.options, 2).remove_leftovers()
    aborted = [p for m, p in store.deletes() if "uploadId=" in p]
    assert len(aborted) == 1 and "uploadId=crashed" in aborted[0], aborted
    # a record listed far in the future (a hostile store) is believed no further ahead of
    # this host's clock (here the store's) than STORE_AHEAD_AT_MOST: the live upload stays
    store.seen.clear()
    store.behind = datetime.timedelta(0)
    store.listing = store.listed_with_puts(["run/step-000000002/COMMIT"], "2100-01-01T00:00:00.000Z", "v1")
    StepPlace(parse_url("s3://bucket/run/step-000000002"), store.options, 2).remove_leftovers()
    assert not any("uploadId=live" in p for m, p in store.deletes())


def test_a_record_stamped_in_the_year_1_aborts_nothing_and_raises_nothing(store):
    # a store that stamps a step's record at the very start of the calendar: its cutoff (24
    # hours before that) cannot be written as a time, so it proves nothing, and a commit's
    # cleanup goes on (it raised datetime's OverflowError, which no caller expects)
    from ckptfmt.runs.stepplace import StepPlace
    from ckptfmt.storage.urls import parse_url

    store.listing = store.listed_with_puts(["run/step-000000002/COMMIT"], "0001-01-01T00:00:00.000Z", "v1")
    store.uploads = _uploads_begun(
        store, "run/step-000000002/state.ckpt", {"crashed": datetime.timedelta(days=2)}
    )
    StepPlace(parse_url("s3://bucket/run/step-000000002"), store.options, 2).remove_leftovers()
    assert not any("uploadId=" in p for m, p in store.deletes())


class _LaggingPuts(dict):
    """Objects PUT, as a listing that still shows a deleted marker for the rest of the pass."""

    def pop(self, key, default=None):
        return self.get(key, default) if "/ARCHIVING." in key else super().pop(key, default)


def test_a_lagging_listing_of_the_cleaners_own_clock_marker_is_no_writer_come(store):
    # a copy on another host died in step 2 long ago (its marker old), leaving no record; the
    # cleaner reads the store's clock to age it, and the store's listings go on showing the
    # reading's marker after its DELETE: being beneath the run's CLOCK/, never in the step,
    # it is no writer come to the step, and the prefix goes
    from ckptfmt.runs.objectnames import COPY_MARKER

    foreign = f"{COPY_MARKER}{'f' * 16}.4242.77.0badcafe"
    step = "run/step-000000002"
    store.head = lambda h: _reply(h, 404, {}) if h.path.endswith("/COMMIT") else store.honest_head(h)
    store.listing = store.listed_with_puts([f"{step}/{foreign}", f"{step}/state.ckpt"], STALE, "v1")
    store.puts = _LaggingPuts()
    assert ObjectRun("s3://bucket/run", store.options).remove_interrupted_copies() == [2]
