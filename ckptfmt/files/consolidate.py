"""A self-contained copy of an incremental checkpoint: every chunk local, no feature bit 0.

The chunks an incremental file refers to are read from the files that hold them (verified
there, as a load verifies them) and written into the copy a bounded window at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..background import inflight
from ..engine import bytesview, chunkwrite, hostmem
from ..engine.commit import AtomicFile
from ..engine.writeoptions import WriteOptions
from ..fileio import is_url
from ..format import dtypes
from ..format.encode import Encoded, StoragePlan
from ..storage.client import check_options
from ..storage.upload import ObjectFile
from . import encryption
from . import save as writer
from .reader import CheckpointFile

#: raw bytes consolidate() reads (verified) and writes per step
_CONSOLIDATE_WINDOW = 64 << 20


@dataclass(frozen=True)
class ConsolidateReport:
    chunks: int  # chunks in the copy
    external_chunks: int  # of those, read from referenced files
    referenced_files: int
    file_bytes: int


def _storage_widths(f: CheckpointFile) -> list[int]:
    """The shuffle width of each storage: that of the first tensor or array using it."""
    widths = [0] * len(f.storages)
    for node in f.tree.nodes:
        if node[0] == "tensor" and not widths[node[1]["storage"]]:
            widths[node[1]["storage"]] = dtypes.torch_shuffle_width(node[1]["dtype"])
        elif node[0] == "ndarray" and not widths[node[1]["storage"]]:
            dt = dtypes.numpy_dtype(node[1]["dtype"])
            widths[node[1]["storage"]] = 1 if dt is None else dtypes.numpy_shuffle_width(dt)
    return widths


def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    compression: str | None = None,
    level: int | None = None,
    decrypt_with: Any = None,
    encrypt_with: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> ConsolidateReport:
    """Write a self-contained copy of `src` at `dst`: every chunk local, no feature bit 0.

    The copy has the same object tree, storages (with their device tags), metadata and
    chunk size.  Chunks are read and verified (checksums and digests, in the files they
    lie in) a window at a time, so memory stays bounded whatever the state's size.  Either
    may be an object-store URL (``storage_options``: the client's settings): the source is
    read by ranged GETs, the copy streamed into a multipart upload as it is written.
    `decrypt_with`: the key of an encrypted `src` (its referenced files are unwrapped by the
    same key); `encrypt_with`: the copy is encrypted under this key (default `decrypt_with`:
    an encrypted checkpoint stays encrypted; a key service's unwrapping callable cannot
    encrypt, so pass its wrapping one).
    """
    writer.check_save_args(compression, level, None)
    if encrypt_with is None and decrypt_with is not None and not callable(decrypt_with):
        encrypt_with = decrypt_with
    seal = encryption.sealer(encrypt_with)
    source, target = os.fspath(src), os.fspath(dst)
    options = check_options(storage_options)
    inflight.wait_for_path(source)
    inflight.wait_for_path(target)
    if source == target or (os.path.exists(target) and os.path.samefile(source, target)):
        raise ValueError(f"{target}: consolidate writes a new file; it cannot replace the file it reads")
    with CheckpointFile(
        source, decrypt_with=decrypt_with, storage_options=options if is_url(source) else None
    ) as f:
        widths = _storage_widths(f)
        # the index of the copy: the same tree and storages (their bytes come from the file)
        encoded = Encoded(
            nodes=f.tree.nodes,
            storages=[
                StoragePlan(r.nbytes, r.device, widths[i], np.empty(0), r.key)
                for i, r in enumerate(f.storages)
            ],
            devices=list(f.source_devices),
        )
        buf = hostmem.empty_bytes(max(_CONSOLIDATE_WINDOW, f.chunk_size))
        view = bytesview.tensor_bytes(buf)
        chunk_width = [widths[sid] for sid, r in enumerate(f.storages) for _ in range(r.n_chunks)]
        to_store = is_url(target)
        output: Any = (
            ObjectFile(target, options, writer.object_capacity(encoded, f.chunk_size))
            if to_store
            else AtomicFile(target)
        )
        with output as out:
            file_id = chunkwrite.new_file_id()
            # the copy keeps the source's chunk size and metadata
            write = WriteOptions(compression, level, f.chunk_size, f.metadata, seal=seal)
            cw = chunkwrite.ChunkWriter(out.fd, file_id, write, path=target)
            k = 0
            while k < len(f.chunks):
                items: list[tuple[int, memoryview]] = []
                pos = 0
                while k < len(f.chunks) and (not items or pos + f.chunks[k].raw_len <= len(view)):
                    items.append((k, view[pos : pos + f.chunks[k].raw_len]))
                    pos += f.chunks[k].raw_len
                    k += 1
                f.read_into(items, True)
                cw.write([(dest, chunk_width[kk]) for kk, dest in items])
                if to_store:  # the parts written so far go up while the next window is read
                    out.written(cw.pos)
            length = cw.finish(encoded)
            out.commit()
        external = sum(1 for ch in f.chunks if ch.source >= 0)
        return ConsolidateReport(len(f.chunks), external, len(f.externals), length)
