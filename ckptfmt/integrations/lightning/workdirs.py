"""Private temporary folders for the local copies of checkpoints on fsspec and ``s3://`` URLs.

A save to such a URL is written to a local file before its upload, and a load fetches one:
files as large as the checkpoint.  A process killed while it holds one (out of memory, a
scheduler's SIGKILL) can remove nothing, so each folder is named as the engine names its
temp entries (engine/commit.py: ``.<kind>.ckptfmt-tmp.<host>.<pid>.<start>.<random>``), and
every new folder first removes those whose process is gone.  The temporary folder
(``TMPDIR``) may be shared with other users: it is read through a CheckpointDir (no link
followed, only these names touched), and a folder of another user (made by none of our
processes, whatever its name says) or one that cannot be examined or removed is left.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator

from ...engine import commit
from ...engine.ckptdir import CheckpointDir
from ...errors import CheckpointError

#: the kinds of folder: a save's local file before its upload, a load's fetched copy
UPLOAD = "ckptfmt-upload"
DOWNLOAD = "ckptfmt-download"
_KINDS = (UPLOAD, DOWNLOAD)


#: the folders this process holds, open and locked until removed: a process of another host
#: or pid namespace sharing the temporary folder cannot ask whether this one lives, and the
#: lock tells it (engine/commit.py's rule for temp entries)
_HELD: dict[str, CheckpointDir] = {}
_HELD_LOCK = threading.Lock()


def _forget_in_child() -> None:
    """A forked child holds none of its parent's folders (they are removed by the parent, or
    as a dead process's); the lock may have been held at the fork."""
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def make(kind: str) -> str:
    """A new folder (mode 0700) of `kind` in the temporary folder, locked while this process
    holds it, after removing the folders that dead processes left there; its path."""
    with CheckpointDir.open(tempfile.gettempdir()) as d:
        remove_abandoned(d)
        name, _ = commit.new_temp(d, kind, lambda n: d.mkdir(n, 0o700))
        try:
            folder = d.sub(name)
            commit.lock_exclusive(folder.fd)
        except BaseException:
            remove(d.path_of(name))
            raise
        with _HELD_LOCK:
            _HELD[folder.path] = folder
        return folder.path


def remove(path: str) -> None:
    """Remove folder `path` made by :func:`make` and everything in it (never through a link)."""
    parent, name = os.path.split(path)
    with contextlib.suppress(OSError, CheckpointError), CheckpointDir.open(parent) as d:
        d.remove_tree(name)
    with _HELD_LOCK:
        folder = _HELD.pop(path, None)
    if folder is not None:
        folder.close()  # the lock goes with the folder
    commit.disown(name)


@contextlib.contextmanager
def held(kind: str) -> Iterator[str]:
    """:func:`make`, removed on exit whatever happens."""
    path = make(kind)
    try:
        yield path
    finally:
        remove(path)


def remove_abandoned(d: CheckpointDir) -> list[str]:
    """Remove the folders of these kinds in `d`, made by this user, that no live process owns;
    their names."""
    removed = []
    for name in d.names():
        parsed = commit.parse_temp_name(name)
        if parsed is None or parsed[0] not in _KINDS or not _made_by_us(d, name):
            continue
        if not commit.abandoned_temp_dir(d, name):
            continue
        with contextlib.suppress(OSError, CheckpointError):
            if d.remove_tree(name):
                removed.append(name)
    return removed


def _made_by_us(d: CheckpointDir, name: str) -> bool:
    """Whether entry `name` of `d` belongs to this process's user: in a shared temporary
    folder anyone can give a folder our names, and a process that may remove any folder
    (root) must not remove another user's."""
    try:
        st = d.lstat(name)
    except OSError:
        return False
    return st is not None and st.st_uid == os.geteuid()
