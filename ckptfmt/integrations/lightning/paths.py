"""Where a path Lightning gives lives: a local file, an ``s3://`` object (ckptfmt's own
client) or a URL of another fsspec protocol (that protocol's filesystem).

Also the ``storage_options`` Lightning passes to ``save_checkpoint``, which mean something
different at each kind of place: split here into ckptfmt's save options and the place's own;
and the URL as messages show it: a URL may carry credentials (``ftp://user:password@host``,
a signed URL's or a SAS token's query string), which never appear in an error.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsspec.core import split_protocol
from fsspec.registry import known_implementations
from fsspec.registry import registry as fsspec_classes

from ...errors import UnsupportedError
from ...storage.client import check_options
from ...storage.urls import SCHEMES, parse_url

#: a local path, written by ckptfmt's atomic local commit
LOCAL = "local"
#: an ``s3://`` or ``gs://`` URL, written and read by ckptfmt's object-store clients
OBJECT = "object"
#: a URL of any other fsspec protocol, moved through a local temporary file
FSSPEC = "fsspec"

#: the keys of a per-call ``storage_options`` that are ckptfmt's save options, at any place
SAVE_OPTIONS = ("compression", "level", "metadata")


class RemotePathError(UnsupportedError):
    """A URL of a protocol that fsspec knows no filesystem for."""


#: what stands in a message for a URL's password or query string
HIDDEN = "***"


@dataclass(frozen=True)
class Target:
    """A checkpoint's place: its kind (LOCAL, OBJECT or FSSPEC) and its path or URL."""

    kind: str
    path: str

    @property
    def name(self) -> str:
        """The path as messages show it (no credentials)."""
        return self.path if self.kind == LOCAL else shown(self.path)


#: credentials shorter than this are not looked for in a store's own messages (they would
#: match ordinary words there); the URL itself is always shown without them
MIN_QUOTED_SECRET = 6


def shown(url: str) -> str:
    """`url` as messages show it: each chained URL's password and query string hidden."""
    return "::".join(_shown_part(part) for part in url.split("::"))


def _shown_part(part: str) -> str:
    scheme, sep, rest = part.partition("://")
    if not sep:
        return part
    rest, query, _ = rest.partition("?")
    authority, slash, path = rest.partition("/")
    user, at, host = authority.rpartition("@")
    if at and ":" in user:
        authority = f"{user.split(':', 1)[0]}:{HIDDEN}@{host}"
    return f"{scheme}://{authority}{slash}{path}" + (f"?{HIDDEN}" if query else "")


def without_secrets(text: str, url: str) -> str:
    """`text`, a store's own message about `url`, with the credentials `url` carries hidden:
    the URL itself, and each password, query string and query value long enough to tell,
    as written and percent-decoded (the message may quote them apart from the URL)."""
    text = text.replace(url, shown(url))
    for secret in _secrets(url):
        text = text.replace(secret, HIDDEN)
    return text


def _secrets(url: str) -> list[str]:
    found = []
    for part in url.split("::"):
        authority = part.partition("://")[2].partition("?")[0].partition("/")[0]
        user = authority.rpartition("@")[0]
        query = part.partition("?")[2]
        values = [v.partition("=")[2] for v in query.split("&")]
        for secret in [user.partition(":")[2], query, *values]:
            found += [secret, urllib.parse.unquote(secret)]
    return sorted({s for s in found if len(s) >= MIN_QUOTED_SECRET}, key=len, reverse=True)


def target(path: Any) -> Target:
    """The place a path Lightning gives names (``file://`` URLs are local paths)."""
    text = os.fsdecode(os.fspath(path))
    if text.startswith("file://"):
        return Target(LOCAL, text[len("file://") :])
    if text.partition("://")[0] in SCHEMES and "://" in text:
        return Target(OBJECT, str(parse_url(text)))
    if "://" in text or "::" in text:  # "::" chains protocols: simplecache::gs://...
        protocol = split_protocol(text.split("::", 1)[0])[0] or text.split("::", 1)[0]
        if protocol not in known_implementations and protocol not in fsspec_classes:
            raise RemotePathError(
                f"fsspec knows no filesystem for the {protocol}:// protocol; give a local path, an "
                "s3:// or gs:// URL or a URL of a protocol fsspec serves (az://, hdfs://, memory://, ...)",
                path=shown(text),
            )
        return Target(FSSPEC, text)
    return Target(LOCAL, text)


def split_storage_options(storage_options: Any, where: Target) -> tuple[dict[str, Any], dict[str, Any]]:
    """``save_checkpoint``'s `storage_options` as (ckptfmt save options, the place's options):
    compression, level and metadata apply anywhere; the rest are the object-store client's
    settings on ``s3://`` (checked here) and the filesystem's options on other fsspec URLs.
    ValueError where they make no sense: not a dict, or place options for a local path."""
    if storage_options is None:
        return {}, {}
    if not isinstance(storage_options, Mapping) or not all(isinstance(k, str) for k in storage_options):
        raise ValueError(
            f"{where.name}: storage_options must be None or a dict with str keys, not "
            f"{type(storage_options).__name__}"
        )
    save = {k: v for k, v in storage_options.items() if k in SAVE_OPTIONS}
    place = {k: v for k, v in storage_options.items() if k not in SAVE_OPTIONS}
    if place and where.kind == LOCAL:
        raise ValueError(
            f"{where.name}: storage_options {sorted(place)} apply to s3:// and other fsspec URLs, not "
            f"to a local path, where only {', '.join(SAVE_OPTIONS)} do"
        )
    if where.kind == OBJECT:
        try:
            place = check_options(place)
        except ValueError as e:
            raise ValueError(f"{where.name}: {e}") from None
    return save, place
