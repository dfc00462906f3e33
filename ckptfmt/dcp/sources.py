"""The files of a ckptfmt DCP checkpoint: rank file names, and a rank file opened and checked
against the commit record that names it (``Source``), which loads, ``verify`` and
``consolidate`` read items from alike.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError, CorruptError, IncompleteError
from ..files import multifile
from ..files.names import rank_of
from ..files.places import Place
from ..files.reader import CheckpointFile
from . import metadata as mdv

LAYOUT = "dcp"
#: the file that marks a directory in DCP's own FileSystemWriter format (read by convert.py)
DCP_METADATA_NAME = ".metadata"


def rank_note(name: str) -> str:
    rank = rank_of(name)
    return f" (rank {rank})" if rank is not None else ""


def open_source(
    where: Place | str,
    name: str,
    label: str,
    record: multifile.CommitRecord | None,
    trusted: Any = None,
    decrypt: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> CheckpointFile:
    """A rank file `name` the commit record names, opened in the checkpoint's place `where`
    (a local directory: beneath its descriptor without following a link, spec 13.6; an object
    prefix: pinned to the ETag it was checked with, spec 13.7) and checked against the record;
    it may read chunks only from files the record names (spec 13.1).  A single file the caller
    names (`where` its path or URL, with `storage_options`) is opened by its path.
    `trusted`: public keys; the record was read signed by one of them and the file is hashed
    against it then read (spec 16.7); a single file must itself be signed by one.  `decrypt`:
    the key of an encrypted save (spec section 17)."""
    if record is None:
        assert isinstance(where, str)
        return CheckpointFile(
            where, trusted_keys=trusted, decrypt_with=decrypt, storage_options=storage_options
        )
    assert isinstance(where, Place)
    return where.open_named(record, name, label, trusted=trusted, decrypt=decrypt)


class Source:
    """An open ckptfmt file that items are read from: a rank file `name` of the checkpoint in
    place `where`, checked against the commit record `record`, or (record None) a single
    checkpoint file, `where` its path or URL."""

    def __init__(
        self,
        where: Place | str,
        name: str,
        label: str,
        record: multifile.CommitRecord | None,
        keyed: bool,
        trusted: Any = None,
        decrypt: Any = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.label = label
        path = where.path_of(name) if isinstance(where, Place) else where
        try:
            self.f = open_source(where, name, label, record, trusted, decrypt, storage_options)
        except FileNotFoundError:
            raise IncompleteError(f"{label} named by the commit record is missing", path=path) from None
        except CheckpointError:  # a store's failure (a StorageError is an OSError too) says why itself
            raise
        except OSError as e:
            raise IncompleteError(f"{label} cannot be read: {e.strerror}", path=path) from None
        part = next((p for p in record.files if p.name == name), None) if record is not None else None
        try:
            if part is not None and (
                self.f.prologue.file_id != part.file_id
                or self.f.prologue.file_length != part.length
                or self.f.footer.index_checksum != part.index_checksum
            ):
                raise CorruptError(
                    f"{label} is not the file the commit record names (written by another save?)", path=path
                )
            self.items: dict[int, int] = {}
            if keyed:
                for k, node in self.f.root_items():
                    if type(k) is not int:
                        raise CorruptError(f"{label}: a key of its root dict is not an int", path=path)
                    self.items[k] = node
                if self.f.tree.nodes[self.f.tree.root][0] != "dict":
                    raise CorruptError(f"{label}: the root is not a dict of items", path=path)
        except BaseException:
            self.f.close()
            raise
        self.keyed = keyed

    def node(self, key: int, fqn: str) -> int:
        if not self.keyed:
            return key
        node = self.items.get(key)
        if node is None:
            raise CorruptError(f"{self.label} holds no item {key}", path=self.f.path, key=fqn)
        return node

    def tensor_meta(self, node: int, loc: mdv.Location, fqn: str) -> dict[str, Any]:
        kind = self.f.tree.nodes[node][0]
        if kind != "tensor":
            raise CorruptError(
                f"{self.label}: item {loc.key} is a {kind}, not a tensor", path=self.f.path, key=fqn
            )
        meta: dict[str, Any] = self.f.tree.nodes[node][1]
        if loc.dtype is not None and meta["dtype"] != loc.dtype:
            # copying would convert silently (floats truncated into ints): spec 13.5 forbids it
            raise CorruptError(
                f"{self.label}: item {loc.key} is {meta['dtype']}, the commit record says {loc.dtype}",
                path=self.f.path,
                key=fqn,
            )
        if loc.sizes is not None and tuple(meta["shape"]) != loc.sizes:
            raise CorruptError(
                f"{self.label}: item {loc.key} has shape {meta['shape']}, the commit record says {list(loc.sizes)}",
                path=self.f.path,
                key=fqn,
            )
        return meta
