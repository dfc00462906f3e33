"""load() and open(): the reading side of the public API."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..background import inflight
from ..engine import forkreset
from ..errors import CheckpointError
from ..format import devices
from ..gcpause import pausing_in_main_thread
from .reader import CheckpointFile

log = logging.getLogger("ckptfmt")
_DOUBLE = struct.Struct("<d")
#: seconds Reader.close waits for the gets in progress on other threads to end
CLOSE_WAIT = 60.0


def same_key(a: object, b: object) -> bool:
    """Whether `b` names the dict key `a` for Reader.get: the same object; or the same type
    and equal, where floats that are NaN match when their bits are equal (NaN is not equal
    to itself, so a NaN key could otherwise never be found) and tuples match element by
    element under this rule.  Unlike a dict, 1, 1.0 and True are different keys here."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b) and _DOUBLE.pack(a) == _DOUBLE.pack(b))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_key(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:
        return False


@pausing_in_main_thread
def load(
    path: str | os.PathLike[str],
    map_location: devices.MapLocation = None,
    *,
    verify: bool = True,
    mmap: bool = False,
    max_bytes: int | None = None,
    trusted_keys: Any = None,
    storage_options: dict[str, Any] | None = None,
    decrypt_with: Any = None,
) -> Any:
    """Load a whole state.  `verify` checks every chunk's checksum as it is read.

    trusted_keys: Ed25519 public keys (``cryptography`` key objects, paths, or the bytes
    of PEM or OpenSSH public keys): the file must be signed by one of them (spec section
    16).  The signature is checked over the prologue and index before any chunk is read,
    and each chunk against its signed SHA-256 as it is read (verify=False is ignored);
    SignatureError when the file is unsigned, signed by another key, or any byte changed,
    raised before anything is returned.  With mmap=True every mapped chunk's SHA-256 is
    checked through the mapping (in parallel) before any tensor is returned; a change made
    to the file after that shows through the mapping unchecked (spec 16.4).

    decrypt_with: the key of an encrypted file (32 bytes, a key file's path, or a key
    service's callable; spec section 17): DecryptionError without it, with another key, or
    when a tag fails, never wrong values.  Not with mmap=True (ValueError): an encrypted
    file's pages hold ciphertext, so a mapping would expose ciphertext, not tensors; a load
    without mmap decrypts into memory.

    max_bytes: raise LimitError, before allocating it, when the load would need more
    memory than this for the index (format.index_memory_bound, computed before the JSON is
    parsed) plus the storages and their decode and staging buffers (memory-mapped storages
    count nothing).  Without it a file may ask for up to about 46 bytes per byte of index
    (8 to 15 for the indexes ckptfmt writes), one byte per byte of raw chunk and up to
    32768 bytes per byte of zstd chunk (spec section 8).

    mmap=True: CPU tensors whose chunks are all uncompressed are backed by the
    file itself (zero-copy, pages read on first use); compressed chunks are
    decoded into memory.  With verify=True every mapped chunk is hashed once
    here, through the mapping, so later reads come from the page cache; with
    verify=False nothing is read until used, and changes made to the file after
    loading are not detected.  A file truncated while mapped raises SIGBUS on
    access, as with any memory map.

    storage_options: for an object-store URL (``s3://bucket/key``): the client's settings
    (endpoint_url, region_name, aws_access_key_id, ...; boto3's AWS_* environment variables
    apply too).  Only the byte ranges a read needs are fetched, each pinned to the object's
    ETag: an object replaced meanwhile raises StorageError, never mixed data.
    """
    devices.check_map_location(map_location)
    inflight.wait_for_path(path)
    with CheckpointFile(
        path,
        max_bytes=max_bytes,
        trusted_keys=trusted_keys,
        storage_options=storage_options,
        decrypt_with=decrypt_with,
        read_ahead=True,
    ) as f:
        return f.load_subtree(f.tree.root, map_location, verify, use_mmap=mmap)


class _Gets:
    """The gets (and loads) of one Reader in progress, and its closing: `close` lets those in
    progress end and refuses new ones; the file is closed once none is in progress, by close
    itself where they end within CLOSE_WAIT, else by the last of them as it ends (its
    descriptors are never closed under a read: no EBADF, no descriptor reused for another
    file's bytes)."""

    def __init__(self, path: str, close: Callable[[], None]) -> None:
        self._path = path
        self._close_file = close
        self._closing = False
        self._closed = False
        self._forget_in_child()
        forkreset.register(self)

    def _forget_in_child(self) -> None:
        """A forked child's: no get of the parent's runs there (its count would never fall),
        and a parent thread may have held the lock at the fork."""
        self._cond = threading.Condition()
        self._running = 0

    @contextlib.contextmanager
    def running(self, what: str) -> Iterator[None]:
        """`what` (a get, a load) runs within: refused once the reader is closing."""
        with self._cond:
            if self._closing:
                raise CheckpointError(f"{what}: the reader is closed", path=self._path)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                last = self._closes_now()
                self._cond.notify_all()
            if last:
                self._close_quietly()

    def _close_quietly(self) -> None:
        """The last get's closing of the file: a failure is logged, never raised in place of
        that get's result (the reader's close returned already, or waited no longer)."""
        try:
            self._close()
        except Exception:
            log.warning("closing %s after its last get failed", self._path, exc_info=True)

    def close(self) -> None:
        """Refuse new gets; close the file once those in progress are over (CLOSE_WAIT)."""
        with self._cond:
            self._closing = True
            self._cond.wait_for(lambda: not self._running, timeout=CLOSE_WAIT)
            now = self._closes_now()
        if now:
            self._close()

    def _close(self) -> None:
        forkreset.unregister(self)
        self._close_file()

    def _closes_now(self) -> bool:
        """Under the lock: whether the caller closes the file (closing, none in progress,
        not closed already)."""
        if not self._closing or self._running or self._closed:
            return False
        self._closed = True
        return True


class Reader:
    """An open checkpoint: the index is parsed, data is read only on `get`.

    With `max_bytes`, opening and each get() or load() raise LimitError before allocating
    more than that for the index and the storages that call reads (see load()); calls made
    at once from several threads may each take that much.  Calls from several threads run at
    once; on an object store they share what one has fetched (a range two of them need is
    fetched once, and its memory freed once both are done with it).

    close() while other threads' gets run: those gets finish, whole and bit for bit, and
    close waits for them (CLOSE_WAIT seconds at most; where one runs longer, close returns and
    the last get to end closes the file); a get or load begun after close raises
    CheckpointError ("the reader is closed").
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        trusted_keys: Any = None,
        storage_options: dict[str, Any] | None = None,
        decrypt_with: Any = None,
    ) -> None:
        inflight.wait_for_path(path)
        self._file = CheckpointFile(
            path,
            max_bytes=max_bytes,
            trusted_keys=trusted_keys,
            storage_options=storage_options,
            decrypt_with=decrypt_with,
        )
        self._items = self._file.root_items()
        self._gets = _Gets(self._file.path, self._file.close)

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
        return any(same_key(k, key) for k, _ in self._items)

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Any, map_location: devices.MapLocation = None, *, verify: bool = True) -> Any:
        """Load one top-level entry, reading only the chunks it needs.

        `key` matches a saved key as same_key() says: any key returned by keys() finds its
        entry, NaN included; otherwise the same type and an equal value."""
        devices.check_map_location(map_location)
        for k, node in self._items:
            if same_key(k, key):
                with self._gets.running(f"get({key!r})"):
                    return self._file.load_subtree(node, map_location, verify)
        # a missing key is the caller's, as for a dict; the message says where it was looked for
        raise KeyError(f"{key!r}: no such top-level entry in {self._file.path} (keys() lists them)")

    def load(self, map_location: devices.MapLocation = None, *, verify: bool = True) -> Any:
        devices.check_map_location(map_location)
        with self._gets.running("load()"):
            return self._file.load_subtree(self._file.tree.root, map_location, verify)

    def close(self) -> None:
        """Close the file once the gets in progress are over (see the class)."""
        self._gets.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open(  # noqa: A001 - the public name is fixed
    path: str | os.PathLike[str],
    *,
    max_bytes: int | None = None,
    trusted_keys: Any = None,
    storage_options: dict[str, Any] | None = None,
    decrypt_with: Any = None,
) -> Reader:
    """Open a checkpoint, parse and validate its index; read data lazily with .get().
    max_bytes, trusted_keys, storage_options, decrypt_with: see load() (with trusted_keys the
    signature is checked here, and each chunk a get() reads against its signed digest; on an
    object store a get() fetches only its own chunks; an encrypted file's get() decrypts only
    its own chunks)."""
    return Reader(
        path,
        max_bytes=max_bytes,
        trusted_keys=trusted_keys,
        storage_options=storage_options,
        decrypt_with=decrypt_with,
    )
