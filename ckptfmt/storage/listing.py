"""A prefix of a bucket used as a directory: its child "directories" and objects, small
objects read and written whole, deletion, and multipart uploads left by crashed savers.

Listings are paginated by the store (1000 keys a page) and read to the end; a listing
that names keys outside the prefix asked for, repeats a continuation token or names more
than MAX_LISTED entries is refused (hostile input: nothing outside a checkpoint is ever
touched, and no listing is followed forever).
"""

from __future__ import annotations

import datetime
import email.utils
import hashlib
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, NamedTuple, TypeVar

from ..errors import LimitError, StorageError
from . import client as s3
from .backends import store_for
from .store import Page, Store, Upload
from .upload import uploading
from .urls import ObjectURL

#: a single object read whole (commit records, sidecars) is refused above this size
MAX_SMALL_OBJECT = 256 << 20
#: a listing naming more entries than this is refused: what a run plausibly holds (a run of
#: half a million steps has a million objects; rotation keeps runs far smaller), and a store
#: that pages forever must not keep a reader listing forever
MAX_LISTED = 1 << 20
#: and one of more pages than this: the pages MAX_LISTED entries fill (S3 and GCS pages hold
#: up to 1000), and a few more; a store answering empty pages with a continuation token reaches it
#: after MAX_PAGES requests
MAX_PAGES = MAX_LISTED // 1000 + 64

T = TypeVar("T")


def _prefix(url: ObjectURL) -> str:
    return url.key.rstrip("/") + "/" if url.key else ""


def child_names(url: ObjectURL, options: dict[str, Any]) -> list[str]:
    """The names of the "directories" directly beneath `url` (common prefixes), sorted."""
    prefix = _prefix(url)
    out: set[str] = set()
    for page in _pages_with(url, options, "list", prefix, "/"):
        for p in page.prefixes:
            if not isinstance(p, str) or not p.startswith(prefix) or not p.endswith("/"):
                raise StorageError(f"list: the store answered a prefix outside {prefix!r}", path=str(url))
            name = p[len(prefix) : -1]
            if name and "/" not in name:
                out.add(name)
    return sorted(out)


class Listed(NamedTuple):
    """What a listing says of one object: its size, when it was last written, and its version
    (S3's ETag, GCS's generation; None where the store gives none)."""

    size: int
    modified: datetime.datetime | None
    version: str | None


class Listing(dict[str, Listed]):
    """What listed() gives: every object beneath a prefix, by its key relative to it, and
    `date`: the store's time when it answered, the Date header of the listing's last answer
    that sent one that parses (None where none did): the store's clock, which this host's
    may not agree with (runs/objectnames.py proven_store_time says what of it is believed)."""

    date: datetime.datetime | None = None


def listed(url: ObjectURL, options: dict[str, Any]) -> Listing:
    """Every object beneath `url` (recursively), by its key relative to `url`, checked: a key
    outside the prefix, or an entry without a size, is refused."""
    return _listed_under(url, options, _prefix(url))


def listed_object(url: ObjectURL, options: dict[str, Any]) -> Listed | None:
    """The object at `url` as a listing shows it (its size, Last-Modified and version; None
    where it is not listed), by a listing of its key alone: one page, where a listing of
    its "directory" takes one a thousand objects.  What a HEAD does not give: the time the
    store stamped it, by the clock that stamps the other objects listed."""
    return _listed_under(url, options, url.key).get("")


def _listed_under(url: ObjectURL, options: dict[str, Any], prefix: str) -> Listing:
    """Every object whose key begins with `prefix`, by its key less `prefix`, checked."""
    out = Listing()
    for page in _pages_with(url, options, "list", prefix, None):
        out.date = http_date(page.date) or out.date
        for entry in page.entries:
            key, size, version = entry.key, entry.size, entry.version
            if not isinstance(key, str) or not key.startswith(prefix) or type(size) is not int:
                raise StorageError(f"list: the store answered an entry outside {prefix!r}", path=str(url))
            kept = version if isinstance(version, str) and version else None
            out[key[len(prefix) :]] = Listed(size, _utc(entry.modified), kept)
    return out


def objects(url: ObjectURL, options: dict[str, Any]) -> dict[str, tuple[int, datetime.datetime | None]]:
    """Every object beneath `url` (recursively): its key relative to `url`, its size and when
    it was last written."""
    return {key: (e.size, e.modified) for key, e in listed(url, options).items()}


def versions(url: ObjectURL, options: dict[str, Any]) -> dict[str, str | None]:
    """Every object beneath `url` with the version the listing gives it: {key relative to
    `url`: version, or None where the store gives none} (what a conditional delete names)."""
    return {key: e.version for key, e in listed(url, options).items()}


def _page_within(
    whole: s3.Budget,
    url: ObjectURL,
    operation: str,
    request: Callable[[], T],
    options: dict[str, Any],
    progress: str,
) -> T:
    """One page of a listing, its attempts ending with the listing's deadline (`whole`), not
    one deadline past it; a page that fails once the listing's time is spent fails with the
    listing's deadline error (`progress` saying how far it got)."""
    left = whole.remaining()  # once: what is left may reach 0 between two looks
    if left <= 0:
        raise _listing_late(whole, url, operation, progress)
    try:
        return s3.request(str(url), operation, request, options | {"deadline": left})
    except StorageError as e:
        if whole.remaining() > 0:
            raise
        raise _listing_late(whole, url, operation, progress) from e


def _listing_late(whole: s3.Budget, url: ObjectURL, operation: str, progress: str) -> StorageError:
    return StorageError(
        f"{operation}: the listing took more than {whole.deadline:g} s (storage option deadline) {progress}",
        path=str(url),
    )


def _uploads(url: ObjectURL, options: dict[str, Any], prefix: str) -> Iterator[Upload]:
    """The uploads begun beneath `prefix` and not completed, every page of them, with the
    bounds that _pages_with puts on a listing of objects (its deadline too)."""
    store = store_for(url, options)
    marker: dict[str, str] = {}
    seen: set[bytes] = set()
    whole = s3.Budget(options)  # the listing's deadline, every page within it
    for pages in range(MAX_PAGES):
        request = partial(store.list_uploads, url, prefix, marker)
        page = _page_within(whole, url, "list uploads", request, options, f"after {pages} pages")
        yield from page.uploads
        if not page.truncated:
            return
        marker = page.marker
        if not marker:
            raise StorageError("list uploads: a truncated listing without a next marker", path=str(url))
        digest = _digest(repr(sorted(marker.items())))
        if digest in seen:
            raise StorageError(
                "list uploads: the listing repeats a marker (it would never end)", path=str(url)
            )
        seen.add(digest)
    raise LimitError(f"list uploads: the listing has more than {MAX_PAGES} pages", path=str(url))


def _digest(token: str) -> bytes:
    """A short digest of a continuation token or marker (their length is the store's to choose)."""
    return hashlib.blake2b(token.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _utc(when: Any) -> datetime.datetime | None:
    """A time from a store's answer, made comparable with now: one without a zone (botocore
    gives those when the store sends none) is taken as UTC, as S3 means it."""
    if not isinstance(when, datetime.datetime):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.timezone.utc)


def http_date(value: object) -> datetime.datetime | None:
    """An answer's Date header (an HTTP-date, RFC 9110 5.6.7) as a time with its zone (UTC
    where it names none); None where it is not one (not text, longer than any date, or not
    a date)."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        return _utc(email.utils.parsedate_to_datetime(value))
    except (TypeError, ValueError, OverflowError):
        return None


def _pages_with(
    url: ObjectURL, options: dict[str, Any], operation: str, prefix: str, delimiter: str | None
) -> Iterator[Page]:
    """The listing's pages to the end, all within one deadline (storage option deadline); a
    store that never ends it (a token it gave before, or more entries than MAX_LISTED) is
    refused rather than followed forever."""
    store = store_for(url, options)
    token: object = None
    seen_tokens: set[bytes] = set()  # digests: a token's length is the store's to choose
    listed = pages = 0
    whole = s3.Budget(options)  # each page is an operation; the listing as a whole has a deadline too
    while True:
        page = _page_within(
            whole,
            url,
            operation,
            partial(store.list_page, url, prefix, delimiter, token),
            options,
            f"after {pages} pages and {listed} entries",
        )
        listed += len(page.entries) + len(page.prefixes)
        pages += 1
        if listed > MAX_LISTED or pages > MAX_PAGES:
            raise LimitError(
                f"{operation}: the listing names more than {MAX_LISTED} entries or {MAX_PAGES} pages",
                path=str(url),
            )
        yield page
        if not page.truncated:
            return
        token = page.token
        if not isinstance(token, str) or not token:
            raise StorageError(
                f"{operation}: a truncated listing without a continuation token", path=str(url)
            )
        digest = _digest(token)
        if digest in seen_tokens:
            raise StorageError(
                f"{operation}: the listing repeats a continuation token (it would never end)",
                path=str(url),
            )
        seen_tokens.add(digest)


def delete_object(url: ObjectURL, options: dict[str, Any], *, if_match: str | None = None) -> bool:
    """Delete the one object at `url` (nothing else beneath it); an absent object is no error.
    `if_match`: only that version (S3's ETag, by a conditional DeleteObject; GCS's generation,
    by ifGenerationMatch): another version there is left, and False returned."""
    store = store_for(url, options)
    try:
        s3.request(str(url), "delete", lambda: store.delete(url, if_match), options)
    except StorageError as e:
        if if_match is not None and e.__cause__ is not None and s3.is_precondition_failed(e.__cause__):
            return False
        raise
    except FileNotFoundError:  # a conditional delete of an object that is gone
        return True
    return True


def delete_versions(
    url: ObjectURL, options: dict[str, Any], versions: Iterable[tuple[str, str | None]]
) -> None:
    """Delete each (name relative to `url`, version) in order, only as that version (If-Match):
    an object another writer has put there since stays; one given no version is left."""
    for name, version in versions:
        if version is not None:
            delete_object(url.child(name), options, if_match=version)


def delete_prefix(
    url: ObjectURL, options: dict[str, Any], ours: Callable[[str], bool], first: tuple[str, ...] = ()
) -> None:
    """Delete the objects beneath `url` whose key relative to `url` is `ours` (what ckptfmt
    writes there: an object another program left beneath the same prefix is never deleted);
    the keys in `first` (relative) go before the rest, each alone, so that a reader never
    sees the rest gone while they remain."""
    store = store_for(url, options)
    prefix = _prefix(url)
    for name in first:
        if ours(name):
            one = url.with_key(prefix + name)
            s3.request(str(url), f"delete {name}", partial(store.delete, one, None), options)
    keys = [prefix + k for k in objects(url, options) if ours(k) and k not in first]
    for i in range(0, len(keys), 1000):
        _delete_batch(store, url, keys[i : i + 1000], options)


def _delete_batch(store: Store, url: ObjectURL, batch: list[str], options: dict[str, Any]) -> None:
    """Delete the keys of `batch` by one request, tried again within one Budget where the
    store may succeed another time, each retry naming only the keys the store said it failed
    to delete (S3's per-key errors inside an answer of 200)."""
    pending = batch
    per_key = False  # whether the store named, key by key, what it failed to delete

    def attempt() -> None:
        nonlocal pending, per_key
        try:
            store.delete_many(url, pending)
        except Exception as e:
            left = getattr(e, "ckptfmt_failed_keys", None)
            if left:
                pending, per_key = left, True
            raise

    try:
        s3.request(str(url), "delete", attempt, options)
    except StorageError as e:
        if not per_key:
            raise
        # the retries ran out on the store's per-key failures: the user learns which keys stay
        raise StorageError(
            f"{e.reason}; {len(pending)} of {len(batch)} keys still not deleted: {_some(pending)}",
            path=str(url),
        ) from e


def _some(keys: list[str], shown: int = 5) -> str:
    """The first `shown` of `keys` for a message, the rest counted."""
    named = ", ".join(s3.quoted(k, 200) for k in keys[:shown])
    return named + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


#: seconds a store's time (a listing's Date, or the time it lists an object written) is believed
#: ahead of this host's clock at most (runs/objectnames.py StoreStamp): a stamp further ahead
#: is taken as this far ahead
STORE_AHEAD_AT_MOST = 300.0
#: seconds a store's time (a Last-Modified, an upload's start) may be cut down by: S3 lists
#: them in whole seconds
STAMP_ROUNDING = 1.0


def earlier_by(at: datetime.datetime, *spans: datetime.timedelta) -> datetime.datetime | None:
    """Store time `at` less `spans`, or None where that falls before the year 1: a store that
    stamps an object in the year 1 (hostile, or broken) makes a cutoff that proves nothing."""
    try:
        return at - sum(spans, datetime.timedelta())
    except OverflowError:
        return None


def abort_uploads_begun_before(
    url: ObjectURL,
    options: dict[str, Any],
    ours: Callable[[str], bool],
    begun_before: Callable[[datetime.datetime], datetime.datetime | None],
) -> int:
    """Abort the uploads beneath `url` whose key relative to `url` is `ours` (another program's
    upload beneath the same prefix is not a leftover, nor one this process is writing) begun
    before the store time `begun_before(oldest)` (absolute, by the store's clock, which stamps when an upload began;
    None: none is aborted), asked once and only when one of ours is listed, `oldest` the time
    the oldest of them began: the caller proves the store's time only where one could be old
    enough, never by this host's clock (it may run a day ahead).  Returns how many."""
    store = store_for(url, options)
    prefix = _prefix(url)
    candidates: list[tuple[str, str, datetime.datetime]] = []
    for up in _uploads(url, options, prefix):
        key, upload_id, began = up.key, up.upload_id, _utc(up.initiated)
        if not isinstance(key, str) or not key.startswith(prefix) or not isinstance(upload_id, str):
            continue
        if began is not None and ours(key[len(prefix) :]) and not uploading(upload_id):
            candidates.append((key, upload_id, began))
    if not candidates:
        return 0
    cutoff = begun_before(min(began for _, _, began in candidates))
    if cutoff is None:
        return 0
    aborted = 0
    for key, upload_id, began in candidates:
        if began < cutoff:
            one = url.with_key(key)
            s3.request(str(url), "abort a stale upload", partial(store.abort_upload, one, upload_id), options)
            aborted += 1
    return aborted
