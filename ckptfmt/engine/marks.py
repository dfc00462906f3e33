"""ckptfmt's mark on a folder it makes: the proof that a folder without a valid commit record
is ckptfmt's to delete.

A checkpoint folder (a CheckpointManager step directory, a Hugging Face ``checkpoint-N``) is
made under a temporary name (engine.commit), the mark written inside, then renamed: from the
moment the folder has its name, it bears the mark.  A deletion puts the mark first (a
folder of an older ckptfmt has none), removes the commit record, then every other entry,
the mark last, so a deletion cut short leaves a folder that is still provably ckptfmt's.  A
folder with neither a valid commit record nor the mark (another tool's, the stock Trainer's,
a person's) is never deleted; an empty one may be (removing it loses nothing).
"""

from __future__ import annotations

import json
import os
import stat

from ..errors import CheckpointError
from .ckptdir import CheckpointDir

MARK_NAME = ".ckptfmt-folder"


def put_mark(folder: CheckpointDir, writer: str) -> None:
    """The mark in `folder`, written and durable (the folder fsynced); kept if already there."""
    try:
        fd = folder.create(MARK_NAME)
    except FileExistsError:
        return
    try:
        view = memoryview(json.dumps({"writer": writer}).encode() + b"\n")
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    folder.fsync()


#: the most a mark may hold (put_mark writes a few dozen bytes)
MAX_MARK_BYTES = 4096


def is_marked(folder: CheckpointDir) -> bool:
    """Whether `folder` holds the mark: a regular file (a link there is not the mark) holding
    what put_mark writes, a JSON object naming its writer.  A file of that name holding
    anything else (empty, a person's) proves nothing, and the folder is not ckptfmt's."""
    st = folder.lstat(MARK_NAME)
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MARK_BYTES:
        return False
    try:
        content = json.loads(folder.read_file(MARK_NAME, MAX_MARK_BYTES))
    except (CheckpointError, OSError, ValueError, RecursionError):
        return False
    return isinstance(content, dict) and isinstance(content.get("writer"), str)


def ours_without_record(folder: CheckpointDir) -> bool:
    """Whether a folder without a valid commit record may be deleted: it bears the mark or is
    empty."""
    return is_marked(folder) or not folder.names()


def remove_mark_if_alone(folder: CheckpointDir) -> None:
    """The end of a deletion: the mark goes once nothing else is left (a folder still holding
    files that are kept keeps its mark, and stays ckptfmt's)."""
    if folder.names() == [MARK_NAME]:
        folder.unlink(MARK_NAME)
