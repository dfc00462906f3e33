"""Object-store URLs: recognising them and splitting them into bucket and key.

A checkpoint path is a URL when it starts with a scheme and ``://``; ``s3://`` (S3 and
S3-compatible stores: MinIO, Ceph, OSS ...), ``gs://`` or gcsfs's ``gcs://`` (Google Cloud
Storage) and ``az://``, ``abfs://`` or ``abfss://`` (Azure Blob Storage: ``az://CONTAINER/BLOB``,
or adlfs's ``abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/BLOB`` naming the account, with
``.blob.`` for ``.dfs.`` too) are served, any other scheme is refused by name rather than
taken for a local relative path.
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
#: the store each scheme reaches: besides their own, the schemes their fsspec filesystems
#: take (gcsfs's gcs://, adlfs's abfs:// and abfss://)
STORE_OF = {"s3": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}
SCHEMES = tuple(STORE_OF)
#: the host of an Azure URL that names its account (adlfs's form): CONTAINER@ACCOUNT.dfs... ;
#: account names are 3-24 lowercase letters and digits
_AZURE_HOST = re.compile(r"^(?P<account>[a-z0-9]{3,24})\.(?:blob|dfs)\.core\.windows\.net$")


@dataclass(frozen=True)
class ObjectURL:
    """One object (or a prefix) in a bucket: ``s3://bucket/key``, ``gs://bucket/key``."""

    scheme: str
    bucket: str
    key: str
    #: the host of an Azure URL naming its account (``ACCOUNT.dfs.core.windows.net``), else ""
    host: str = ""

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}{'@' + self.host if self.host else ''}/{self.key}"

    @property
    def store(self) -> str:
        """The store the URL reaches: "s3", "gs" or "az"."""
        return STORE_OF[self.scheme]

    @property
    def account(self) -> str | None:
        """The Azure storage account the URL names, if it names one."""
        m = _AZURE_HOST.match(self.host)
        return m.group("account") if m else None

    def with_key(self, key: str) -> ObjectURL:
        """The URL of the object `key` of the same bucket (and account)."""
        return ObjectURL(self.scheme, self.bucket, key, self.host)

    def child(self, name: str) -> ObjectURL:
        """The URL of `name` beneath this one taken as a prefix."""
        return self.with_key(f"{self.key.rstrip('/')}/{name}" if self.key else name)


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
            "(S3 and S3-compatible stores, with storage_options={'endpoint_url': ...}), gs:// or "
            "gcs:// URLs (Google Cloud Storage) and az://, abfs:// or abfss:// URLs (Azure Blob Storage)",
            path=text,
        )
    bucket, _, key = text[m.end() :].partition("/")
    store = STORE_OF[scheme]
    bucket, at, host = bucket.partition("@")
    if at and (store != "az" or not _AZURE_HOST.match(host)):
        raise UnsupportedError(
            f"{bucket + at + host!r} is not a bucket name"
            + (
                " (an Azure URL names its account as CONTAINER@ACCOUNT.dfs.core.windows.net)"
                if store == "az"
                else ""
            ),
            path=text,
        )
    if not _BUCKETS[store].match(bucket):
        raise UnsupportedError(f"{bucket!r} is not a valid bucket name", path=text)
    if need_key and not key:
        raise UnsupportedError("the URL names a bucket but no object in it", path=text)
    if key and any(part in ("", ".", "..") for part in key.rstrip("/").split("/")):
        raise UnsupportedError("object keys with empty, '.' or '..' segments are not used", path=text)
    return ObjectURL(scheme, bucket, key, host)
