"""The S3 client behind every object-store URL, and the translation of its failures.

One boto3 client per distinct set of storage options, shared by the threads of this process
(boto3 clients are thread-safe; sessions are not, so a client is made once under a lock).
Credentials, region and endpoint follow boto3's own conventions: ``AWS_*`` environment
variables, ``~/.aws`` files and instance roles work as users expect; ``storage_options``
overrides them per call.  Retries are botocore's "standard" mode: bounded attempts with
exponential backoff on throttling, 5xx answers and dropped connections.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..errors import CheckpointError, StorageError

#: what storage_options may hold: boto3 client arguments and ckptfmt's own tuning
CLIENT_OPTIONS = (
    "endpoint_url",
    "region_name",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "profile_name",
)
TUNING_OPTIONS = (
    "max_attempts",
    "concurrency",
    "part_size",
    "connect_timeout",
    "read_timeout",
    "addressing_style",
    "request_size",
    "request_timeout",
)
_ALIASES = {"region": "region_name", "endpoint": "endpoint_url", "profile": "profile_name"}

DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_CONCURRENCY = 8

_clients: dict[tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]], Any] = {}
_lock = threading.Lock()

T = TypeVar("T")


def check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """storage_options as a plain dict with aliases resolved; ValueError on unknown names."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"storage_options must be a dict, not {type(options).__name__}")
    out: dict[str, Any] = {}
    for name, value in options.items():
        name = _ALIASES.get(name, name)
        if name not in CLIENT_OPTIONS and name not in TUNING_OPTIONS:
            known = ", ".join(sorted(CLIENT_OPTIONS + TUNING_OPTIONS + tuple(_ALIASES)))
            raise ValueError(f"unknown storage option {name!r}; known: {known}")
        out[name] = value
    for name in ("max_attempts", "concurrency"):
        if name in out and (type(out[name]) is not int or not 1 <= out[name] <= 64):
            raise ValueError(f"storage option {name} must be an int from 1 to 64, not {out[name]!r}")
    for name in ("part_size", "request_size"):
        if name in out and (type(out[name]) is not int or not 1 << 20 <= out[name] <= 5 << 30):
            raise ValueError(
                f"storage option {name} must be an int of bytes from 1 MiB to 5 GiB, not {out[name]!r}"
            )
    if "request_timeout" in out and (
        type(out["request_timeout"]) not in (int, float) or not 0 < out["request_timeout"] <= 86400
    ):
        raise ValueError(
            f"storage option request_timeout must be seconds above 0, at most a day, not {out['request_timeout']!r}"
        )
    return out


def concurrency(options: Mapping[str, Any]) -> int:
    """How many requests one transfer keeps in flight."""
    return int(options.get("concurrency", DEFAULT_CONCURRENCY))


def _import_boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise CheckpointError("object-store URLs need boto3: pip install 'ckptfmt[s3]'") from None
    return boto3


def client_for(options: Mapping[str, Any]) -> Any:
    """The shared boto3 S3 client for these (checked) options."""
    # boto3 reads AWS_* variables when the client is made: a change to them makes a new one
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    cache_key = (tuple(sorted((k, repr(v)) for k, v in options.items())), environment)
    with _lock:
        found = _clients.get(cache_key)
        if found is None:
            found = _clients[cache_key] = _new_client(options)
        return found


def _new_client(options: Mapping[str, Any]) -> Any:
    boto3 = _import_boto3()
    from botocore.config import Config

    session = boto3.session.Session(profile_name=options.get("profile_name"))
    config = Config(
        retries={"mode": "standard", "max_attempts": int(options.get("max_attempts", DEFAULT_MAX_ATTEMPTS))},
        max_pool_connections=max(10, 2 * concurrency(options)),
        connect_timeout=options.get("connect_timeout", 10),
        read_timeout=options.get("read_timeout", 60),
        # payload checksums only where the operation demands them: ours cover every byte
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # "path" for stores reached by address (MinIO, Ceph); botocore's "auto" otherwise
        s3={"addressing_style": options.get("addressing_style", "auto")},
    )
    kwargs = {k: options[k] for k in CLIENT_OPTIONS if k in options and k != "profile_name"}
    return session.client("s3", config=config, **kwargs)


def error_code(e: BaseException) -> tuple[str, int]:
    """A botocore ClientError's S3 error code and HTTP status ("", 0 for other errors)."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return code, int(status) if isinstance(status, int) else 0


_MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}


def translate(e: BaseException, url: str, operation: str) -> BaseException:
    """The error a user sees for a failed request: FileNotFoundError for a missing object or
    bucket, StorageError (naming the URL and the operation) for everything else."""
    code, status = error_code(e)
    if code in _MISSING or status == 404:
        return FileNotFoundError(errno.ENOENT, f"{operation}: no such object or bucket", url)
    if code in _DENIED or status == 403:
        return StorageError(f"{operation}: access denied ({code or status}): check the credentials", path=url)
    if code == "PreconditionFailed" or status == 412:
        return StorageError(f"{operation}: the object changed while it was being read", path=url)
    if code:
        return StorageError(f"{operation} failed: {code} (HTTP {status})", path=url)
    kind = type(e).__name__
    return StorageError(f"{operation} failed after retries: {kind}: {e}", path=url)


def request(url: str, operation: str, call: Callable[[], T]) -> T:
    """Run one client call, translating its failure (botocore has retried what it retries)."""
    try:
        return call()
    except (CheckpointError, FileNotFoundError):
        raise
    except transfer_errors() as e:
        raise translate(e, url, operation) from e


def transfer_errors() -> tuple[type[BaseException], ...]:
    """What a request can fail with: botocore's errors (after its retries), socket errors, and
    ValueError, which botocore raises for an answer it cannot parse (a date in a header or a
    listing that is not one)."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError, OSError, ValueError)


def is_precondition_failed(e: BaseException) -> bool:
    code, status = error_code(e)
    return code == "PreconditionFailed" or status == 412
