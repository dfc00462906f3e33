"""Which filesystem holds an open file, read from /proc/self/mountinfo once per device.

Writers choose how many engine threads write one file by it (chunkwrite.write_threads):
on tmpfs every write to a file copies into its pages under the file's inode lock, so
writers of one file take turns however many there are.  A memfd (an object upload's spool)
is a file of the same shared-memory filesystem, on no mount: `is_memfd` tells one.
"""

from __future__ import annotations

import os

MOUNTINFO = "/proc/self/mountinfo"

#: the filesystem type found for each device number (st_dev), None where no mount has it (a
#: memfd's device): a sharded save writes many files on one device, and mountinfo is read
#: once for them all.  A mounted device keeps its type until it is unmounted; a number reused
#: by a later mount could keep a stale type here, which only chooses how many threads write,
#: never what is written (forget_devices after remounting).
_types: dict[int, str | None] = {}

#: devices remembered at most (a process sees a handful; the table is emptied when full)
MAX_DEVICES = 64


def filesystem_type(fd: int) -> str | None:
    """The type ("tmpfs", "ext4", ...) of the mounted filesystem that holds the file open at
    `fd`, matched by device number in /proc/self/mountinfo (read once per device); None where
    no mount there has that device (a memfd, a pipe, no /proc) or it cannot be read."""
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        return None
    if dev in _types:
        return _types[dev]
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None  # not remembered: a later file may find it readable
    kind = type_of_device(text, f"{os.major(dev)}:{os.minor(dev)}")
    if len(_types) >= MAX_DEVICES:
        _types.clear()
    _types[dev] = kind
    return kind


def forget_devices() -> None:
    """Read mountinfo again for the next file of every device (mounts have changed)."""
    _types.clear()


def type_of_device(mountinfo: str, device: str) -> str | None:
    """The filesystem type of the first mount of `device` ("major:minor") in the text of a
    mountinfo file: each line's third field is the device, the first field after the " - "
    separator the type (proc(5)); None where no well-formed line names it."""
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        kind = tail.split()
        if sep and len(fields) >= 3 and fields[2] == device and kind:
            return kind[0]
    return None


def is_memfd(fd: int) -> bool:
    """Whether `fd` is a memfd (memfd_create's file, shared memory as tmpfs's files are: its
    writes take turns under the inode lock too), by the name /proc gives its descriptor."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False
