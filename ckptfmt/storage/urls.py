"""Object-store URLs: recognising them and splitting them into bucket and key.

A checkpoint path is a URL when it starts with a scheme and ``://``; ``s3://`` (S3 and
S3-compatible stores: MinIO, Ceph, OSS ...), ``gs://`` (Google Cloud Storage) and ``az://``
or ``abfs://`` (Azure Blob Storage: ``az://CONTAINER/BLOB``) are served, any other scheme is
refused by name rather than taken for a local relative path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import UnsupportedError
from ..fileio import URL_SCHEME, is_url

__all__ = ["SCHEMES", "ObjectURL", "is_url", "parse_url"]

#: each store's own rules for bucket names: S3's 3-63 lowercase letters, digits, dots and
#: hyphens; GCS's also underscores, and up to 222 characters where dots separate its parts
_BUCKETS = {
    "s3": re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
    "gs": re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$"),
    # Azure's containers: 3-63 lowercase letters, digits and single hyphens
    "az": re.compile(r"^(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$"),
}
#: the URL forms of a store that its own tools accept besides its scheme: adlfs's abfs://
_BUCKETS["abfs"] = _BUCKETS["az"]
SCHEMES = tuple(_BUCKETS)


@dataclass(frozen=True)
class ObjectURL:
    """One object (or a prefix) in a bucket: ``s3://bucket/key``, ``gs://bucket/key``."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    def child(self, name: str) -> ObjectURL:
        """The URL of `name` beneath this one taken as a prefix."""
        return ObjectURL(self.scheme, self.bucket, f"{self.key.rstrip('/')}/{name}" if self.key else name)


def parse_url(url: str | os.PathLike[str], *, need_key: bool = True) -> ObjectURL:
    """Split `url`; UnsupportedError for a scheme not served, a bad bucket name, or (with
    `need_key`) no object key, or a key with empty, ``.`` or ``..`` segments, which stores
    treat differently from each other and from local paths."""
    text = os.fspath(url)
    m = URL_SCHEME.match(text)
    if m is None:
        raise UnsupportedError("not an object-store URL", path=text)
    scheme = m.group(1).lower()
    if scheme not in SCHEMES:
        raise UnsupportedError(
            f"the {scheme}:// scheme is not supported; object stores are reached through s3:// URLs "
            "(S3 and S3-compatible stores, with storage_options={'endpoint_url': ...}), gs:// "
            "URLs (Google Cloud Storage) and az:// or abfs:// URLs (Azure Blob Storage)",
            path=text,
        )
    bucket, _, key = text[m.end() :].partition("/")
    if not _BUCKETS[scheme].match(bucket):
        raise UnsupportedError(f"{bucket!r} is not a valid bucket name", path=text)
    if need_key and not key:
        raise UnsupportedError("the URL names a bucket but no object in it", path=text)
    if key and any(part in ("", ".", "..") for part in key.rstrip("/").split("/")):
        raise UnsupportedError("object keys with empty, '.' or '..' segments are not used", path=text)
    return ObjectURL(scheme, bucket, key)
