"""Checkpoint files on an object store: a real moto S3 server over HTTP, through boto3.

Round trips through every reading entry point, the bytes of an object equal to those of the
same save to a local file, multipart uploads that leave nothing behind, partial reads that
fetch only what they need, an object replaced while read, and faults injected by a proxy
(resets mid-upload and mid-download, 5xx answers, refused credentials, slow answers).
"""

from __future__ import annotations

import os
import re
import time
import traceback

import pytest
import torch
from helpers import assert_same, states
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.engine import fetchplan
from ckptfmt.errors import CorruptError, StorageError, UnsupportedError
from ckptfmt.storage import download

MiB = 1 << 20


def _client(options: dict[str, str]):
    from s3_server import s3_client

    return s3_client(options["endpoint_url"])


def _state(n: int = 1000) -> dict[str, object]:
    g = torch.Generator().manual_seed(n)
    return {
        "w": torch.randn(n, generator=g),
        "b": torch.arange(7, dtype=torch.int16),
        "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "step": 12,
        "opt": {"lr": 0.1, "betas": (0.9, 0.999)},
    }


def _open_uploads(options: dict[str, str], bucket: str) -> list[object]:
    return list(_client(options).list_multipart_uploads(Bucket=bucket).get("Uploads", []))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states(max_leaves=8), compression=st.sampled_from([None, "zstd"]))
def test_round_trip_through_the_store(s3_bucket, state, compression):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/runs/x.ckpt"
    ckptfmt.save(state, url, compression=compression, storage_options=options)
    assert_same(state, ckptfmt.load(url, storage_options=options))
    assert ckptfmt.verify(url, storage_options=options).ok


def test_the_object_holds_the_bytes_a_local_save_writes(s3_bucket, tmp_path, monkeypatch):
    """Reproducible files (a pinned file id and time): the upload is byte for byte the file,
    across several multipart parts uploaded out of order (part 1 last)."""
    bucket, options = s3_bucket
    monkeypatch.setenv("CKPTFMT_FILE_ID", "00112233445566778899aabbccddeeff")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    state = {"big": torch.randn(9 * MiB // 4), "small": torch.arange(100)}  # 4 parts of 8 MiB
    local = tmp_path / "x.ckpt"
    ckptfmt.save(state, local)
    ckptfmt.save(state, f"s3://{bucket}/x.ckpt", storage_options={**options, "part_size": 8 * MiB})
    body = _client(options).get_object(Bucket=bucket, Key="x.ckpt")
    assert body["ETag"].strip('"').endswith("-2")  # two parts: a multipart upload
    assert body["Body"].read() == local.read_bytes()
    assert _open_uploads(options, bucket) == []


@pytest.mark.parametrize("blocking", [True, False])
def test_every_reader_reads_a_url(s3_bucket, blocking):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/a/b/state.ckpt"
    state = _state(3 * MiB)
    handle = ckptfmt.save(state, url, blocking=blocking, storage_options=options)
    if handle is not None:
        handle.wait()
    assert_same(state, ckptfmt.load(url, storage_options=options))
    with ckptfmt.open(url, storage_options=options) as f:
        assert f.keys() == list(state)
        assert torch.equal(f.get("b"), state["b"])
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    ckptfmt.load_into(url, target, storage_options=options)
    assert all(torch.equal(target[k], state[k]) for k in ("w", "b", "half"))
    report = ckptfmt.verify(url, storage_options=options)
    assert report.ok and report.bytes_checked > 3 * MiB


def test_signed_and_compressed_objects(s3_bucket, tmp_path):
    pytest.importorskip("cryptography")
    from ckptfmt.cli import main

    bucket, options = s3_bucket
    assert main(["keygen", str(tmp_path / "k")]) == 0
    url = f"s3://{bucket}/signed.ckpt"
    state = _state(50_000)
    ckptfmt.save(state, url, compression="zstd", sign_with=tmp_path / "k", storage_options=options)
    assert_same(state, ckptfmt.load(url, trusted_keys=[tmp_path / "k.pub"], storage_options=options))


def test_a_partial_read_fetches_only_its_chunks(store_faults):
    faults, options = store_faults, store_faults.options
    url = f"{faults.new_root()}/p.ckpt"
    reads = faults.op("read", "p.ckpt")
    state = {"first": torch.arange(10), "big": torch.zeros(24 * MiB // 4), "small": torch.arange(10)}
    ckptfmt.save(state, url, storage_options=options)
    faults.clear_counts()
    with ckptfmt.open(url, storage_options=options) as f:
        assert faults.count(*reads) == 2  # the prologue and the tail (footer and index)
        assert torch.equal(f.get("first"), state["first"])
        assert faults.count(*reads) == 3  # one ranged GET, for one chunk
        assert torch.equal(f.get("small"), state["small"])
        assert faults.count(*reads) == 3  # its chunk came with the tail: reused, not asked again
    assert sum(hi - lo for lo, hi in faults.ranges("p.ckpt")) < download.TAIL_BYTES + 64 * 1024


@pytest.mark.parametrize("window", [fetchplan.FETCH_WINDOW, 2 * MiB + 12345])
def test_a_load_makes_one_request_per_cell_like_a_plain_download(store_faults, monkeypatch, window):
    """A whole load asks for each request_size cell of the object once, as a plain parallel
    download of it does, the tail (footer and index) in one request of its own: the prologue
    comes with the first cell, and the chunks in the tail are read from it, not asked for
    again.  With read windows smaller than the object too, whose edges fall inside chunks."""
    monkeypatch.setattr(fetchplan, "FETCH_WINDOW", window)
    faults = store_faults
    options = faults.options | {"request_size": MiB}
    url = f"{faults.new_root()}/cells.ckpt"
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(300_000 + 1000 * i, generator=g) for i in range(6)}  # chunks cross cells
    ckptfmt.save(state, url, storage_options=options)
    size = faults.size(url)
    tail = size - download.TAIL_BYTES
    cells = [(lo, min(lo + MiB, tail)) for lo in range(0, tail, MiB)] + [(tail, size)]
    faults.clear_counts()
    assert_same(state, ckptfmt.load(url, storage_options=options))
    assert faults.count(*faults.op("head", "cells.ckpt")) == 1
    assert sorted(faults.ranges("cells.ckpt")) == cells
    faults.clear_counts()
    assert ckptfmt.verify(url, storage_options=options).ok
    assert sorted(faults.ranges("cells.ckpt")) == cells


@pytest.mark.parametrize("room", [0, 300 << 10, 3 << 20, 40 << 20, 1 << 30])
@pytest.mark.parametrize("largest", [0, 4160, 1 << 20])
def test_windows_under_a_memory_bound_fit_what_it_leaves(room, largest):
    """The windows a load under max_bytes reads by, and the one chunk that crosses a window's
    edge, hold no more than the room the bound leaves; none where one MIN_WINDOW does not fit."""
    fits = fetchplan.windows_within(room, largest, 1 << 40)
    pages = 2 * 4096  # the crossing chunk's pages: a page more at each of its edges
    if room - largest - pages < fetchplan.MIN_WINDOW:
        assert fits is None
        return
    assert fits is not None
    window, ahead = fits
    assert window >= fetchplan.MIN_WINDOW and window % 4096 == 0 and 1 <= ahead <= fetchplan.FETCH_AHEAD
    assert window * ahead + largest + pages <= room
    assert window <= fetchplan.FETCH_WINDOW
    # where all there is to read fits, it is read as without a bound
    total = max(room, largest)
    assert fetchplan.windows_within(total, largest, total) == (fetchplan.FETCH_WINDOW, fetchplan.FETCH_AHEAD)


def test_a_page_two_ranges_given_back_share_is_freed_with_the_second(s3_bucket):
    """The spool frees whole pages: one that two ranges share is freed once both are given
    back (it stayed, one page per window of a load, until the object was closed)."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/pages.ckpt"
    ckptfmt.save({"w": torch.randn(MiB // 4)}, url, storage_options=options)
    remote = download.RemoteObject(url, options, fetch_index=False, max_bytes=1 << 30)
    try:
        assert remote.spool is not None
        remote.fetch([(0, 6000), (6000 + download.MERGE_GAP + 1, 90_000)])
        remote.fetch([(6000, 6000 + download.MERGE_GAP + 1)])
        assert os.fstat(remote.spool.fd).st_blocks > 0
        remote.release([(0, 6000)], wait=True)
        remote.release([(6000, 6000 + download.MERGE_GAP + 1)], wait=True)
        remote.release([(6000 + download.MERGE_GAP + 1, 90_000)], wait=True)
        assert os.fstat(remote.spool.fd).st_blocks == 0
        assert remote.occupied() == 0 and remote.peak_bytes == _pages([(0, 90_000)])
    finally:
        remote.close()


def _pages(ranges: list[tuple[int, int]]) -> int:
    """The bytes of the distinct 4 KiB pages `ranges` touch, counted page by page."""
    return 4096 * len({p for lo, hi in ranges for p in range(lo // 4096, (hi - 1) // 4096 + 1)})


def test_read_windows_count_the_pages_their_requests_hold():
    """The spool holds whole pages: 1000 requests of 256 bytes, 8 KiB apart, hold a page or
    two each, and a window of 256 KiB takes as many as its pages fit, a page two requests share
    counted once (it took all 1000: 256 KB of requests, 4 MB of pages)."""
    requests = [(i * 8448 + 100, i * 8448 + 356) for i in range(1000)]
    window = 256 << 10
    windows = fetchplan.request_windows(requests, window)
    assert [r for w in windows for r in w] == requests
    assert all(_pages(w) <= window for w in windows)
    assert all(_pages([*w, nxt[0]]) > window for w, nxt in zip(windows, windows[1:]))
    assert fetchplan.paged_bytes(requests) == _pages(requests)
    shared = [(0, 100), (200, 300), (4000, 4200), (8190, 8200)]  # pages 0, 0, 0-1, 1-2
    assert fetchplan.request_windows(shared, 8192) == [shared[:3], shared[3:]]
    assert fetchplan.paged_bytes(shared) == _pages(shared) == 3 * 4096


def test_an_object_replaced_while_read_is_an_error_not_mixed_data(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/r.ckpt"
    # "a" lies before the tail an open fetches: reading it asks the store again
    ckptfmt.save({"a": torch.zeros(1000), "b": torch.zeros(MiB // 2)}, url, storage_options=options)
    with ckptfmt.open(url, storage_options=options) as f:
        ckptfmt.save({"a": torch.ones(1000), "b": torch.ones(MiB // 2)}, url, storage_options=options)
        with pytest.raises(StorageError, match="changed while it was being read") as e:
            f.get("a")
        assert url in str(e.value)


def test_damaged_object_bytes_are_caught(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/d.ckpt"
    ckptfmt.save({"a": torch.arange(10_000)}, url, storage_options=options)
    client = _client(options)
    data = bytearray(client.get_object(Bucket=bucket, Key="d.ckpt")["Body"].read())
    data[200] ^= 1  # inside the first chunk
    client.put_object(Bucket=bucket, Key="d.ckpt", Body=bytes(data))
    with pytest.raises(CorruptError, match="checksum"):
        ckptfmt.load(url, storage_options=options)
    report = ckptfmt.verify(url, storage_options=options)
    assert not report.ok and "chunk 0" in str(report.problems[0])


def test_missing_objects_and_buckets_are_file_not_found(s3_bucket):
    bucket, options = s3_bucket
    with pytest.raises(FileNotFoundError) as e:
        ckptfmt.load(f"s3://{bucket}/nothing.ckpt", storage_options=options)
    assert f"s3://{bucket}/nothing.ckpt" in str(e.value)
    with pytest.raises(FileNotFoundError):
        ckptfmt.save({"a": 1}, "s3://no-such-bucket-here/x.ckpt", storage_options=options)


def test_refused_forms(s3_bucket):
    bucket, options = s3_bucket
    with pytest.raises(UnsupportedError, match="hdfs:// scheme is not supported"):
        ckptfmt.load("hdfs://bucket/x.ckpt")
    with pytest.raises(UnsupportedError, match="valid bucket name"):
        ckptfmt.load("s3://B_ad/x.ckpt")
    with pytest.raises(UnsupportedError, match="'..' segments"):
        ckptfmt.save({"a": 1}, f"s3://{bucket}/a/../x.ckpt", storage_options=options)
    with pytest.raises(ValueError, match="unknown storage option 'endpoint_uri'"):
        ckptfmt.load(f"s3://{bucket}/x.ckpt", storage_options={"endpoint_uri": "http://x"})
    url = f"s3://{bucket}/m.ckpt"
    ckptfmt.save({"a": torch.zeros(10)}, url, storage_options=options)
    with pytest.raises(ValueError, match="mmap=True needs a local file"):
        ckptfmt.load(url, mmap=True, storage_options=options)


# -- faults, injected by the proxy -------------------------------------------------------


def _big_state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(20 * MiB // 4, generator=torch.Generator().manual_seed(1))}


def test_a_reset_mid_upload_is_retried(store_faults):
    faults = store_faults
    options = faults.options | {"part_size": 8 * MiB}
    url = f"{faults.new_root()}/u.ckpt"
    faults.reset_on(*faults.op("part"), nth=2, upload_bytes=MiB)  # of the three parts
    faults.fail_next(*faults.op("part"), status=503, code="SlowDown", count=2)
    state = _big_state()
    ckptfmt.save(state, url, storage_options=options)
    assert faults.pending_rules() == 0  # every fault happened
    assert_same(state, ckptfmt.load(url, storage_options=options))


def test_a_save_that_keeps_failing_commits_nothing_and_aborts_its_upload(store_faults):
    faults = store_faults
    options = faults.options | {"part_size": 8 * MiB, "max_attempts": 2}
    root = faults.new_root()
    url = f"{root}/f.ckpt"
    faults.reset_on(*faults.op("part"), nth=1)  # one part goes, then every part is refused
    faults.fail_next(*faults.op("part"), status=500, count=1000)
    with pytest.raises(StorageError) as e:
        ckptfmt.save(_big_state(), url, storage_options=options)
    assert url in str(e.value) and re.search(r"upload part \d", str(e.value)), str(e.value)
    faults.clear_rules()
    if faults.kind == "s3":
        assert faults.count("DELETE", "uploadId") == 1  # AbortMultipartUpload
    assert faults.uploads(root) == []  # S3's aborted, GCS's parts deleted
    with pytest.raises(FileNotFoundError):
        ckptfmt.load(url, storage_options=options)


def _spool_mappings(name: str) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if f"memfd:ckptfmt-{name}" in line]


def test_a_failed_part_s_error_does_not_keep_the_spool_alive(s3_faults):
    """The error of a part that failed is raised by the save: its tracebacks' frames held the
    part's view of the spool, so the spool's mapping (and its pages) lived while the caller
    kept the error."""
    faults = s3_faults
    options = faults.storage_options() | {"max_attempts": 1, "part_size": 8 * MiB}
    bucket = faults.new_bucket()
    faults.fail_next("PUT", "partNumber=3", status=400, count=1000)
    with pytest.raises(StorageError) as kept:
        ckptfmt.save(_big_state(), f"s3://{bucket}/pinned.ckpt", storage_options=options)
    deadline = time.monotonic() + 30  # the upload pool frees the mapping after the save returns
    while _spool_mappings("pinned.ckpt") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _spool_mappings("pinned.ckpt") == [], kept.value
    faults.clear_rules()


def test_parts_go_up_while_later_chunks_are_written(s3_bucket, monkeypatch):
    """The engine tells the upload what it has written every 16 MiB, not once per batch (64 MiB
    for a save to a store): each part is sent once its bytes are in the spool, while the
    writer fills the next."""
    from ckptfmt.storage.upload import ObjectFile

    bucket, options = s3_bucket
    told: list[int] = []
    sent: list[tuple[int, int]] = []  # (part, the writer's position when it was sent)
    written, submit = ObjectFile.written, ObjectFile._submit

    def spy_written(self, pos):
        told.append(pos)
        written(self, pos)

    def spy_submit(self, number, length):
        sent.append((number, told[-1]))
        submit(self, number, length)

    monkeypatch.setattr(ObjectFile, "written", spy_written)
    monkeypatch.setattr(ObjectFile, "_submit", spy_submit)
    state = {"w": torch.randn(48 * MiB // 4, generator=torch.Generator().manual_seed(3))}
    url = f"s3://{bucket}/streamed.ckpt"
    ckptfmt.save(state, url, storage_options=options)
    assert told[0] < 20 * MiB and all(b - a <= 20 * MiB for a, b in zip(told, told[1:])), told
    assert sent[0][0] == 2 and sent[0][1] < 48 * MiB, sent  # before the last chunk was written
    assert sent[-1][0] == 1  # the prologue's part, last
    assert_same(state, ckptfmt.load(url, storage_options=options))
    assert _open_uploads(options, bucket) == []


def test_the_writer_s_check_for_failed_parts_holds_only_the_parts_in_flight(s3_bucket, monkeypatch):
    """written() runs every 16 MiB and checks for a failed part: it holds only the requests
    still in flight (bounded by the concurrency), not every part ever sent (a scan of them all
    each time was quadratic: 24 s of writer CPU for 100 GiB)."""
    from ckptfmt.storage.upload import ObjectFile

    bucket, options = s3_bucket
    options = options | {"part_size": 8 * MiB, "concurrency": 2}
    held: list[int] = []
    written = ObjectFile.written

    def counting(self, pos):
        written(self, pos)
        held.append(len(self._in_flight))

    monkeypatch.setattr(ObjectFile, "written", counting)
    state = {"w": torch.randn(88 * MiB // 4, generator=torch.Generator().manual_seed(4))}
    url = f"s3://{bucket}/many-parts.ckpt"
    ckptfmt.save(state, url, storage_options=options)
    assert len(held) >= 5 and max(held) <= 2 + 2, held  # the pool's two, one queued, the start
    assert_same(state, ckptfmt.load(url, storage_options=options))


def test_an_upload_that_cannot_begin_fails_and_leaves_nothing(s3_faults):
    """The multipart upload is begun on the upload threads while the writer goes on: its
    refusal is still the save's error, and nothing is left."""
    faults = s3_faults
    options = faults.storage_options() | {"max_attempts": 2}
    bucket = faults.new_bucket()
    url = f"s3://{bucket}/never.ckpt"
    faults.fail_next("POST", "?uploads", status=500, count=1000)
    with pytest.raises(StorageError) as e:
        ckptfmt.save(_big_state(), url, storage_options=options)
    assert url in str(e.value) and "start multipart upload" in str(e.value), str(e.value)
    faults.clear_rules()
    assert faults.count("PUT", "partNumber=") == 0
    assert _open_uploads(options, bucket) == []
    assert faults.client().list_objects_v2(Bucket=bucket).get("Contents", []) == []


def test_a_failed_part_is_raised_once_then_named(s3_faults):
    """The first failure of a part is raised where the writer next looks; a later look raises
    a StorageError caused by it, not the same exception again (each raise of one object adds
    the frames it passes through to its traceback), and the upload is aborted on exit."""
    from ckptfmt.storage.upload import ObjectFile

    faults = s3_faults
    options = faults.storage_options() | {"max_attempts": 1, "part_size": 8 * MiB}
    bucket = faults.new_bucket()
    faults.fail_next("PUT", "partNumber=2", status=400, count=1000)
    with ObjectFile(f"s3://{bucket}/twice.ckpt", options, 32 * MiB) as out:
        os.pwrite(out.fd, bytes(16 * MiB), 0)
        out.written(16 * MiB)  # part 2 goes, and fails on the upload threads
        deadline = time.monotonic() + 30
        with pytest.raises(StorageError) as first:
            while time.monotonic() < deadline:
                out.written(16 * MiB)
                time.sleep(0.01)
        assert "upload part 2" in str(first.value), first.value
        frames = len(traceback.extract_tb(first.value.__traceback__))
        with pytest.raises(StorageError) as again:
            out.written(16 * MiB)
        assert again.value is not first.value and again.value.__cause__ is first.value
        assert "failed earlier" in str(again.value) and "upload part 2" in str(again.value)
        assert len(traceback.extract_tb(first.value.__traceback__)) == frames
    faults.clear_rules()
    assert _open_uploads(options, bucket) == []


def test_a_failed_overwrite_keeps_the_committed_object(store_faults):
    options = store_faults.options | {"max_attempts": 1}
    url = f"{store_faults.new_root()}/keep.ckpt"
    ckptfmt.save({"v": torch.ones(10)}, url, storage_options=options)
    store_faults.fail_next(*store_faults.op("write", "keep.ckpt"), status=500, count=5)
    with pytest.raises(StorageError):
        ckptfmt.save({"v": torch.zeros(10)}, url, storage_options=options)
    store_faults.clear_rules()
    assert torch.equal(ckptfmt.load(url, storage_options=options)["v"], torch.ones(10))


def test_a_reset_mid_download_resumes(store_faults):
    faults = store_faults
    options = faults.options | {"request_size": 4 * MiB}
    url = f"{faults.new_root()}/dl.ckpt"
    state = _big_state()
    ckptfmt.save(state, url, storage_options=options)
    # the fourth GET, a chunk request: the first two fetch the first and the last 4 MiB (the
    # prologue, the tail) and one of them is answered 503 and asked again
    faults.reset_on(*faults.op("read", "dl.ckpt"), nth=4, download_bytes=MiB)
    faults.fail_next(*faults.op("read", "dl.ckpt"), status=503, code="SlowDown", count=1)
    assert_same(state, ckptfmt.load(url, storage_options=options))
    assert faults.pending_rules() == 0


def test_refused_credentials_name_the_url_and_the_operation(store_faults):
    from azure_server import KEY

    options = store_faults.options
    url = f"{store_faults.new_root()}/c.ckpt"
    ckptfmt.save({"a": torch.zeros(3)}, url, storage_options=options)
    store_faults.fail_next(None, "c.ckpt", status=403, code="AccessDenied", count=20)
    with pytest.raises(StorageError, match=r"look up: access denied") as e:
        ckptfmt.load(url, storage_options=options)
    assert str(e.value).startswith(url)
    for secret in (options.get("aws_secret_access_key"), KEY):
        assert secret is None or secret not in str(e.value)


def test_slow_answers_time_out_then_succeed_on_retry(store_faults):
    options = store_faults.options | {"read_timeout": 1}
    url = f"{store_faults.new_root()}/slow.ckpt"
    ckptfmt.save({"a": torch.arange(100)}, url, storage_options=options)
    store_faults.delay(*store_faults.op("read", "slow.ckpt"), seconds=3, count=1)
    assert torch.equal(ckptfmt.load(url, storage_options=options)["a"], torch.arange(100))
    assert store_faults.pending_rules() == 0


def test_request_planning_merges_neighbours_and_cuts_long_ranges_at_the_grid():
    plan = download.plan_requests([(0, 10), (20, 30), (10 * MiB, 30 * MiB)], max_bytes=8 * MiB, gap=16)
    assert plan == [(0, 30), (10 * MiB, 16 * MiB), (16 * MiB, 24 * MiB), (24 * MiB, 30 * MiB)]
    assert download.plan_requests([(5, 5)]) == []


_spans = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=6)


@given(_spans, _spans)
def test_range_arithmetic_matches_sets_of_bytes(ranges, held):
    def of(rs):
        return {b for lo, hi in rs for b in range(lo, hi)}

    merged = download.merge_ranges(held)
    assert of(merged) == of(held)
    assert all(a[1] < b[0] for a, b in zip(merged, merged[1:]))  # sorted, apart
    left = download.subtract_ranges(ranges, merged)
    assert of(left) == of(ranges) - of(held)
    assert left == download.merge_ranges(left)


@st.composite
def _targets(draw) -> list[tuple[int, int]]:
    """Spans of memory a load's bytes go to, as start_into is given them: sorted, disjoint,
    unmerged (adjacent ones: a chunk and its pad), gaps between, and empty ones anywhere (a
    tensor of no elements), inside a larger one too."""
    edges = sorted(set(draw(st.lists(st.integers(0, 60), max_size=8))))
    spans = [(a, b) for a, b in zip(edges, edges[1:]) if draw(st.booleans())]
    empties = draw(st.lists(st.integers(0, 60), max_size=2))
    return sorted([*spans, *((e, e) for e in empties)])


@given(_targets(), st.integers(0, 60), st.integers(0, 60))
def test_a_request_s_bytes_go_to_the_targets_within_it_and_its_gaps_to_the_spool(spans, lo, size):
    """ranges.routed: each byte of a request (starting or ending inside a target, or in no
    target at all) lands once, in order, in the target that holds it (each cut once) or else
    in the spool, whose parts (the gaps) are returned too; empty targets take no byte and
    hide none."""
    from ckptfmt.storage.ranges import routed

    data = bytes(range(200))
    targets = [(a, memoryview(bytearray(b - a))) for a, b in spans]
    r = (lo, lo + size)
    views, gaps = routed(r, targets, lambda a, b: memoryview(bytearray(data[a:b])))
    assert sum(len(v) for v in views) == size
    at = lo
    for v in views:  # each view filled with the bytes of the object it stands for
        v[:] = data[at : at + len(v)]
        at += len(v)
    for a, v in targets:
        hit = [i for i in range(a, a + len(v)) if lo <= i < r[1]]
        assert bytes(v[i - a] for i in hit) == bytes(data[i] for i in hit)
    assert gaps == download.subtract_ranges([r], download.merge_ranges(spans))
    within = [(a, b) for a, b in spans if max(a, lo) < min(b, r[1])]
    assert len(views) == len(within) + len(gaps)


def test_a_trickling_answer_is_cut_off_at_the_request_deadline(store_faults):
    """A store that answers and then sends a byte every few tenths of a second never lets
    read_timeout fire; request_timeout bounds each request: the load fails in about
    attempts x timeout, naming the object and the range, or succeeds where a retry does."""
    faults = store_faults
    options = faults.options | {"request_timeout": 0.5, "max_attempts": 2}
    url = f"{faults.new_root()}/trickle.ckpt"
    ckptfmt.save(_state(), url, storage_options=options)
    faults.trickle(*faults.op("read", "trickle.ckpt"), after_bytes=100, interval=0.2)
    started = time.monotonic()
    with pytest.raises(
        StorageError, match=r"read bytes \d+-\d+: the answer did not arrive within 0.5 s"
    ) as e:
        ckptfmt.load(url, storage_options=options)
    assert time.monotonic() - started < 5
    assert url in str(e.value) and "request_timeout" in str(e.value)
    faults.clear_rules()
    faults.trickle(*faults.op("read", "trickle.ckpt"), after_bytes=100, interval=0.2, count=1)
    assert_same(_state(), ckptfmt.load(url, storage_options=options))  # resumed from byte 100
    assert faults.pending_rules() == 0
    with pytest.raises(ValueError, match="request_timeout must be seconds"):
        ckptfmt.load(url, storage_options=options | {"request_timeout": 0})


def test_environment_credentials_are_used(s3_bucket, monkeypatch):
    """boto3's conventions hold: AWS_* variables stand in for storage_options."""
    bucket, options = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["aws_secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    url = f"s3://{bucket}/env.ckpt"
    ckptfmt.save({"a": torch.arange(5)}, url)
    assert torch.equal(ckptfmt.load(url)["a"], torch.arange(5))
    assert os.environ["AWS_ENDPOINT_URL"] == options["endpoint_url"]


def test_encrypted_objects(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/secret.ckpt"
    key = bytes(range(32))
    state = _state(40_000)
    ckptfmt.save(state, url, encrypt_with=key, compression="zstd", storage_options=options)
    assert_same(state, ckptfmt.load(url, decrypt_with=key, storage_options=options))
    with pytest.raises(ckptfmt.DecryptionError):
        ckptfmt.load(url, decrypt_with=bytes(32), storage_options=options)
    assert ckptfmt.verify(url, decrypt_with=key, storage_options=options).ok
