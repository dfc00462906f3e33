"""Create-only writes whose answer was lost (storage/lost_answer.py): the retry refused by the
object its own first attempt made succeeds; one refused by another writer's object, or
after a definite refusal, is still ObjectExistsError."""

from __future__ import annotations

import os

import pytest

from ckptfmt.errors import ObjectExistsError
from ckptfmt.storage.upload import upload_file

SMALL = 1000  # bytes: one PUT
LARGE = 20 << 20  # an upload in parts (16 MiB parts)


def _file(tmp_path, name: str, data: bytes) -> int:
    path = tmp_path / name
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


def _upload(tmp_path, url: str, options: dict, data: bytes) -> int:
    fd = _file(tmp_path, "mine", data)
    try:
        return upload_file(fd, url, options, if_absent=True)
    finally:
        os.close(fd)


def _ours_and_theirs(size: int) -> tuple[bytes, bytes]:
    """Two objects of one length that differ in their first byte only."""
    ours = os.urandom(size)
    return ours, bytes([ours[0] ^ 1]) + ours[1:]


@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_a_create_only_write_whose_answer_was_lost_is_still_refused_by_another_writers_object(
    store_faults, tmp_path, size
):
    if store_faults.kind == "gs" and size == LARGE:
        pytest.skip("fake-gcs-server does not check a compose's ifGenerationMatch=0 (tests/gcs_server.py)")
    ours, theirs = _ours_and_theirs(size)
    url = store_faults.new_root() + "/obj"
    store_faults.put_raw(url, theirs)
    operation = "write" if size == SMALL else "complete"
    method, target = store_faults.op(operation, "obj" if operation == "write" else "")
    store_faults.reset_on(method, target)  # no answer: the retry meets the other's object
    with pytest.raises(ObjectExistsError, match="another writer created it"):
        _upload(tmp_path, url, store_faults.options, ours)
    store_faults.clear_rules()
    assert store_faults.get_raw(url) == theirs


def test_a_definite_refusal_is_not_taken_for_a_lost_answer(store_faults, tmp_path):
    """An object with this write's very bytes, made by another writer: refused at the first
    attempt, no answer lost, so nothing is read back."""
    ours, _ = _ours_and_theirs(SMALL)
    url = store_faults.new_root() + "/obj"
    store_faults.put_raw(url, ours)
    with pytest.raises(ObjectExistsError):
        _upload(tmp_path, url, store_faults.options, ours)


@pytest.mark.parametrize("store_faults", ["az"], indirect=True)
def test_an_upload_in_parts_whose_completion_answer_was_lost_appears_whole(store_faults, tmp_path):
    """Azure's Put Block List (If-None-Match: *) retried after it made the object: the object
    is this write's.  (GCS's last compose is mended the same way, its part objects then
    deleted, but fake-gcs-server does not check a compose's condition: not shown here.)"""
    ours, _ = _ours_and_theirs(LARGE)
    url = store_faults.new_root() + "/obj"
    method, target = store_faults.op("complete")
    store_faults.reset_on(method, target, answered=True)
    assert _upload(tmp_path, url, store_faults.options, ours) == LARGE
    store_faults.clear_rules()
    assert store_faults.get_raw(url) == ours
