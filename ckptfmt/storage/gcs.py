"""The Google Cloud Storage store (gs:// URLs) over GCS's JSON API, through requests.

Why this client: on fake-gcs-server, plain HTTP requests saved and loaded at 165/357 MB/s
where google-cloud-storage reached 59/193 (its per-request overhead, checksumming and
buffering); obstore (one Rust client for every cloud) was slower than boto3 on S3 (52/211
against 93/260 MB/s on moto), so it would not serve both.  requests is what google-auth's
AuthorizedSession already is: credentials come through google-auth's default chain
(GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default login, the metadata server of
a GCE/GKE node), or storage option ``token`` (a service account's JSON key file, or
``"anon"``); an emulator is reached as Google's own clients reach one, through
STORAGE_EMULATOR_HOST (no credentials are sent to it).

Each guarantee by GCS's own mechanism: the version of an object is its generation; ranged
reads name it (``generation=``: a replaced object answers 404, taken here as a refused
condition, never a mix of two versions); a commit record is created only if absent
(``ifGenerationMatch=0``); a conditional delete names the generation listed.  An upload in
parts (the engine writes the prologue's part last) stores each part as an object of its own
beside the target, named ``KEY.ckptfmt-part-UPLOADID-NNNNN``, and composes them (32 at a time,
in rounds) into the target, which appears whole, or not at all, at the last compose
(``ifGenerationMatch=0`` where created only if absent); the parts are then deleted.  Listings
do not show part objects; ``list_uploads`` does, grouped by upload, so the stale uploads of a
crashed saver are found and deleted as S3's multipart uploads are aborted.

Every answer is read within its deadline and bounded before it is parsed (client.read_listing),
as JSON that must be an object.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import CheckpointError, StorageError
from . import answers, client, http
from .pools import run_each
from .store import WRITE_TOKEN, Entry, Head, Page, Reply, Upload, UploadPage, ViewFile
from .urls import ObjectURL

EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"
API_ENDPOINT = "https://storage.googleapis.com"
SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
#: what names a part object: KEY + PART_MARK + UPLOAD_ID + "-" + the part's label
PART_MARK = ".ckptfmt-part-"
#: GCS composes at most this many objects in one request
MAX_COMPOSE = 32
#: the entries (items and prefixes) one listing page is asked for (maxResults)
PAGE_ENTRIES = answers.PAGE_ENTRIES
#: what a listing page is asked to hold (partial response): only what _entry reads
LISTED_FIELDS = "items(name,size,updated,generation),prefixes,nextPageToken"
_log = logging.getLogger("ckptfmt")
#: pages of part objects one abort lists at most (10,000 parts and their composites fill 11)
MAX_ABORT_PAGES = 64


def environment() -> tuple[tuple[str, str], ...]:
    """What of the environment a store is made from (a change to it makes a new one)."""
    names = (
        EMULATOR_VARIABLE,
        "GOOGLE_APPLICATION_CREDENTIALS",
        "GOOGLE_CLOUD_PROJECT",
        client.DEADLINE_VARIABLE,
    )
    return tuple((k, os.environ[k]) for k in names if k in os.environ)


def new_store(options: Mapping[str, Any]) -> GCSStore:
    emulator = os.environ.get(EMULATOR_VARIABLE)
    if emulator:
        endpoint = emulator if "://" in emulator else f"http://{emulator}"
        session = http.new_session(options, "gs")
    else:
        endpoint = API_ENDPOINT
        session = http.new_session(options, "gs", _authorized_session(options))
    return GCSStore(session, endpoint.rstrip("/"), client.timeouts(options), client.concurrency(options))


def _authorized_session(options: Mapping[str, Any]) -> Any:
    """A session sending the credentials of storage option token, or of google-auth's default
    chain; StorageError naming the chain when there are none."""
    token = options.get("token")
    if token == "anon":
        return None  # a plain session
    try:
        import google.auth
        from google.auth.transport.requests import AuthorizedSession
    except ImportError:
        raise CheckpointError("gs:// URLs need google-auth: pip install 'ckptfmt[gcs]'") from None
    try:
        if token is not None:
            from google.oauth2 import service_account

            credentials = service_account.Credentials.from_service_account_file(str(token), scopes=[SCOPE])
        else:
            credentials, _ = google.auth.default(scopes=[SCOPE])
    except (google.auth.exceptions.GoogleAuthError, OSError, ValueError) as e:
        where = (
            f"the key file {token!r} (storage option token)"
            if token is not None
            else (
                "google-auth's default chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth "
                "application-default login, the metadata server)"
            )
        )
        raise StorageError(f"no Google credentials from {where}: {e}") from None
    return AuthorizedSession(credentials)


class GCSStore:
    """The Store interface (storage/store.py) over GCS's JSON API."""

    scheme = "gs"
    version_name = "generation"
    pin_is_advisory = False
    parts_outlive_completion = True

    def __init__(
        self,
        session: Any,
        endpoint: str,
        timeouts: tuple[float, float],
        concurrency: int = client.DEFAULT_CONCURRENCY,
    ) -> None:
        self.session = session
        self.endpoint = endpoint
        self.timeouts = timeouts
        #: requests one upload's completion or abort keeps in flight (storage option concurrency)
        self.concurrency = concurrency

    # -- requests ----------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None = None,
        data: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One request (its answer's body not yet read); AnswerError naming GCS's reason."""
        url = self.endpoint + path
        return http.send(
            self.session, method, url, self.timeouts, _reason, params=params, data=data, headers=headers
        )

    def _json(self, method: str, path: str, *, entries: int = 0, **kwargs: Any) -> dict[str, Any]:
        """A request whose answer is a JSON object, read within the operation's deadline and
        bounded before it is parsed: in bytes, and in what parsing it builds (one object's
        description, or a page of at most `entries` entries)."""
        return self._dated_json(method, path, entries=entries, **kwargs)[0]

    def _dated_json(
        self, method: str, path: str, *, entries: int = 0, **kwargs: Any
    ) -> tuple[dict[str, Any], object]:
        """_json's object, and the answer's Date header as sent (None where none came)."""
        answer = self._call(method, path, **kwargs)
        what = "a listing's answer" if entries else "the store's answer"
        nodes = answers.page_nodes(entries) if entries else answers.OBJECT_NODES
        return _object(http.read_answer(answer, what), nodes), answer.headers.get("Date")

    @staticmethod
    def _object_path(url: ObjectURL, key: str | None = None) -> str:
        name = urllib.parse.quote(url.key if key is None else key, safe="")
        return f"/storage/v1/b/{urllib.parse.quote(url.bucket, safe='')}/o/{name}"

    @staticmethod
    def _bucket_path(url: ObjectURL, upload: bool = False) -> str:
        return f"{'/upload' if upload else ''}/storage/v1/b/{urllib.parse.quote(url.bucket, safe='')}/o"

    # -- reading ---------------------------------------------------------------------

    def head(self, url: ObjectURL) -> Head:
        meta = self._json("GET", self._object_path(url))
        metadata = meta.get("metadata")
        token = metadata.get(WRITE_TOKEN) if isinstance(metadata, dict) else None
        return Head(http.size_of(meta.get("size")), meta.get("generation"), token)

    def get(self, url: ObjectURL, byte_range: tuple[int, int] | None, version: str | None) -> Reply:
        params = {"alt": "media"} | ({"generation": version} if version is not None else {})
        headers = {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"} if byte_range is not None else {}
        try:
            answer = self._call("GET", self._object_path(url), params=params, headers=headers)
        except client.AnswerError as e:
            if version is not None and e.status == 404:  # that generation is gone: replaced
                raise client.AnswerError("conditionNotMet", 412, "the generation read is gone") from None
            raise
        length = answer.headers.get("Content-Length")
        return Reply(
            http.size_of(length),
            answer.headers.get("Content-Range"),
            answer.headers.get("x-goog-generation"),
            http.body_of(answer),
        )

    # -- writing ---------------------------------------------------------------------

    def put(
        self, url: ObjectURL, body: memoryview, *, if_absent: bool, token: str | None = None
    ) -> str | None:
        # one multipart request (metadata, then the bytes): the form whose ifGenerationMatch
        # every server checks (tests/gcs_server.py)
        boundary = uuid.uuid4().hex
        head = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps({'name': url.key} | _metadata(token))}\r\n--{boundary}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        data = b"".join((head, body, f"\r\n--{boundary}--\r\n".encode()))
        # the name in the query too (GCS takes it there): request logs and proxies see the key
        params = {"uploadType": "multipart", "name": url.key}
        params |= {"ifGenerationMatch": "0"} if if_absent else {}
        meta = self._json(
            "POST",
            self._bucket_path(url, upload=True),
            params=params,
            data=data,
            headers={"Content-Type": f"multipart/related; boundary={boundary}"},
        )
        return _generation(meta)

    def start_upload(self, url: ObjectURL, token: str | None = None) -> str:
        return uuid.uuid4().hex[:16]  # the parts' names carry it: nothing to ask the store

    def put_part(self, url: ObjectURL, upload_id: str, number: int, body: memoryview) -> str:
        name = _part_key(url.key, upload_id, f"{number:05d}")
        meta = self._json(
            "POST",
            self._bucket_path(url, upload=True),
            params={"uploadType": "media", "name": name},
            data=ViewFile(body),
            headers={"Content-Type": "application/octet-stream"},
        )
        generation = _generation(meta)
        if generation is None:
            raise StorageError(f"upload part {number}: the store's answer has no generation", path=str(url))
        return generation

    def complete_upload(
        self,
        url: ObjectURL,
        upload_id: str,
        parts: dict[int, str],
        *,
        if_absent: bool,
        token: str | None = None,
    ) -> str | None:
        """Compose the parts, MAX_COMPOSE at a time, into composites of composites until one
        compose makes the object; then delete the parts and composites, each retried within
        this operation's deadline (one that still fails is logged and left to a run's
        cleanup, abort_uploads_begun_before: the object is complete).  A failed compose deletes nothing:
        the attempt that retries it composes the same parts (ObjectFile's abort deletes them
        where none succeeds).  The composes of one level, and the deletes, are sent
        `concurrency` at a time, within this operation's deadline: one after another, the
        deletes of 17 parts took 0.1 s on fake-gcs-server (docs/object-stores.md)."""
        sources = [(_part_key(url.key, upload_id, f"{n:05d}"), parts[n]) for n in sorted(parts)]
        made: list[str] = [name for name, _ in sources]
        level = 0
        while len(sources) > MAX_COMPOSE:
            level += 1
            groups = [sources[i : i + MAX_COMPOSE] for i in range(0, len(sources), MAX_COMPOSE)]
            names = [_part_key(url.key, upload_id, f"c{level}x{i:05d}") for i in range(len(groups))]
            made += names
            generations = self._each(
                lambda named: self._compose(url, named[0], named[1], if_absent=False), zip(names, groups)
            )
            sources = list(zip(names, generations))
        generation = self._compose(url, url.key, sources, if_absent=if_absent, token=token)
        self._delete_quietly(url, made)
        return generation

    def _each(self, call: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """`call` of each item, `concurrency` at a time, each within the deadline of the
        operation this thread is carrying out; their results in order.  The first failure
        stops the rest (none not yet sent is sent) and is raised (pools.run_each)."""
        budget = client.current_budget()

        def within(item: Any) -> Any:
            if budget is None:
                return call(item)
            with client.carrying(budget):
                return call(item)

        return run_each(within, items, self.concurrency, "ckptfmt-gcs")

    def _compose(
        self,
        url: ObjectURL,
        key: str,
        sources: list[tuple[str, str]],
        *,
        if_absent: bool,
        token: str | None = None,
    ) -> str:
        request = {
            "sourceObjects": [{"name": name, "generation": gen} for name, gen in sources],
            "destination": {"contentType": "application/octet-stream"} | _metadata(token),
        }
        meta = self._json(
            "POST",
            self._object_path(url, key) + "/compose",
            params={"ifGenerationMatch": "0"} if if_absent else None,
            data=json.dumps(request).encode(),
            headers={"Content-Type": "application/json"},
        )
        generation = _generation(meta)
        if generation is None:
            raise StorageError("compose: the store's answer has no generation", path=str(url))
        return generation

    def abort_upload(self, url: ObjectURL, upload_id: str) -> None:
        stem = _part_key(url.key, upload_id, "")
        token: object = None
        for _ in range(MAX_ABORT_PAGES):
            page = self._page(url, stem, None, token, parts=True)
            # only this upload's parts: a listing naming another upload's (a live writer's) or
            # any other object beyond the prefix asked for deletes nothing of it
            self._delete_quietly(
                url, [e.key for e in page.entries if isinstance(e.key, str) and e.key.startswith(stem)]
            )
            if not page.truncated or not isinstance(page.token, str) or page.token == token:
                return
            token = page.token

    def _delete_quietly(self, url: ObjectURL, keys: list[str]) -> None:
        """Delete these part objects, each retried within what remains of the operation's
        deadline (its Budget's attempts); one that still cannot be deleted is logged by name
        (WARNING) and left: it is listed as an upload (list_uploads) and deleted by a run's
        cleanup once stale, or by hand (docs/object-stores.md)."""
        outer = client.current_budget()

        def delete(key: str) -> None:
            budget = _budget_within(outer)
            try:
                budget.run(
                    f"gs://{url.bucket}/{key}", "delete a part object", lambda: self._delete(url, key, None)
                )
            except (CheckpointError, OSError) as e:
                _log.warning("a part object is left (a run's cleanup deletes it once stale): %s", e)

        self._each(delete, keys)

    # -- deleting --------------------------------------------------------------------

    def delete(self, url: ObjectURL, version: str | None) -> None:
        self._delete(url, url.key, version)

    def _delete(self, url: ObjectURL, key: str, version: str | None) -> None:
        params = {"ifGenerationMatch": version} if version is not None else None
        try:
            self._call("DELETE", self._object_path(url, key), params=params).close()
        except client.AnswerError as e:
            if e.status != 404:  # absent is no error
                raise

    def delete_many(self, url: ObjectURL, keys: list[str]) -> None:
        for key in keys:
            self._delete(url, key, None)

    # -- listing ---------------------------------------------------------------------

    def list_page(self, url: ObjectURL, prefix: str, delimiter: str | None, token: object) -> Page:
        return self._page(url, prefix, delimiter, token, parts=False)

    def _page(
        self, url: ObjectURL, prefix: str, delimiter: str | None, token: object, *, parts: bool
    ) -> Page:
        """One page of the objects beneath `prefix`: the part objects of uploads (`parts`),
        or every other object."""
        # only the fields read: a real item is then four (its custom metadata never comes)
        params = {"prefix": prefix, "maxResults": str(PAGE_ENTRIES), "fields": LISTED_FIELDS}
        if delimiter:
            params["delimiter"] = delimiter
        if token is not None:
            params["pageToken"] = str(token)
        if parts:
            params["matchGlob"] = f"**{PART_MARK}*"  # GCS lists only those (the emulator all)
        page, date = self._dated_json("GET", self._bucket_path(url), entries=PAGE_ENTRIES, params=params)
        items = page.get("items", [])
        prefixes = page.get("prefixes", [])
        if not isinstance(items, list) or not isinstance(prefixes, list):
            raise ValueError("a listing whose items or prefixes are not lists")
        answers.check_page_size(len(items) + len(prefixes))
        entries = [_entry(item) for item in items]
        # a name that is not a string is kept for the lister to refuse
        entries = [e for e in entries if not isinstance(e.key, str) or (PART_MARK in e.key) == parts]
        token = page.get("nextPageToken")
        return Page(entries, prefixes, token is not None, token, date)

    def list_uploads(self, url: ObjectURL, prefix: str, marker: dict[str, str]) -> UploadPage:
        page = self._page(url, prefix, None, marker.get("pageToken"), parts=True)
        began: dict[tuple[str, str], datetime.datetime | None] = {}
        for entry in page.entries:
            if not isinstance(entry.key, str):
                continue
            target, _, rest = entry.key.rpartition(PART_MARK)
            upload_id = rest.partition("-")[0]
            if not target or not upload_id:
                continue
            earlier = began.get((target, upload_id), entry.modified)
            began[(target, upload_id)] = min(
                (t for t in (earlier, entry.modified) if t is not None), default=None
            )
        uploads = [Upload(key, upload_id, when) for (key, upload_id), when in began.items()]
        following = {"pageToken": page.token} if isinstance(page.token, str) and page.token else {}
        return UploadPage(uploads, page.truncated, following)


def _budget_within(outer: client.Budget | None) -> client.Budget:
    """A Budget of the attempts `outer` allows, ending when `outer` does (a fresh default one
    where there is none): the part deletes of a compose or an abort run within its deadline."""
    if outer is None:
        return client.Budget({})
    return client.Budget({"deadline": max(outer.remaining(), 0.001), "max_attempts": outer.attempts})


def _metadata(token: str | None) -> dict[str, Any]:
    """The object resource's field storing a write's token (none where no token)."""
    return {"metadata": {WRITE_TOKEN: token}} if token is not None else {}


def _part_key(key: str, upload_id: str, label: str) -> str:
    return f"{key}{PART_MARK}{upload_id}-{label}" if label else f"{key}{PART_MARK}{upload_id}-"


def _reason(answer: Any) -> str:
    """GCS's reason for a refused request (its JSON error's first reason), from at most 64 KiB
    of the answer read within the operation's deadline; the status where there is none."""
    try:
        error = _object(http.read_refusal(answer), answers.OBJECT_NODES).get("error")
        reasons = error.get("errors") if isinstance(error, dict) else None
        reason = reasons[0].get("reason") if isinstance(reasons, list) and reasons else None
        if isinstance(reason, str) and reason:
            return reason[:100]
    except Exception:  # a body that is not GCS's error: the status says enough
        pass
    return str(answer.status_code)


def _object(body: bytes, nodes: int) -> dict[str, Any]:
    """`body` parsed as a JSON object holding at most `nodes` values (answers.parse_json):
    ValueError (an answer that would come again) otherwise."""
    value = answers.parse_json(body, nodes)
    if not isinstance(value, dict):
        raise ValueError("the store's answer is not a JSON object")
    return value


def _generation(meta: dict[str, Any]) -> str | None:
    generation = meta.get("generation")
    return generation if isinstance(generation, str) and generation.isdigit() else None


def _entry(item: object) -> Entry:
    if not isinstance(item, dict):
        return Entry(None, None, None, None)
    return Entry(
        item.get("name"), http.size_of(item.get("size")), _time(item.get("updated")), item.get("generation")
    )


def _time(value: object) -> datetime.datetime | None:
    """An RFC 3339 time from a listing; None where it is not one."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
