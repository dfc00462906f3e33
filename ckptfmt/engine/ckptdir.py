"""Every filesystem operation inside a checkpoint directory, relative to one open descriptor.

A checkpoint directory may come from anywhere: a download, a shared filesystem where
other users can write.  Its entries are hostile input like the bytes of its files, so
nothing here ever resolves a path string that an entry could redirect (spec section
13.6):

* the directory the caller names is opened once, with ``O_DIRECTORY``: the path a
  caller gives (a run directory that is a link to a larger disk, say) is the caller's to
  trust, and it is resolved exactly once;
* every name inside is resolved relative to that descriptor (``openat``, ``unlinkat``,
  ``renameat``, ``mkdirat`` through ``dir_fd``), one component at a time, each with
  ``O_NOFOLLOW``: a symbolic link anywhere inside is never followed, only removed as a
  name;
* files are opened ``O_NONBLOCK`` and checked with ``fstat`` on what was opened: a FIFO,
  a device or a socket is refused without blocking, and no check is ever repeated on a
  path string afterwards;
* new files are created ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a name already there, a
  dangling link included, is never written through).

This module imports nothing of the package but its errors and fileio; the layers above (commit
records, the checkpoint manager, the trainer integrations) do their filesystem work
through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from ..errors import CorruptError, LimitError, UnsupportedError
from ..fileio import regular_or_close

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC
#: directories below an entry that remove_tree descends into; a checkpoint never nests deeper,
#: and a hostile tree thousands of levels deep must not exhaust the stack or descriptors
MAX_REMOVE_DEPTH = 32


class LinkError(CorruptError):
    """An entry that must be a file or directory of the checkpoint is a symbolic link (or
    another kind of entry): following it could lead outside the checkpoint."""


def _component(name: str, where: str) -> str:
    """`name` as one path component: never empty, '.', '..' or containing a separator."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise CorruptError(f"{name[:80]!r} is not a name inside the directory", path=where)
    return name


class CheckpointDir:
    """An open directory; names are resolved beneath its descriptor, never through a link.

    Use as a context manager (or call close()).  `path` is what messages show; the
    descriptor, not the path, is what every operation uses.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    # -- opening ---------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, create: bool = False) -> CheckpointDir:
        """Open directory `path`, a path the caller gives and trusts (links in it are followed,
        once); created first when `create`.  FileNotFoundError when absent; LinkError when not
        a directory."""
        path = os.fspath(path)
        if create:
            os.makedirs(path, exist_ok=True)
        try:
            fd = os.open(path, _DIR_FLAGS & ~os.O_NOFOLLOW)
        except OSError as e:
            raise _open_error(e, path, "directory", followed=True) from None
        return cls(fd, path)

    def sub(self, name: str) -> CheckpointDir:
        """The subdirectory `name`: a directory itself, never a link to one."""
        where = self.path_of(_component(name, self.path))
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except OSError as e:
            raise _open_error(e, where, "directory") from None
        return CheckpointDir(fd, where)

    def walk(self, relpath: str) -> tuple[CheckpointDir, str]:
        """(the directory holding the last component of `relpath`, that component): every
        directory on the way opened with O_NOFOLLOW.  A leading '..' goes to this directory's
        parent (never a link: '..' is the directory's own parent entry)."""
        parts = relpath.split("/")
        current = CheckpointDir(os.dup(self.fd), self.path)
        try:
            for i, part in enumerate(parts[:-1]):
                if part == ".." and i == 0:
                    fd = os.open("..", _DIR_FLAGS, dir_fd=current.fd)
                    nxt = CheckpointDir(fd, os.path.dirname(current.path) or "..")
                else:
                    nxt = current.sub(part)
                current.close()
                current = nxt
            return current, _component(parts[-1], current.path)
        except BaseException:
            current.close()
            raise

    def open_file(self, name: str) -> int:
        """A read-only descriptor of regular file `name`, opened without following a link and
        without blocking (a FIFO is refused, not waited on).  FileNotFoundError when absent."""
        where = self.path_of(_component(name, self.path))
        before = self.lstat(name)
        if before is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", where)
        if stat.S_ISLNK(before.st_mode):
            raise LinkError("a symbolic link where a file must be (never followed)", path=where)
        if not stat.S_ISREG(before.st_mode):  # refused before opening: a device's open has effects
            raise UnsupportedError("not a regular file", path=where)
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self.fd)
        except OSError as e:
            raise _open_error(e, where, "file") from None
        return regular_or_close(fd, where)

    def open_ref(self, relpath: str) -> int:
        """open_file for a path relative to this directory (a reference path, spec 12.3),
        each directory on the way opened without following a link."""
        holder, name = self.walk(relpath)
        with holder:
            return holder.open_file(name)

    def read_file(self, name: str, limit: int) -> bytes:
        """The whole of regular file `name`; LimitError when it holds more than `limit` bytes
        (checked as it is read, so a file that grows meanwhile is bounded too)."""
        fd = self.open_file(name)
        try:
            out = bytearray()
            while len(out) <= limit:
                got = os.read(fd, limit + 1 - len(out))
                if not got:
                    return bytes(out)
                out += got
            raise LimitError(f"more than {limit} bytes", path=self.path_of(name))
        finally:
            os.close(fd)

    # -- looking ---------------------------------------------------------------------

    def names(self) -> list[str]:
        """The entries, sorted (no '.' or '..')."""
        return sorted(os.listdir(self.fd))

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry itself (a link is not followed), or None when there is none."""
        try:
            return os.stat(_component(name, self.path), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_dir(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def exists(self, name: str) -> bool:
        return self.lstat(name) is not None

    def path_of(self, name: str) -> str:
        """The path a message shows for entry `name` (never used to reach it)."""
        return os.path.join(self.path, name)

    # -- changing --------------------------------------------------------------------

    def mkdir(self, name: str, mode: int = 0o777) -> None:
        with _naming(self.path_of(name)):
            os.mkdir(_component(name, self.path), mode, dir_fd=self.fd)

    def create(self, name: str, mode: int = 0o644) -> int:
        """A new file `name`, opened for writing; FileExistsError when any entry has that name
        (a link included, dangling or not)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
        with _naming(self.path_of(name)):
            return os.open(_component(name, self.path), flags, mode, dir_fd=self.fd)

    def rename(self, old: str, new: str, target: CheckpointDir | None = None) -> None:
        """Rename entry `old` to `new` (in `target`, default this directory), replacing a
        file there; the entry itself moves, whatever kind it is."""
        dst = self if target is None else target
        with _naming(self.path_of(old)):
            os.rename(
                _component(old, self.path),
                _component(new, dst.path),
                src_dir_fd=self.fd,
                dst_dir_fd=dst.fd,
            )

    def unlink(self, name: str) -> bool:
        """Remove entry `name` that is not a directory (a link is removed, never followed);
        False when there was none."""
        try:
            with _naming(self.path_of(name)):
                os.unlink(_component(name, self.path), dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    def remove_tree(self, name: str, _depth: int = 0) -> bool:
        """Remove entry `name` and, for a real directory, everything below it; True when it is
        gone.  Links anywhere are removed as names, never followed: nothing outside this
        directory is touched.  Below MAX_REMOVE_DEPTH levels nothing is removed (False)."""
        st = self.lstat(name)
        if st is None:
            return True
        if not stat.S_ISDIR(st.st_mode):
            return self.unlink(name) or self.lstat(name) is None
        if _depth >= MAX_REMOVE_DEPTH:
            return False
        try:
            sub = self.sub(name)
        except (FileNotFoundError, LinkError):
            return False  # gone, or swapped for something else since the lstat: not ours to follow
        with sub:
            for entry in sub.names():
                sub.remove_tree(entry, _depth + 1)
        return self.rmdir(name)

    def rmdir(self, name: str) -> bool:
        """Remove empty directory `name`; False when it is not empty, not there, or not a
        directory (a link put in its place is left alone)."""
        try:
            os.rmdir(_component(name, self.path), dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                return False
            raise
        return True

    def fsync(self) -> None:
        """Make the directory's entries durable (some filesystems cannot fsync a directory)."""
        try:
            os.fsync(self.fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):
                raise

    def fetcher_of(self, fd: int) -> None:
        """Nothing: a local file's bytes need no fetching (sources.References)."""
        return None

    def opening_time(self) -> float:
        """No bound of its own: a local open takes no requests (sources.References)."""
        return 0.0

    def release(self, fd: int) -> None:
        """Close a descriptor open_ref gave (sources.References)."""
        os.close(fd)

    # -- lifetime --------------------------------------------------------------------

    def dup(self) -> CheckpointDir:
        """Another handle on the same directory, closed on its own."""
        return CheckpointDir(os.dup(self.fd), self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointDir({self.path!r}, fd={self.fd})"


@contextlib.contextmanager
def _naming(where: str) -> Iterator[None]:
    """OSErrors of a call made relative to a descriptor name the entry's path, not its bare name."""
    try:
        yield
    except OSError as e:
        if e.filename is None or e.filename == os.path.basename(where):
            raise OSError(e.errno, e.strerror, where) from None
        raise


def _open_error(
    e: OSError, where: str, kind: str, *, followed: bool = False
) -> OSError | CorruptError | UnsupportedError:
    """What a failed open of an entry means to a user: a link or the wrong kind of entry is
    refused as LinkError; a missing one stays FileNotFoundError; others keep their errno.
    `followed`: the open followed links (a path the caller trusts), so a link that failed led
    to something else, which the message names."""
    if e.errno == errno.ELOOP:
        return LinkError(f"a symbolic link where a {kind} must be (never followed)", path=where)
    if e.errno == errno.ENXIO:  # a socket (or a device without its driver) put there meanwhile
        return UnsupportedError(f"not a regular {kind}", path=where)
    if e.errno == errno.ENOTDIR:  # O_DIRECTORY | O_NOFOLLOW on a link fails this way too
        if followed:
            return LinkError(f"not a directory where a {kind} must be", path=where)
        link = os.path.islink(where)  # only to word the message: nothing is opened through it
        what = "a symbolic link" if link else "not a directory"
        return LinkError(f"{what} where a {kind} must be (never followed)", path=where)
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError(e.errno, e.strerror, where)
    return OSError(e.errno, e.strerror, where)
