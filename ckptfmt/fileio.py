"""Opening and reading the files a reader is given: the two helpers every reading path shares.

The index parser (index.py), the chunk reader (chunkread.py), the commit record's
checks (multifile.py), format sniffing (sniff.py) and the DCP readers all open files with
`open_regular` (ckptdir.py, which opens files beneath a directory's descriptor, with
`regular_or_close`) and read their fixed-size parts with `pread_exact`; this module
imports nothing of the package but its errors.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat

from .errors import UnsupportedError

#: a scheme and "://": group 1 is the scheme
URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(path: object) -> bool:
    """Whether `path` names an object-store location (a str starting with a scheme and ://),
    not a local path: such paths are never opened as files (storage/ reads them)."""
    return isinstance(path, str) and URL_SCHEME.match(path) is not None


def open_regular(path: str, *, follow_symlinks: bool = True) -> int:
    """A read-only descriptor of `path`, which must be a regular file.

    Opened with O_NONBLOCK so that a FIFO (or a device) at that path cannot block the
    open; the flag is cleared once fstat shows a regular file.  UnsupportedError otherwise.
    `follow_symlinks` False: a symbolic link at `path` itself fails to open (OSError, ELOOP).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None
    return regular_or_close(fd, path)


def regular_or_close(fd: int, path: str) -> int:
    """`fd`, opened with O_NONBLOCK, once fstat shows a regular file (the flag then cleared:
    reads of a regular file never block anyway); closed and UnsupportedError otherwise."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsupportedError("not a regular file", path=path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def pread_exact(fd: int, offset: int, n: int) -> bytes:
    """Up to n bytes at offset (fewer only where the file ends)."""
    first = os.pread(fd, n, offset) if n else b""
    if len(first) == n or not first:
        return first  # the usual case: one read, no copy
    out = bytearray(first)
    while len(out) < n:
        got = os.pread(fd, n - len(out), offset + len(out))
        if not got:
            break
        out += got
    return bytes(out)


def file_stamp(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells one state of a local file from another: its device, inode, modification
    and change times and size (the change time too: a rewrite in place that puts the
    modification time back cannot set it)."""
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
