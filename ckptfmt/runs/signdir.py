"""Signing an existing checkpoint directory (``ckptfmt sign DIR``, spec 16.7): a step of a run
or a DCP save, given a signed commit record without rewriting any of its data files.

The directory is first verified as a load would check it (verify_step: the record, the step
rule, the layout's checks and every chunk of every file it names), so a damaged checkpoint is
never signed.  The record's values are then written again as a signed record carrying the
SHA-256 of every file it names, through the commit protocol (renaming over ``COMMIT`` is
atomic: a reader sees the old record or the signed one), and the result is checked as a
reader trusting only the signing key would check it.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError, IncompleteError
from ..files import multifile, recordsign
from .stepcheck import verify_step


def sign_directory(
    path: str | os.PathLike[str], key: Any, *, decrypt_with: Any = None
) -> multifile.CommitRecord:
    """Sign the checkpoint directory `path` (one holding a COMMIT) with the Ed25519 private key
    `key`; return the signed record.  CheckpointError when it does not verify.  `decrypt_with`:
    the key of an encrypted checkpoint's files, which are verified with it (every tag) before
    the record binds their SHA-256 over their ciphertext."""
    where = os.fspath(path)
    private = recordsign.private_key(key)
    report = verify_step(where, None, None, decrypt_with)
    if not report.ok:
        first = report.problems[0]
        if first.kind == "incomplete":
            raise IncompleteError(f"not a complete checkpoint, not signed: {first.message}", path=where)
        raise CheckpointError(f"does not verify, not signed: {first.kind}: {first.message}", path=where)
    with multifile.opened(where) as d:
        record = multifile.read_commit(d)
        recordsign.write_signed(d, record, private)
        return recordsign.check_directory(d, recordsign.public_keys([private.public_key()]))
