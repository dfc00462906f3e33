"""The S3 store (s3:// URLs: S3 and S3-compatible stores, MinIO, Ceph, OSS ...) through boto3.

One boto3 client per distinct set of storage options, shared by the threads of this process
(boto3 clients are thread-safe; sessions are not, so a client is made once under a lock).
Credentials, region and endpoint follow boto3's own conventions: ``AWS_*`` environment
variables, ``~/.aws`` files and instance roles work as users expect; ``storage_options``
overrides them per call.  botocore's retries are off (client.request retries), and its
requests are sent by ckptfmt: each answer's head, and each body botocore parses, within the
operation's deadline, bodies bounded before botocore parses them (_send_within_deadlines).

boto3 stays S3's client on evidence: on moto, save/load ran at 93/260 MB/s through boto3
against 52/211 through obstore (bench/objects.py, docs/objects.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import CheckpointError, StorageError
from . import answers, client, http
from .store import WRITE_TOKEN, Entry, Head, Page, Reply, Upload, UploadPage, ViewFile
from .urls import ObjectURL

#: the entries a listing page holds at most (S3's MaxKeys and MaxUploads, 1000 unless asked)
PAGE_ENTRIES = answers.PAGE_ENTRIES
#: the operations whose answers are listings (_send_within_deadlines counts their tags)
LISTING_OPERATIONS = ("ListObjectsV2", "ListMultipartUploads")
#: the per-key errors of DeleteObjects that another attempt may not meet (S3's 500 and 503)
TRANSIENT_DELETE_ERRORS = frozenset({"InternalError", "SlowDown", "ServiceUnavailable"})


def environment() -> tuple[tuple[str, str], ...]:
    """What of the environment a client is made from: boto3 reads AWS_* variables when the
    client is made, so a change to them makes a new one."""
    return tuple(
        sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_") or k == client.DEADLINE_VARIABLE)
    )


def new_store(options: Mapping[str, Any]) -> S3Store:
    return S3Store(_new_client(options))


class S3Store:
    """The Store interface (storage/store.py) over one boto3 S3 client."""

    scheme = "s3"
    version_name = "ETag"
    pin_is_advisory = True
    parts_outlive_completion = False

    def __init__(self, boto_client: Any) -> None:
        self.client = boto_client

    def head(self, url: ObjectURL) -> Head:
        reply = self.client.head_object(Bucket=url.bucket, Key=url.key)
        metadata = reply.get("Metadata")
        token = metadata.get(WRITE_TOKEN) if isinstance(metadata, dict) else None
        return Head(reply.get("ContentLength"), reply.get("ETag"), token)

    def get(self, url: ObjectURL, byte_range: tuple[int, int] | None, version: str | None) -> Reply:
        extra: dict[str, str] = {}
        if byte_range is not None:
            extra["Range"] = f"bytes={byte_range[0]}-{byte_range[1] - 1}"
        if version is not None:
            extra["IfMatch"] = version
        reply = self.client.get_object(Bucket=url.bucket, Key=url.key, **extra)
        body = reply["Body"]
        return Reply(
            reply.get("ContentLength"),
            reply.get("ContentRange"),
            reply.get("ETag"),
            client.Body(body, getattr(body, "_raw_stream", body)),
        )

    def put(
        self, url: ObjectURL, body: memoryview, *, if_absent: bool, token: str | None = None
    ) -> str | None:
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_absent else {}
        extra |= _metadata(token)
        reply = self.client.put_object(  # each attempt reads the body from its start
            Bucket=url.bucket, Key=url.key, Body=ViewFile(body) if len(body) else b"", **extra
        )
        return _etag(reply)

    def start_upload(self, url: ObjectURL, token: str | None = None) -> str:
        reply = self.client.create_multipart_upload(Bucket=url.bucket, Key=url.key, **_metadata(token))
        return str(reply["UploadId"])

    def put_part(self, url: ObjectURL, upload_id: str, number: int, body: memoryview) -> str:
        reply = self.client.upload_part(
            Bucket=url.bucket, Key=url.key, UploadId=upload_id, PartNumber=number, Body=ViewFile(body)
        )
        etag = _etag(reply)
        if etag is None:
            raise StorageError(f"upload part {number}: the store's answer has no ETag", path=str(url))
        return etag

    def complete_upload(
        self,
        url: ObjectURL,
        upload_id: str,
        parts: dict[int, str],
        *,
        if_absent: bool,
        token: str | None = None,
    ) -> str | None:
        # the token was stored by start_upload: CompleteMultipartUpload takes no metadata
        listed = [{"PartNumber": n, "ETag": parts[n]} for n in sorted(parts)]
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        reply = self.client.complete_multipart_upload(
            Bucket=url.bucket, Key=url.key, UploadId=upload_id, MultipartUpload={"Parts": listed}, **extra
        )
        return _etag(reply)

    def abort_upload(self, url: ObjectURL, upload_id: str) -> None:
        self.client.abort_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=upload_id)

    def delete(self, url: ObjectURL, version: str | None) -> None:
        condition = {} if version is None else {"IfMatch": version}
        self.client.delete_object(Bucket=url.bucket, Key=url.key, **condition)

    def delete_many(self, url: ObjectURL, keys: list[str]) -> None:
        """DeleteObjects; its per-key errors, inside an answer of 200, raised: a store's
        transient failure (InternalError, SlowDown) as an AnswerError the retry loop tries
        again, carrying (ckptfmt_failed_keys) the keys of this batch left to delete."""
        reply = self.client.delete_objects(Bucket=url.bucket, Delete={"Objects": [{"Key": k} for k in keys]})
        errors = reply.get("Errors")
        if not errors:
            return
        errors = [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []
        first = errors[0] if errors else {}
        codes = {str(e.get("Code")) for e in errors}
        if errors and codes <= TRANSIENT_DELETE_ERRORS:
            code = str(first.get("Code"))
            failed = client.AnswerError(
                code, 503 if code == "SlowDown" else 500, f"{len(errors)} of {len(keys)} keys not deleted"
            )
            asked = set(keys)
            failed.ckptfmt_failed_keys = [  # type: ignore[attr-defined]
                k for e in errors if isinstance(k := e.get("Key"), str) and k in asked
            ]
            raise failed
        # the refusal that ends the delete, not a transient failure beside it
        refused = next((e for e in errors if str(e.get("Code")) not in TRANSIENT_DELETE_ERRORS), first)
        what = client.quoted(f"{refused.get('Key')}: {refused.get('Code')}")
        raise StorageError(f"delete {what} ({len(errors)} of {len(keys)} keys not deleted)", path=str(url))

    def list_page(self, url: ObjectURL, prefix: str, delimiter: str | None, token: object) -> Page:
        extra = {"Delimiter": delimiter} if delimiter else {}
        if token is not None:
            extra["ContinuationToken"] = str(token)
        page = self.client.list_objects_v2(Bucket=url.bucket, Prefix=prefix, **extra)
        entries = [
            Entry(e.get("Key"), e.get("Size"), e.get("LastModified"), e.get("ETag"))
            if isinstance(e, dict)
            else Entry(None, None, None, None)
            for e in page.get("Contents", []) or []
        ]
        prefixes = [
            p.get("Prefix") if isinstance(p, dict) else None for p in page.get("CommonPrefixes", []) or []
        ]
        answers.check_page_size(len(entries) + len(prefixes))
        truncated, token = bool(page.get("IsTruncated")), page.get("NextContinuationToken")
        return Page(entries, prefixes, truncated, token, _date(page))

    def list_uploads(self, url: ObjectURL, prefix: str, marker: dict[str, str]) -> UploadPage:
        reply = self.client.list_multipart_uploads(Bucket=url.bucket, Prefix=prefix, **marker)
        uploads = [
            Upload(u.get("Key"), u.get("UploadId"), u.get("Initiated"))
            for u in reply.get("Uploads", []) or []
            if isinstance(u, dict)
        ]
        answers.check_page_size(len(uploads))
        key, upload = reply.get("NextKeyMarker"), reply.get("NextUploadIdMarker")
        following: dict[str, str] = {}
        if isinstance(key, str) and key:
            following = {"KeyMarker": key} | (
                {"UploadIdMarker": upload} if isinstance(upload, str) and upload else {}
            )
        return UploadPage(uploads, bool(reply.get("IsTruncated")), following)


def _metadata(token: str | None) -> dict[str, Any]:
    """The user metadata argument storing a write's token (none where no token)."""
    return {"Metadata": {WRITE_TOKEN: token}} if token is not None else {}


def _etag(reply: object) -> str | None:
    etag = reply.get("ETag") if isinstance(reply, dict) else None
    return etag if isinstance(etag, str) and etag else None


def _date(reply: dict[str, Any]) -> object:
    """The Date header of the answer botocore parsed into `reply` (None where none came)."""
    meta = reply.get("ResponseMetadata")
    headers = meta.get("HTTPHeaders") if isinstance(meta, dict) else None
    return headers.get("date") if isinstance(headers, dict) else None


def _import_boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise CheckpointError("s3:// URLs need boto3: pip install 'ckptfmt[s3]'") from None
    return boto3


def _new_client(options: Mapping[str, Any]) -> Any:
    boto3 = _import_boto3()
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError
    from urllib3.exceptions import HTTPError

    # urllib3's: the bodies ckptfmt reads itself (_send_within_deadlines) fail with them
    client.add_transfer_errors(BotoCoreError, ClientError, HTTPError)
    session = boto3.session.Session(profile_name=options.get("profile_name"))
    connect_timeout, read_timeout = client.timeouts(options)
    config = Config(
        # one attempt: ckptfmt retries (Budget), under the operation's deadline
        retries={"mode": "standard", "total_max_attempts": 1},
        max_pool_connections=max(10, 2 * client.concurrency(options)),
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        # payload checksums only where the operation demands them: ours cover every byte
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # "path" for stores reached by address (MinIO, Ceph); botocore's "auto" otherwise
        s3={"addressing_style": options.get("addressing_style", "auto")},
    )
    own = ("profile_name", "addressing_style")
    kwargs = {k: options[k] for k in client.STORE_OPTIONS["s3"] if k in options and k not in own}
    boto_client = session.client("s3", config=config, **kwargs)
    _send_within_deadlines(boto_client)
    return boto_client


class _Bytes:
    """What botocore reads an answer's content from (its raw.stream())."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **kwargs: Any) -> Iterator[bytes]:
        yield self._data


def _send_within_deadlines(boto_client: Any) -> None:
    """Have `boto_client` send every request itself (botocore's before-send event): each
    answer's head within what remains of the operation's deadline (http.HeadWatch on the
    connections of botocore's pools), and each body botocore parses (every answer's but a
    GetObject's data) read with read_listing, within that deadline and bounded before it is
    parsed, a listing's tags counted too (answers.check_xml).  botocore's read_timeout bounds
    each wait for a byte: a store sending its status line or a body a byte at a time held a
    request for as long as it liked."""
    from botocore.awsrequest import AWSHTTPConnectionPool, AWSHTTPSConnectionPool, AWSResponse

    session = boto_client._endpoint.http_session  # botocore's own: its pool, proxies and TLS
    pools = http.watched_pools(AWSHTTPConnectionPool, AWSHTTPSConnectionPool)
    session._pool_classes_by_scheme = pools  # for the proxies' pools, made when first used
    session._manager.pool_classes_by_scheme = pools

    def send(request: Any, event_name: str = "", **kwargs: Any) -> Any:
        operation = event_name.rpartition(".")[2]
        streamed = request.stream_output  # GetObject's: bodies.read_body reads the data
        request.stream_output = True  # botocore's session must not read the body itself
        answer = http.head_within_deadline(lambda: session.send(request), lambda a: a.raw.close())
        if request.method == "HEAD" or (streamed and answer.status_code < 300):
            return answer  # no body (its Content-Length is the object's), or the data
        what = "a listing's answer" if operation in LISTING_OPERATIONS else "the store's answer"
        body = client.read_listing(answer.raw, http.time_left(), what)
        if operation in LISTING_OPERATIONS:
            answers.check_xml(body, answers.page_nodes(PAGE_ENTRIES))  # before botocore builds it
        return AWSResponse(answer.url, answer.status_code, answer.headers, _Bytes(body))

    boto_client.meta.events.register("before-send.s3", send)
