"""A create-only write whose answer was lost takes the object there for its own only where it
carries the token drawn for that write (storage/lost_answer.py): never another writer's object
of the same bytes (reproducible files pin the file id), and the read-back runs within the
write's deadline, its failure saying the write's outcome is unknown."""

from __future__ import annotations

import os
import time

import pytest
import torch

import ckptfmt
from ckptfmt.errors import ObjectExistsError, StorageError
from ckptfmt.storage.backends import store_for
from ckptfmt.storage.upload import ObjectFile, upload_file
from ckptfmt.storage.urls import parse_url

SMALL = 1000  # bytes: one PUT
LARGE = 20 << 20  # an upload in parts (16 MiB parts)
PART = 16 << 20


def _upload(tmp_path, url: str, options: dict, data: bytes) -> int:
    path = tmp_path / "mine"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return upload_file(fd, url, options, if_absent=True)
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_every_store_keeps_a_create_only_writes_token_with_its_object(store_faults, size):
    """The token is what tells a write's own object apart: each emulator must keep it (S3's
    Metadata on PutObject and CreateMultipartUpload, GCS's metadata on the upload and the
    compose, Azure's x-ms-meta-* on Put Blob and Put Block List)."""
    data = os.urandom(size)
    url = store_faults.new_root() + "/obj"
    with ObjectFile(url, store_faults.options, size, if_absent=True) as out:
        out.spool.view(0, size)[:] = data
        out.written(size)
        out.commit()
        token = out.token
    assert isinstance(token, str) and len(token) == 32
    where = parse_url(url)
    assert store_for(where, store_faults.options).head(where).token == token
    assert store_faults.get_raw(url) == data


def test_another_writers_object_of_the_very_same_bytes_is_not_taken_for_this_writes(store_faults, tmp_path):
    """Another writer put this write's very bytes (a reproducible file); this write's PUT never
    reached the store (reset unforwarded) and its retry is refused: the object is not its."""
    data = os.urandom(SMALL)
    url = store_faults.new_root() + "/obj"
    store_faults.put_raw(url, data)
    before = store_for(parse_url(url), store_faults.options).head(parse_url(url)).version
    store_faults.reset_on(*store_faults.op("write", "obj"))
    with pytest.raises(ObjectExistsError, match="another writer created it"):
        _upload(tmp_path, url, store_faults.options, data)
    store_faults.clear_rules()
    assert store_for(parse_url(url), store_faults.options).head(parse_url(url)).version == before


def test_another_writers_empty_object_is_not_taken_for_this_writes(store_faults, tmp_path):
    url = store_faults.new_root() + "/obj"
    store_faults.put_raw(url, b"")
    store_faults.reset_on(*store_faults.op("write", "obj"))
    with pytest.raises(ObjectExistsError, match="another writer created it"):
        _upload(tmp_path, url, store_faults.options, b"")


@pytest.mark.parametrize("store_faults", ["s3", "az"], indirect=True)
def test_another_writers_object_of_the_same_length_and_first_part_is_not_taken_for_this_writes(
    store_faults, tmp_path
):
    """Two writers of one step, the same first part (a frozen base) and length, the rest
    different: this write's completion never reached the store.  (fake-gcs-server does not
    check a compose's condition: not shown on GCS.)"""
    ours = os.urandom(LARGE)
    theirs = ours[:PART] + os.urandom(LARGE - PART)
    url = store_faults.new_root() + "/obj"
    store_faults.put_raw(url, theirs)
    store_faults.reset_on(*store_faults.op("complete"))
    with pytest.raises(ObjectExistsError, match="another writer created it"):
        _upload(tmp_path, url, store_faults.options, ours)
    store_faults.clear_rules()
    assert store_faults.get_raw(url) == theirs


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_a_reproducible_save_of_another_state_never_takes_the_first_saves_object(store_faults, monkeypatch):
    """docs/tuning.md's reproducible files (CKPTFMT_FILE_ID, SOURCE_DATE_EPOCH): two saves of
    one step, the same frozen base and length, different heads.  B's completion never reaches
    the store: B's save fails, and A's state is what is there (B's save took A's object, and
    its version, before)."""
    monkeypatch.setenv("CKPTFMT_FILE_ID", "00112233445566778899aabbccddeeff")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    from ckptfmt.files.save import save_file, save_options

    frozen = torch.arange(5 << 20, dtype=torch.float32)  # 20 MiB: the same in both
    url = store_faults.new_root() + "/model.ckpt"
    options = save_options(storage_options=store_faults.options | {"part_size": 8 << 20})
    save_file({"frozen": frozen, "head": torch.zeros(1000)}, url, options, create_only=True)
    store_faults.reset_on(*store_faults.op("complete"))
    with pytest.raises(ObjectExistsError):
        save_file({"frozen": frozen, "head": torch.ones(1000)}, url, options, create_only=True)
    store_faults.clear_rules()
    got = ckptfmt.load(url, storage_options=store_faults.options)
    assert torch.equal(got["head"], torch.zeros(1000))


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_the_read_back_runs_within_the_writes_deadline(store_faults, tmp_path):
    """The store made the object and the answer was lost; the read-back's HEAD and GET are slow.
    They run within what is left of the write's 4 s, not 4 s each on top of it: the write
    fails by its deadline, saying its outcome is unknown (before, it took 7 s or more)."""
    url = store_faults.new_root() + "/obj"
    store_faults.reset_on(*store_faults.op("write", "obj"), answered=True)
    store_faults.delay(*store_faults.op("head", "obj"), seconds=3.5, count=1)
    store_faults.delay(*store_faults.op("read", "obj"), seconds=3.5, count=1)
    began = time.monotonic()
    with pytest.raises(StorageError, match=r"no answer came for the write of .*deadline of 4 s"):
        _upload(tmp_path, url, store_faults.options | {"deadline": 4}, os.urandom(SMALL))
    assert time.monotonic() - began < 6.5


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_a_read_back_that_fails_says_the_writes_outcome_is_unknown(store_faults, tmp_path):
    data = os.urandom(SMALL)
    url = store_faults.new_root() + "/obj"
    store_faults.reset_on(*store_faults.op("write", "obj"), answered=True)
    store_faults.fail_next(*store_faults.op("head", "obj"), status=503, count=20)
    with pytest.raises(StorageError) as caught:
        _upload(tmp_path, url, store_faults.options | {"max_attempts": 2}, data)
    assert "no answer came for the write of " + url in str(caught.value)
    assert "could not be read back to tell whether it is this write's" in str(caught.value)
    assert "HTTP 503" in str(caught.value)
    store_faults.clear_rules()
    assert store_faults.get_raw(url) == data  # the write was carried out: unknown, not refused


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_a_read_back_answer_naming_no_version_proves_nothing(store_faults, tmp_path):
    """S3's If-Match is a pin a proxy may ignore: a GET answer without an ETag does not prove
    the bytes it holds are the version asked for."""
    url = store_faults.new_root() + "/obj"
    store_faults.reset_on(*store_faults.op("write", "obj"), answered=True)
    store_faults.drop_header(*store_faults.op("read", "obj"), "ETag")
    with pytest.raises(StorageError, match="could not be read back.*names no ETag"):
        _upload(tmp_path, url, store_faults.options, os.urandom(SMALL))


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_no_abort_is_sent_for_a_completed_upload_taken_as_this_writes(store_faults, tmp_path):
    """S3's completion made the object, its answer lost, the retry answered NoSuchUpload: the
    object is this write's, and there is no upload left to abort."""
    data = os.urandom(LARGE)
    url = store_faults.new_root() + "/obj"
    store_faults.reset_on(*store_faults.op("complete"), answered=True)
    # what S3 may answer a completion retried once done (moto answers it as the first)
    store_faults.fail_next(*store_faults.op("complete"), status=404, code="NoSuchUpload")
    store_faults.clear_counts()
    assert _upload(tmp_path, url, store_faults.options, data) == LARGE
    assert store_faults.count("DELETE", "uploadId=") == 0
    store_faults.clear_rules()
    assert store_faults.get_raw(url) == data
