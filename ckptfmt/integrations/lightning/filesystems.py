"""What Lightning sees of a non-blocking save in flight: fsspec filesystems that answer for it.

Lightning asks every question about a path through fsspec (``url_to_fs``), and
``ModelCheckpoint`` chooses file names by asking which exist (``-vN`` for a name that is
taken) and finds ``last`` files with ``ls``: a save still being written must look like the
file it will be, or the next save takes its name and overwrites it.  The filesystems here
subclass fsspec's own for a protocol, registered in its place with fsspec's
``register_implementation``: ``exists``, ``isfile`` and ``ls`` count a save in flight as its
file; ``info`` (sizes, times) waits for it, so details are those of the written file.

Which protocols: local files, and every store in :data:`VIEWED` when a non-blocking plugin
is made (a save to another protocol is written blocking); ``s3://``, ``gs://``, ``az://``
and ``abfs://`` always, with their filesystems' listings caches off (s3fs, gcsfs, adlfs),
since the plugin writes those objects behind their backs.  A filesystem
someone else registered for a protocol is left alone.  The classes pickle by name
(``ddp_spawn`` pickles ``ModelCheckpoint`` with its filesystem): this module's
``__getattr__`` makes them again in a new process.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import os
import threading
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem, sync_wrapper
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations
from fsspec.registry import registry as fsspec_classes

import ckptfmt

from ...engine.commit import temp_prefix

#: fsspec protocols whose filesystem a non-blocking plugin replaces by a view of its saves
#: in flight (besides local files and OWN): the stores Lightning users write checkpoints to
VIEWED = ("memory", "hdfs", "webhdfs", "sftp", "ftp", "oss")
#: the protocols whose objects the plugin writes with ckptfmt's own clients (storage/urls.py)
OWN = ("s3", "gs", "gcs", "az", "abfs", "abfss")
#: the name prefix of the view classes (pickled by name, made again by __getattr__)
_VIEW_PREFIX = "_InFlight_"


class _SavesInFlight:
    """This process's non-blocking saves, by key: a local file's real path, else its URL as
    the protocol's filesystem spells it (``url_key``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[str, ckptfmt.SaveHandle] = {}

    def add(self, key: str, handle: ckptfmt.SaveHandle) -> None:
        with self._lock:
            self._handles[key] = handle

    def running(self) -> dict[str, ckptfmt.SaveHandle]:
        """The saves still running (finished ones are dropped: the file answers for itself)."""
        with self._lock:
            for key in [k for k, h in self._handles.items() if h.done()]:
                del self._handles[key]
            return dict(self._handles)

    def reset(self) -> None:
        """In a forked child: the parent's saves are not this process's, and the lock may be held."""
        self._lock = threading.Lock()
        self._handles = {}


IN_FLIGHT = _SavesInFlight()
os.register_at_fork(after_in_child=IN_FLIGHT.reset)


def local_key(path: str) -> str:
    return os.path.realpath(path)


def url_key(fs: Any, path: str) -> str:
    """A URL as `fs` spells it, whichever spelling it was given in (``memory://a`` and
    ``memory:///a`` are one file)."""
    return str(fs.unstrip_protocol(fs._strip_protocol(path)))


def shows_in_flight(fs: Any) -> bool:
    """Whether `fs` answers for saves in flight (else a save there must block)."""
    return isinstance(fs, _LocalFileSystem) or getattr(type(fs), "_ckptfmt_view", False)


# -- local files -------------------------------------------------------------------------


class _LocalFileSystem(LocalFileSystem):  # type: ignore[misc]  # fsspec has no type hints
    """fsspec's local filesystem, seeing a non-blocking save in flight as the file it will be."""

    def exists(self, path: Any, **kwargs: Any) -> bool:
        return self._in_flight(path) is not None or bool(super().exists(path, **kwargs))

    def lexists(self, path: Any, **kwargs: Any) -> bool:
        return self._in_flight(path) is not None or bool(super().lexists(path, **kwargs))

    def isfile(self, path: Any) -> bool:
        return self._in_flight(path) is not None or bool(super().isfile(path))

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        if not isinstance(path, os.DirEntry):
            handle = self._in_flight(path)
            if handle is not None:
                handle.exception()  # waits; the error is the plugin's to raise, at its next save
        return dict(super().info(path, **kwargs))

    def ls(self, path: Any, detail: bool = False, **kwargs: Any) -> list[Any]:
        directory = os.path.realpath(self._strip_protocol(path))
        running = {k: h for k, h in IN_FLIGHT.running().items() if os.path.dirname(k) == directory}
        if detail:  # sizes and times of files being written: those they will have
            for handle in running.values():
                handle.exception()
            return list(super().ls(path, detail=True, **kwargs))
        names = list(super().ls(path, detail=False, **kwargs))
        if not running:
            return names
        temps = tuple(os.path.basename(temp_prefix(k)) for k in running)
        shown = [n for n in names if not os.path.basename(n).startswith(temps)]
        base = self._strip_protocol(path).rstrip("/")
        present = {os.path.basename(n) for n in shown}
        shown += [f"{base}/{os.path.basename(k)}" for k in running if os.path.basename(k) not in present]
        return shown

    def _in_flight(self, path: Any) -> ckptfmt.SaveHandle | None:
        return IN_FLIGHT.running().get(local_key(self._strip_protocol(path)))


# -- stores --------------------------------------------------------------------------------


class _View:
    """The questions a store's filesystem answers with saves in flight counted (mixed in
    before the store's own class; the blocking and the async forms share these helpers)."""

    _ckptfmt_view = True

    def _in_flight(self, path: Any) -> ckptfmt.SaveHandle | None:
        return IN_FLIGHT.running().get(url_key(self, path))

    def _in_flight_beneath(self, path: Any, *, directly: bool = False) -> dict[str, ckptfmt.SaveHandle]:
        prefix = self._strip_protocol(path).rstrip("/") + "/"  # type: ignore[attr-defined]
        found = {}
        for key, handle in IN_FLIGHT.running().items():
            name = self._strip_protocol(key)  # type: ignore[attr-defined]
            if name.startswith(prefix) and not (directly and "/" in name[len(prefix) :]):
                found[name] = handle
        return found

    @staticmethod
    def _with_running(names: list[Any], running: dict[str, ckptfmt.SaveHandle]) -> list[Any]:
        present = set(names)
        return names + [n for n in running if n not in present]


class _SyncView(_View):
    def exists(self, path: Any, **kwargs: Any) -> bool:
        if self._in_flight(path) is not None or self._in_flight_beneath(path):
            return True
        return bool(super().exists(path, **kwargs))  # type: ignore[misc]

    def isfile(self, path: Any) -> bool:
        return self._in_flight(path) is not None or bool(super().isfile(path))  # type: ignore[misc]

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        handle = self._in_flight(path)
        if handle is not None:  # details are the written file's; its error is the plugin's
            handle.exception()
        return dict(super().info(path, **kwargs))  # type: ignore[misc]

    def ls(self, path: Any, detail: bool = False, **kwargs: Any) -> list[Any]:
        running = self._in_flight_beneath(path, directly=True)
        if detail:  # sizes and times of files being written: those they will have
            for handle in running.values():
                handle.exception()
            return list(super().ls(path, detail=True, **kwargs))  # type: ignore[misc]
        try:
            names = list(super().ls(path, detail=False, **kwargs))  # type: ignore[misc]
        except FileNotFoundError:
            if not running:
                raise
            names = []  # only saves in flight there yet
        return self._with_running(names, running)


class _AsyncView(_View):
    async def _exists(self, path: Any, **kwargs: Any) -> bool:
        if self._in_flight(path) is not None or self._in_flight_beneath(path):
            return True
        return bool(await super()._exists(path, **kwargs))  # type: ignore[misc]

    async def _isfile(self, path: Any) -> bool:
        return self._in_flight(path) is not None or bool(await super()._isfile(path))  # type: ignore[misc]

    async def _info(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        handle = self._in_flight(path)
        if handle is not None:
            await asyncio.to_thread(handle.exception)
        return dict(await super()._info(path, *args, **kwargs))  # type: ignore[misc]

    async def _ls(self, path: Any, detail: bool = False, **kwargs: Any) -> list[Any]:
        running = self._in_flight_beneath(path, directly=True)
        if detail:
            for handle in running.values():
                await asyncio.to_thread(handle.exception)
            return list(await super()._ls(path, detail=True, **kwargs))  # type: ignore[misc]
        try:
            names = list(await super()._ls(path, detail=False, **kwargs))  # type: ignore[misc]
        except FileNotFoundError:
            if not running:
                raise
            names = []
        return self._with_running(names, running)

    # some stores (s3fs) bind their blocking methods to their own coroutines: bind these
    exists = sync_wrapper(_exists)
    isfile = sync_wrapper(_isfile)
    info = sync_wrapper(_info)
    ls = sync_wrapper(_ls)


class _NoListingsCache:
    """ckptfmt writes OWN objects itself, behind fsspec's back: a cached listing would show a
    taken name as free (and ModelCheckpoint would give a second save the name of the first)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("use_listings_cache", False)
        super().__init__(*args, **kwargs)


@functools.cache
def view_class(protocol: str) -> type:
    """The view of the filesystem fsspec knows for `protocol` (imported here: ImportError,
    with fsspec's own advice, where its package is missing)."""
    base = _original_class(protocol)
    mixin = _AsyncView if issubclass(base, AsyncFileSystem) else _SyncView
    bases = (mixin, _NoListingsCache, base) if protocol in OWN else (mixin, base)
    namespace = {"__module__": __name__, "__qualname__": _VIEW_PREFIX + protocol}
    return type(_VIEW_PREFIX + protocol, bases, namespace)


#: the class path and advice fsspec had for a protocol before a view took its place
_ORIGINAL: dict[str, tuple[str, str | None]] = {}


def _original_class(protocol: str) -> type:
    current = fsspec_classes.get(protocol)
    if current is not None and not getattr(current, "_ckptfmt_view", False):
        return current
    path, errtxt = _ORIGINAL.get(protocol) or (known_implementations[protocol]["class"], None)
    cls = _imported(path)
    if cls is None:
        raise ImportError(errtxt or f"cannot import {path}, fsspec's filesystem for {protocol}://")
    return cls


def __getattr__(name: str) -> Any:
    protocol = name[len(_VIEW_PREFIX) :]
    if name.startswith(_VIEW_PREFIX) and (protocol in known_implementations or protocol in fsspec_classes):
        return view_class(protocol)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- registration --------------------------------------------------------------------------


def show_saves_in_flight(blocking: bool) -> None:
    """Register the views where fsspec's own filesystems are in use: OWN always, local files
    and the stores of VIEWED when saves do not block."""
    protocols = OWN if blocking else (*OWN, *VIEWED)
    if not blocking:
        for protocol in ("file", "local"):
            if fsspec.get_filesystem_class(protocol) is LocalFileSystem:
                fsspec.register_implementation(protocol, _LocalFileSystem, clobber=True)
    for protocol in protocols:
        _show(protocol)


def _show(protocol: str) -> None:
    known = known_implementations.get(protocol, {})
    path = known.get("class")
    current = fsspec_classes.get(protocol)
    if not isinstance(path, str) or path.startswith(__name__):
        return  # unknown here, or a view already
    if current is None:
        # not imported yet: fsspec imports the view, and through it the store's package,
        # when the protocol is first used (its advice kept for a missing package)
        _ORIGINAL[protocol] = (path, known.get("err"))
        fsspec.register_implementation(
            protocol, f"{__name__}:{_VIEW_PREFIX}{protocol}", clobber=True, errtxt=known.get("err")
        )
    elif current is _imported(path):  # fsspec's own class, imported: replaced by its view now
        fsspec.register_implementation(protocol, view_class(protocol), clobber=True)


def _imported(path: str) -> type | None:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
