"""The files of a ckptfmt DCP checkpoint: rank file names, and a rank file opened and checked
against the commit record that names it (``Source``), which loads, ``verify`` and
``consolidate`` read items from alike.
"""

from __future__ import annotations

import re
from typing import Any

from ..engine.ckptdir import CheckpointDir
from ..errors import CorruptError, IncompleteError
from ..files import multifile, recordsign
from ..files.reader import CheckpointFile
from . import metadata as mdv

LAYOUT = "dcp"
RANK_FILE_RE = re.compile(r"rank-([0-9]{5,9})\.ckpt")


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.ckpt"


def rank_note(name: str) -> str:
    m = RANK_FILE_RE.fullmatch(name)
    return f" (rank {int(m.group(1))})" if m else ""


def open_source(
    where: CheckpointDir | str,
    name: str,
    label: str,
    record: multifile.CommitRecord | None,
    trusted: Any = None,
    decrypt: Any = None,
) -> CheckpointFile:
    """A rank file `name` the commit record names is opened beneath the checkpoint directory's
    descriptor `where` without following a link (spec 13.6) and read through the descriptor
    whose identity was checked; it may read chunks only from files the record names (spec
    13.1).  A single file the caller names (`where` its path) is opened by its path.
    `trusted`: public keys; the record was read signed by one of them (recordsign.read_trusted)
    and the file is hashed against it through the descriptor then read (spec 16.7), and the
    files it reads chunks from too; a single file must itself be signed by one.  `decrypt`:
    the key of an encrypted save (spec section 17)."""
    if record is None:
        assert isinstance(where, str)
        return CheckpointFile(where, trusted_keys=trusted, decrypt_with=decrypt)
    assert isinstance(where, CheckpointDir)
    part = next((p for p in record.files if p.name == name), None)
    if part is None:
        raise CorruptError(f"the commit record names no file {name!r}", path=where.path)
    if trusted is None:
        fd = multifile.open_part(where, part, where.path, label)
    else:
        fd = recordsign.open_trusted_part(where, part, where.path)
    f = CheckpointFile(where.path_of(name), fd=fd, within=where, decrypt_with=decrypt)
    try:
        multifile.check_references(f, record, where.path_of(name))
        if trusted is not None:
            read = {ext.rel for ext in f.externals}
            recordsign.check_files(where, [p for p in record.references if p.name in read], where.path)
    except BaseException:
        f.close()
        raise
    return f


class Source:
    """An open ckptfmt file that items are read from: a rank file `name` of the checkpoint
    directory open as `where`, checked against the commit record `record`, or (record None)
    a single checkpoint file, `where` its path."""

    def __init__(
        self,
        where: CheckpointDir | str,
        name: str,
        label: str,
        record: multifile.CommitRecord | None,
        keyed: bool,
        trusted: Any = None,
        decrypt: Any = None,
    ) -> None:
        self.label = label
        path = where.path_of(name) if isinstance(where, CheckpointDir) else where
        try:
            self.f = open_source(where, name, label, record, trusted, decrypt)
        except FileNotFoundError:
            raise IncompleteError(f"{label} named by the commit record is missing", path=path) from None
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
