"""The object-store test infrastructure itself, through boto3 over real HTTP: moto's server
(tests/s3_server.py) does what its docstring says it does, and each fault of the proxy
(tests/s3_faults.py) reaches the client as the failure it stands for."""

from __future__ import annotations

import http.client
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

if not os.environ.get("CKPTFMT_REQUIRE_S3"):  # CI requires it: there, a missing botocore fails
    pytest.importorskip("botocore")
import botocore  # noqa: E402
from botocore.exceptions import (  # noqa: E402
    ClientError,
    ConnectionClosedError,
    ReadTimeoutError,
    ResponseStreamingError,  # noqa: E402
)
from s3_server import S3Server, answers, s3_client  # noqa: E402

MiB = 1 << 20


def payload(n: int, seed: int = 0) -> bytes:
    """n bytes that differ at every offset of interest (no repeating 256-byte pattern)."""
    import random

    return random.Random(seed).randbytes(n)


def error_of(exc: ClientError) -> tuple[str, int]:
    return exc.response["Error"]["Code"], exc.response["ResponseMetadata"]["HTTPStatusCode"]


def upload_out_of_order(c, bucket: str, key: str, parts: list[bytes], **complete_kw) -> dict:
    """A multipart upload with explicit part numbers, uploaded last part first."""
    uid = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etags = {}
    for number in range(len(parts), 0, -1):
        r = c.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=number, Body=parts[number - 1])
        etags[number] = r["ETag"]
    done = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
    return c.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": done}, **complete_kw
    )


# -- the server ---------------------------------------------------------------------------------


def test_put_get_round_trip(s3_server, s3_bucket):
    bucket, opts = s3_bucket
    assert opts["endpoint_url"] == s3_server.endpoint_url and opts["region"] == "us-east-1"
    c = s3_server.client()
    data = payload(3 * MiB + 7)
    c.put_object(Bucket=bucket, Key="dir/a.ckpt", Body=data)
    assert c.get_object(Bucket=bucket, Key="dir/a.ckpt")["Body"].read() == data
    assert c.head_object(Bucket=bucket, Key="dir/a.ckpt")["ContentLength"] == len(data)


def test_buckets_are_fresh(s3_server):
    a, b = s3_server.new_bucket(), s3_server.new_bucket()
    assert a != b
    assert s3_server.client().list_objects_v2(Bucket=a)["KeyCount"] == 0


def test_multipart_parts_uploaded_out_of_order(s3_server, s3_bucket):
    bucket, _ = s3_bucket
    c = s3_server.client()
    parts = [payload(5 * MiB, 1), payload(123_457, 2)]
    r = upload_out_of_order(c, bucket, "mp", parts)
    assert r["ETag"].endswith('-2"')
    assert c.get_object(Bucket=bucket, Key="mp")["Body"].read() == b"".join(parts)


def test_parts_but_the_last_must_be_5_mib(s3_server, s3_bucket):
    bucket, _ = s3_bucket
    with pytest.raises(ClientError) as e:
        upload_out_of_order(s3_server.client(), bucket, "small", [b"a" * 1000, b"b"])
    assert error_of(e.value) == ("EntityTooSmall", 400)


def test_completion_with_a_missing_part_is_refused(s3_server, s3_bucket):
    bucket, _ = s3_bucket
    c = s3_server.client()
    uid = c.create_multipart_upload(Bucket=bucket, Key="k")["UploadId"]
    p1 = c.upload_part(Bucket=bucket, Key="k", UploadId=uid, PartNumber=1, Body=payload(5 * MiB))
    parts = [{"PartNumber": 1, "ETag": p1["ETag"]}, {"PartNumber": 2, "ETag": p1["ETag"]}]
    with pytest.raises(ClientError) as e:
        c.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=uid, MultipartUpload={"Parts": parts})
    assert error_of(e.value) == ("InvalidPart", 400)


def test_ranged_get_and_if_match(s3_server, s3_bucket):
    bucket, _ = s3_bucket
    c = s3_server.client()
    data = payload(1000)
    etag = c.put_object(Bucket=bucket, Key="k", Body=data)["ETag"]
    r = c.get_object(Bucket=bucket, Key="k", Range="bytes=100-199", IfMatch=etag)
    assert r["Body"].read() == data[100:200] and r["ContentRange"] == "bytes 100-199/1000"
    r = c.get_object(Bucket=bucket, Key="k", Range="bytes=990-2000")  # clipped at the end
    assert r["Body"].read() == data[990:] and r["ContentRange"] == "bytes 990-999/1000"
    with pytest.raises(ClientError) as e:
        c.get_object(Bucket=bucket, Key="k", Range="bytes=0-9", IfMatch='"0123456789abcdef0123456789abcdef"')
    assert error_of(e.value) == ("PreconditionFailed", 412)
    c.put_object(Bucket=bucket, Key="k", Body=payload(1000, 9))  # replaced between two reads
    with pytest.raises(ClientError) as e:
        c.get_object(Bucket=bucket, Key="k", Range="bytes=200-299", IfMatch=etag)
    assert error_of(e.value) == ("PreconditionFailed", 412)
    with pytest.raises(ClientError) as e:
        c.get_object(Bucket=bucket, Key="k", Range="bytes=1000-1001")
    assert error_of(e.value) == ("InvalidRange", 416)


def test_put_if_none_match_creates_only(s3_server, s3_bucket):
    bucket, _ = s3_bucket
    c = s3_server.client()
    c.put_object(Bucket=bucket, Key="commit", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as e:
        c.put_object(Bucket=bucket, Key="commit", Body=b"second", IfNoneMatch="*")
    assert error_of(e.value) == ("PreconditionFailed", 412)
    assert c.get_object(Bucket=bucket, Key="commit")["Body"].read() == b"first"


def test_complete_multipart_if_none_match_creates_only(s3_server, s3_bucket):
    bucket, _ = s3_bucket
    c = s3_server.client()
    first = [payload(5 * MiB, 3), b"tail"]
    upload_out_of_order(c, bucket, "obj", first, IfNoneMatch="*")
    with pytest.raises(ClientError) as e:
        upload_out_of_order(c, bucket, "obj", [payload(5 * MiB, 4), b"other"], IfNoneMatch="*")
    assert error_of(e.value) == ("PreconditionFailed", 412)
    assert c.get_object(Bucket=bucket, Key="obj")["Body"].read() == b"".join(first)


def test_list_and_abort_multipart_uploads(s3_server, s3_bucket):
    bucket, _ = s3_bucket
    c = s3_server.client()
    uid = c.create_multipart_upload(Bucket=bucket, Key="run/step-1.ckpt")["UploadId"]
    c.upload_part(Bucket=bucket, Key="run/step-1.ckpt", UploadId=uid, PartNumber=1, Body=b"x")
    listed = c.list_multipart_uploads(Bucket=bucket, Prefix="run/")["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in listed] == [("run/step-1.ckpt", uid)]
    c.abort_multipart_upload(Bucket=bucket, Key="run/step-1.ckpt", UploadId=uid)
    assert c.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    with pytest.raises(ClientError) as e:
        c.list_parts(Bucket=bucket, Key="run/step-1.ckpt", UploadId=uid)
    assert error_of(e.value) == ("NoSuchUpload", 404)
    with pytest.raises(ClientError) as e:  # AWS says 404 NoSuchUpload; moto 5.2.1 says 500
        c.upload_part(Bucket=bucket, Key="run/step-1.ckpt", UploadId=uid, PartNumber=2, Body=b"y")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] in (404, 500)
    assert "run/step-1.ckpt" not in [o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_server_stops_with_its_block():
    with S3Server() as server:
        url = server.endpoint_url
        assert answers(url)
        server.new_bucket("named-bucket")
        assert "named-bucket" in [b["Name"] for b in server.client().list_buckets()["Buckets"]]
    assert not answers(url)


# -- the proxy: plain forwarding ----------------------------------------------------------------


def test_proxy_forwards_keep_alive(s3_faults):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    data = payload(2 * MiB + 1)  # over botocore's Expect: 100-continue threshold
    c.put_object(Bucket=bucket, Key="k", Body=data)
    for _ in range(10):
        assert c.get_object(Bucket=bucket, Key="k", Range="bytes=5-9")["Body"].read() == data[5:10]
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == data
    assert s3_faults.count() == 12
    assert s3_faults.connections == 1  # one connection carried them all


def test_proxy_forwards_chunked_bodies(s3_faults):
    bucket = s3_faults.new_bucket()
    data = [payload(70_000, 5), payload(1, 6), payload(300_000, 7)]
    # moto checks that a request is signed, not its signature
    auth = {
        "Authorization": "AWS4-HMAC-SHA256 Credential=k/20260101/us-east-1/s3/aws4_request, "
        "SignedHeaders=host, Signature=00"
    }
    conn = http.client.HTTPConnection("127.0.0.1", s3_faults.port, timeout=10)
    conn.request("PUT", f"/{bucket}/chunked", body=iter(data), headers=auth, encode_chunked=True)
    assert conn.getresponse().read() is not None
    conn.request("GET", f"/{bucket}/chunked", headers=auth)  # the same connection, after it
    r = conn.getresponse()
    assert (r.status, r.read()) == (200, b"".join(data))
    conn.close()
    assert s3_faults.count("PUT", "/chunked") == 1


def test_multipart_through_the_proxy(s3_faults):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    parts = [payload(5 * MiB, 11), payload(5 * MiB, 12), payload(10, 13)]
    upload_out_of_order(c, bucket, "mp", parts)
    assert c.get_object(Bucket=bucket, Key="mp")["Body"].read() == b"".join(parts)
    assert [s3_faults.count("PUT", f"partNumber={n}") for n in (1, 2, 3)] == [1, 1, 1]
    assert s3_faults.count("POST", "?uploads") == 1 and s3_faults.count("POST", "uploadId=") == 1


# -- the proxy: faults --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status,code,method",
    [(500, "InternalError", "GET"), (503, "SlowDown", "GET"), (403, "AccessDenied", "PUT")],
)
def test_error_answers(s3_faults, status, code, method):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    c.put_object(Bucket=bucket, Key="k", Body=b"v")
    s3_faults.fail_next(method, "/k", status=status, count=2)

    def act():
        if method == "GET":
            return c.get_object(Bucket=bucket, Key="k")["Body"].read()
        return c.put_object(Bucket=bucket, Key="k", Body=payload(2 * MiB))  # sent with Expect

    for _ in range(2):
        with pytest.raises(ClientError) as e:
            act()
        assert error_of(e.value) == (code, status)
    act()  # the third goes through
    assert s3_faults.pending_rules() == 0


def test_error_answer_to_a_body_sent_without_expect(s3_faults):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    uid = c.create_multipart_upload(Bucket=bucket, Key="k")["UploadId"]
    p1 = c.upload_part(Bucket=bucket, Key="k", UploadId=uid, PartNumber=1, Body=b"only part")
    done = {"Parts": [{"PartNumber": 1, "ETag": p1["ETag"]}]}
    s3_faults.fail_next("POST", "uploadId=", status=503)
    with pytest.raises(ClientError) as e:  # boto3 sends this XML body without Expect
        c.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=uid, MultipartUpload=done)
    assert error_of(e.value) == ("SlowDown", 503)
    connections = s3_faults.connections
    c.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=uid, MultipartUpload=done)
    assert s3_faults.connections == connections  # the refused body was read; the connection lived on
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"only part"


def test_head_error_has_no_body(s3_faults):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    c.put_object(Bucket=bucket, Key="k", Body=b"v")
    s3_faults.fail_next("HEAD", "/k", status=403)
    with pytest.raises(ClientError) as e:
        c.head_object(Bucket=bucket, Key="k")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert c.head_object(Bucket=bucket, Key="k")["ContentLength"] == 1


def test_reset_on_the_nth_match(s3_faults):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    c.put_object(Bucket=bucket, Key="k", Body=b"value")
    s3_faults.reset_on("GET", "/k", nth=2)
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"value"
    with pytest.raises(ConnectionClosedError):
        c.get_object(Bucket=bucket, Key="k")
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"value"
    assert s3_faults.count("GET", "/k") == 3


def test_reset_mid_upload(s3_faults, s3_server):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    uid = c.create_multipart_upload(Bucket=bucket, Key="big")["UploadId"]
    s3_faults.reset_on("PUT", "partNumber=2", upload_bytes=1 * MiB)
    p1 = c.upload_part(Bucket=bucket, Key="big", UploadId=uid, PartNumber=1, Body=payload(5 * MiB, 1))
    with pytest.raises((ConnectionClosedError, botocore.exceptions.EndpointConnectionError)):
        c.upload_part(Bucket=bucket, Key="big", UploadId=uid, PartNumber=2, Body=payload(5 * MiB, 2))
    direct = s3_server.client()
    assert [p["PartNumber"] for p in direct.list_parts(Bucket=bucket, Key="big", UploadId=uid)["Parts"]] == [
        1
    ]
    s3_faults.clear_counts()
    c.abort_multipart_upload(Bucket=bucket, Key="big", UploadId=uid)
    assert s3_faults.count("DELETE", "uploadId=") == 1
    assert p1["ETag"]


def test_reset_mid_download(s3_faults):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    data = payload(4 * MiB)
    c.put_object(Bucket=bucket, Key="k", Body=data)
    s3_faults.reset_on("GET", "/k", download_bytes=1 * MiB)
    r = c.get_object(Bucket=bucket, Key="k")  # the head arrives
    assert r["ContentLength"] == len(data)
    with pytest.raises(ResponseStreamingError):
        r["Body"].read()
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == data


def test_reset_after_the_server_answered(s3_faults, s3_server):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    s3_faults.reset_on("PUT", "/done", answered=True)
    with pytest.raises(ConnectionClosedError):
        c.put_object(Bucket=bucket, Key="done", Body=b"made")
    # the client saw a reset, yet the server made the object
    assert s3_server.client().get_object(Bucket=bucket, Key="done")["Body"].read() == b"made"


def test_delay(s3_faults):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    c.put_object(Bucket=bucket, Key="k", Body=b"v")
    s3_faults.delay("GET", "/k", seconds=0.5, count=1)
    t = time.monotonic()
    c.get_object(Bucket=bucket, Key="k")["Body"].read()
    assert time.monotonic() - t >= 0.5
    impatient = s3_client(s3_faults.endpoint_url, max_attempts=1, read_timeout=0.3)
    s3_faults.delay("GET", "/k", seconds=1.0, count=1)
    with pytest.raises(ReadTimeoutError):
        impatient.get_object(Bucket=bucket, Key="k")


def test_counts_show_a_partial_read(s3_faults):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    data = payload(1 * MiB)
    c.put_object(Bucket=bucket, Key="k", Body=data)
    s3_faults.clear_counts()
    for start in (0, 400_000):  # two of ten 100 kB ranges
        got = c.get_object(Bucket=bucket, Key="k", Range=f"bytes={start}-{start + 99_999}")["Body"].read()
        assert got == data[start : start + 100_000]
    assert s3_faults.count("GET") == 2 and s3_faults.count("GET", "/other") == 0
    assert s3_faults.requests() == [("GET", f"/{bucket}/k"), ("GET", f"/{bucket}/k")]


def test_rules_hold_under_concurrent_requests(s3_faults):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    c.put_object(Bucket=bucket, Key="k", Body=b"v")
    s3_faults.clear_counts()
    s3_faults.fail_next("GET", "/k", status=503, count=3)
    lock = threading.Lock()
    outcomes: list[str] = []

    def get(_):
        try:
            c.get_object(Bucket=bucket, Key="k")["Body"].read()
            out = "ok"
        except ClientError as e:
            out = error_of(e)[0]
        with lock:
            outcomes.append(out)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(get, range(24)))
    assert sorted(outcomes).count("SlowDown") == 3 and outcomes.count("ok") == 21
    assert s3_faults.count("GET", "/k") == 24


def test_cleared_rules_do_nothing(s3_faults):
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    c.put_object(Bucket=bucket, Key="k", Body=b"v")
    s3_faults.fail_next("GET", "/k", status=500)
    s3_faults.reset_on(None, "/k")
    s3_faults.clear_rules()
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"


def test_botocore_max_attempts_counts_retries(s3_faults):
    """botocore's retries={"max_attempts": 1} still retries once; total_max_attempts=1 does not."""
    from botocore.config import Config

    bucket = s3_faults.new_bucket()
    s3_faults.client().put_object(Bucket=bucket, Key="k", Body=b"v")
    legacy = s3_client(s3_faults.endpoint_url, None, retries={"max_attempts": 1, "mode": "standard"})
    assert isinstance(legacy.meta.config, Config)
    s3_faults.clear_counts()
    s3_faults.fail_next("GET", "/k", status=503)
    assert legacy.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"  # retried after the 503
    assert s3_faults.count("GET", "/k") == 2
