"""One store's emulator behind the fault proxy (tests/s3_faults.py), as the store-independent
tests see it: S3 (moto, reached through storage options), GCS (fake-gcs-server, through
STORAGE_EMULATOR_HOST) or Azure (Azurite, through AZURE_STORAGE_CONNECTION_STRING).

A test names what it does to a request by operation (`op("read", key)`, `op("write", key)`,
...), and StoreFaults says how that request looks on its store: the method and the part of
its target that names it (GCS quotes a key's slashes in the path, writes objects with POST and
reads metadata with a GET; Azure lists with ``comp=list``).  Its other attributes are the
proxy's (rules, counts)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from s3_faults import FaultProxy, Target

#: the store kinds the tests run on
KINDS = ("s3", "gs", "az")


class StoreFaults:
    """A FaultProxy in front of one store's emulator, the store reached through it."""

    def __init__(self, kind: str, proxy: FaultProxy, options: dict[str, Any], new_bucket: Any) -> None:
        self.kind = kind
        self.proxy = proxy
        #: the storage options of a call through the proxy (GCS and Azure: the environment)
        self.options = options
        self._new_bucket = new_bucket

    def __getattr__(self, name: str) -> Any:
        return getattr(self.proxy, name)  # the proxy's rules and counts

    def new_root(self) -> str:
        """The URL of a fresh bucket (container), made on the emulator directly (uncounted)."""
        return f"{self.kind}://{self._new_bucket()}"

    def keys(self, url: str) -> set[str]:
        """The keys of the objects beneath the prefix `url` (relative to it), as the store
        lists them (through the proxy: clear its listing rules first)."""
        from ckptfmt.storage import listing
        from ckptfmt.storage.urls import parse_url

        return set(listing.objects(parse_url(url, need_key=False), self.options))

    def size(self, url: str) -> int:
        """The size of the object `url`, as the store says it."""
        from ckptfmt.storage.backends import store_for
        from ckptfmt.storage.urls import parse_url

        where = parse_url(url)
        return int(store_for(where, self.options).head(where)[0])  # type: ignore[call-overload]

    def uploads(self, url: str) -> list[str]:
        """The keys of the unfinished uploads beneath the prefix `url` (the first page): S3's
        multipart uploads, GCS's part objects; Azure keeps none visible."""
        from ckptfmt.storage.backends import store_for
        from ckptfmt.storage.urls import parse_url

        where = parse_url(url, need_key=False)
        page = store_for(where, self.options).list_uploads(where, where.key, {})
        return [str(u.key) for u in page.uploads]

    def get_raw(self, url: str, limit: int = 1 << 30) -> bytes:
        """The bytes of the object `url`, whole."""
        from ckptfmt.storage.wholeget import fetch_whole

        spool = fetch_whole(url, self.options, limit)
        return bytes(spool.view(0, spool.size))

    def delete_raw(self, url: str) -> None:
        """Delete the object `url`, as another program would."""
        from ckptfmt.storage.backends import store_for
        from ckptfmt.storage.urls import parse_url

        where = parse_url(url)
        store_for(where, self.options).delete(where, None)

    def put_raw(self, url: str, data: bytes) -> None:
        """Write `data` as the object `url`, as another program would (nothing of ckptfmt's
        format in it)."""
        from ckptfmt.storage.backends import store_for
        from ckptfmt.storage.urls import parse_url

        where = parse_url(url)
        store_for(where, self.options).put(where, memoryview(data), if_absent=False)

    def key(self, key: str) -> str:
        """How an object key (or the end of one) appears in the targets of this store's requests."""
        return key.replace("/", "%2F") if self.kind == "gs" else key

    def op(self, operation: str, key: str = "") -> tuple[str, Target]:
        """(method, target) of the requests of `operation` on the object `key` (its end):
        "read" (a GET of its bytes), "head" (its size and version), "write" (a whole object
        in one request), "delete", "list" (a listing page), "part" (one part of an upload
        in parts), "complete" (what makes such an upload appear)."""
        k = self.key(key)
        if operation == "list":
            return "GET", {"s3": "list-type=2", "az": "comp=list"}.get(self.kind) or _GCS_LISTING
        if operation == "delete":
            return "DELETE", k
        if self.kind == "gs":
            return {
                "read": ("GET", re.compile(re.escape(k) + r"\?alt=media")),
                "head": ("GET", re.compile(re.escape(k) + r"$")),
                "write": ("POST", re.compile(r"uploadType=multipart&name=[^&]*" + re.escape(k))),
                "part": ("POST", "uploadType=media"),
                "complete": ("POST", "/compose"),
            }[operation]
        if operation == "head":
            return "HEAD", k
        if operation == "part":
            return "PUT", "partNumber=" if self.kind == "s3" else "blockid="
        if operation == "complete":
            return ("POST", "uploadId=") if self.kind == "s3" else ("PUT", "comp=blocklist")
        return {"read": "GET", "write": "PUT"}[operation], k


#: GCS's objects.list of a prefix (not of its uploads' part objects, which match a glob)
_GCS_LISTING = re.compile(r"^/storage/v1/b/[^/?]+/o\?(?!.*matchGlob=)")


@contextlib.contextmanager
def open_store_faults(kind: str, request: Any, monkeypatch: Any) -> Iterator[StoreFaults]:
    """A StoreFaults over a proxy in front of the session's emulator of `kind` (its fixture
    taken from `request`), the store's environment pointed at the proxy, for a `with` block."""
    if kind == "s3":
        server = request.getfixturevalue("s3_server")
        with FaultProxy(server.endpoint_url) as proxy:
            yield StoreFaults(kind, proxy, proxy.storage_options(), proxy.new_bucket)
    elif kind == "gs":
        server = request.getfixturevalue("gcs_server")
        with FaultProxy(server.endpoint) as proxy:
            monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint_url)
            yield StoreFaults(kind, proxy, {}, server.new_bucket)
    else:
        server = request.getfixturevalue("azure_server")
        upstream = server.endpoint.rsplit("/", 1)[0]
        with FaultProxy(upstream) as proxy:
            through = server.connection_string.replace(upstream, proxy.endpoint_url)
            monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", through)
            yield StoreFaults(kind, proxy, {}, server.new_container)
