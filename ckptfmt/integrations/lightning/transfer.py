"""Checkpoints on a store ckptfmt has no client for, through the store's fsspec filesystem.

ckptfmt writes and reads local files (and ``s3://`` objects itself); for any other fsspec
protocol (``gs://``, ``az://``, ``hdfs://``, ``memory://`` ...) a save is written by ckptfmt
to a local temporary file and uploaded with the filesystem's ``put_file``, and a load
fetches the file with ``get_file`` into a local temporary file that ckptfmt reads (every
chunk verified as usual).  Temporary files live in private folders of the default temporary
folder (``TMPDIR``, workdirs.py) and are removed whatever happens; those of a killed process
by the next one.  A non-blocking save returns after
ckptfmt's snapshot; a thread waits for the local file, uploads it, and only then finishes
the save's handle.  Also the local copy of an ``s3://`` object that torch.load must read
(a ``torch.save`` file, which is read from its end first).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fsspec.core import url_to_fs

import ckptfmt

from ...background import inflight
from ...errors import CheckpointError, LimitError, StorageError
from ...storage.download import RemoteObject
from . import workdirs
from .filesystems import url_key
from .paths import shown, without_secrets

#: the name of the local copy in its private temporary folder: never the remote file's name,
#: which may be '..', '.' or anything else a store allows
LOCAL_NAME = "checkpoint"
#: the bytes of an object fetched by one request, and held in memory at once, when copied
COPY_BYTES = 16 << 20


def open_fs(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The filesystem of `url` (made with `options`) and the path on it."""
    try:
        return url_to_fs(url, **(options or {}))
    except TypeError as e:
        raise ValueError(
            f"{shown(url)}: the filesystem refused storage_options {sorted(options or {})}: "
            f"{without_secrets(str(e), url)}"
        ) from None


def inflight_key(fs: Any, path: str) -> str:
    """The name of an upload to `path` on `fs` among ckptfmt's saves in flight: its URL as
    url_key spells it, credentials hidden (a handle's name shows in messages)."""
    return shown(url_key(fs, path))


def save(
    write: Callable[[str, bool], ckptfmt.SaveHandle],
    fs: Any,
    path: str,
    url: str,
    key: str,
    *,
    blocking: bool,
) -> ckptfmt.SaveHandle:
    """Save with `write(local_path, blocking)` (ckptfmt.save bound to the state), then upload
    to `path` on `fs`; `url` names the checkpoint in errors (its credentials hidden), `key` in
    the saves in flight (url_key's spelling, shown by inflight_key).  Returns a handle whose
    cost counts the upload: done when blocking, else one that finishes once the upload is."""
    began = time.perf_counter()
    key = shown(key)
    inflight.wait_for_path(key)  # an upload still running there must not land after this one
    workdir = workdirs.make(workdirs.UPLOAD)
    local = os.path.join(workdir, LOCAL_NAME)
    try:
        with naming(url, local):
            handle = write(local, blocking)
        if not blocking:
            return _upload_after(handle, fs, local, path, url, key, workdir)._returning(began)
    except BaseException:
        workdirs.remove(workdir)
        raise
    try:
        nbytes = os.path.getsize(local)
        _upload(fs, local, path, url)
    finally:
        workdirs.remove(workdir)
    uploaded = ckptfmt.SaveHandle(key, began)
    uploaded._durable_now(nbytes)
    uploaded._finish(None)
    return uploaded._returning(began)


def _upload_after(
    local_save: ckptfmt.SaveHandle, fs: Any, local: str, path: str, url: str, key: str, workdir: str
) -> ckptfmt.SaveHandle:
    handle = ckptfmt.SaveHandle(key)

    def finish() -> None:
        error: BaseException | None = None
        try:
            _finished(local_save)
            error = local_save.exception()
            if error is not None:
                error = renamed(error, shown(url), local)
            else:
                nbytes = os.path.getsize(local)
                _upload(fs, local, path, url)
                handle._durable_now(nbytes)
        except BaseException as e:  # the save's error, raised by whoever waits for it
            error = e
        finally:
            workdirs.remove(workdir)
            inflight.end(handle)
            handle._finish(error)

    thread = threading.Thread(target=finish, name=f"ckptfmt-save-upload-{posixpath.basename(shown(url))}")
    handle._thread = thread
    inflight.begin(handle)
    try:
        thread.start()
    except BaseException as e:
        _finished(local_save)  # it writes into the folder the caller removes next
        inflight.end(handle)
        handle._finish(e)
        raise
    return handle


def _finished(local_save: ckptfmt.SaveHandle) -> None:
    """Wait for the local save and its thread, whatever it ends in."""
    local_save.exception()
    if local_save._thread is not None:
        local_save._thread.join()  # it frees what the local save held


def _upload(fs: Any, local: str, path: str, url: str) -> None:
    try:
        parent = posixpath.dirname(path.rstrip("/"))
        if parent:
            fs.makedirs(parent, exist_ok=True)  # as Lightning's own plugin does; a no-op on stores
        fs.put_file(local, path)
    except Exception as e:
        raise StorageError(f"uploading the checkpoint failed: {_one_line(e, url)}", path=shown(url)) from e


@contextlib.contextmanager
def fetched(fs: Any, path: str, url: str) -> Iterator[str]:
    """A local copy of the file at `path` on `fs` (removed on exit); FileNotFoundError naming
    `url` where there is none.  Disk and memory stay bounded whatever the store sends: the copy
    is read COPY_BYTES at a time, never past the size the filesystem gave for the file, and
    refused before a byte is fetched when that size is unknown or larger than the room left
    in the temporary folder."""
    with workdirs.held(workdirs.DOWNLOAD) as workdir:
        local = os.path.join(workdir, LOCAL_NAME)
        try:
            size = file_size(fs, path, url)
            _check_room(workdir, size, url)
            _copy(fs, path, local, size, url)
        except FileNotFoundError:
            raise FileNotFoundError(f"Checkpoint file not found: {shown(url)}") from None
        except CheckpointError:
            raise
        except Exception as e:
            raise StorageError(
                f"downloading the checkpoint failed: {_one_line(e, url)}", path=shown(url)
            ) from e
        with naming(url, local):
            yield local


def file_size(fs: Any, path: str, url: str) -> int:
    """The size of the file at `path`, from its details; FileNotFoundError where there is no
    file (a folder, a FIFO or a device is never opened: opening a FIFO waits for a writer)."""
    info = fs.info(path)
    if info.get("type") != "file":
        raise FileNotFoundError(path)
    size = info.get("size")
    if type(size) is not int or size < 0:
        raise StorageError(
            f"the filesystem gives no size for it ({size!r}): a file of unknown length is not downloaded",
            path=shown(url),
        )
    return size


def _check_room(workdir: str, size: int, url: str) -> None:
    free = shutil.disk_usage(workdir).free
    if size > free:
        raise LimitError(
            f"a file of {size} bytes does not fit in the temporary folder {os.path.dirname(workdir)} "
            f"({free} bytes free; TMPDIR chooses it)",
            path=shown(url),
        )


def _copy(fs: Any, path: str, local: str, size: int, url: str) -> None:
    """Copy exactly `size` bytes of `path` to `local`, COPY_BYTES at a time."""
    done = 0
    with fs.open(path, "rb", **_sequential(fs)) as source, open(local, "wb") as out:
        while done < size:
            want = min(COPY_BYTES, size - done)
            piece = source.read(want)
            if not piece or len(piece) > want:
                raise StorageError(
                    f"the file changed while it was downloaded: {done} of its {size} bytes read, "
                    f"then {len(piece)} where {want} were asked for",
                    path=shown(url),
                )
            out.write(piece)
            done += len(piece)


def _sequential(fs: Any) -> dict[str, Any]:
    """How to open a file of `fs` to read it once from start to end: HTTP files as a stream
    (fsspec's random-access HTTP file reads blocks at offsets, which a server without range
    requests refuses after the first)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return {"block_size": 0} if {"http", "https"} & set(protocols) else {}


@contextlib.contextmanager
def object_copy(url: str, options: dict[str, Any]) -> Iterator[str]:
    """A local copy of the ``s3://`` object at `url` (removed on exit), fetched COPY_BYTES at
    a time with ETag-pinned ranged reads: memory stays bounded whatever the object's size, and
    an object larger than the room left in the temporary folder is refused before a byte is
    fetched."""
    with workdirs.held(workdirs.DOWNLOAD) as workdir:
        local = os.path.join(workdir, LOCAL_NAME)
        remote = RemoteObject(url, options, fetch_index=False)  # copied whole, never parsed
        try:
            _check_room(workdir, remote.size, url)
            with open(local, "wb") as out:
                for start in range(0, remote.size, COPY_BYTES):
                    end = min(remote.size, start + COPY_BYTES)
                    remote.fetch([(start, end)])
                    assert remote.spool is not None
                    with remote.spool.view(start, end) as view:
                        out.write(view)
                    remote.release([(start, end)])
        finally:
            remote.close()
        with naming(url, local):
            yield local


@contextlib.contextmanager
def naming(url: str, local: str) -> Iterator[None]:
    """Errors about the local copy `local` name `url` (its credentials hidden), where the
    checkpoint really is."""
    try:
        yield
    except (CheckpointError, OSError) as e:
        renamed(e, shown(url), local)
        raise


def renamed(e: BaseException, url: str, local: str) -> BaseException:
    """`e`, naming `url` where it named the local copy `local`."""
    if isinstance(e, CheckpointError) and e.path == local:
        e.path = url
        e.args = (e._render(),)
    elif isinstance(e, OSError) and e.filename == local:
        e.filename = url
    return e


def remove(fs: Any, path: str) -> None:
    """Delete the file at `path` on `fs`; an absent one is no error, and a folder is never removed."""
    with contextlib.suppress(FileNotFoundError):
        if fs.isfile(path):
            fs.rm_file(path)


def _one_line(e: BaseException, url: str) -> str:
    """`e` in one line, without the credentials `url` may carry (a store's message may quote it)."""
    text = without_secrets(" ".join(str(e).split()), url)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
