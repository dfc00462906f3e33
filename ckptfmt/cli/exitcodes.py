"""What the command line reports and the exit status each kind of problem gives.

ERROR_EXIT_CODES is the one table from errors to exit statuses; every command goes
through exit_code.  EXIT_CODES is the same table in words, for --help.
"""

from __future__ import annotations

import os

from ..errors import CheckpointError, StorageError
from ..fileio import is_url
from ..format.sniff import DESCRIPTIONS, sniff

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_CODES = """exit status:
  0  success; diff: the files are identical
  1  a file is damaged, incomplete, unsupported (its version, a feature, codec or dtype)
     or over a limit: it failed verification; diff: the files differ
  2  usage error, or a path that is missing, unreadable, a directory where a file is
     needed, or not a ckptfmt file (another format, a FIFO, a device); an object store
     that refuses or fails a request (s3:// paths)
Every command gives the same status for the same kind of problem.  inspect and
verify --quick check structure, index and referenced files, not chunk data.
"""


class NotCheckpointError(Exception):
    """The path is not a ckptfmt file: its first bytes are another format's, or it is not a
    regular file (a FIFO, a device)."""

    def __init__(self, path: str, description: str, kind: str | None = None) -> None:
        self.path = path
        self.kind = kind  # what sniff found, when it found a format
        super().__init__(description)


class UsageError(Exception):
    """Arguments that cannot work: an output that would replace its input, a conversion the
    target format cannot hold, a missing optional package."""


class ForeignFileError(Exception):
    """convert: a torch.save or safetensors file that its own reader refuses."""


#: The one table from what went wrong to the exit status; every command goes through it
#: (exit_code).  The first matching row counts: a CheckpointError is also a ValueError.
ERROR_EXIT_CODES: tuple[tuple[type[Exception], int], ...] = (
    # damaged, incomplete, unsupported version/feature/codec/dtype, over a limit (the four
    # error classes of spec section 9), or a state the format cannot store
    (StorageError, EXIT_USAGE),  # the store, not the checkpoint: like an unreadable path
    (CheckpointError, EXIT_FAILED),
    (ForeignFileError, EXIT_FAILED),
    (NotCheckpointError, EXIT_USAGE),
    (OSError, EXIT_USAGE),  # missing, unreadable, a directory where a file is needed
    (UsageError, EXIT_USAGE),
)
KNOWN_ERRORS = tuple(cls for cls, _ in ERROR_EXIT_CODES)


def exit_code_for(kind: type[BaseException]) -> int | None:
    """The exit status for errors of class `kind` (ERROR_EXIT_CODES), None if it has no row."""
    for cls, code in ERROR_EXIT_CODES:
        if issubclass(kind, cls):
            return code
    return None


def exit_code(error: BaseException) -> int:
    """The exit status for `error`; an error without a row is a bug and is raised again."""
    code = exit_code_for(type(error))
    if code is None:
        raise error
    return code


def error_text(error: BaseException, path: str) -> str:
    """`error` as one line that names `path` (and any other file the error is about)."""
    if isinstance(error, OSError):
        text = error.strerror or str(error)
        if error.filename is not None and os.fspath(error.filename) != path:
            text = f"{os.fspath(error.filename)}: {text}"
    else:
        text = str(error)
    text = " ".join(text.split())
    return text if text.startswith(path + ":") else f"{path}: {text}"


#: the status of a file whose verification found problems (verify reports CheckpointErrors)
FILE_FAILED = dict(ERROR_EXIT_CODES)[CheckpointError]


def require_ckptfmt(path: str) -> None:
    """NotCheckpointError unless `path`'s first bytes are a ckptfmt file's (or an unfinished
    one's); OSError when it is missing, unreadable or a directory.  An object-store URL is
    left to the reader, which refuses what is not a ckptfmt file (UnsupportedError)."""
    if is_url(path):
        return
    kind = sniff(path)
    if kind != "ckptfmt":
        raise NotCheckpointError(path, DESCRIPTIONS[kind], kind)
