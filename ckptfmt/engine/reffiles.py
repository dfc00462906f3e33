"""A referenced file (spec section 12) checked, once opened, to be the one its referencing
file's index records (section 12.5): its prologue and footer, file id, length and encryption
(section 17.9), and an encrypted one's data key; a local one opened again checked to be the
file it was when first opened.  chunkread.ChunkReader opens each."""

from __future__ import annotations

import os

from ..errors import CheckpointError, CorruptError, DecryptionError, IncompleteError
from ..fileio import file_stamp, pread_exact
from ..format import encryption
from ..format import layout as fmt
from ..format.encryption import Opener
from ..format.index import External


def check_stamp(stamps: dict[int, tuple[int, ...]], e: int, fd: int, what: str, path: str) -> None:
    """Local referenced file e, open at `fd`, is the file it was when first opened (`stamps`:
    each one's then), as an object must be its first version: opened again (let go of to keep
    few open), CorruptError where it was replaced or rewritten meanwhile."""
    stamp = file_stamp(os.fstat(fd))
    if stamps.setdefault(e, stamp) != stamp:
        raise CorruptError(
            f"{what} changed since this file first opened it (replaced or rewritten)", path=path
        )


def check_opened(
    fd: int,
    ext: External,
    what: str,
    path: str,
    encrypted: bool,
    opener: Opener | None,
    with_key: bool,
) -> tuple[int, tuple[bytes, encryption.EncryptionBlock] | None]:
    """(end of its data section, its data key and encryption block where `with_key`) of the
    referenced file open at `fd`, named `what` in errors about `path`, the file referring to
    it; CorruptError or IncompleteError where it is not the file recorded."""
    size = os.fstat(fd).st_size
    try:
        pro = fmt.parse_prologue(pread_exact(fd, 0, fmt.PROLOGUE_SIZE), size, ext.name)
        foot = fmt.parse_footer(
            pread_exact(fd, pro.file_length - fmt.FOOTER_SIZE, fmt.FOOTER_SIZE), pro, ext.name
        )
    except CheckpointError as inner:
        cls = IncompleteError if isinstance(inner, IncompleteError) else CorruptError
        raise cls(f"{what} is unusable: {inner}", path=path) from inner
    if pro.file_id != ext.file_id:
        raise CorruptError(
            f"{what} has file id {pro.file_id.hex()}, the reference records {ext.file_id.hex()} "
            "(another file lies at that path now)",
            path=path,
        )
    if pro.file_length != ext.length:
        raise CorruptError(
            f"{what} is {pro.file_length} bytes, the reference records {ext.length}", path=path
        )
    if bool(pro.required_features & fmt.FEATURE_ENCRYPTED) != encrypted:
        raise CorruptError(
            f"{what} is {'not ' if encrypted else ''}encrypted, and this file is "
            f"{'' if encrypted else 'not'}: references never cross that line (spec 17.9)",
            path=path,
        )
    key = _external_key(fd, pro, foot, what, path, opener) if with_key else None
    return foot.index_offset, key


def _external_key(
    fd: int, pro: fmt.Prologue, foot: fmt.Footer, what: str, path: str, opener: Opener | None
) -> tuple[bytes, encryption.EncryptionBlock]:
    """An encrypted referenced file's data key, unwrapped by the referencing file's key, and
    its encryption block (whose tag table holds its chunks' tags)."""
    at = fmt.align_up(foot.index_offset + foot.index_length)
    head = pread_exact(fd, at, encryption.HEADER_SIZE)
    size = encryption.block_length_from_header(head)
    if size is None or size > foot.signature_length:
        raise CorruptError(f"{what}: its encryption block's header is impossible", path=path)
    try:
        block = encryption.parse_block(pread_exact(fd, at, size), path, at)
        assert opener is not None
        return opener.data_key(block, pro.file_id), block
    except CheckpointError as err:
        cls = DecryptionError if isinstance(err, DecryptionError) else CorruptError
        raise cls(f"{what}: {err.reason}", path=path) from None
