"""Attacks on the parsers added last session: the torch-free verify of a run's sharded (DCP)
step, the gs:// and az:// answers and listings (a hostile HTTP server on 127.0.0.1 pretending
to be the store) and the fork child protocol.  Each test
failed before the fix it names; each answer must end, within its deadline, as a ckptfmt error
naming the URL, and nothing beyond what ckptfmt wrote may be deleted."""

from __future__ import annotations

import os
import signal
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from test_hostile_gcs import HostileGCS, _json, _reply, _within

import ckptfmt
from ckptfmt import dcp as cdcp
from ckptfmt.background import forksave
from ckptfmt.cli import main as cli
from ckptfmt.engine import native
from ckptfmt.errors import CorruptError, SnapshotError, StorageError
from ckptfmt.storage import listing
from ckptfmt.storage.backends import store_for
from ckptfmt.storage.urls import parse_url

# -- a run's sharded step: verify refuses what a resume refuses -------------------------------------------


def _python_v2(cap):
    cap["python"]["version"] = 2
    return (cap,)


def _short_torch_state(cap):
    cap["torch_cpu"] = cap["torch_cpu"][:100].clone()
    return (cap,)


@pytest.mark.parametrize(
    "saved",
    [_python_v2, _short_torch_state, lambda cap: (cap, cap)],
    ids=["python-state-version-2", "torch-cpu-state-short", "two-captures"],
)
def test_verify_of_a_sharded_step_refuses_rng_states_its_resume_refuses(tmp_path, capsys, saved):
    """A sharded step ({"state": ..., "rng": {"rank-00000": (capture,)}}) whose RNG states its
    rank's resume refuses (sharded._checked_rng, before anything is filled): ``ckptfmt verify``
    of the run said OK, checking the record and every item but never the RNG states."""
    from ckptfmt.runs.rng import capture_rng

    run = tmp_path / "run"
    ckptfmt.CheckpointManager(str(run)).save(1, {"w": torch.ones(1)})
    step = run / "step-000000002"
    cdcp.save({"state": {"w": torch.ones(1)}, "rng": {"rank-00000": saved(capture_rng())}}, str(step), step=2)
    with pytest.raises(CorruptError, match="RNG state"):
        ckptfmt.CheckpointManager(str(run)).load_into({"w": torch.zeros(1)}, step=2)
    assert cli(["verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert (
        "step-000000001: OK" in out and "step-000000002: FAILED corrupt" in out and "rng.rank-00000" in out
    ), out


def test_verify_of_a_sharded_step_on_a_store_refuses_rng_states_its_resume_refuses(env_bucket, capsys):
    from ckptfmt.runs.rng import capture_rng

    step = f"s3://{env_bucket}/run/step-000000002"
    cdcp.save({"state": {"w": torch.ones(1)}, "rng": {"rank-00000": _python_v2(capture_rng())}}, step, step=2)
    assert cli(["verify", f"s3://{env_bucket}/run"]) == 1
    out = capsys.readouterr().out
    assert "step-000000002" in out and "rng.rank-00000" in out, out


def test_verify_of_a_sharded_step_with_sound_rng_states_is_ok(tmp_path, capsys):
    from ckptfmt.runs.rng import capture_rng

    run = tmp_path / "run"
    step = run / "step-000000002"
    cdcp.save({"state": {"w": torch.ones(1)}, "rng": {"rank-00000": (capture_rng(),)}}, str(step), step=2)
    ckptfmt.CheckpointManager(str(run)).load_into({"w": torch.zeros(1)}, step=2)
    assert cli(["verify", str(run)]) == 0, capsys.readouterr().out


# -- gs:// -------------------------------------------------------------------------------------------

GS_URL = "gs://bucket/x.ckpt"


@pytest.fixture
def gcs(tmp_path, monkeypatch) -> Iterator[HostileGCS]:
    ckptfmt.save({"a": torch.arange(100)}, tmp_path / "x.ckpt")
    s = HostileGCS((tmp_path / "x.ckpt").read_bytes())
    s.thread.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", s.endpoint)
    try:
        yield s
    finally:
        s.server.shutdown()
        s.server.server_close()


def _slowly(h: BaseHTTPRequestHandler, data: bytes) -> None:
    """Send `data` a byte every 0.3 s, until the client hangs up."""
    try:
        for c in data:
            h.wfile.write(bytes([c]))
            h.wfile.flush()
            time.sleep(0.3)
    except OSError:
        pass


def test_a_refusal_whose_body_trickles_in_ends_at_the_deadline(gcs):
    """A 503 whose error body comes a byte every 0.3 s: GCS's reason was read from it with no
    deadline (a read timeout bounds each byte's wait, never the body), so the load waited for
    the whole trickle (here 15 s; 64 KiB of it: hours) whatever the deadline said."""

    def trickle(h, query):
        h.send_response(503)
        h.send_header("Content-Length", "100000")
        h.send_header("Content-Type", "application/json")
        h.end_headers()
        _slowly(h, b" " * 50)

    gcs.meta = trickle
    e = _within(10, lambda: ckptfmt.load(GS_URL, storage_options={"max_attempts": 1, "deadline": 2}))
    assert isinstance(e, StorageError) and "HTTP 503" in str(e) and GS_URL in str(e), repr(e)


def test_an_answer_whose_head_trickles_in_ends_at_the_deadline(gcs):
    """The status line and headers a byte every 0.3 s: every wait for a byte is within the read
    timeout, so the request waited until the head was whole (here 17 s; 64 KiB a line, 100
    lines: days) whatever the deadline said."""

    gcs.meta = lambda h, query: _slowly(h, b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 40)
    e = _within(10, lambda: ckptfmt.load(GS_URL, storage_options={"max_attempts": 2, "deadline": 2}))
    assert isinstance(e, StorageError) and "did not arrive within" in str(e) and GS_URL in str(e), repr(e)


def _trickled_refusal(h: BaseHTTPRequestHandler, query: object = None) -> None:
    h.send_response(503)
    h.send_header("Content-Length", "100000")
    h.end_headers()
    _slowly(h, b" " * 50)


@pytest.mark.parametrize(
    "media",
    [lambda h, q: _slowly(h, b"HTTP/1.1 206 OK\r\nX-Pad: " + b"a" * 40), _trickled_refusal],
    ids=["head", "refusal"],
)
def test_a_ranged_read_whose_answer_trickles_in_ends_at_the_deadline(gcs, media):
    """The object's bytes (not its description) answered with a head, or a refusal's body, a
    byte every 0.3 s: a ranged read keeps its own Budget, which its requests did not carry, so
    they were read within the default deadline (300 s) whatever the storage option said."""
    gcs.media = media
    e = _within(10, lambda: ckptfmt.load(GS_URL, storage_options={"max_attempts": 2, "deadline": 2}))
    assert isinstance(e, StorageError) and GS_URL in str(e) and "deadline 2 s" in str(e), repr(e)


def test_aborting_an_upload_deletes_only_its_own_parts(gcs):
    """abort_upload lists the parts beneath its upload's stem and deleted every part object the
    listing named: a listing that also names another upload's parts (a live writer's, beside
    the same object) or a part elsewhere in the bucket made the abort delete them."""
    upload = "0123456789abcdef"
    own = f"x.ckpt.ckptfmt-part-{upload}-00001"
    others = ["x.ckpt.ckptfmt-part-fedcba9876543210-00001", "run/y.ckpt.ckptfmt-part-00000000aaaaaaaa-00001"]
    gcs.listing = lambda h, q: _json(h, {"items": [{"name": n, "size": "1"} for n in [own, *others]]})
    url = parse_url(GS_URL)
    store_for(url, {"max_attempts": 1}).abort_upload(url, upload)
    deleted = gcs.deletes()
    assert any(own in p for p in deleted), deleted
    assert not [p for p in deleted if any(o.replace("/", "%2F") in p for o in others)], deleted


def _peak_of(call) -> tuple[BaseException, int, float]:
    """What `call` raised, the most memory Python held meanwhile (tracemalloc) and how long it took."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start = time.monotonic()
        e = _within(60, call)
        return e, tracemalloc.get_traced_memory()[1], time.monotonic() - start
    finally:
        tracemalloc.stop()


def _gcs_items(n: int) -> list[dict[str, str]]:
    return [
        {
            "name": f"run/step-{i:09d}/state.ckpt",
            "size": "1",
            "generation": "1",
            "updated": "2026-01-01T00:00:00Z",
        }
        for i in range(n)
    ]


def test_a_listing_page_of_empty_items_is_refused_before_they_are_built(gcs):
    """16 MiB of "{}," items, under the page's byte cap, cost json.loads 1 GB and 17 s (about 70
    times their bytes): every item was built before anything counted them.  ckptfmt asks for
    1000 a page; a page holding far more values than 1000 entries can is refused first."""
    body = b'{"items":[' + b"{}," * ((16 << 20) // 3 - 10) + b"{}]}"
    gcs.listing = lambda h, q: _reply(h, 200, {"Content-Length": str(len(body))}, body)
    e, peak, took = _peak_of(lambda: listing.objects(parse_url("gs://bucket/run"), {"max_attempts": 1}))
    assert isinstance(e, StorageError) and "values" in str(e) and "gs://bucket/run" in str(e), repr(e)
    assert took < 2 and peak < 200 << 20, (took, peak)


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000 + b"]" * 100_000, b'{"items":' + b"[" * 20_000 + b"]" * 20_000 + b"}"],
    ids=["nested-100k-deep", "nested-within-the-bound"],
)
def test_a_listing_nested_without_end_is_a_storage_error(gcs, body):
    gcs.listing = lambda h, q: _reply(h, 200, {"Content-Length": str(len(body))}, body)
    e = _within(10, lambda: listing.objects(parse_url("gs://bucket/run"), {"max_attempts": 1}))
    assert isinstance(e, StorageError) and "gs://bucket/run" in str(e), repr(e)


def test_a_listing_page_of_more_entries_than_asked_is_refused(gcs):
    gcs.listing = lambda h, q: _json(h, {"items": _gcs_items(int(q["maxResults"][0]) + 1)})
    e = _within(10, lambda: listing.objects(parse_url("gs://bucket/run"), {"max_attempts": 1}))
    assert isinstance(e, StorageError) and "1001 entries (at most 1000 asked)" in str(e), repr(e)


def test_a_full_listing_page_is_read(gcs):
    """1000 items as GCS gives them with every field of the object resource (a server that
    ignores the fields asked for), names of 1024 bytes full of JSON's special characters."""
    full = {"kind": "storage#object", "bucket": "bucket", "metageneration": "1", "contentType": "x"}
    full |= {"storageClass": "STANDARD", "md5Hash": "a", "crc32c": "b", "etag": "c", "timeCreated": "t"}
    full |= {"metadata": {f"k{i}": "v" for i in range(20)}, "owner": {"entity": "e", "entityId": "i"}}
    items = [it | full | {"name": it["name"][:-10] + '",{[\\"' * 100} for it in _gcs_items(1000)]

    def page(h, q):
        assert q["fields"] == ["items(name,size,updated,generation),prefixes,nextPageToken"], q
        _json(h, {"kind": "storage#objects", "items": items})

    gcs.listing = page
    assert len(listing.objects(parse_url("gs://bucket/run"), {"max_attempts": 1})) == 1000


# -- az:// -------------------------------------------------------------------------------------------


class HostileAzure:
    """A Blob service (or S3) endpoint whose every GET answers `body` (a listing), or what the
    `answer` hook sends (HEADs too), and whose DELETEs are recorded."""

    def __init__(self) -> None:
        self.body = b""
        self.answer: Callable[[BaseHTTPRequestHandler], None] | None = None
        self.seen: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's names
                outer.seen.append("GET " + self.path)
                if outer.answer is not None:
                    return outer.answer(self)
                _reply(self, 200, {"Content-Length": str(len(outer.body))}, outer.body)

            def do_HEAD(self) -> None:  # noqa: N802
                outer.seen.append("HEAD " + self.path)
                if outer.answer is not None:
                    return outer.answer(self)
                _reply(self, 404, {"Content-Length": "0"})

            def do_DELETE(self) -> None:  # noqa: N802
                outer.seen.append("DELETE " + self.path)
                _reply(self, 202, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/devstoreaccount1"


@pytest.fixture
def azure(monkeypatch) -> Iterator[HostileAzure]:
    s = HostileAzure()
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        f"AccountName=devstoreaccount1;AccountKey=a2V5;BlobEndpoint={s.endpoint}",
    )
    try:
        yield s
    finally:
        s.server.shutdown()
        s.server.server_close()


def _blob_listing(names: list[str], dtd: str = "", encoding: str = "utf-8") -> bytes:
    blobs = "".join(
        f"<Blob><Name>{n}</Name><Properties><Content-Length>1</Content-Length></Properties></Blob>"
        for n in names
    )
    text = (
        f'<?xml version="1.0" encoding="{encoding}"?>{dtd}'
        f"<EnumerationResults><Blobs>{blobs}</Blobs></EnumerationResults>"
    )
    return text.encode(encoding)


def test_an_honest_listing_of_blobs_is_read(azure):
    azure.body = _blob_listing(["run/a", "run/b"])
    assert sorted(listing.objects(parse_url("az://container/run"), {"max_attempts": 1})) == ["a", "b"]


def _many_blobs() -> bytes:
    blobs = b"<Blob/>" * ((16 << 20) // 7 - 10)
    return b"<EnumerationResults><Blobs>" + blobs + b"</Blobs></EnumerationResults>"


def _many_attributes() -> bytes:
    attributes = b" ".join(b'a%d=""' % i for i in range((16 << 20) // 12))
    return b"<EnumerationResults><Blobs><Blob " + attributes + b"/></Blobs></EnumerationResults>"


@pytest.mark.parametrize("flood", [_many_blobs, _many_attributes], ids=["blobs", "attributes"])
def test_a_listing_page_of_empty_blobs_is_refused_before_they_are_built(azure, flood):
    """16 MiB of <Blob/> (or of one blob's attributes), under the page's byte cap: ElementTree
    built an element (an attribute) of each, and expat took seconds over them, before the
    listing was looked at.  A page holding far more tags and attributes than 1000 entries can
    is refused first."""
    azure.body = flood()
    e, peak, took = _peak_of(lambda: listing.objects(parse_url("az://container/run"), {"max_attempts": 1}))
    assert isinstance(e, StorageError) and "az://container/run" in str(e), repr(e)
    assert "tags" in str(e) and took < 2 and peak < 200 << 20, (e, took, peak)


def test_a_listing_of_more_blobs_than_asked_is_refused(azure):
    azure.body = _blob_listing([f"run/{i}" for i in range(1001)])
    e = _within(10, lambda: listing.objects(parse_url("az://container/run"), {"max_attempts": 1}))
    assert isinstance(e, StorageError) and "1001 entries (at most 1000 asked)" in str(e), repr(e)
    azure.body = _blob_listing([f"run/{i}" for i in range(1000)])
    assert len(listing.objects(parse_url("az://container/run"), {"max_attempts": 1})) == 1000


@pytest.mark.parametrize("encoding, why", [("utf-16", "not XML in UTF-8"), ("utf-8", "DTD")])
def test_a_listing_declaring_a_dtd_in_utf16_is_refused(azure, encoding, why):
    """The DTD guard searched the bytes for "<!DOCTYPE": in UTF-16 they are not there, and expat
    expanded the entities (an answer of 12 MiB, under the listing's 16 MiB bound, became 1 GB of
    names).  Here the entity spells a name inside the prefix, which the listing returned.  A
    listing is now read as UTF-8 (what Azure answers), where the parser finds the DTD; a body
    in UTF-16 is refused as such (its tags and attributes could not be counted on its bytes)."""
    dtd = '<!DOCTYPE x [<!ENTITY a "run/aaaa">]>'
    azure.body = _blob_listing(["&a;"], dtd, encoding)
    e = _within(10, lambda: listing.objects(parse_url("az://container/run"), {"max_attempts": 1}))
    assert isinstance(e, StorageError) and why in str(e) and "az://container/run" in str(e), repr(e)
    assert not [p for p in azure.seen if p.startswith("DELETE")]


# -- s3:// (a hostile endpoint in place of S3: botocore reads its answers) ------------------------------


@pytest.fixture
def s3(azure) -> Iterator[dict[str, object]]:
    """The storage options of an S3 client reaching the hostile endpoint (the Azure one: it is
    only an HTTP server)."""
    root = azure.endpoint.rsplit("/", 1)[0]
    yield {
        "endpoint_url": root,
        "aws_access_key_id": "key",
        "aws_secret_access_key": "secret",
        "region_name": "us-east-1",
        "addressing_style": "path",
        "max_attempts": 1,
    }


def _s3_listing(contents: bytes) -> bytes:
    return (
        b'<?xml version="1.0" encoding="UTF-8"?>'
        b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>bucket</Name>'
        b"<IsTruncated>false</IsTruncated>" + contents + b"</ListBucketResult>"
    )


def _s3_entry(key: str) -> bytes:
    return (
        f"<Contents><Key>{key}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
        '<ETag>"0123456789abcdef0123456789abcdef"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass>'
        "<Owner><ID>0123</ID><DisplayName>owner</DisplayName></Owner></Contents>"
    ).encode()


def test_an_s3_listing_page_of_empty_entries_is_refused_before_botocore_builds_them(azure, s3):
    """16 MiB of <Contents/> (1.5 million), under the page's byte cap: botocore built a dict of
    each (800,000 took 9 s and 180 MB), then ckptfmt an entry of each, before anything counted
    them.  The listing guard counts the tags first."""
    azure.body = _s3_listing(b"")
    assert listing.objects(parse_url("s3://bucket/run"), s3) == {}  # the client made (boto3's imports)
    azure.body = _s3_listing(b"<Contents/>" * ((16 << 20) // 11 - 100))
    e, peak, took = _peak_of(lambda: listing.objects(parse_url("s3://bucket/run"), s3))
    assert isinstance(e, StorageError) and "tags" in str(e) and "s3://bucket/run" in str(e), repr(e)
    assert took < 2 and peak < 200 << 20, (took, peak)


def test_an_s3_listing_page_of_more_entries_than_asked_is_refused(azure, s3):
    azure.body = _s3_listing(b"".join(_s3_entry(f"run/{i}") for i in range(1001)))
    e = _within(10, lambda: listing.objects(parse_url("s3://bucket/run"), s3))
    assert isinstance(e, StorageError) and "1001 entries (at most 1000 asked)" in str(e), repr(e)
    azure.body = _s3_listing(b"".join(_s3_entry(f"run/{i}") for i in range(1000)))
    assert len(listing.objects(parse_url("s3://bucket/run"), s3)) == 1000


def test_an_s3_answer_whose_head_trickles_in_ends_at_the_deadline(azure, s3):
    """The status line and headers a byte every 0.3 s: botocore's read_timeout bounds each wait
    for a byte, never the head, so the request waited until the head was whole (here 15 s; 64
    KiB a line, 100 lines: days) whatever the deadline said.  As on gs:// and az://, the head
    must come within what remains of the operation's deadline."""
    azure.answer = lambda h: _slowly(h, b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 40)
    options = s3 | {"max_attempts": 2, "deadline": 2}
    e = _within(10, lambda: ckptfmt.load("s3://bucket/x.ckpt", storage_options=options))
    assert isinstance(e, StorageError) and "did not arrive within" in str(e), repr(e)
    assert "s3://bucket/x.ckpt" in str(e) and "deadline 2 s" in str(e), repr(e)


def test_an_s3_refusal_whose_body_trickles_in_ends_at_the_deadline(azure, s3):
    """An object's read refused with a 503 whose XML error body comes a byte every 0.3 s:
    botocore read it whole, with no deadline, before it said what was refused (here 15 s; of
    100,000 bytes: hours)."""

    def trickle(h: BaseHTTPRequestHandler) -> None:
        if h.command == "HEAD":  # the object is there
            return _reply(h, 200, {"Content-Length": "1000", "ETag": '"e"'})
        h.send_response(503)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        _slowly(h, b"<Error>" + b" " * 50)

    azure.answer = trickle
    options = s3 | {"deadline": 2}
    e = _within(10, lambda: ckptfmt.load("s3://bucket/x.ckpt", storage_options=options))
    assert isinstance(e, StorageError) and "did not arrive within" in str(e), repr(e)
    assert "s3://bucket/x.ckpt" in str(e) and "deadline 2 s" in str(e), repr(e)


def test_an_s3_listing_whose_body_stalls_is_a_storage_error(azure, s3):
    """A listing's head, then nothing for longer than read_timeout: the guard reading the body
    let urllib3's bare ReadTimeoutError escape (botocore translates only what it reads)."""

    def stall(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", "100")
        h.end_headers()
        h.wfile.write(b"<a")
        h.wfile.flush()
        time.sleep(4)

    azure.answer = stall
    options = s3 | {"read_timeout": 1, "deadline": 3}
    e = _within(10, lambda: listing.objects(parse_url("s3://bucket/run"), options))
    assert isinstance(e, StorageError) and "Read timed out" in str(e) and "s3://bucket/run" in str(e), repr(e)


# -- the fork child protocol ---------------------------------------------------------------------------


def test_a_staged_child_killed_before_its_job_fails_the_save_as_a_snapshot_error(tmp_path):
    """A staged child (take_snapshot) that died before the save handed it its job (the OOM
    killer, an operator's kill): sending it the job failed, and the save raised a bare
    BrokenPipeError ("cannot take a fork snapshot: Broken pipe"), not ckptfmt's SnapshotError
    saying which process ended how.  Nothing is written and the child is reaped."""
    p = tmp_path / "x.ckpt"
    ckptfmt.save({"a": torch.zeros(10)}, p)
    a = torch.arange(1000.0)
    snapshot = forksave.take_snapshot([("a", a.untyped_storage())])
    os.kill(snapshot.pid, signal.SIGKILL)
    os.waitid(os.P_PID, snapshot.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
    from ckptfmt.files.save import save_file, save_options, staged_by

    with pytest.raises(
        SnapshotError,
        match=r"pid \d+\) could not be handed its job .*: it was killed by signal 9 \(SIGKILL\)",
    ):
        save_file(
            {"a": a}, str(p), staged_by(save_options(blocking=False), snapshot)
        )  # the DCP writer's path
    assert torch.equal(ckptfmt.load(p)["a"], torch.zeros(10)) and os.listdir(tmp_path) == ["x.ckpt"]
    with pytest.raises(ChildProcessError):  # reaped
        os.waitpid(snapshot.pid, os.WNOHANG)


def _garbled(change):
    """ForkedWrite.outcome reading what a child left in the memory it shares with the parent,
    then `change`d (records, end) -> (records, end): a child that wrote garbage there."""
    real = native.ForkedWrite.outcome

    def outcome(self, path):
        got = real(self, path)
        return None if got is None else change(*got)

    return outcome


@pytest.mark.parametrize(
    "change",
    [
        lambda recs, end: ([recs[0], (recs[1][0] + 64, *recs[1][1:]), *recs[2:]], end + 64),
        lambda recs, end: ([(recs[0][0], recs[0][1] - 1, *recs[0][2:]), *recs[1:]], end),
        lambda recs, end: (recs[:-1], end),
        lambda recs, end: (recs, end + (1 << 40)),
    ],
    ids=["hole-between-chunks", "stored-shorter-than-raw", "a-record-missing", "end-beyond"],
)
def test_a_child_reporting_garbage_commits_nothing(tmp_path, monkeypatch, change):
    """The parent built the index from whatever records and end the child left in shared memory
    and committed it: a child that reported garbage replaced the previous file with one no
    load reads.  Now the report is checked against the chunks the child was given first."""
    p = tmp_path / "x.ckpt"
    ckptfmt.save({"a": torch.zeros(10)}, p)
    monkeypatch.setattr(native.ForkedWrite, "outcome", _garbled(change))
    state = {"a": torch.arange(3 * 1024 * 1024, dtype=torch.uint8)}
    handle = ckptfmt.save(state, p, blocking=False, snapshot="fork", chunk_size=1 << 20)
    with pytest.raises(SnapshotError, match="nothing was committed"):
        handle.wait()
    assert torch.equal(ckptfmt.load(p)["a"], torch.zeros(10)) and os.listdir(tmp_path) == ["x.ckpt"]


@pytest.mark.parametrize("wrong", ["beyond-the-table", "other-bytes"])
def test_an_incremental_child_reporting_a_wrong_match_commits_nothing(tmp_path, monkeypatch, wrong):
    """An incremental child reports, per chunk, where in the held table it was given it found the
    same bytes; the parent took that as it came: a match beyond the table escaped as a bare
    IndexError, and one naming another held chunk committed a file whose chunk refers to other
    bytes than the state's.  Now each match is checked against the table (length and digest)."""
    from ckptfmt.files import incremental

    state = {"a": torch.arange(1 << 20, dtype=torch.int32), "b": torch.ones(1 << 18, dtype=torch.uint8)}
    kw = {"chunk_size": 1 << 20}
    incremental.save(state, tmp_path / "0.ckpt", **kw)
    state["b"].add_(1)
    real = native.ForkedWrite.findings

    def findings(self):
        digests, matches = real(self)
        assert matches[0] >= 0  # a's first chunk is held by 0.ckpt
        m = matches[0]  # the held table holds a's four chunks, each other bytes
        matches[0] = 1 << 40 if wrong == "beyond-the-table" else (m - 1 if m > 0 else m + 1)
        return digests, matches

    monkeypatch.setattr(native.ForkedWrite, "findings", findings)
    h = incremental.save(
        state, tmp_path / "1.ckpt", base=tmp_path / "0.ckpt", blocking=False, snapshot="fork", **kw
    )
    with pytest.raises(SnapshotError, match="reported chunk 0 found as held chunk .* nothing was committed"):
        h.wait()
    assert sorted(os.listdir(tmp_path)) == ["0.ckpt"]
