"""Non-tensor values of a DCP state ("byte items") through ckptfmt's object model.

DCP hands a storage layer each non-tensor value as an ``io.BytesIO``; its default
planner fills it with ``torch.save`` (a pickle) and reads it back with
``torch.load(weights_only=False)``.  Our planners use :class:`ObjectBytes`
instead: a BytesIO that carries the value itself and, for storage layers that
only see bytes, holds the value encoded as a complete ckptfmt file (magic,
checksums, the object model; no pickle).  Our Writer stores the value straight
into the rank's file and our Reader hands it back without any byte round trip.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any

from ..engine.chunkwrite import build_file
from ..engine.writeoptions import WriteOptions
from ..errors import CheckpointError, UnsupportedError, UnsupportedObjectError
from ..fileio import pread_exact
from ..files.reader import CheckpointFile
from ..format import layout as fmt
from ..format.encode import encode


class ObjectBytes(io.BytesIO):
    """A BytesIO holding a non-tensor value: ``.value`` is the object, the bytes (if any) its
    encoding as a ckptfmt file."""

    def __init__(self, value: Any, data: bytes = b"") -> None:
        super().__init__(data)
        self.value = value


def raw_bytes_io(value: object) -> object:
    """An io.BytesIO as the bytes it holds (how a byte item stores one: raw bytes, no pickle; a
    load into a state that holds a BytesIO there gives one back); any other value as it is."""
    if isinstance(value, io.BytesIO) and not isinstance(value, ObjectBytes):
        return value.getvalue()
    return value


def check_storable(value: object, fqn: str) -> None:
    """Raise UnsupportedObjectError naming `fqn` unless ckptfmt's object model can store `value`."""
    try:
        encode(raw_bytes_io(value))
    except UnsupportedObjectError as e:
        raise UnsupportedObjectError(_where_in(e.reason), key=fqn) from None


def _where_in(reason: str) -> str:
    """encode's message for a value encoded on its own ("state[...]: cannot store ...")
    without its root name: the key path inside the value, then the reason."""
    return reason.removeprefix("state").lstrip(": ")


def _scratch_fd() -> tuple[int, str]:
    """An anonymous read-write file and a path that opens it (memfd on Linux, else a temp file)."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("ckptfmt-value", os.MFD_CLOEXEC)
        return fd, f"/proc/self/fd/{fd}"
    fd, path = tempfile.mkstemp(prefix=".ckptfmt-value-")
    os.unlink(path)  # the open descriptor keeps it; /dev/fd names it on BSD and macOS
    return fd, f"/dev/fd/{fd}"


def encode_value(value: object, fqn: str) -> bytes:
    """`value` as the bytes of a whole ckptfmt file (for storage layers that store bytes)."""
    try:
        encoded = encode(value)
    except UnsupportedObjectError as e:
        raise UnsupportedObjectError(_where_in(e.reason), key=fqn) from None
    fd, _ = _scratch_fd()
    try:
        n = build_file(fd, encoded, WriteOptions())
        return pread_exact(fd, 0, n)
    finally:
        os.close(fd)


def decode_value(data: bytes | memoryview, fqn: str) -> object:
    """The value a ckptfmt-encoded byte item holds; anything else (a pickle) is refused."""
    if bytes(data[: len(fmt.MAGIC)]) != fmt.MAGIC:
        raise UnsupportedError(
            "this non-tensor value is not stored in ckptfmt's object model (a pickle written by "
            "DCP's default planner?); ckptfmt never unpickles",
            key=fqn,
        )
    fd, path = _scratch_fd()
    try:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
        try:
            with CheckpointFile(path) as f:
                return f.load_subtree(f.tree.root, None, True)
        except CheckpointError as e:
            raise type(e)(f"the stored value is damaged: {e.reason}", key=fqn) from None
    finally:
        os.close(fd)
