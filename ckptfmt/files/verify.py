"""verify(): check a whole file and list every problem, not just the first."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..background import inflight
from ..errors import (
    CheckpointError,
    CorruptError,
    DecryptionError,
    IncompleteError,
    LimitError,
    SignatureError,
    StorageError,
    UnsupportedError,
)
from ..gcpause import pausing_in_main_thread
from .encryption import (
    UNCHECKED_CLEAR_INDEX,
    UNCHECKED_ENCRYPTED_INDEX,
    UNCHECKED_SIGNED_CLEAR_INDEX,
    UNCHECKED_SIGNED_ENCRYPTED_INDEX,
    KeyRequired,
    ciphertext_problems,
)
from .reader import CheckpointFile


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a file, and where."""

    kind: str  # "corrupt", "incomplete", "unsupported", "limit", "signature", "decryption"
    message: str
    key: str | None = None
    chunk: int | None = None
    offset: int | None = None

    def __str__(self) -> str:
        where = [
            p
            for p in (
                self.key,
                None if self.chunk is None else f"chunk {self.chunk}",
                None if self.offset is None else f"offset {self.offset}",
            )
            if p
        ]
        return ": ".join([*where, self.message])


@dataclass
class VerifyReport:
    path: str
    problems: list[Problem] = field(default_factory=list)
    chunks: int = 0
    bytes_checked: int = 0
    #: what could not be checked (an encrypted file verified without its key), else empty
    not_checked: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok


def _kind(e: CheckpointError) -> str:
    if isinstance(e, SignatureError):
        return "signature"
    if isinstance(e, DecryptionError):
        return "decryption"
    if isinstance(e, IncompleteError):
        return "incomplete"
    if isinstance(e, UnsupportedError):
        return "unsupported"
    if isinstance(e, LimitError):
        return "limit"
    if isinstance(e, CorruptError):
        return "corrupt"
    return "error"


def problem_of(e: CheckpointError) -> Problem:
    return Problem(_kind(e), e.reason, e.key, e.chunk, e.offset)


def _file_problem(e: CheckpointError) -> Problem:
    """Problem `e` of the file checked; a StorageError is raised instead: a store that fails
    says nothing of the file, which a report of problems would call damaged."""
    if isinstance(e, StorageError):
        raise e
    return problem_of(e)


@pausing_in_main_thread
def verify(
    path: str | os.PathLike[str],
    *,
    quick: bool = False,
    progress: Callable[[int, int], None] | None = None,
    trusted_keys: Any = None,
    storage_options: dict[str, Any] | None = None,
    decrypt_with: Any = None,
) -> VerifyReport:
    """Check structure, index and (unless `quick`) every chunk's checksum and size.

    Damage to the prologue, footer or index stops the check (nothing after them
    can be trusted); damaged chunks are each reported and the check goes on.
    External chunks (an incremental checkpoint's) are checked in the files they
    lie in; a problem there is reported with both files named.

    trusted_keys (see load()): the file must also be signed by one of these keys; a missing
    or failing signature is a problem of kind "signature" (and stops the check), a chunk
    that does not match its signed digest one per chunk.  Every chunk is then checked even
    when `quick`: the signature covers the digest table, not the data, and verify never
    says OK to a file a load with the same keys refuses.  Bad keys raise ValueError.

    decrypt_with (see load()): the key of an encrypted file (spec section 17): every tag is
    checked too.  Without it, an encrypted file is checked as far as its clear parts allow
    (17.6) and `report.not_checked` says what was not; a signed encrypted file's signature is
    checked without the key (17.8).
    """
    inflight.wait_for_path(path)
    report = VerifyReport(os.fspath(path))
    try:
        f = CheckpointFile(
            path,
            trusted_keys=trusted_keys,
            storage_options=storage_options,
            decrypt_with=decrypt_with,
            ciphertext_only=True,
            read_ahead=True,
        )
    except KeyRequired:
        # with trusted keys, only a signed file whose signature held gets this far (17.8)
        report.not_checked = (
            UNCHECKED_ENCRYPTED_INDEX if trusted_keys is None else UNCHECKED_SIGNED_ENCRYPTED_INDEX
        )
        return report
    except StorageError:  # the store failed, not the file: nothing about it is known
        raise
    except CheckpointError as e:
        report.problems.append(problem_of(e))
        return report
    with f:
        if f.encrypted and decrypt_with is None:
            report.chunks = len(f.chunks)
            report.not_checked = UNCHECKED_SIGNED_CLEAR_INDEX if f.signed else UNCHECKED_CLEAR_INDEX
            if not quick:
                report.problems.extend(problem_of(e) for e in ciphertext_problems(f))
                report.bytes_checked = f.prologue.file_length
        else:
            check_file(f, report, quick=quick, progress=progress)
    return report


def check_file(
    f: CheckpointFile,
    report: VerifyReport,
    *,
    quick: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """verify()'s checks of a file already open (its index validated), added to `report`."""
    report.chunks = len(f.chunks)
    # the files an incremental checkpoint refers to: present, the recorded ones, and
    # holding its external chunks inside their data sections (checked even when quick)
    for err in f.external_problems():
        report.problems.append(_file_problem(err))
    # a file opened with trusted keys is only authentic once each chunk matches its signed digest
    if not quick or f.signed:
        for err in f.iter_chunk_problems(progress):
            report.problems.append(_file_problem(err))
        report.bytes_checked = f.prologue.file_length
