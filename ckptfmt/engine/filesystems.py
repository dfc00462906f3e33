"""Which filesystem holds an open file, read from /proc/self/mountinfo.

Writers choose how many engine threads write one file by it (chunkwrite.write_threads):
on tmpfs every write to a file copies into its pages under the file's inode lock, so
writers of one file take turns however many there are.
"""

from __future__ import annotations

import os

MOUNTINFO = "/proc/self/mountinfo"


def filesystem_type(fd: int) -> str | None:
    """The type ("tmpfs", "ext4", ...) of the mounted filesystem that holds the file open at
    `fd`, matched by device number in /proc/self/mountinfo; None where no mount there has that
    device (a memfd, a pipe, no /proc) or it cannot be read."""
    try:
        dev = os.fstat(fd).st_dev
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return type_of_device(text, f"{os.major(dev)}:{os.minor(dev)}")


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
