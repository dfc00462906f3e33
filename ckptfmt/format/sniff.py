"""Recognise checkpoint files by their first bytes, not their names."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import struct

from .layout import MAGIC


def sniff(path: str | os.PathLike[str]) -> str:
    """One of "ckptfmt", "torch-zip", "torch-legacy", "safetensors", "unknown", or "special"
    (a FIFO, device or socket: opened without blocking and never read).  IsADirectoryError
    for a directory."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(st.st_mode):
            return "special"
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        head = os.pread(fd, 64 * 1024, 0)
        size = st.st_size
    finally:
        os.close(fd)
    if MAGIC.startswith(head[:8]) or not any(head[:64]):
        return "ckptfmt"  # empty, a prefix of the magic or zeros: an unfinished or truncated save
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "torch-legacy"
    if len(head) >= 10:
        (n,) = struct.unpack_from("<Q", head)
        if 2 <= n <= size - 8 and head[8:9] == b"{":
            if n + 8 <= len(head):
                try:
                    json.loads(head[8 : 8 + n])
                except ValueError:
                    return "unknown"
            return "safetensors"
    return "unknown"


DESCRIPTIONS = {
    "ckptfmt": "ckptfmt checkpoint",
    "torch-zip": "torch.save zip archive (pickle inside)",
    "torch-legacy": "legacy torch.save pickle file",
    "safetensors": "safetensors file",
    "unknown": "not a ckptfmt file (unknown format)",
    "special": "not a regular file (a FIFO, device or socket)",
}
