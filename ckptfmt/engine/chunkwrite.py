"""Writing one ckptfmt file to an open descriptor: chunks, index, footer, prologue.

The file is laid out as spec sections 2 to 7 describe: chunks from offset 64,
each 64-byte aligned, then the index, the footer and, written last, the
prologue, so an unfinished file does not even start with the magic.  Chunks
are encoded and written by the C engine when it is built, else in Python;
both write identical bytes.  Tensor bytes go from the tensor's memory to
``pwrite`` through memoryviews: no full-size copies (compression works one
chunk at a time).

Rewriting a file's tail (signing an existing file: write_signed_tail) needs neither
torch nor numpy; what turns tensors and arrays into bytes imports them when it runs.

This module knows nothing of temp files or saves in flight: the blocking save
(files/save.py) and the background writer (background/copysave.py) both use it.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import os
import platform
import secrets
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import xxhash

from .. import __version__
from ..errors import LimitError
from ..format import encryption, signing
from ..format import layout as fmt
from ..format.timestamps import format_utc, utc_at, utc_now
from . import hostmem
from . import native as _native
from .filesystems import filesystem_type, is_memfd
from .writeoptions import ChunkRecord, Signer, WriteOptions

if TYPE_CHECKING:
    import zstandard

    from ..format.encode import Encoded, StoragePlan


def new_file_id() -> bytes:
    """The 16 bytes that bind a file's checksums to it: random, or CKPTFMT_FILE_ID (reproducible files)."""
    pinned = os.environ.get("CKPTFMT_FILE_ID")
    if pinned:
        try:
            fid = bytes.fromhex(pinned)
        except ValueError:
            fid = b""
        if len(fid) != 16:
            raise ValueError("CKPTFMT_FILE_ID must be 32 hex digits")
        return fid
    return secrets.token_bytes(16)


def _created() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    return format_utc(utc_at(int(epoch)) if epoch else utc_now())


def _library_version(name: str) -> str | None:
    """The version of torch or numpy, read without importing it where it is not imported (a
    commit record signed by `ckptfmt sign` builds no tensor); None where it is not installed."""
    module = sys.modules.get(name)
    if module is not None:
        return str(module.__version__)
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def producer_info() -> dict[str, str]:
    info = {
        "ckptfmt": __version__,
        "format": f"{fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR}",
        "python": platform.python_version(),
    }
    for name in ("torch", "numpy"):
        version = _library_version(name)
        if version is not None:
            info[name] = version
    info["created"] = _created()
    return info


def storage_bytes(plan: StoragePlan) -> memoryview:
    """A byte view of a storage's memory on the CPU (a copy only for device storages)."""
    src = plan.source
    if isinstance(src, bytes):  # an array as its stored bytes (format/arrays.py): no numpy
        return memoryview(src)
    import numpy as np

    from . import bytesview

    if isinstance(src, np.ndarray):
        return bytesview.array_bytes(src)
    flat = bytesview.storage_as_uint8(src)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return bytesview.tensor_bytes(flat)


class ChunkEncoder:
    """Turns one chunk of raw bytes into its stored form: (codec, filter, width, payload).

    Compression uses the C engine's zstd when the engine is built, so both
    paths write identical bytes; without it, the zstandard package.
    """

    def __init__(self, options: WriteOptions) -> None:
        self.compress: Any = None
        if options.compression == "zstd":
            level = options.level
            if _native.built():
                lvl = _native.FAST_PROFILE if level is None else level
                self.compress = lambda data: _native.zstd_compress(data, lvl)
            else:
                self.compress = _zstandard_compressor(level).compress

    def encode(self, raw: memoryview, width: int) -> tuple[int, int, int, Any]:
        if self.compress is None or not len(raw):
            return fmt.CODEC_RAW, fmt.FILTER_NONE, 0, raw
        shuffle = width > 1 and len(raw) % width == 0
        if shuffle:
            import numpy as np

            packed = self.compress(np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).T.tobytes())
        else:
            packed = self.compress(raw)
        if len(packed) >= len(raw):
            return fmt.CODEC_RAW, fmt.FILTER_NONE, 0, raw
        if shuffle:
            return fmt.CODEC_ZSTD, fmt.FILTER_SHUFFLE, width, packed
        return fmt.CODEC_ZSTD, fmt.FILTER_NONE, 0, packed


def _zstandard_compressor(level: int | None) -> zstandard.ZstdCompressor:
    """The zstandard package with the engine's parameters (used where the engine is not built);
    without a level, format.ZSTD_FAST_PROFILE.  Imported here: a save through the engine
    never needs it, and a process's first save pays every import on its path."""
    import zstandard

    if level is None:
        profile = fmt.ZSTD_FAST_PROFILE
        params = zstandard.ZstdCompressionParameters.from_level(
            profile["level"],
            strategy=zstandard.STRATEGY_FAST,
            min_match=profile["min_match"],
            hash_log=profile["hash_log"],
            write_content_size=True,
            write_checksum=False,
        )
        return zstandard.ZstdCompressor(compression_params=params)
    return zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


#: device storages are copied to the host this many bytes at a time (blocking saves)
HOST_BATCH_BYTES = 256 << 20


def _write_chunks_python(
    fd: int,
    file_id: bytes,
    first_index: int,
    pos: int,
    pieces: list[tuple[memoryview, int]],
    coder: ChunkEncoder,
    digests_out: list[bytes] | None = None,
    sha_out: list[bytes] | None = None,
    key: bytes | None = None,
    tags_out: list[bytes] | None = None,
) -> tuple[list[ChunkRecord], int]:
    out: list[ChunkRecord] = []
    for i, (raw, width) in enumerate(pieces):
        if digests_out is not None:
            digests_out.append(fmt.content_digest(raw))
        codec, filt, fwidth, payload = coder.encode(raw, width)
        stored_len = len(payload)
        if key is not None and tags_out is not None:  # encrypted after compression (spec 17.3)
            payload, tag = encryption.seal_chunk(
                key, file_id, first_index + i, pos, len(raw), codec, filt, fwidth, payload
            )
            tags_out.append(tag)
        seed = fmt.chunk_seed(file_id, first_index + i, pos, stored_len, len(raw), codec, filt, fwidth)
        check = xxhash.xxh3_64_intdigest(payload, seed=seed)
        if sha_out is not None:
            sha_out.append(
                signing.chunk_digest(
                    file_id, first_index + i, pos, stored_len, len(raw), codec, filt, fwidth, payload
                )
            )
        _pwrite_all(fd, payload, pos)
        out.append((pos, stored_len, len(raw), codec, filt, fwidth, check))
        pos = fmt.align_up(pos + stored_len)
    return out, pos


def storage_chunks(plan: StoragePlan, chunk_size: int) -> list[tuple[memoryview, int]]:
    """A storage's chunks in file order: (bytes, shuffle width) each."""
    data = storage_bytes(plan)
    return [(data[start : start + chunk_size], plan.width) for start in range(0, plan.nbytes, chunk_size)]


def _grouped(pieces: Iterable[tuple[memoryview, int]], least: int) -> Iterator[list[tuple[memoryview, int]]]:
    """`pieces` in order, in lists of at least `least` bytes (the last one shorter)."""
    group: list[tuple[memoryview, int]] = []
    held = 0
    for piece in pieces:
        group.append(piece)
        held += len(piece[0])
        if held >= least:
            yield group
            group, held = [], 0
    if group:
        yield group


def _batches(
    encoded: Encoded, chunk_size: int, batch_bytes: int = HOST_BATCH_BYTES
) -> Iterator[list[tuple[memoryview, int]]]:
    """Chunk views in file order, grouped so that device copies (and what an object upload
    holds in its spool) stay bounded."""
    pieces = (piece for plan in encoded.storages for piece in storage_chunks(plan, chunk_size))
    return _grouped(pieces, batch_bytes)


#: a writer told what is written (an object upload's) is told after about this many bytes of
#: chunks, however large its batches: an upload's default part, so that each part goes as soon
#: as its bytes are in the spool, while the next are written (where one engine thread writes:
#: written_step)
WRITTEN_STEP_BYTES = 16 << 20


def written_step(write_threads: int, chunk_size: int) -> int:
    """Bytes of chunks between two reports to a ChunkWriter's on_written: WRITTEN_STEP_BYTES
    where one engine thread writes (a plain save into a memfd spool: its engine calls cost
    nothing to split); else at least two chunks per writer thread, since each engine call
    drains its thread pool at the end (128 MiB of zstd in 16 MiB runs on 2 threads: 207 ->
    257 ms)."""
    if write_threads == 1:
        return WRITTEN_STEP_BYTES
    return max(WRITTEN_STEP_BYTES, 2 * write_threads * chunk_size)


#: filesystems on which writes to one file run one at a time (the inode lock is held while
#: each write allocates and fills its pages): a second writer thread only waits or spins
#: on the lock, and on a busy machine each thread also waits for a CPU of its own
ONE_WRITER_FILESYSTEMS = frozenset({"tmpfs"})


def write_threads(fd: int, options: WriteOptions) -> int:
    """Engine threads to write chunks to `fd` with: one where the chunks are stored as they
    are (no compression, encryption or signature: the checksum alone, hashed in cache just
    before each piece is written) to a file on tmpfs, whose writes run one at a time anyway;
    else the engine's default.  CKPTFMT_THREADS, when set, is always obeyed.

    Measured (bench/README.md, "Durable saves"): on a loaded 2-core machine a 1 GiB save to
    tmpfs with two threads waited 0.41 s for a CPU against 0.07 s with one, and took 0.69 s
    against 0.48 s.  An object upload's spool, a memfd, is the same shared memory: 64 MiB
    written into one took 30-34 ms with one thread or two, and twice the CPU with two
    (docs/object-stores.md, "Where a save's time goes"), CPU its upload threads and a local
    store server then wait for."""
    threads = _native.default_threads()
    if threads == 1 or not _plain(options) or _native.threads_set():
        return threads
    one_writer = filesystem_type(fd) in ONE_WRITER_FILESYSTEMS or is_memfd(fd)
    return 1 if one_writer else threads


def _plain(options: WriteOptions) -> bool:
    """Whether chunks are stored as they are: no compression, encryption or signature."""
    return options.compression is None and options.seal is None and options.sign is None


def chunks_end(encoded: Encoded, chunk_size: int) -> int:
    """Where the index of a file whose chunks are all stored raw begins: the end of its chunks."""
    end = fmt.PROLOGUE_SIZE
    for plan in encoded.storages:
        whole, rest = divmod(plan.nbytes, chunk_size)
        end += whole * fmt.align_up(chunk_size) + (fmt.align_up(rest) if rest else 0)
    return end


def huge_pages_for(fd: int, encoded: Encoded, options: WriteOptions, engine: str) -> int:
    """Give a new file on tmpfs 2 MiB pages for its chunks before they are written, where
    hostmem.wants_huge_file says so: the 2 MiB regions collapsed (0 where none).

    Where the mount gives none, a tmpfs write allocates, charges and adds to the page cache
    each 4 KiB page under the file's lock, for safetensors and dd too; into 2 MiB pages a
    write only copies (bench/README.md, "Durable saves").  Only plain raw chunks (the end of
    the chunks known before any is written, one writer thread) and no memfd (an upload's
    spool is sparse and sent part by part)."""
    global _kernel_collapses
    if not _kernel_collapses or engine != "c" or not _plain(options) or options.dedup is not None:
        return 0
    if filesystem_type(fd) != "tmpfs" or is_memfd(fd):
        return 0
    end = chunks_end(encoded, options.chunk_size)
    if not hostmem.wants_huge_file(end):  # last: it counts the free blocks as taken
        return 0
    regions, err = _native.huge_file(fd, end)  # what was refused keeps small pages: same bytes
    if err == errno.EINVAL:  # no MADV_COLLAPSE for tmpfs (before Linux 6.1, THP `deny`): not again
        _kernel_collapses = False
    return regions


#: False once the kernel refused MADV_COLLAPSE on a tmpfs file as unsupported (its answer for
#: this process; a forked child's kernel is the same)
_kernel_collapses = True


class ChunkWriter:
    """Writes batches of chunk views as the next chunks of one file, on the C engine or in Python.

    Both the blocking save and the background writer go through here, so an
    incremental save (a `dedup`) works the same on every path: its external
    records take no space, and each run of local chunks between them is written
    with the chunk number and offset it has in the file.
    """

    def __init__(
        self,
        fd: int,
        file_id: bytes,
        options: WriteOptions,
        *,
        engine: str | None = None,
        threads: int | None = None,
        path: str = "",
        on_written: Callable[[int], None] | None = None,
    ) -> None:
        """`on_written(pos)`: told, every WRITTEN_STEP_BYTES of a batch and at its end, that
        every byte below `pos` is written (an object upload sends the parts that are complete)."""
        self.fd = fd
        self.on_written = on_written
        self.file_id = file_id
        self.options = options
        self.engine = engine or ("c" if _native.available() else "python")
        #: threads that hash (an incremental save's search for chunks it can refer to)
        self.threads = threads or _native.default_threads()
        #: threads of each engine call that writes chunks (write_threads)
        self.write_threads = threads or write_threads(fd, options)
        #: bytes of chunks written between two reports to on_written
        self.written_step = written_step(self.write_threads, options.chunk_size)
        self.path = path
        self.dedup = options.dedup
        self.coder = ChunkEncoder(options)
        self.chunks: list[ChunkRecord] = []
        self.pos = fmt.PROLOGUE_SIZE  # where the next local chunk starts
        #: signed files (spec section 16): each chunk's SHA-256, taken as it is written
        self.shas: list[bytes] | None = [] if options.sign is not None else None
        #: encrypted files (spec section 17): each chunk's GCM tag as written
        self.tags: list[bytes] | None = [] if options.seal is not None else None

    def write(self, pieces: list[tuple[memoryview, int]]) -> None:
        if self.on_written is None:
            self._write(pieces)
            return
        for run in _grouped(pieces, self.written_step):
            self._write(run)
            self.on_written(self.pos)

    def _write(self, pieces: list[tuple[memoryview, int]]) -> None:
        if self.dedup is None:
            self._write_run(pieces)
            return
        if not self.dedup.can_refer:  # one pass: each chunk's digest is taken as it is written
            first = len(self.chunks)
            digests: list[bytes] = []
            self._write_run(pieces, digests)
            self.dedup.written(first, digests)
            return
        found = self.dedup.classify(len(self.chunks), pieces, self.engine, self.threads)
        i = 0
        while i < len(pieces):
            held = found[i]
            if held is not None:  # an external record: no bytes, no offset here
                self.chunks.append(held)
                if self.tags is not None:  # its tag is in the file that holds it (spec 17.9)
                    self.tags.append(bytes(encryption.TAG_SIZE))
                i += 1
                continue
            j = i
            while j < len(pieces) and found[j] is None:
                j += 1
            self._write_run(pieces[i:j])
            i = j

    def _write_run(self, pieces: list[tuple[memoryview, int]], digests: list[bytes] | None = None) -> None:
        if self.engine == "c":
            records, self.pos = _native.write_chunks(
                self.fd,
                self.file_id,
                len(self.chunks),
                self.pos,
                pieces,
                self.options,
                self.write_threads,
                self.path,
                digests_out=digests,
                sha_out=self.shas,
                tags_out=self.tags,
            )
        else:
            records, self.pos = _write_chunks_python(
                self.fd,
                self.file_id,
                len(self.chunks),
                self.pos,
                pieces,
                self.coder,
                digests,
                self.shas,
                self.options.key,
                self.tags,
            )
        self.chunks.extend(records)

    def finish(self, encoded: Encoded) -> int:
        """Write the index, the footer and the prologue after the chunks written so far; the
        file's length."""
        return finish_file(
            self.fd, self.file_id, encoded, self.chunks, self.pos, self.options, self.shas, self.tags
        )


def build_file(
    fd: int,
    encoded: Encoded,
    options: WriteOptions,
    *,
    engine: str | None = None,
    threads: int | None = None,
    path: str = "",
    on_written: Callable[[int], None] | None = None,
    batch_bytes: int = HOST_BATCH_BYTES,
) -> int:
    """Write a whole ckptfmt file to `fd` (at offset 0) as `options` say; return its length.
    Signed (options.sign, spec section 16): chunk digests taken as the chunks are written.
    Encrypted (options.seal, section 17): chunks encrypted as they are written.
    `on_written`, `batch_bytes`: see ChunkWriter and _batches (object uploads)."""
    size = options.chunk_size
    if size & (size - 1) or not fmt.MIN_CHUNK_SIZE <= size <= fmt.MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be a power of two in [{fmt.MIN_CHUNK_SIZE}, {fmt.MAX_CHUNK_SIZE}]")
    out = ChunkWriter(
        fd, new_file_id(), options, engine=engine, threads=threads, path=path, on_written=on_written
    )
    huge_pages_for(fd, encoded, options, out.engine)
    for pieces in _batches(encoded, size, batch_bytes):
        out.write(pieces)
    return out.finish(encoded)


def finish_file(
    fd: int,
    file_id: bytes,
    encoded: Encoded,
    chunks: list[ChunkRecord],
    pos: int,
    options: WriteOptions,
    shas: list[bytes] | None = None,
    tags: list[bytes] | None = None,
) -> int:
    """Write the index, the footer and, last, the prologue; signed (options.sign, each chunk's
    SHA-256 in `shas`), the signature block between the index and the footer; encrypted
    (options.seal, each chunk's GCM tag in `tags`) the encryption block there, the index sealed."""
    dedup = options.dedup
    index: dict[str, Any] = {
        "chunk_size": options.chunk_size,
        "producer": producer_info(),
        "source_devices": encoded.devices,
        "metadata": dict(options.metadata),
        "storages": [[p.nbytes, p.device] for p in encoded.storages],
    }
    if dedup is None:
        index["chunks"] = [[o, s, r, c, f, w, f"{h:016x}"] for o, s, r, c, f, w, h in chunks]
    else:  # spec section 12: the externals list comes before the records that name it
        index["externals"] = dedup.externals()
        index["chunks"] = [dedup.record(k, rec) for k, rec in enumerate(chunks)]
    index["nodes"] = encoded.nodes
    blob = json.dumps(index, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    if len(blob) > fmt.Limits.MAX_INDEX_BYTES:
        raise LimitError(
            f"the index would be {len(blob)} bytes, above the limit {fmt.Limits.MAX_INDEX_BYTES}"
        )
    required = fmt.FEATURE_EXTERNAL if dedup is not None else 0
    return write_tail(fd, file_id, pos, blob, required, options.sign, shas, options.seal, tags)


def write_tail(
    fd: int,
    file_id: bytes,
    index_offset: int,
    blob: bytes,
    required: int,
    sign: Signer | None = None,
    shas: list[bytes] | None = None,
    seal: encryption.Sealer | None = None,
    tags: list[bytes] | None = None,
) -> int:
    """Write the index `blob` at `index_offset`, the encryption block (with `seal`, the index
    sealed) and the signature block (with `sign`, after the encryption block when both: the
    file is encrypted, then signed, spec 17.8), the footer and, last, the prologue; truncate
    the file to its length and return it."""
    block = b""
    if seal is not None:
        assert tags is not None
        blob, block = seal.seal(file_id, index_offset, blob, b"".join(tags))
        required |= fmt.FEATURE_ENCRYPTED
    return write_signed_tail(fd, file_id, index_offset, blob, required, block, sign, shas)


def write_signed_tail(
    fd: int,
    file_id: bytes,
    index_offset: int,
    blob: bytes,
    required: int,
    enc_block: bytes,
    sign: Signer | None,
    shas: list[bytes] | None,
) -> int:
    """write_tail once the index is as stored and the encryption block (of an encrypted file,
    else b"") made: the signature block, the footer and the prologue."""
    index_end = fmt.align_up(index_offset + len(blob))
    block = enc_block
    block_len = len(enc_block)
    if sign is not None:
        assert shas is not None
        block_len += signing.block_length(len(shas))
        required |= fmt.FEATURE_SIGNED
    footer_offset = index_end + block_len
    footer = fmt.Footer(
        index_offset, len(blob), fmt.index_checksum(file_id, index_offset, blob), file_id, block_len
    )
    length = footer_offset + fmt.FOOTER_SIZE
    prologue = fmt.Prologue(fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR, file_id, length, required, 0)
    if sign is not None:
        assert shas is not None
        enc_sha256 = hashlib.sha256(enc_block).digest() if enc_block else b""
        block += sign(
            prologue.pack(), footer.pack(), hashlib.sha256(blob).digest(), b"".join(shas), enc_sha256
        )
        assert len(block) == block_len
    # the zero padding between the index and the block or footer is written explicitly
    _pwrite_all(fd, blob + bytes(index_end - index_offset - len(blob)) + block + footer.pack(), index_offset)
    _pwrite_all(fd, prologue.pack(), 0)
    os.ftruncate(fd, length)
    return length
