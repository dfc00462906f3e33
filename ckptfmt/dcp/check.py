"""The one validator of a ckptfmt DCP checkpoint directory (spec/FORMAT.md 13.5).

Two halves: the commit record's ``dcp`` member (``checked_record``: metadata.check_value) and the
rank files' agreement with it (``check_items``: each item's key exists in its rank file, and a
tensor chunk's node is a tensor of the record's dtype and the row's shape).  ``cdcp.load``
runs the first on every load and the second on each item it reads (storage.Reader, through
the same ``Source`` methods); ``verify``, ``ls`` (``describe``), ``consolidate`` and
``convert`` run both over every item.  So verify answers OK exactly when every check a load
can make passes, and chunk data is then checked by verify's checksums.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..engine.ckptdir import CheckpointDir
from ..errors import CheckpointError, UnsupportedError
from ..files import multifile, places
from ..files.places import Place
from . import metadata as mdv
from .sources import LAYOUT, Source, rank_note

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex


def read_record(
    directory: Place | CheckpointDir | str, trusted: Any = None
) -> tuple[multifile.CommitRecord, Metadata, dict[MetadataIndex, mdv.Location]]:
    """The checkpoint's commit record, checked as layout "dcp", its Metadata and item
    locations; `trusted`: public keys, one of which must have signed the record."""
    with places.held(directory) as p:
        record = p.read_record(trusted)
        return (record, *record_metadata(record, p.path))


def record_metadata(
    record: multifile.CommitRecord, directory: str
) -> tuple[Metadata, dict[MetadataIndex, mdv.Location]]:
    """The Metadata and item locations of a commit record read from `directory` (checked_record,
    then torch's Metadata built for a load)."""
    return mdv.to_metadata(checked_record(record, directory))


def checked_record(record: multifile.CommitRecord, directory: str) -> mdv.CheckedRecord:
    """The dcp member of a commit record read from `directory`, checked as a load checks it
    (metadata.check_value: no torch); UnsupportedError for another layout."""
    commit = f"{directory}/{multifile.COMMIT_NAME}"
    if record.layout != LAYOUT:
        raise UnsupportedError(
            f"a {record.layout!r} checkpoint, not a DCP one (load it with ckptfmt.load)", path=commit
        )
    return mdv.check_value(record.layout_data, [p.name for p in record.files], commit)


def check_items(
    directory: Place | CheckpointDir | str,
    record: multifile.CommitRecord,
    items: Iterable[tuple[str, mdv.Location]],
    fqns: set[str] | None = None,
    trusted: Any = None,
    decrypt: Any = None,
) -> tuple[list[CheckpointError], int]:
    """Check the `items` ((key, location) pairs) of `fqns` (all: None) against their rank files,
    as a load that reads them does (the rank files read beneath the directory's descriptor, each
    reading chunks only from files the record names; `directory` a local one or an object
    prefix); the first problem of each rank file, and the bytes of the distinct
    storages holding their tensor chunks (what a consolidation may allocate, at most).
    `trusted`: public keys; `record` was read signed by one, and each rank file is hashed
    against it before its index is read (spec 16.7)."""
    by_file: dict[str, list[tuple[str, mdv.Location]]] = {}
    for fqn, loc in items:
        if fqns is None or fqn in fqns:
            by_file.setdefault(loc.file, []).append((fqn, loc))
    problems: list[CheckpointError] = []
    held = 0
    with contextlib.ExitStack() as stack:
        try:
            d = stack.enter_context(places.held(directory))
        except CheckpointError as e:
            return [e], 0
        for name in sorted(by_file):
            try:
                held += _check_file(d, name, record, by_file[name], trusted, decrypt)
            except CheckpointError as e:
                problems.append(e)
    return problems, held


def _check_file(
    d: Place,
    name: str,
    record: multifile.CommitRecord,
    items: list[tuple[str, mdv.Location]],
    trusted: Any = None,
    decrypt: Any = None,
) -> int:
    src = Source(d, name, f"{name}{rank_note(name)}", record, keyed=True, trusted=trusted, decrypt=decrypt)
    try:
        storages: set[int] = set()
        for fqn, loc in items:
            node = src.node(loc.key, fqn)
            if loc.sizes is not None:
                storages.add(src.tensor_meta(node, loc, fqn)["storage"])
        return sum(src.f.storages[sid].nbytes for sid in storages)
    finally:
        src.f.close()


def verify_directory(
    directory: str | os.PathLike[str] | CheckpointDir | Place,
    decrypt: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> list[CheckpointError]:
    """Everything ``cdcp.load`` checks, for every item of the checkpoint: the problems found
    (the record's, else the first of each rank file); chunk data is verify's checksums' job.
    The directory (or object prefix) is opened once; the record and rank files are read
    beneath it.  `decrypt`: the key of an encrypted save's rank files."""
    with contextlib.ExitStack() as stack:
        try:
            d = stack.enter_context(places.held(directory, storage_options))
            record = d.read_record()
            checked = checked_record(record, d.path)
        except CheckpointError as e:
            return [e]
        return check_items(d, record, checked.items(), decrypt=decrypt)[0]
