"""load() and open(): the reading side of the public API."""

from __future__ import annotations

import os
from typing import Any

from . import background, devices
from .reader import CheckpointFile


def load(
    path: str | os.PathLike[str],
    map_location: devices.MapLocation = None,
    *,
    verify: bool = True,
    mmap: bool = False,
) -> Any:
    """Load a whole state.  `verify` checks every chunk's checksum as it is read.

    mmap=True: CPU tensors whose chunks are all uncompressed are backed by the
    file itself (zero-copy, pages read on first use); compressed chunks are
    decoded into memory.  With verify=True every mapped chunk is hashed once
    here, through the mapping, so later reads come from the page cache; with
    verify=False nothing is read until used, and changes made to the file after
    loading are not detected.  A file truncated while mapped raises SIGBUS on
    access, as with any memory map.
    """
    devices.check_map_location(map_location)
    background.wait_for_path(path)
    with CheckpointFile(path) as f:
        return f.load_subtree(f.tree.root, map_location, verify, use_mmap=mmap)


class Reader:
    """An open checkpoint: the index is parsed, data is read only on `get`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        background.wait_for_path(path)
        self._file = CheckpointFile(path)
        self._items = self._file.root_items()

    @property
    def path(self) -> str:
        return self._file.path

    @property
    def metadata(self) -> dict[str, str]:
        """The user metadata given to save()."""
        return dict(self._file.metadata)

    @property
    def producer(self) -> dict[str, str]:
        """Who wrote the file: ckptfmt, format, python, torch and numpy versions, time."""
        return dict(self._file.producer)

    @property
    def source_devices(self) -> list[str]:
        """The devices the saved tensors lived on."""
        return list(self._file.source_devices)

    def keys(self) -> list[Any]:
        """Top-level keys, in saved order (empty when the state is not a dict)."""
        return [k for k, _ in self._items]

    def __contains__(self, key: object) -> bool:
        return any(k == key for k, _ in self._items)

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Any, map_location: devices.MapLocation = None, *, verify: bool = True) -> Any:
        """Load one top-level entry, reading only the chunks it needs."""
        devices.check_map_location(map_location)
        for k, node in self._items:
            if type(k) is type(key) and k == key:
                return self._file.load_subtree(node, map_location, verify)
        raise KeyError(key)

    def load(self, map_location: devices.MapLocation = None, *, verify: bool = True) -> Any:
        devices.check_map_location(map_location)
        return self._file.load_subtree(self._file.tree.root, map_location, verify)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open(path: str | os.PathLike[str]) -> Reader:  # noqa: A001 - the public name is fixed
    """Open a checkpoint, parse and validate its index; read data lazily with .get()."""
    return Reader(path)
