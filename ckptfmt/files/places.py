"""Where the files of a multi-file checkpoint lie: a local directory or an object-store prefix.

A multi-file checkpoint (spec section 13) is a set of ckptfmt files and a commit record
written last.  Its writers and readers need the same few operations wherever it lies: create
a file, describe one (its identity for the record), open one checked against the record,
list, delete, read the record, and write the record last and only once.  ``LocalPlace``
does them beneath one open directory descriptor (engine/ckptdir.py: nothing is resolved
through a link, spec 13.6); ``ObjectPlace`` under a prefix of an object store (storage/:
each file one object, streamed into a multipart upload; the record created only if absent
with If-None-Match; every read pinned to the ETag it first saw, spec 13.7).

``place_at(path, storage_options)`` picks one.  Everything read from either is hostile
input: records are bounded before they are decoded, files are checked against the record
(length, file id, index checksum) before anything else is read from them, and a listing
naming keys outside the prefix is refused (storage/listing.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..background.inflight import SaveHandle
from ..engine import commit
from ..engine.ckptdir import CheckpointDir, LinkError
from ..errors import (
    CheckpointError,
    CorruptError,
    IncompleteError,
    LimitError,
    StorageError,
    UnsupportedError,
)
from ..fileio import is_url
from ..format.index import External
from ..storage import listing, references
from ..storage.client import check_options
from ..storage.download import RemoteObject, head
from ..storage.urls import ObjectURL, parse_url
from ..storage.wholeget import fetch_whole
from . import multifile, recordsign
from .encryption import save_and_read_keys
from .names import is_own_name
from .reader import CheckpointFile

if TYPE_CHECKING:
    from ..background.forksave import ForkSnapshot

#: multipart uploads older than this are a crashed saver's leftovers (a live saver writes
#: more often: it has no lock on a store, so age stands for "no live process holds it")
STALE_AFTER = datetime.timedelta(hours=24)


def normalized(path: str | os.PathLike[str]) -> str:
    """How a checkpoint's place is named in messages and records: a URL without a trailing
    slash, a local path made absolute."""
    text = os.fspath(path)
    return text.rstrip("/") if is_url(text) else os.path.abspath(text)


class Place:
    """The files of one checkpoint (see the module doc); a context manager."""

    path: str

    def path_of(self, name: str) -> str:
        return f"{self.path}/{name}"

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def names(self) -> list[str]:
        """The names of the files directly in the place."""
        raise NotImplementedError

    def remove(self, name: str) -> None:
        """Delete file `name` (an absent one is no error)."""
        raise NotImplementedError

    def save_target(self, name: str) -> tuple[str, CheckpointDir | None, dict[str, Any] | None]:
        """Where a save of file `name` goes: its path or URL, the open directory it is made
        beneath (None on a store), the store's client settings (None for a local file)."""
        raise NotImplementedError

    def save(
        self, name: str, state: object, staged: ForkSnapshot | None = None, **options: Any
    ) -> SaveHandle | None:
        """Write `state` as the ckptfmt file `name` (files.save's options), atomically; the
        save's handle (running still with blocking=False).  `staged`: a fork snapshot taken
        before the save was planned, whose child writes the file (files.save.staged_by)."""
        from .save import save_file, save_options, staged_by

        target, within, storage = self.save_target(name)
        checked = staged_by(save_options(storage_options=storage, **options), staged)
        return save_file(state, target, checked, within=within)

    def save_against(
        self,
        name: str,
        state: object,
        base: str | None,
        staged: ForkSnapshot | None = None,
        *,
        min_reference_bytes: int = 0,
        **options: Any,
    ) -> SaveHandle | None:
        """save with content digests, against the file `base` (a path or URL; None: the first
        of a series): chunks it already stores are referred to (files.incremental.save)."""
        from .incremental import save_checked
        from .save import save_options, staged_by

        target, within, storage = self.save_target(name)
        encrypt, decrypt = save_and_read_keys(
            options.pop("encrypt_with", None), options.pop("decrypt_with", None)
        )
        checked = staged_by(save_options(storage_options=storage, encrypt_with=encrypt, **options), staged)
        return save_checked(
            state,
            target,
            checked,
            base=base,
            base_chunks=options.get("chunk_size") is None,
            min_reference_bytes=min_reference_bytes,
            within=within,
            decrypt_with=decrypt,
        )

    def externals_of(self, name: str, key: Any = None) -> dict[str, External]:
        """The files the committed file `name` reads chunks from, by reference path, as its
        index records them (file id, length); `key`: its encryption key, which its index needs."""
        with self.open_file(name, key) as f:
            return {ext.rel: ext for ext in f.externals}

    def open_file(self, name: str, key: Any = None) -> CheckpointFile:
        """The file `name` as it is now, opened (its writer describes what it just wrote)."""
        raise NotImplementedError

    def describe(self, name: str) -> multifile.PartRecord:
        """The identity of the committed file `name`, for a commit record."""
        raise NotImplementedError

    def open_part(
        self, rec: multifile.PartRecord, label: str, *, trusted: Any = None, decrypt: Any = None
    ) -> CheckpointFile:
        """The file `rec` names, opened and checked to be it (length, file id, index checksum);
        what is read through it is what was checked.  `trusted`: public keys the record was
        read signed with (the file is hashed against its digest first); `decrypt`: the key of
        an encrypted file."""
        raise NotImplementedError

    def open_named(
        self,
        record: multifile.CommitRecord,
        name: str,
        label: str,
        *,
        trusted: Any = None,
        decrypt: Any = None,
    ) -> CheckpointFile:
        """File `name` of the checkpoint whose commit record is `record`, opened by open_part;
        it may read chunks only from files the record names (spec 13.1), and with `trusted`
        those files are hashed against the record too."""
        f = self.open_part(self.named_part(record, name), label, trusted=trusted, decrypt=decrypt)
        return self._reading_named(f, record, name, hash_references=trusted is not None)

    def named_part(self, record: multifile.CommitRecord, name: str) -> multifile.PartRecord:
        """The entry of file `name` in `record` (CorruptError when it names none)."""
        part = next((p for p in record.files if p.name == name), None)
        if part is None:
            raise CorruptError(f"the commit record names no file {name!r}", path=self.path)
        return part

    def _reading_named(
        self, f: CheckpointFile, record: multifile.CommitRecord, name: str, *, hash_references: bool
    ) -> CheckpointFile:
        """`f` (file `name`, open) once it is seen to read chunks only from files `record`
        names, those it reads hashed against the record when `hash_references`; closed on
        failure."""
        try:
            multifile.check_references(f, record, self.path_of(name))
            if hash_references:
                read = {ext.rel for ext in f.externals}
                self.check_digests([p for p in record.references if p.name in read])
        except BaseException:
            f.close()
            raise
        return f

    def check_digests(self, parts: list[multifile.PartRecord]) -> None:
        """Hash each file of `parts` against its recorded SHA-256 (spec 16.7)."""
        raise NotImplementedError

    def check_part(self, rec: multifile.PartRecord) -> None:
        """Raise unless the file `rec` names is there, as recorded."""
        self.open_part(rec, rec.name).close()

    def read_record(self, trusted: Any = None) -> multifile.CommitRecord:
        """The commit record, bounded before it is decoded (IncompleteError when absent);
        `trusted`: it must be signed by one of these public keys."""
        raise NotImplementedError

    def write_record(self, record: multifile.CommitRecord, sign_with: Any = None) -> None:
        """Write the commit record, last (on a store: only if absent)."""
        raise NotImplementedError

    def withdraw_record(self) -> None:
        """Remove the commit record before files under it are replaced: from now on the place
        holds no checkpoint, so a save that dies half way leaves none."""
        raise NotImplementedError

    def with_digest(self, part: multifile.PartRecord) -> multifile.PartRecord:
        """`part` with its file's SHA-256 (for a signed record, spec 16.7)."""
        raise NotImplementedError

    def remove_leftovers(self) -> None:
        """Remove what crashed saves left (temporaries, unfinished uploads); never a live save's."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> Place:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class LocalPlace(Place):
    """A local checkpoint directory, held open: every name resolved beneath its descriptor
    (closed with the place unless `owned` is False: a directory the caller lends)."""

    def __init__(self, d: CheckpointDir, *, owned: bool = True) -> None:
        self.dir: CheckpointDir | None = d
        self.path = d.path
        self._owned = owned

    @property
    def d(self) -> CheckpointDir:
        if self.dir is None:
            raise ValueError(f"{self.path}: the place is closed")
        return self.dir

    def path_of(self, name: str) -> str:
        return self.d.path_of(name)

    def exists(self, name: str) -> bool:
        return self.d.exists(name)

    def names(self) -> list[str]:
        return self.d.names()

    def remove(self, name: str) -> None:
        self.d.unlink(name)

    def save_target(self, name: str) -> tuple[str, CheckpointDir | None, dict[str, Any] | None]:
        return self.d.path_of(name), self.d, None

    def open_file(self, name: str, key: Any = None) -> CheckpointFile:
        return CheckpointFile(
            self.d.path_of(name), fd=self.d.open_file(name), within=self.d, decrypt_with=key
        )

    def describe(self, name: str) -> multifile.PartRecord:
        return multifile.describe_in(self.d, name)

    def open_part(
        self, rec: multifile.PartRecord, label: str, *, trusted: Any = None, decrypt: Any = None
    ) -> CheckpointFile:
        d = self.d
        if trusted is None:
            fd = multifile.open_part(d, rec, d.path, label)
        else:
            fd = recordsign.open_trusted_part(d, rec, d.path)
        return CheckpointFile(d.path_of(rec.name), fd=fd, within=d, decrypt_with=decrypt)

    def check_digests(self, parts: list[multifile.PartRecord]) -> None:
        recordsign.check_files(self.d, parts, self.path)

    def check_part(self, rec: multifile.PartRecord) -> None:
        multifile.check_part(self.d, rec, self.path)

    def read_record(self, trusted: Any = None) -> multifile.CommitRecord:
        if trusted is None:
            return multifile.read_commit(self.d)
        return recordsign.read_trusted(self.d, trusted)

    def write_record(self, record: multifile.CommitRecord, sign_with: Any = None) -> None:
        multifile.write_commit(self.path, record, within=self.d, sign_with=sign_with)

    def withdraw_record(self) -> None:
        if self.d.unlink(multifile.COMMIT_NAME):
            self.d.fsync()

    def with_digest(self, part: multifile.PartRecord) -> multifile.PartRecord:
        return recordsign.part_with_digest(self.d, part)

    def remove_leftovers(self) -> None:
        commit.remove_abandoned_temps(self.d)  # of crashed saves, never one a live save owns

    def close(self) -> None:
        if self.dir is not None:
            if self._owned:
                self.dir.close()
            self.dir = None


class ObjectPlace(Place):
    """A prefix of an object store: each file one object beneath it (``PREFIX/NAME``)."""

    def __init__(self, url: str | ObjectURL, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url if isinstance(url, ObjectURL) else parse_url(url, need_key=False)
        self.path = str(self.url).rstrip("/")
        self.options = check_options(storage_options)

    def __repr__(self) -> str:
        return f"ObjectPlace({self.path!r})"

    def _url(self, name: str) -> ObjectURL:
        if not multifile.valid_part_name(name, reference=False) and name != multifile.COMMIT_NAME:
            raise CorruptError(f"{name[:80]!r} is not a name of a checkpoint's file", path=self.path)
        return self.url.child(name)

    def exists(self, name: str) -> bool:
        try:
            head(self._url(name), self.options)
        except FileNotFoundError:
            return False
        return True

    def names(self) -> list[str]:
        return sorted(k for k in listing.objects(self.url, self.options) if "/" not in k)

    def remove(self, name: str) -> None:
        listing.delete_object(self._url(name), self.options)

    def save_target(self, name: str) -> tuple[str, CheckpointDir | None, dict[str, Any] | None]:
        return str(self._url(name)), None, self.options

    def open_file(self, name: str, key: Any = None) -> CheckpointFile:
        return CheckpointFile(str(self._url(name)), storage_options=self.options, decrypt_with=key)

    def describe(self, name: str) -> multifile.PartRecord:
        """Read from the object's prologue and tail (one HEAD and ranged GETs, not the object)."""
        return self.described(name)[0]

    def described(self, name: str) -> tuple[multifile.PartRecord, str]:
        """The identity of the object `name` (a file, or a reference path of the record) and
        the version (ETag) it was read from, for with_digest to hash that version: from its
        prologue and footer only, so an older object's index is never read, whatever it claims."""
        return describe_object(str(self.object_url(name)), self.options, name)

    def open_part(
        self,
        rec: multifile.PartRecord,
        label: str,
        *,
        trusted: Any = None,
        decrypt: Any = None,
        reference_etags: dict[str, str] | None = None,
    ) -> CheckpointFile:
        """With `trusted`, the object is read whole and hashed against the record's digest at
        the version (ETag) the file's reads are then pinned to: one more pass over it.
        `reference_etags`: the versions the objects it refers to must be read at (by
        reference path), those their digests were checked on."""
        url = str(self._url(rec.name))
        try:
            # signed: hashed before the object is opened with a key, and read at the version hashed
            etag = None if trusted is None else recordsign.check_object(url, rec, self.options, None)
            f = CheckpointFile(
                url,
                storage_options=self.options,
                decrypt_with=decrypt,
                etag=etag,
                reference_etags=reference_etags,
            )
        except FileNotFoundError:
            raise IncompleteError(f"{label} named by the commit record is missing", path=self.path) from None
        try:  # the open pinned the object's ETag: what is checked is what is read
            found = multifile.identity_of(f, rec.name)
            multifile.check_identity(found, rec, label, self.path)
        except BaseException:
            f.close()
            raise
        return f

    def open_named(
        self,
        record: multifile.CommitRecord,
        name: str,
        label: str,
        *,
        trusted: Any = None,
        decrypt: Any = None,
    ) -> CheckpointFile:
        """With `trusted`, every object the record refers to is hashed against it before the
        file is opened, and the file reads them at the versions hashed (their ETags pinned):
        what was checked is what is read."""
        part = self.named_part(record, name)
        pins = self.pinned_digests(list(record.references)) if trusted is not None else None
        f = self.open_part(part, label, trusted=trusted, decrypt=decrypt, reference_etags=pins)
        return self._reading_named(f, record, name, hash_references=False)

    def check_part(self, rec: multifile.PartRecord) -> None:
        try:
            found = self.describe(rec.name)
        except FileNotFoundError:
            raise IncompleteError(
                f"{rec.name} named by the commit record is missing", path=self.path
            ) from None
        except CheckpointError as e:
            raise CorruptError(f"{rec.name} is damaged: {e}", path=self.path) from None
        multifile.check_identity(found, rec, rec.name, self.path)

    def read_record(self, trusted: Any = None) -> multifile.CommitRecord:
        try:
            return self.record_sized(None, trusted)
        except FileNotFoundError:
            raise IncompleteError("no commit record: the save did not finish", path=self.path) from None

    def record_sized(self, size: int | None, trusted: Any = None) -> multifile.CommitRecord:
        """The commit record, its size as a listing gave it (None: unknown, the open bounds it),
        refused above the limit before it is decoded; FileNotFoundError when absent.  With
        `trusted` keys it must be signed by one and carry every file's SHA-256."""
        url = str(self._url(multifile.COMMIT_NAME))
        if size is not None and size > multifile.MAX_RECORD_BYTES:
            raise LimitError(
                f"commit record of {size} bytes exceeds the limit {multifile.MAX_RECORD_BYTES}", path=url
            )
        # one GET: a record is small, and a HEAD and ranged GETs would double the requests
        # that listing a run's steps makes
        spool = fetch_whole(url, self.options, multifile.MAX_RECORD_BYTES, "the commit record")
        try:
            fd = os.dup(spool.fd)
            bound = multifile.record_memory(spool.size)
        finally:
            spool.close()
        with CheckpointFile(url, fd=fd, max_bytes=bound, trusted_keys=trusted) as f:
            if f.prologue.file_length > multifile.MAX_RECORD_BYTES:
                raise LimitError("commit record exceeds the limit", path=url)
            record = multifile.record_from(f)
        return record if trusted is None else recordsign.require_digests(record, url)

    def write_record(self, record: multifile.CommitRecord, sign_with: Any = None) -> None:
        url = self._url(multifile.COMMIT_NAME)
        try:
            from .save import save_file, save_options

            options = save_options(sign_with=sign_with, storage_options=self.options)
            save_file(record.as_value(), str(url), options, create_only=True)
        except FileExistsError:
            raise CheckpointError(
                "another save committed here while this one ran (the commit record is created only "
                "if absent)",
                path=str(url),
            ) from None

    def withdraw_record(self) -> None:
        self.remove(multifile.COMMIT_NAME)

    def check_digests(self, parts: list[multifile.PartRecord]) -> None:
        self.pinned_digests(parts)

    def pinned_digests(self, parts: list[multifile.PartRecord]) -> dict[str, str]:
        """Hash each object of `parts` (files or references) against its recorded SHA-256;
        the version (ETag) of each that was hashed, by name, for reads to be pinned to."""
        return {
            part.name: recordsign.check_object(str(self.object_url(part.name)), part, self.options, None)
            for part in parts
        }

    def object_url(self, name: str) -> ObjectURL:
        """The object a file name or a reference path (spec section 12) of the record names."""
        if "/" not in name:
            return self._url(name)
        if not multifile.valid_part_name(name, reference=True):
            raise CorruptError(f"{name[:80]!r} is not a reference path", path=self.path)
        return references.resolve(self.url, name)

    def with_digest(self, part: multifile.PartRecord, etag: str | None = None) -> multifile.PartRecord:
        """The object is read back whole to hash it: one more pass over its bytes.  `etag`:
        the version that was described (StorageError if another one is there now)."""
        digest, _ = recordsign.object_sha256(str(self.object_url(part.name)), self.options, etag)
        return dataclasses.replace(part, sha256=digest)

    def remove_leftovers(self) -> None:
        """Abort the uploads of ckptfmt's names here begun STALE_AFTER (and a second for the
        store's rounding) before this place's commit record was written, by the store's
        clock (its Last-Modified listed, capped at STORE_AHEAD_AT_MOST ahead of this host's
        clock, which may itself run a day ahead of the store's): a live saver's stays."""
        listing.abort_uploads_begun_before(self.url, self.options, is_own_name, self._stale_upload_cutoff)

    def _stale_upload_cutoff(self, oldest: datetime.datetime) -> datetime.datetime | None:
        """The store time before which an upload here is a crashed saver's (remove_leftovers);
        None where no record is listed with a time (nothing proven: none is aborted).  The
        record alone is listed: the uploads are what the leftovers are, listed by
        abort_uploads_begun_before, and a HEAD tells no Last-Modified."""
        entry = listing.listed_object(self._url(multifile.COMMIT_NAME), self.options)
        if entry is None or entry.modified is None:
            return None
        host = datetime.datetime.now(datetime.timezone.utc)
        written = min(entry.modified, host + datetime.timedelta(seconds=listing.STORE_AHEAD_AT_MOST))
        return listing.earlier_by(written, STALE_AFTER, datetime.timedelta(seconds=listing.STAMP_ROUNDING))


def holds_file(url: str, options: dict[str, Any], part: multifile.PartRecord) -> bool:
    """Whether the object at `url` is the file `part` names, by its prologue and footer
    (length, file id, index checksum); anything else there, or nothing, is not.  A failing
    store is a StorageError, not an answer."""
    try:
        found = describe_object(url, options, part.name)[0]
        multifile.check_identity(found, part, part.name, url)
    except StorageError:
        raise
    except (FileNotFoundError, CheckpointError):
        return False
    return True


def place_at(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, create: bool = False
) -> Place:
    """The place `path` names: an object-store prefix for a URL, else a local directory opened
    (created first when `create`; IncompleteError when absent, LinkError when not a directory)."""
    text = normalized(path)
    if is_url(text):
        return ObjectPlace(text, storage_options)
    check_place_options(text, storage_options)
    try:
        return LocalPlace(CheckpointDir.open(text, create=create))
    except FileNotFoundError:
        raise IncompleteError("no such checkpoint directory", path=text) from None
    except CheckpointError:
        raise
    except OSError as e:
        raise IncompleteError(f"cannot open the directory: {e.strerror}", path=text) from None


def checkpoint_place(path: str, storage_options: dict[str, Any] | None = None) -> Place | None:
    """The place of the multi-file checkpoint at `path`, or None where `path` is a single file
    (an object with no commit record beneath it; a local path that is not a directory) or
    nothing at all (the file reader then says what is missing)."""
    if is_url(path):
        place = ObjectPlace(path, storage_options)
        if place.exists(multifile.COMMIT_NAME):
            return place
        try:
            head(parse_url(path), place.options)
        except (FileNotFoundError, UnsupportedError):
            return place  # neither: read as a checkpoint prefix, which says its record is missing
        return None
    try:
        return LocalPlace(CheckpointDir.open(path))
    except LinkError:  # not a directory: a single checkpoint file
        return None
    except FileNotFoundError:
        return None
    except OSError as e:
        raise IncompleteError(f"cannot open the directory: {e.strerror}", path=path) from None


def check_place_options(path: str, storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """`storage_options`, which only an object-store URL takes (ValueError for a local path)."""
    if storage_options and not is_url(path):
        raise ValueError(f"{path}: storage_options are for object-store URLs (s3://...)")
    return storage_options


@contextlib.contextmanager
def held(
    where: Place | CheckpointDir | str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Iterator[Place]:
    """`where` as a Place: one given (or a CheckpointDir) is lent, not closed here; a path or
    URL is opened here (place_at) and closed after."""
    if isinstance(where, Place):
        yield where
    elif isinstance(where, CheckpointDir):
        yield LocalPlace(where, owned=False)
    else:
        with place_at(where, storage_options) as p:
            yield p


def describe_object(url: str, options: dict[str, Any], name: str) -> tuple[multifile.PartRecord, str]:
    """The identity of the ckptfmt object at `url` (a part or a referenced object), from its
    prologue and footer only: one HEAD and two small ranged GETs, never its index, whatever
    size its footer claims for it (FileNotFoundError when there is none); and the ETag of the
    version read."""
    remote = RemoteObject(url, options, fetch_index=False)
    try:
        remote.fetch_structure()
        return multifile.describe_open_part(remote.fd, url, name), remote.etag
    finally:
        remote.close()
