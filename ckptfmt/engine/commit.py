"""The commit protocol (spec section 10): temp file, fsync, rename, directory fsync, cleanup.

A save writes a temp sibling of its target and renames it over the target once
the file is durable, so a reader only ever sees the old file or the new one.
This module owns the temp files: their names, who owns one, and when one left
behind by a crashed save may be removed.

Names.  ``.<target name>.ckptfmt-tmp.<host>.<pid>.<start>.<random>``:

* ``host``: 16 hex digits naming this machine *and* pid namespace (a hash of the
  kernel's boot id and of ``/proc/self/ns/pid``), so two containers on one host,
  or two hosts sharing a filesystem, never mistake each other's pids;
* ``pid`` and ``start``: the creating process and its start time (clock ticks
  since boot, ``/proc/<pid>/stat`` field 22; 0 where unknown), so a reused pid
  is told from the original owner;
* ``random``: 8 hex digits; with ``O_CREAT | O_EXCL`` the name is new.

Ownership.  The owner is written into the name, so a temp file is owned from
the instant ``open(O_EXCL)`` creates it: there is no window between creating
and locking in which a cleanup could take it for abandoned.  The owner then
takes an exclusive ``flock`` too (where the filesystem supports it), which also
tells live saves on other hosts apart when locks are coherent there.  Where
``flock`` fails with ENOSYS, ENOLCK, EOPNOTSUPP or ENOTSUP (Lustre without
``-o flock``, NFS without a lock manager) the save goes on without the lock:
the name alone decides.

Cleanup.  Right after creating (and locking) its own temp file, a save removes
the abandoned temp files of *any* target in the directory (a run that saves
``step-N.ckpt`` for growing N never repeats a name).  A regular file named like
a temp file is abandoned when

* its owner is on this host and pid namespace and is gone: the pid does not
  exist, is a zombie, or has another start time (for this process: the file is
  not one of its saves in progress).  The owner's answer decides even if some
  process holds the file's lock (a child that inherited the descriptor through
  fork): only the owner's writer thread could ever commit the file;
* its owner is elsewhere (another host or pid namespace), no process holds its
  lock, and its mtime is more than ``FOREIGN_GRACE_S`` before the mtime of the
  temp file just created (the filesystem's clock, not this host's): a free lock
  does not prove the owner dead there (it may not have locked yet, or locks may
  be local to each client), only age does;
* it has the older ``<pid>.<random>`` name (no owner): when its lock is free,
  as its writers locked right after creating; where locks are not supported,
  by age as above.

Symbolic links, directories and anything else are never touched by that cleanup,
and a file is unlinked only if its name still leads to the inode that was examined.

Temporary directories.  The checkpoint manager's temporary step directories are
named and owned the same way (``new_temp``), and ``abandoned_temp_dir`` tells
when one is abandoned by the same rules, asked of the directory and its lock;
removing it is the manager's (it holds the run's deletions).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from ..errors import CheckpointError
from .ckptdir import CheckpointDir

TEMP_MARKER = ".ckptfmt-tmp."

#: flock is not supported on every filesystem (Lustre without -o flock, some NFS)
NO_LOCKING = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})
_HELD = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})

#: a temp file whose owner cannot be checked from here (another host or pid namespace, or
#: an older version's name) is abandoned once it has not been written for this long.  Live
#: saves write continuously; the longest quiet spell is the final fsync of a large file.
FOREIGN_GRACE_S = 3600.0

#: the largest process id a name can hold (pid_t is a C int)
PID_MAX = 2**31 - 1

_T = TypeVar("_T")

_OWNED_SUFFIX = re.compile(r"([0-9a-f]{16})\.([0-9]{1,10})\.([0-9]{1,20})\.[0-9a-f]{8}")
_LEGACY_SUFFIX = re.compile(r"[0-9]+\.[0-9a-f]+")


def temp_prefix(path: str) -> str:
    """The start of the name of every temp file of target `path` (its directory included)."""
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}{TEMP_MARKER}")


# -- who owns a temp file ------------------------------------------------------------------------


def _read_text(path: str) -> str:
    try:  # bytes decoded, not a text file: its codec module would be imported by a process's first save
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace").strip()
    except OSError:
        return ""


def _compute_host_token() -> str:
    boot = _read_text("/proc/sys/kernel/random/boot_id") or socket.gethostname()
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return hashlib.sha256(f"{boot}\0{pidns}".encode()).hexdigest()[:16]


_host_token_cache: str | None = None


def host_token() -> str:
    """16 hex digits naming this host and pid namespace (recomputed in a forked child)."""
    global _host_token_cache
    if _host_token_cache is None:
        _host_token_cache = _compute_host_token()
    return _host_token_cache


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process, None if unreadable."""
    text = _read_text(f"/proc/{pid}/stat")
    # "pid (comm) state ppid ... starttime": comm may hold spaces and parentheses
    fields = text[text.rfind(")") + 2 :].split() if ")" in text else []
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return fields[0], int(fields[19])


def _start_of(pid: int) -> int:
    st = _proc_stat(pid)
    return 0 if st is None else st[1]


_self_cache: tuple[int, int] | None = None


def _self() -> tuple[int, int]:
    """(pid, start time) of this process (read afresh in a forked child)."""
    global _self_cache
    if _self_cache is None:
        pid = os.getpid()
        _self_cache = (pid, _start_of(pid))
    return _self_cache


def owner_token() -> str:
    """The owner part of this process's temp file names: ``<host>.<pid>.<start>``."""
    pid, start = _self()
    return f"{host_token()}.{pid}.{start}"


def names_a_process(pid: int) -> bool:
    """Whether `pid` (read from a name) is in the range of a pid_t: a process id is positive and
    fits a C int.  Any other names no process (spec section 10): asking the kernel about it
    would raise OverflowError, or (0) ask about our own process group."""
    return 0 < pid <= PID_MAX


def _alive(pid: int, start: int) -> bool:
    """Whether process `pid` of this host and pid namespace, started at `start`, still runs."""
    if not names_a_process(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, run by another user
    except OSError:
        return True  # cannot tell: never guess "dead"
    st = _proc_stat(pid)
    if st is None:
        return True  # exists, but /proc does not say more (hidepid, not Linux)
    state, started = st
    if state in ("Z", "X"):
        return False  # killed, not yet reaped
    return start == 0 or started == start


def owned_suffix() -> str:
    """A name suffix owned by this process: ``<host>.<pid>.<start>.<random>`` (as temp names end)."""
    return f"{owner_token()}.{secrets.token_hex(4)}"


def parse_owned_suffix(suffix: str) -> tuple[str, int, int] | None:
    """(host, pid, start) of a suffix made by owned_suffix(), else None."""
    m = _OWNED_SUFFIX.fullmatch(suffix)
    return None if m is None else (m.group(1), int(m.group(2)), int(m.group(3)))


def owner_dead(host: str, pid: int, start: int) -> bool | None:
    """Whether the process an owner token names (``<host>.<pid>.<start>``, owner_token) has
    ended: True or False where it ran on this host and pid namespace, None elsewhere (it
    cannot be asked from here)."""
    if host != host_token():
        return None
    if (pid, start) == _self():
        return False
    return not _alive(pid, start)


# temp files of this process's saves in progress, by name: registered before the file is
# created and dropped after it is renamed or removed, so one of this process's temp files
# that is not here was left by a save that failed and could not remove it
_own: set[str] = set()
_own_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child is another process: its host token and its own (pid, start time) are
    read afresh, none of its parent's temp files is its own, and the lock may have been held
    by a thread of the parent's at the fork."""
    global _host_token_cache, _self_cache, _own_lock
    _host_token_cache = _self_cache = None
    _own_lock = threading.Lock()
    _own.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def parse_temp_name(name: str) -> tuple[str, tuple[str, int, int] | None] | None:
    """(target name, (host, pid, start) or None for an older name) of a temp file name, else None."""
    if not name.startswith(".") or TEMP_MARKER not in name:
        return None
    target, _, suffix = name[1:].rpartition(TEMP_MARKER)
    if not target:
        return None
    m = _OWNED_SUFFIX.fullmatch(suffix)
    if m is not None:
        return target, (m.group(1), int(m.group(2)), int(m.group(3)))
    if _LEGACY_SUFFIX.fullmatch(suffix):
        return target, None
    return None


def iter_temp_names(directory: str) -> Iterator[str]:
    """Names in `directory` that are temp file names (of any target)."""
    try:
        with os.scandir(directory or ".") as it:
            names = [e.name for e in it]
    except OSError:
        return
    for name in names:
        if parse_temp_name(name) is not None:
            yield name


def iter_temp_files(path: str) -> Iterator[str]:
    """Paths of the temp files of target `path`: saves in progress or abandoned."""
    d, target = os.path.split(path)
    for name in iter_temp_names(d):
        parsed = parse_temp_name(name)
        if parsed is not None and parsed[0] == target:
            yield os.path.join(d, name)


# -- locks -------------------------------------------------------------------------------------


def lock_exclusive(fd: int) -> bool:
    """Take `fd`'s exclusive flock, waiting for it: True, or False where flock is not supported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        if e.errno in NO_LOCKING:
            return False
        raise
    return True


def _probe(fd: int) -> bool | None:
    """Try the flock without waiting: True taken (by us), False held elsewhere, None unknown."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in _HELD:
            return False
        return None  # unsupported here (or EBADF: NFS wants a writable descriptor)
    return True


def _abandoned(name: str, owner: tuple[str, int, int] | None, fd: int, mtime: float, now: float) -> bool:
    if owner is not None and owner[0] == host_token():
        # the owner can be asked: its answer decides (a lock held by a child that inherited
        # the descriptor through fork does not keep a dead owner's save alive: only the
        # owner's writer thread could ever commit it)
        _, pid, start = owner
        if (pid, start) == _self():
            with _own_lock:
                return name not in _own
        return not _alive(pid, start)
    lock = _probe(fd)
    if lock is False:
        return False  # a live process holds it
    if owner is None and lock is True:
        return True  # an older version's name: its writers locked right after creating
    # another host or pid namespace: a free lock does not prove the owner dead there (it
    # may not have locked yet, or locks may be local to each client); only age does
    return now - mtime > FOREIGN_GRACE_S


def abandoned_temp_dir(d: CheckpointDir, name: str, now: float | None = None) -> bool:
    """Whether entry `name` of `d` is a temporary directory (named as a temp file is) that a
    dead or failed save left, by the rules for temp files; a link, a file or anything that
    cannot be examined is not."""
    if parse_temp_name(name) is None:
        return False
    try:
        sub = d.sub(name)
    except (OSError, CheckpointError):
        return False  # gone, a link, or not a directory
    with sub:  # closing drops the lock the probe may have taken
        try:
            return _abandoned_open(name, sub.fd, time.time() if now is None else now) is not None
        except OSError:
            return False


def _abandoned_open(name: str, fd: int, now: float) -> os.stat_result | None:
    """The status of temp entry `name`, open at `fd`, when it is abandoned; else None."""
    parsed = parse_temp_name(name)
    st = os.fstat(fd)
    if parsed is None or not _abandoned(name, parsed[1], fd, st.st_mtime, now):
        return None
    return st


def _remove_if_abandoned(d: CheckpointDir, name: str, now: float) -> bool:
    if parse_temp_name(name) is None:
        return False
    try:
        fd = d.open_file(name)
    except (OSError, CheckpointError):
        return False  # gone already, a link, a directory (the manager's temporary step directories)
    try:
        st = _abandoned_open(name, fd, now)
        if st is None:
            return False
        cur = d.lstat(name)
        if cur is None or (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
            return False
        return d.unlink(name)
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the lock the probe may have taken


def remove_abandoned_temps(directory: str | CheckpointDir, now: float | None = None) -> list[str]:
    """Remove the temp files in `directory` that crashed or failed saves left; return their names.

    Never one that a live save owns (see the module docstring); errors only skip a file.
    `now` is the time ages are measured from: best the filesystem's own clock (the
    mtime of a file just created there), else this host's.
    """
    when = time.time() if now is None else now
    if isinstance(directory, CheckpointDir):
        return [n for n in directory.names() if _remove_if_abandoned(directory, n, when)]
    try:
        d = CheckpointDir.open(directory or ".")
    except (OSError, CheckpointError):
        return []
    with d:
        return [n for n in d.names() if _remove_if_abandoned(d, n, when)]


# -- creating a temp entry ----------------------------------------------------------------------


def new_temp(d: CheckpointDir, target: str, make: Callable[[str], _T]) -> tuple[str, _T]:
    """Create a temp entry of `target` in `d` with `make(name)` (which must fail with
    FileExistsError when the name is taken): (its name, what make returned).  The name is
    this process's and registered as a save in progress before it exists, so no cleanup, in
    any thread or process, ever takes it for abandoned; ``disown`` it once it is renamed or
    removed."""
    prefix = os.path.basename(temp_prefix(target))
    owner = owner_token()
    while True:
        name = f"{prefix}{owner}.{secrets.token_hex(4)}"
        with _own_lock:
            _own.add(name)  # before it exists: a cleanup in another thread never sees it unowned
        try:
            return name, make(name)
        except FileExistsError:
            disown(name)
        except BaseException:
            disown(name)
            raise


def disown(name: str) -> None:
    """Temp entry `name` is no longer a save in progress of this process (renamed or removed;
    one left behind is then abandoned)."""
    with _own_lock:
        _own.discard(name)


# -- durability -----------------------------------------------------------------------------------


class AtomicFile:
    """A temp sibling of `path`, owned by this process, that becomes `path` on commit or vanishes.

    Every operation goes through one descriptor of the target's directory (`within`, or the
    directory of `path` opened once): the temp file is created ``O_EXCL | O_NOFOLLOW``
    beneath it, renamed beneath it and the directory fsynced through it, so a directory
    swapped for a link meanwhile (spec 13.6) cannot redirect the save.  ``locked`` says
    whether it holds the temp file's flock (False where the filesystem does not support
    flock; ownership then rests on the name alone).
    """

    def __init__(self, path: str, within: CheckpointDir | None = None) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.tmp = ""  # the temp file's path, for messages and tests
        self.fd = -1
        self.locked = False
        self._within = within
        self._dir: CheckpointDir | None = None
        self._tmp_name = ""

    def __enter__(self) -> AtomicFile:
        if self._within is not None:
            d = self._dir = self._within.dup()
        else:
            d = self._dir = CheckpointDir.open(os.path.dirname(self.path) or ".")
        try:
            self._create(d)
            self.locked = lock_exclusive(self.fd)
            # ages of other hosts' temps are measured by the filesystem's clock, not this host's
            remove_abandoned_temps(d, os.fstat(self.fd).st_mtime)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _create(self, d: CheckpointDir) -> None:
        if d.is_dir(self.name):
            raise IsADirectoryError(errno.EISDIR, "is a directory", self.path)
        self._tmp_name, self.fd = new_temp(d, self.name, d.create)
        self.tmp = d.path_of(self._tmp_name)

    def open_for_reading(self) -> int:
        """A new read-only descriptor of the temp file (through the directory it was created in,
        without following a link): to check what was written before committing it."""
        assert self._dir is not None and self._tmp_name
        return os.open(self._tmp_name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir.fd)

    def commit(self, *, free_replaced: Callable[[int], None] | None = None) -> None:
        """fsync the file, rename it over the target, fsync the directory.

        A file it replaces is held open across the rename and handed to `free_replaced`
        (default: closed on a thread of its own), so that freeing it is off this path."""
        assert self._dir is not None
        os.fsync(self.fd)
        replaced = _hold_old_file(self._dir, self.name)
        try:
            self._dir.rename(self._tmp_name, self.name)
        finally:
            if replaced >= 0:
                (free_replaced or _close_later)(replaced)
        disown(self._tmp_name)
        self._tmp_name = self.tmp = ""
        self._dir.fsync()

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._tmp_name and self._dir is not None:
            try:
                self._dir.unlink(self._tmp_name)
            except OSError:
                pass  # left for a later cleanup: no longer registered, so abandoned
            disown(self._tmp_name)
            self._tmp_name = self.tmp = ""
        if self._dir is not None:
            self._dir.close()
            self._dir = None


def _hold_old_file(d: CheckpointDir, name: str) -> int:
    """An open descriptor of the regular file a commit is about to replace, or -1.

    Renaming over a file frees its pages and blocks in the rename itself when nothing
    else holds it open: about 0.12 s per GiB on tmpfs, a quarter of a save.  Holding it
    open moves that work to the close, which _close_later does off the caller's path."""
    before = d.lstat(name)
    if before is None or not stat.S_ISREG(before.st_mode) or before.st_blocks == 0:
        return -1  # opening a FIFO or a device has effects of its own; an empty file frees nothing
    try:
        fd = d.open_file(name)
    except (OSError, CheckpointError):
        return -1
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (before.st_dev, before.st_ino):
            return fd
    except OSError:
        pass
    os.close(fd)
    return -1


def _close_later(fd: int) -> None:
    try:
        threading.Thread(target=os.close, args=(fd,), name="ckptfmt-free-replaced", daemon=True).start()
    except RuntimeError:  # no new threads (interpreter shutdown): the commit has happened all the same
        os.close(fd)
