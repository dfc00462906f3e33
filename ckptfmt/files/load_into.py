"""load_into(): fill existing tensors in place, like load_state_dict(strict=...).

Every tensor of the target is matched by key path with the checkpoint; all
shapes and dtypes are checked before anything is modified (targets.py).  Non-tensor
values are set in mutable containers.  Targets on the "meta" device have no memory:
the loaded tensor replaces them in their container.  Which chunk bytes go where is
planned before anything is read (fillplan.py) and carried out by fillreads.py; this
module runs the passes and owns their guarantee.

All or nothing (``atomic=True``, the default)
-------------------------------------------
load_into() works in two passes.  The first reads every chunk the targets need
into a bounded, reused bounce buffer and checks it (checksum, padding, decoding,
content digest), loads the new objects that replace values and meta targets,
and allocates every buffer the second pass uses; nothing of the caller's is
written.  The second pass reads the chunks again, verified again, into the
targets.  Its cost is a second read of the data: about twice the time when the
file is in memory (tmpfs, page cache), less on disk, where the second read
mostly finds the file in the page cache the first one filled (unless the file
is larger than free memory).  Peak extra memory stays a few chunks.  Where every
target takes whole raw chunks of a local, unsigned, unencrypted file (a model's
state, many small tensors), the engine's records of the reads are built once for
both passes (engine/batched.py), and the first pass checks each chunk in the
engine's own per-thread buffer, never in a target.  Tied targets whose tensors the file
holds apart are compared first (fillreads.check_equal); the chunks read for that are checked
as they are read, and the verification pass skips them: each is read once before the writes.

Why not one read into host memory of our own, or a mapping of the file, then
copies out: on the VMs measured, fresh memory costs a page fault per 4 KiB page
and a mapping of a file a fault per page too, each more than a second read of the
same page from the page cache into memory already touched (10^5 chunks of 4 KiB:
one read into fresh memory 5.5 us a chunk, checking through a mapping 3.5 us, each
pass of the two here about 1 us).  A copy out of a mapping could also meet a file
truncated after its check (SIGBUS); a read meets it as a short read, an error.

The guarantee: when load_into() raises, no target was modified, for every
problem the file has when load_into() starts (damaged or missing chunks,
truncation, undecodable data, a referenced file missing or replaced), for every
mismatch between file and targets, and for every error while reading or
allocating during the first pass.  What it cannot promise is the second pass:
if the file's bytes change, or a read fails, after they were verified, the
second pass detects it (with verify=True) but the targets written before that
point keep their new values (each chunk of the second pass is checked as it is
read into its target: changed bytes are found, not kept silently).  That case
raises :class:`PartialLoadError`, which lists the keys that may hold new values
(those of the batches of reads begun); the other targets are unchanged.  A file
read with trusted keys, or an encrypted one, is read the second time through the
bounce buffer: no byte that fails its signed digest or tag reaches a target.  A
change of the file's size or modification time between the start of
load_into() and the end of the first pass is caught before anything is written
(:class:`FileChangedError`).  Renaming another file over the path, or deleting
it, while load_into() runs changes nothing: the open file is read to the end.
ckptfmt itself never writes into an existing checkpoint, so the second-pass
case needs another program writing into the file in place, or a read error on
the second read.  With verify=False neither pass checks checksums, so such a
change can go unnoticed.

``atomic=False`` is the single-pass path: chunks go straight into the targets
and are checked there, so an error found part way leaves the targets written so
far with new values (and a damaged chunk's bytes in its target).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..background import inflight
from ..engine import native as _native
from ..errors import CheckpointError
from ..format import tree
from ..gcpause import pausing_in_main_thread
from . import hostalloc
from .fillplan import Plan, make_plan, window_bytes
from .fillreads import address_windows, alloc, check_equal, prepare_direct, windows, write_targets
from .reader import CheckpointFile
from .targets import LoadReport, match


class FileChangedError(CheckpointError):
    """The file changed while load_into() verified it; no target was modified."""


class PartialLoadError(CheckpointError):
    """load_into() failed after it began writing into the targets.

    The file was verified first, so this means its bytes changed, or could not be
    read again, after that.  `modified_keys` may hold new values; every other target
    is unchanged.  The error that stopped the load is the ``__cause__``.
    """

    def __init__(self, message: str, *, path: str, modified_keys: list[str]) -> None:
        super().__init__(message, path=path)
        self.modified_keys = modified_keys


def _before_write(f: CheckpointFile) -> None:
    """Called between the passes of an atomic load (tests replace it to change the file there)."""


def _stamp(f: CheckpointFile) -> tuple[int, ...]:
    """What says the open file's bytes changed: its size and modification time.  (Not its change
    time: renaming another file over the path, as every save does, changes that of the old one.)
    An object's spool changes as its ranges are fetched: there every request is pinned to the
    ETag instead, and a replaced object fails the read that sees it (StorageError)."""
    if f.remote:
        return ()
    st = os.fstat(f._fd)
    return (st.st_size, st.st_mtime_ns)


@pausing_in_main_thread
def load_into(
    path: str | os.PathLike[str],
    state: Any,
    *,
    strict: bool = True,
    verify: bool = True,
    atomic: bool = True,
    trusted_keys: Any = None,
    storage_options: dict[str, Any] | None = None,
    decrypt_with: Any = None,
) -> LoadReport:
    """Fill the tensors of `state` from the checkpoint at `path`; return missing/unexpected keys.

    Raises MismatchError before modifying anything when a shape or dtype differs,
    (with strict=True) when keys are missing or unexpected, or when two targets share
    memory that cannot be filled correctly: views that share an element unlike the file's
    tensors (views that interleave without sharing one, x[::2] and x[1::2], are filled),
    or one tensor under two keys whose checkpoint entries hold different bytes.  One
    tensor under two keys (tied weights) is filled once where its entries are one tensor
    in the file, or two of equal bytes (compared before anything is written).

    With atomic=True (the default) the file is verified before any target is
    written: when load_into() raises, every target is unchanged, except after a
    change to the file (or a read error) between its verification and the second
    read, which raises PartialLoadError naming the keys that may hold new values.
    atomic=False reads once, straight into the targets: faster, but an error
    found part way leaves the targets filled so far with new values.

    trusted_keys (see load()): the file must be signed by one of these keys; the signature
    is checked before anything is read, and every chunk against its signed digest in the
    first pass, before any target is written.  It needs atomic=True (ValueError otherwise).

    decrypt_with (see load()): the key of an encrypted file; every chunk's tag is checked in
    the first pass, and the second decrypts through the bounce buffer: no byte whose tag
    failed reaches a target.
    """
    if trusted_keys is not None and not atomic:
        raise ValueError(
            "trusted_keys needs atomic=True: every chunk is checked before any target is written"
        )
    inflight.wait_for_path(path)
    with CheckpointFile(
        path, trusted_keys=trusted_keys, storage_options=storage_options, decrypt_with=decrypt_with
    ) as f:
        return fill_from_node(f, f.tree.root, state, strict=strict, verify=verify, atomic=atomic)


def fill_from_node(
    f: CheckpointFile, top: int, state: Any, *, strict: bool, verify: bool, atomic: bool = True
) -> LoadReport:
    """load_into() for the subtree of node `top` of an open file: key paths are relative to it."""
    matched = match(f, top, state, strict=strict)
    plan = make_plan(f, matched)
    with torch.no_grad():
        if atomic:
            _fill_atomic(f, plan, verify)
        else:
            check_equal(f, plan, verify)
            buf = alloc(f, plan.buffer_bytes(f))
            write_targets(f, plan, buf, verify, {})
            for container, ckey, i in plan.replace:
                container[ckey] = f.load_subtree(i, None, verify)
    return matched.report


def verify_chunks(
    f: CheckpointFile, chunks: list[int], verify: bool, buf: torch.Tensor | None = None
) -> None:
    """Read and check `chunks` through a bounce buffer (`buf`, or one of a few chunks); write nothing else.

    With verify=False the checksums are skipped but every chunk is still read and
    decoded, so truncation and undecodable data are found.
    """
    if not chunks:
        return
    if buf is None:
        needed = sum(f.chunks[k].raw_len for k in chunks)
        buf = hostalloc.alloc_bytes(f.path, window_bytes(f, needed), "")
    # check only: the caller reads the chunks again into their places (no readahead advice,
    # as in ChunkReader: the kernel's own keeps up with reads in file order); the C engine is
    # given addresses in the buffer, which lives through the reads
    if _native.available() and buf.is_cpu:
        for places in address_windows(f, chunks, buf):
            f.read_into(places, verify, check_only=True)
        return
    for items, _ in windows(f, chunks, buf):
        f.read_into(items, verify, check_only=True)


def verify_subtree(f: CheckpointFile, top: int, verify: bool = True) -> None:
    """verify_chunks() for every chunk of every storage under node `top` (bounded memory)."""
    chunks = [
        k
        for sid in tree.storages_under(f.tree, top)
        for k in range(f.storages[sid].first_chunk, f.storages[sid].first_chunk + f.storages[sid].n_chunks)
    ]
    verify_chunks(f, chunks, verify)


def _fill_atomic(f: CheckpointFile, plan: Plan, verify: bool) -> None:
    # pass 1: everything that can fail, nothing of the caller's written
    stamp = _stamp(f)
    compared = check_equal(f, plan, verify)  # chunks read and checked there: not checked again
    replaced = [(container, ckey, f.load_subtree(i, None, verify)) for container, ckey, i in plan.replace]
    reads = prepare_direct(f, plan, verify)
    if reads is not None and not compared:  # whole raw chunks only: checked through the engine's own buffer
        buf = None
        reads.read(0, reads.n, verify, check_only=True)
    else:
        buf = alloc(f, plan.buffer_bytes(f, verifying=True))
        if buf is not None:
            chunks = plan.chunks(f)
            verify_chunks(f, [k for k in chunks if k not in compared] if compared else chunks, verify, buf)
    if _stamp(f) != stamp:
        raise FileChangedError(
            "the file was modified while load_into() verified it (its size or times changed); "
            "no target was written",
            path=f.path,
        )
    _before_write(f)
    # pass 2: the writes
    touched: dict[str, None] = {}
    try:
        write_targets(f, plan, buf, verify, touched, reads)
    except Exception as e:
        if not touched:
            raise  # it failed before the first byte reached a target
        keys = list(touched)
        raise PartialLoadError(
            f"the second read failed after load_into() verified the file (it changed, or could not be "
            f"read again): {e}; {len(keys)} target(s) may already hold new values, the others are "
            "unchanged: " + ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else ""),
            path=f.path,
            modified_keys=keys,
        ) from e
    for container, ckey, value in replaced:
        container[ckey] = value
