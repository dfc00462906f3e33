"""Recognise checkpoint files by their first bytes, not their names."""

from __future__ import annotations

import errno
import json
import os
import struct

from ..errors import UnsupportedError
from ..fileio import open_regular, pread_exact
from .layout import MAGIC

#: how many first bytes recognise a file (sniff_head's `head`)
HEAD_BYTES = 64 * 1024


def sniff(path: str | os.PathLike[str]) -> str:
    """One of "ckptfmt", "torch-zip", "torch-legacy", "safetensors", "unknown", or "special"
    (a FIFO, device or socket: opened without blocking and never read).  IsADirectoryError
    for a directory."""
    try:
        fd = open_regular(os.fspath(path))  # a FIFO is opened without waiting for a writer
    except UnsupportedError:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path)) from None
        return "special"
    try:
        size = os.fstat(fd).st_size
        head = pread_exact(fd, 0, HEAD_BYTES)
    finally:
        os.close(fd)
    return sniff_head(head, size)


def sniff_head(head: bytes, size: int) -> str:
    """:func:`sniff` of a file of `size` bytes whose first bytes (up to HEAD_BYTES) are `head`:
    for bytes that are not in a local file (an object's first range)."""
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
