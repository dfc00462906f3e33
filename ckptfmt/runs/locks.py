"""The lock of a step directory: a save holds an exclusive ``flock`` on its step directory
from the moment the directory has its name until the save finishes or its process dies
(spec 13.4), so a cleanup asks the lock whether a directory without a commit record is
still being written."""

from __future__ import annotations

import errno
import fcntl
import os

from ..engine.commit import NO_LOCKING


def try_lock(fd: int) -> bool | None:
    """Take the directory's lock without waiting: True taken, False held elsewhere, None unsupported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if e.errno in NO_LOCKING:  # flock unsupported (Lustre without -o flock, some NFS)
            return None
        raise


def is_locked(path: str) -> bool | None:
    """Whether a live process holds the lock of step directory `path` (None: cannot tell)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        got = try_lock(fd)
        return None if got is None else not got
    finally:
        os.close(fd)  # closing drops a lock taken here
