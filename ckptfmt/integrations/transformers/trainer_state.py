"""``trainer_state.json`` on resume: the Trainer reads it by path, so before a resume it is made
the text the commit recorded in ``trainer_state.ckpt``, replaced (never written through) when
it is missing, differs, or is a link or a FIFO."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable

from ...engine import commit
from ...engine.ckptdir import CheckpointDir
from ...errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptError,
    LimitError,
)
from .names import (
    TRAINER_STATE_JSON,
    TRAINER_STATE_NAME,
)
from .reading import OpenedFolder, open_checked, why


def _replace_file(folder: CheckpointDir, name: str, write: Callable[[int], object]) -> None:
    """Make entry `name` of `folder` the file `write(fd)` writes, with the commit protocol
    beneath the folder's descriptor (commit.AtomicFile): a temp sibling created
    O_EXCL | O_NOFOLLOW and owned by this process (a link already at that name is never
    written through), fsync, rename over `name` (a link or a FIFO is replaced as a name),
    fsync the folder."""
    with commit.AtomicFile(folder.path_of(name), folder) as f:
        write(f.fd)
        f.commit()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _current_json(folder: CheckpointDir, limit: int) -> tuple[str | None, str]:
    """``trainer_state.json`` as it is (None when it cannot be the committed text), and what it
    is when it differs.  Read through the folder: a link is not followed, a FIFO not waited on."""
    try:
        raw = folder.read_file(TRAINER_STATE_JSON, limit)
    except FileNotFoundError:
        return None, "missing"
    except LimitError:
        return None, "not what was committed"
    except (CheckpointError, OSError) as e:
        return None, f"not a regular file of the folder ({why(e)})"
    try:
        return raw.decode("utf-8"), "not what was committed"
    except UnicodeDecodeError:
        return None, "not what was committed"


def restore_trainer_state_json(source: str | OpenedFolder) -> None:
    """Make ``trainer_state.json`` what the commit recorded (the Trainer reads the JSON file by
    path, after this: a link or FIFO there is replaced, never read or written through)."""
    with contextlib.ExitStack() as stack:
        if isinstance(source, str):
            source = stack.enter_context(open_checked(source))
        committed = source.load_required(TRAINER_STATE_NAME)
        text = committed.get("trainer_state_json") if isinstance(committed, dict) else None
        if not isinstance(text, str):
            raise CorruptError(f"{TRAINER_STATE_NAME} holds no trainer state", path=source.path)
        data = text.encode("utf-8")
        current, what = _current_json(source.dir, len(data))
        if current == text:
            return
        where = source.dir.path_of(TRAINER_STATE_JSON)
        warnings.warn(
            f"{where} is {what}: rewriting it from {TRAINER_STATE_NAME}", CheckpointWarning, stacklevel=3
        )
        try:
            _replace_file(source.dir, TRAINER_STATE_JSON, lambda fd: _write_all(fd, data))
        except OSError as e:
            raise CorruptError(
                f"{TRAINER_STATE_JSON} cannot be replaced: {e.strerror}", path=source.path
            ) from None
