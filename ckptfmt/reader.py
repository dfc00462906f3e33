"""Reading ckptfmt files: structure checks, the index, verified chunk reads.

This is the reference reader.  It reads each chunk with one ``preadv`` straight
into the destination storage (raw chunks) or into a reused scratch buffer
(compressed chunks), checks the chunk's context-bound checksum and the zero
padding behind it, and decodes into the destination.  Every number taken from
the file is validated before use; every failure is a CheckpointError that
names the path, key, chunk and offset.

Files with required feature bit 0 (spec section 12) may hold *external* chunks:
records that name a chunk of an earlier file.  Those are read from that file,
opened on first use (a bounded set of descriptors stays open), and verified
with that file's checksum context; their errors name both files.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import functools
import json
import mmap
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from . import _native, bytesview, devices, hostmem, tree
from . import format as fmt
from .errors import CheckpointError, CorruptError, IncompleteError, LimitError, UnsupportedError
from .format import Limits

_INDEX_FIELDS = ("chunk_size", "producer", "source_devices", "metadata", "storages", "chunks", "nodes")
#: with required feature bit 0 the index also lists the files its external chunks lie in
_INDEX_FIELDS_EXTERNAL = (*_INDEX_FIELDS[:5], "externals", *_INDEX_FIELDS[5:])
_HEX16 = frozenset("0123456789abcdef")
#: referenced files kept open at once by one reader (least recently used are closed)
MAX_OPEN_EXTERNALS = 16
_DIGEST_MISMATCH = "content digest mismatch (the decoded bytes are not the ones the index describes)"
#: zstd window limit: frames needing more memory than this are rejected (2**27 = 128 MiB)
_ZSTD_MAX_WINDOW = 1 << 27
#: the magic number of a zstd frame (RFC 8878); legacy (pre-1.0) and skippable frames differ
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# the messages both engines give for a zstd frame the format refuses (spec section 3)
_NOT_A_FRAME = "not a zstd frame (legacy, skippable or unknown magic number)"


def _window_msg(window: int) -> str:
    return f"zstd frame needs a window of {window} bytes, above the limit {_ZSTD_MAX_WINDOW}"


def _dict_msg(dict_id: int) -> str:
    return f"zstd frame needs dictionary {dict_id}; the format uses none"


def open_regular(path: str) -> int:
    """A read-only descriptor of `path`, which must be a regular file.

    Opened with O_NONBLOCK so that a FIFO (or a device) at that path cannot block the
    open; the flag is cleared once fstat shows a regular file.  UnsupportedError otherwise.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsupportedError("not a regular file", path=path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _force_staging() -> bool:
    """CKPTFMT_FORCE_STAGING=1 routes CPU loads through the staged device path (tests use it without a GPU)."""
    return bool(os.environ.get("CKPTFMT_FORCE_STAGING"))


def staging_budget() -> int:
    """Host bytes a load onto an accelerator may stage at once (the staging pool's limit)."""
    from .staging import POOL

    return POOL.limit


@dataclass(frozen=True, slots=True)
class Chunk:
    offset: int
    stored_len: int
    raw_len: int
    codec: int
    filter: int
    width: int
    checksum: int
    pad: int  # zero bytes after the chunk, up to the next chunk or the index
    digest: bytes = b""  # XXH3-128 of the raw bytes (feature bit 0), canonical order
    source: int = -1  # -1: in this file; else the entry of `externals` whose file holds it
    number: int = -1  # for an external chunk: its chunk number in that file


@dataclass(frozen=True, slots=True)
class External:
    """An entry of the index's `externals` (section 12): a file external chunks lie in."""

    rel: str  # the reference path, as recorded
    file_id: bytes
    length: int
    path: str  # rel joined to the referencing file's directory: what is opened

    @property
    def name(self) -> str:
        """The path as messages show it (".." resolved by name)."""
        return os.path.normpath(self.path)


def _is_hex(v: object, digits: int) -> bool:
    return type(v) is str and len(v) == digits and _HEX16.issuperset(v)


def _parse_int(text: str) -> int:
    if len(text) > 20:
        raise ValueError("integer literal too long")
    return int(text)


def _reject_float(text: str) -> Any:
    raise ValueError(f"floating-point literal {text[:20]!r} is not allowed in the index")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate field {k[:40]!r}")
        out[k] = v
    return out


def parse_index_json(raw: bytes, path: str, fields: tuple[str, ...] = _INDEX_FIELDS) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
        obj = json.loads(
            text,
            object_pairs_hook=_pairs,
            parse_int=_parse_int,
            parse_float=_reject_float,
            parse_constant=_reject_float,
        )
    except UnicodeDecodeError as e:
        raise CorruptError(f"index is not valid UTF-8 (byte {e.start})", path=path) from e
    except RecursionError as e:
        raise LimitError("index JSON is nested too deeply", path=path) from e
    except ValueError as e:
        raise CorruptError(f"index is not valid JSON: {str(e)[:200]}", path=path) from e
    if type(obj) is not dict or set(obj) != set(fields):
        raise CorruptError("index must be an object with exactly the fields " + ", ".join(fields), path=path)
    return obj


def _str_map(c: tree._Check, v: object, what: str, cap: int) -> dict[str, str]:
    if type(v) is not dict:
        raise c.fail(f"{what} is not an object")
    if len(v) > cap:
        raise c.fail(f"{what} has {len(v)} entries, above the limit {cap}", limit=True)
    for k, s in v.items():
        c.str_(s, f"{what}[{k[:40]!r}]")
    return dict(v)


class CheckpointFile:
    """An open ckptfmt file with its validated index.

    `max_bytes` bounds the memory this reader allocates for the index (estimated before
    it is parsed, fmt.index_memory_bound) and, per load, for the storages it reads and
    their decode buffers: LimitError before anything above it is allocated.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int | None = None) -> None:
        self.path = os.fspath(path)
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
            raise ValueError(f"max_bytes must be None or a non-negative int, not {max_bytes!r}")
        self.max_bytes = max_bytes
        #: what the index may take while it is parsed and held (an upper bound)
        self.index_memory = 0
        self._fd = open_regular(self.path)
        try:
            self._parse()
        except BaseException:
            os.close(self._fd)
            raise
        self._scratch = bytearray()
        self._mm: mmap.mmap | None = None
        # referenced files: open ones (fd, end of data section), most recently used last,
        # and those that could not be used (error class and reason, reported again per chunk)
        self._ext_open: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._ext_failed: dict[int, tuple[type[CheckpointError], str]] = {}

    # -- structure ----------------------------------------------------------

    def _charge_index(self, nbytes: int) -> None:
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise LimitError(
                f"reading the index needs up to {nbytes} bytes of memory, above max_bytes={self.max_bytes}",
                path=self.path,
                offset=self.footer.index_offset,
            )
        self.index_memory = nbytes

    def _read(self, offset: int, n: int) -> bytes:
        return _pread_exact(self._fd, offset, n)

    def _parse(self) -> None:
        path = self.path
        size = os.fstat(self._fd).st_size
        self.prologue = fmt.parse_prologue(self._read(0, fmt.PROLOGUE_SIZE), size, path)
        length = self.prologue.file_length
        self.footer = fmt.parse_footer(
            self._read(length - fmt.FOOTER_SIZE, fmt.FOOTER_SIZE), self.prologue, path
        )
        ioff, ilen = self.footer.index_offset, self.footer.index_length
        self._charge_index(length - fmt.FOOTER_SIZE - ioff)  # the raw bytes, before they are read
        raw = self._read(ioff, ilen)
        padding = self._read(ioff + ilen, length - fmt.FOOTER_SIZE - ioff - ilen)
        if len(raw) + len(padding) != length - fmt.FOOTER_SIZE - ioff:
            raise IncompleteError("file shrank while its index was read", path=path, offset=ioff)
        if fmt.index_checksum(self.prologue.file_id, ioff, raw) != self.footer.index_checksum:
            raise CorruptError("index checksum mismatch", path=path, offset=ioff)
        if any(padding):
            raise CorruptError("padding after the index is not zero", path=path, offset=ioff + ilen)
        self._charge_index(fmt.index_memory_bound(raw))  # before json builds anything
        external = bool(self.prologue.required_features & fmt.FEATURE_EXTERNAL)
        index = parse_index_json(raw, path, _INDEX_FIELDS_EXTERNAL if external else _INDEX_FIELDS)
        del raw
        c = tree._Check(path)
        self.chunk_size = c.bounded_int(index["chunk_size"], "chunk_size", fmt.MAX_CHUNK_SIZE)
        if self.chunk_size < fmt.MIN_CHUNK_SIZE or self.chunk_size & (self.chunk_size - 1):
            raise CorruptError(f"index: chunk_size {self.chunk_size} is not a power of two", path=path)
        self.producer = _str_map(c, index["producer"], "producer", 64)
        self.metadata = _str_map(c, index["metadata"], "metadata", Limits.MAX_METADATA_ENTRIES)
        self.source_devices = [
            c.str_(d, "source_devices entry") for d in c.list_(index["source_devices"], "source_devices")
        ]
        self.storages = self._parse_storages(c, index["storages"])
        self.has_digests = external
        self.externals = self._parse_externals(c, index["externals"]) if external else []
        # the JSON records are dropped as soon as they are parsed: they cost more than the Chunks
        self.chunks = self._parse_chunks(c, index.pop("chunks"))
        self.tree = tree.validate_tree(index.pop("nodes"), self.storages, path)

    def _parse_storages(self, c: tree._Check, raw: object) -> list[tree.StorageRecord]:
        items = c.list_(raw, "storages")
        if len(items) > Limits.MAX_STORAGES:
            raise c.fail(f"{len(items)} storages exceed the limit {Limits.MAX_STORAGES}", limit=True)
        out = []
        first = 0
        for sid, item in enumerate(items):
            if type(item) is not list or len(item) != 2:
                raise c.fail(f"storage {sid} is not a [nbytes, device] pair")
            nbytes = c.bounded_int(item[0], f"storage {sid} size", Limits.MAX_STORAGE_BYTES)
            device = c.str_(item[1], f"storage {sid} device")
            if not devices.valid_location(device):
                raise c.fail(f"storage {sid} has invalid device {device[:40]!r}")
            n = -(-nbytes // self.chunk_size)
            out.append(tree.StorageRecord(nbytes, device, first, n))
            first += n
        self._n_chunks_expected = first
        return out

    def _parse_externals(self, c: tree._Check, raw: object) -> list[External]:
        """The `externals` member (section 12): reference paths, file ids and lengths."""
        items = c.list_(raw, "externals")
        if len(items) > Limits.MAX_EXTERNALS:
            raise c.fail(f"{len(items)} externals exceed the limit {Limits.MAX_EXTERNALS}", limit=True)
        here = os.path.dirname(self.path)
        out: list[External] = []
        seen_paths: set[str] = set()
        seen_ids: set[bytes] = {self.prologue.file_id}
        for e, item in enumerate(items):
            if type(item) is not list or len(item) != 3:
                raise c.fail(f"external {e} is not a [path, file id, length] record")
            rel = c.str_(item[0], f"external {e} path")
            if fmt.REF_PATH_RE.fullmatch(rel) is None:
                raise c.fail(f"external {e} has the path {rel[:80]!r}, which is not a permitted reference")
            if not _is_hex(item[1], 32):
                raise c.fail(f"external {e} file id must be 32 lowercase hex digits")
            fid = bytes.fromhex(item[1])
            length = c.int_(item[2], f"external {e} file length", 2 * fmt.ALIGNMENT, (1 << 63) - 1)
            if length % fmt.ALIGNMENT:
                raise c.fail(f"external {e} file length {length} is not a multiple of {fmt.ALIGNMENT}")
            if rel in seen_paths or fid in seen_ids:
                raise c.fail(f"external {e} repeats a path or file id (or names this file itself)")
            seen_paths.add(rel)
            seen_ids.add(fid)
            out.append(External(rel, fid, length, os.path.join(here, rel)))
        return out

    def _parse_chunks(self, c: tree._Check, raw: object) -> list[Chunk]:
        items = c.list_(raw, "chunks")
        if len(items) > Limits.MAX_CHUNKS:
            raise c.fail(f"{len(items)} chunks exceed the limit {Limits.MAX_CHUNKS}", limit=True)
        if len(items) != self._n_chunks_expected:
            raise c.fail(f"{len(items)} chunks listed, the storages need {self._n_chunks_expected}")
        # raw length of every chunk follows from the storage sizes and the chunk size
        raw_lens = []
        for rec in self.storages:
            for k in range(rec.n_chunks):
                raw_lens.append(min(self.chunk_size, rec.nbytes - k * self.chunk_size))
        # 7 fields; with content digests (bit 0) 8 for a local chunk, 10 for an external one
        sizes = (8, 10) if self.has_digests else (7,)
        out: list[Chunk] = []
        used = [False] * len(self.externals)
        expect = fmt.PROLOGUE_SIZE  # where the next local chunk must start
        end_of_data = self.footer.index_offset
        for k, item in enumerate(items):
            if type(item) is not list or len(item) not in sizes:
                raise c.fail(f"chunk {k} is not a record of " + " or ".join(map(str, sizes)) + " fields")
            where = f"chunk {k}"
            ch = self._parse_layout(c, k, item, raw_lens[k])
            if len(item) == 10:
                ch = self._parse_external_ref(c, k, item, ch)
                used[ch.source] = True
            else:
                c.int_(ch.offset, f"{where} offset", expect, expect)
                end = ch.offset + ch.stored_len
                if end > end_of_data:
                    raise CorruptError(
                        f"chunk ends at {end}, inside the index at {end_of_data}",
                        path=self.path,
                        chunk=k,
                        offset=ch.offset,
                    )
                expect = fmt.align_up(end)
            out.append(ch)
        if expect != end_of_data:
            raise CorruptError(
                f"data ends at {expect} but the index starts at {end_of_data}", path=self.path, offset=expect
            )
        if not all(used):
            raise c.fail(f"external {used.index(False)} is not used by any chunk")
        return self._with_padding(out, end_of_data)

    def _parse_layout(self, c: tree._Check, k: int, item: list[Any], raw_len: int) -> Chunk:
        """Fields 0-6 (and the digest, field 7, with bit 0): lengths, codec, filter, checksum."""
        off, slen, rlen, codec, filt, width, check = item[:7]
        where = f"chunk {k}"
        c.int_(off, f"{where} offset", 0, (1 << 63) - 1)
        c.int_(rlen, f"{where} raw length", raw_len, raw_len)
        c.int_(codec, f"{where} codec", 0, 255)
        c.int_(filt, f"{where} filter", 0, 255)
        c.int_(width, f"{where} filter width", 0, 255)
        if codec not in fmt.CODEC_NAMES:
            raise UnsupportedError(f"unknown codec id {codec}", path=self.path, chunk=k, offset=off)
        if filt not in fmt.FILTER_NAMES:
            raise UnsupportedError(f"unknown filter id {filt}", path=self.path, chunk=k, offset=off)
        if codec == fmt.CODEC_RAW:
            c.int_(slen, f"{where} stored length", rlen, rlen)
            if filt != fmt.FILTER_NONE:
                raise c.fail(f"{where} is raw but has a filter")
        else:
            c.int_(slen, f"{where} stored length", 1, rlen - 1)
            if rlen > slen * fmt.ZSTD_MAX_RATIO:
                raise c.fail(f"{where} claims {rlen} bytes from {slen}: more than any zstd frame holds")
        if filt == fmt.FILTER_NONE and width != 0:
            raise c.fail(f"{where} has a filter width without a filter")
        if filt == fmt.FILTER_SHUFFLE and (width not in fmt.SHUFFLE_WIDTHS or rlen % width):
            raise c.fail(f"{where} has shuffle width {width} for {rlen} bytes")
        if not _is_hex(check, 16):
            raise c.fail(f"{where} checksum must be 16 lowercase hex digits")
        digest = b""
        if self.has_digests:
            if not _is_hex(item[7], 32):
                raise c.fail(f"{where} content digest must be 32 lowercase hex digits")
            digest = bytes.fromhex(item[7])
        return Chunk(off, slen, rlen, codec, filt, width, int(check, 16), 0, digest)

    def _parse_external_ref(self, c: tree._Check, k: int, item: list[Any], ch: Chunk) -> Chunk:
        """Fields 8 and 9 of an external record: which file, which chunk of it."""
        where = f"chunk {k}"
        if not self.externals:
            raise c.fail(f"{where} is external but the file lists no externals")
        e = c.int_(item[8], f"{where} external", 0, len(self.externals) - 1)
        number = c.int_(item[9], f"{where} chunk number in the referenced file", 0, Limits.MAX_CHUNKS - 1)
        ext = self.externals[e]
        # the referenced file's data section ends at its index, at least 128 bytes before its end
        if ch.offset < fmt.PROLOGUE_SIZE or ch.offset % fmt.ALIGNMENT:
            raise c.fail(f"{where} is external at offset {ch.offset}, not a chunk position")
        if fmt.align_up(ch.offset + ch.stored_len) > ext.length - fmt.FOOTER_SIZE - fmt.ALIGNMENT:
            raise c.fail(f"{where} is external but lies past the data of {ext.rel} ({ext.length} bytes)")
        pad = fmt.align_up(ch.offset + ch.stored_len) - ch.offset - ch.stored_len
        return Chunk(
            ch.offset,
            ch.stored_len,
            ch.raw_len,
            ch.codec,
            ch.filter,
            ch.width,
            ch.checksum,
            pad,
            ch.digest,
            e,
            number,
        )

    @staticmethod
    def _with_padding(chunks: list[Chunk], end_of_data: int) -> list[Chunk]:
        """Local chunks: the padding reaches the next local chunk or the index."""
        nxt = end_of_data
        for k in range(len(chunks) - 1, -1, -1):
            ch = chunks[k]
            if ch.source >= 0:
                continue  # its padding was set from the placement rule of its own file
            chunks[k] = Chunk(
                ch.offset,
                ch.stored_len,
                ch.raw_len,
                ch.codec,
                ch.filter,
                ch.width,
                ch.checksum,
                nxt - ch.offset - ch.stored_len,
                ch.digest,
            )
            nxt = ch.offset
        return chunks

    # -- data ---------------------------------------------------------------

    def close(self) -> None:
        self._mm = None  # tensors made from the mapping keep it alive
        while self._ext_open:
            os.close(self._ext_open.popitem()[1][0])
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chunk_keys(self) -> list[str]:
        """The key path of the first tensor using each chunk (renders every path: for tests and
        tools; the reader itself names a chunk's key only in an error, with key_of)."""
        return [rec.key for rec in self.storages for _ in range(rec.n_chunks)]

    def key_of(self, k: int) -> str:
        """The key path of the first tensor using chunk k, rendered now (at most tree.PATH_CHARS)."""
        firsts = self._first_chunks
        return self.storages[bisect.bisect_right(firsts, k) - 1].key

    @functools.cached_property
    def _first_chunks(self) -> list[int]:
        return [rec.first_chunk for rec in self.storages]

    # -- referenced files (feature bit 0) -------------------------------------

    def _error(
        self, cls: type[CheckpointError], msg: str, k: int, key: str | None, offset: int | None
    ) -> CheckpointError:
        """An error about chunk k; for an external chunk the message names the file it lies in.
        `key` None: the key path of the chunk's storage, rendered now."""
        ch = self.chunks[k]
        if key is None:
            key = self.key_of(k)
        if ch.source < 0:
            return cls(msg, path=self.path, key=key, chunk=k, offset=offset)
        ext = self.externals[ch.source]
        return cls(
            f"external chunk {ch.number} at offset {offset} of {ext.name}: {msg}",
            path=self.path,
            key=key,
            chunk=k,
        )

    def _open_external(self, e: int) -> tuple[int, int]:
        """Open referenced file e and check it is the file recorded; (fd, end of its data section)."""
        ext = self.externals[e]
        what = f"referenced file {ext.name} (external {e})"
        try:
            # O_NONBLOCK: a FIFO at that path must not hang the open (it is rejected below)
            fd = os.open(ext.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise IncompleteError(f"{what} is missing", path=self.path) from None
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise CorruptError(f"{what} is a symbolic link", path=self.path) from None
            raise OSError(err.errno, f"{err.strerror} (a file {self.path} refers to)", ext.name) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptError(f"{what} is not a regular file", path=self.path)
            try:
                pro = fmt.parse_prologue(_pread_exact(fd, 0, fmt.PROLOGUE_SIZE), st.st_size, ext.name)
                foot = fmt.parse_footer(
                    _pread_exact(fd, pro.file_length - fmt.FOOTER_SIZE, fmt.FOOTER_SIZE), pro, ext.name
                )
            except CheckpointError as inner:
                cls = IncompleteError if isinstance(inner, IncompleteError) else CorruptError
                raise cls(f"{what} is unusable: {inner}", path=self.path) from inner
            if pro.file_id != ext.file_id:
                raise CorruptError(
                    f"{what} has file id {pro.file_id.hex()}, the reference records {ext.file_id.hex()} "
                    "(another file lies at that path now)",
                    path=self.path,
                )
            if pro.file_length != ext.length:
                raise CorruptError(
                    f"{what} is {pro.file_length} bytes, the reference records {ext.length}", path=self.path
                )
        except BaseException:
            os.close(fd)
            raise
        return fd, foot.index_offset

    def _external(self, e: int, k: int, key: str | None) -> tuple[int, int]:
        """(fd, end of data section) of referenced file e, opened and checked on first use."""
        got = self._ext_open.get(e)
        if got is not None:
            self._ext_open.move_to_end(e)
            return got
        if e in self._ext_failed:
            cls, reason = self._ext_failed[e]
            raise cls(reason, path=self.path, key=self.key_of(k) if key is None else key, chunk=k)
        try:
            got = self._open_external(e)
        except CheckpointError as err:
            self._ext_failed[e] = (type(err), err.reason)
            raise type(err)(
                err.reason, path=self.path, key=self.key_of(k) if key is None else key, chunk=k
            ) from err
        if len(self._ext_open) >= MAX_OPEN_EXTERNALS:
            os.close(self._ext_open.popitem(last=False)[1][0])
        self._ext_open[e] = got
        return got

    def _source(self, k: int, key: str | None) -> tuple[int, bytes, int]:
        """Where chunk k's stored bytes are: (fd, that file's id, the chunk's number in it)."""
        ch = self.chunks[k]
        if ch.source < 0:
            return self._fd, self.prologue.file_id, k
        fd, data_end = self._external(ch.source, k, key)
        if ch.offset + ch.stored_len + ch.pad > data_end:
            raise self._error(
                CorruptError,
                f"lies outside that file's data section [64, {data_end})",
                k,
                key,
                ch.offset,
            )
        return fd, self.externals[ch.source].file_id, ch.number

    def external_problem(self, k: int) -> Exception | None:
        """Why external chunk k cannot be read (its file missing, replaced, damaged, or the chunk
        outside that file's data), or None; reads no chunk data."""
        try:
            self._source(k, None)
        except (CheckpointError, OSError) as err:
            return err
        return None

    def external_problems(self) -> list[CheckpointError]:
        """Every referenced file that cannot be used, and every external chunk outside its file's data
        (one error per file); no chunk data is read."""
        problems: list[CheckpointError] = []
        unusable: set[int] = set()
        for k, ch in enumerate(self.chunks):
            if ch.source < 0 or ch.source in unusable:
                continue
            try:
                self._source(k, None)
            except CheckpointError as err:
                problems.append(err)
                if ch.source in self._ext_failed:
                    unusable.add(ch.source)  # reported once, not once per chunk
        return problems

    # -- data ---------------------------------------------------------------

    def _readv(self, fd: int, bufs: list[memoryview], offset: int, k: int, key: str | None) -> None:
        """Fill `bufs` from `offset`; a file that ends first is incomplete."""
        got = 0
        for buf in bufs:
            view = buf
            while len(view):
                n = os.preadv(fd, [view], offset + got)
                if n == 0:
                    raise self._error(
                        IncompleteError,
                        "file ended while reading chunk (it shrank after it was opened)",
                        k,
                        key,
                        offset + got,
                    )
                view = view[n:]
                got += n

    def read_chunk(self, k: int, dest: memoryview, verify: bool, key: str | None) -> None:
        """Read chunk k, check it, and leave its raw bytes in `dest` (exactly raw_len bytes)."""
        ch = self.chunks[k]
        fd, file_id, number = self._source(k, key)
        pad_need = ch.pad
        if ch.codec == fmt.CODEC_RAW:
            need = pad_need
        else:
            need = ch.stored_len + pad_need
        if len(self._scratch) < need:
            self._scratch = bytearray(need)
        scratch = memoryview(self._scratch)
        if ch.codec == fmt.CODEC_RAW:
            stored = dest
            self._readv(fd, [dest, scratch[:pad_need]], ch.offset, k, key)
            pad = scratch[:pad_need]
        else:
            self._readv(fd, [scratch[:need]], ch.offset, k, key)
            stored = scratch[: ch.stored_len]
            pad = scratch[ch.stored_len : need]
        if verify:
            seed = fmt.chunk_seed(
                file_id, number, ch.offset, ch.stored_len, ch.raw_len, ch.codec, ch.filter, ch.width
            )
            if xxhash.xxh3_64_intdigest(stored, seed=seed) != ch.checksum:
                raise self._error(CorruptError, "checksum mismatch", k, key, ch.offset)
        if any(pad):
            raise self._error(
                CorruptError, "padding after the chunk is not zero", k, key, ch.offset + ch.stored_len
            )
        if ch.codec == fmt.CODEC_ZSTD:
            self._decompress(k, ch, stored, dest, key)
        if verify and ch.digest and fmt.content_digest(dest) != ch.digest:
            raise self._error(CorruptError, _DIGEST_MISMATCH, k, key, ch.offset)

    def _decompress(self, k: int, ch: Chunk, stored: memoryview, dest: memoryview, key: str | None) -> None:
        def bad(msg: str) -> CheckpointError:
            return self._error(CorruptError, msg, k, key, ch.offset)

        # the frame header checks of the C engine (reader.c), in the same order and words
        if bytes(stored[:4]) != _ZSTD_MAGIC:
            raise bad(_NOT_A_FRAME)
        try:
            params = zstandard.get_frame_parameters(stored)
        except zstandard.ZstdError as e:
            raise bad("zstd data does not decode") from e
        if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
            raise bad("zstd frame does not declare its decoded size")
        if params.content_size != ch.raw_len:
            raise bad(f"zstd frame declares {params.content_size} bytes, the index {ch.raw_len}")
        if params.window_size > _ZSTD_MAX_WINDOW:
            raise bad(_window_msg(params.window_size))
        if params.dict_id:
            raise bad(_dict_msg(params.dict_id))
        try:
            # one-shot decoding: the buffer is exactly raw_len; a content checksum, if the
            # frame has one, is verified (as in C)
            dctx = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
            out = dctx.decompress(stored, max_output_size=ch.raw_len, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise bad("zstd data does not decode") from e
        if len(out) != ch.raw_len:
            raise bad(f"zstd data decodes to {len(out)} bytes, expected {ch.raw_len}")
        if ch.filter == fmt.FILTER_SHUFFLE:
            planes = np.frombuffer(out, dtype=np.uint8).reshape(ch.width, ch.raw_len // ch.width)
            np.frombuffer(dest, dtype=np.uint8).reshape(ch.raw_len // ch.width, ch.width)[...] = planes.T
        else:
            dest[:] = out

    # -- batched, parallel reads ---------------------------------------------

    def _alloc(self, nbytes: int, key: str, pinned: bool = False, *, sid: int | None = None) -> torch.Tensor:
        """`nbytes` of host memory; LimitError naming `key` (or storage `sid`'s key) if it fails."""
        try:
            return hostmem.empty_bytes(nbytes, pinned=pinned)
        except (RuntimeError, MemoryError) as e:
            raise LimitError(
                f"cannot allocate {nbytes} bytes for this storage: {str(e)[:100]}",
                path=self.path,
                key=key if sid is None else self.storages[sid].key,
            ) from e

    def read_into(self, items: list[tuple[int, memoryview]], verify: bool) -> None:
        """Read chunks into their destinations (exactly raw_len bytes each).

        With the C engine all chunks of one file are read in parallel, each verified
        and decoded straight into place; otherwise one by one on this thread.  Chunks
        are grouped by the file they lie in: this one, then each referenced file.
        """
        groups: dict[int, list[tuple[int, memoryview]]] = {}
        for k, dest in items:
            groups.setdefault(self.chunks[k].source, []).append((k, dest))
        for group in groups.values():
            self._read_group(group, verify)

    def _read_group(self, items: list[tuple[int, memoryview]], verify: bool) -> None:
        """Read chunks that all lie in one file."""
        if not _native.available():
            for k, dest in items:
                self.read_chunk(k, dest, verify, None)
            return
        where = [self._source(k, None) for k, _ in items]
        fd, file_id = where[0][0], where[0][1]
        # ask the kernel to start reading the whole range now: the threads then
        # mostly find their chunks in the page cache instead of waiting in turn
        first = min(self.chunks[k].offset for k, _ in items)
        last = max(self.chunks[k].offset + self.chunks[k].stored_len for k, _ in items)
        os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_WILLNEED)
        status = _native.read_chunks(
            fd,
            file_id,
            [(number, self.chunks[k], d) for (k, d), (_, _, number) in zip(items, where)],
            verify,
            _native.default_threads(),
        )
        if status is not None:
            raise self._native_error(status, items)

    def _native_error(
        self, status: tuple[int, int, int, int, int], items: list[tuple[int, memoryview]]
    ) -> Exception:
        code, err, pos, reason, value = status
        if code == _native.ERR_NOMEM or not 0 <= pos < len(items):
            return MemoryError(f"{self.path}: out of memory while reading chunks")
        k = items[pos][0]
        key = self.key_of(k)
        ch = self.chunks[k]
        if code == _native.ERR_IO:
            msg = f"{os.strerror(err)} while reading chunk {k} at offset {value}"
            if ch.source < 0:
                return OSError(err, msg, self.path)
            return OSError(
                err, f"{msg} (external chunk {ch.number} of {self.path})", self.externals[ch.source].name
            )
        if code == _native.ERR_SHORT:
            return self._error(
                IncompleteError,
                "file ended while reading chunk (it shrank after it was opened)",
                k,
                key,
                value,
            )
        # the same messages and offsets as the reference path (read_chunk)
        off = ch.offset
        messages = {
            _native.WHY_CHECKSUM: ("checksum mismatch", off),
            _native.WHY_PADDING: ("padding after the chunk is not zero", ch.offset + ch.stored_len),
            _native.WHY_NO_SIZE: ("zstd frame does not declare its decoded size", off),
            _native.WHY_DECLARED: (f"zstd frame declares {value} bytes, the index {ch.raw_len}", off),
            _native.WHY_DECODED: (f"zstd data decodes to {value} bytes, expected {ch.raw_len}", off),
            _native.WHY_DIGEST: (_DIGEST_MISMATCH, off),
            _native.WHY_FRAME: (_NOT_A_FRAME, off),
            _native.WHY_WINDOW: (_window_msg(value), off),
            _native.WHY_DICT: (_dict_msg(value), off),
        }
        msg, at = messages.get(reason, ("zstd data does not decode", off))
        return self._error(CorruptError, msg, k, key, at)

    def _chunk_views(
        self, sid: int, flat: torch.Tensor, first: int = 0, count: int | None = None, base: int = 0
    ) -> list[tuple[int, memoryview]]:
        """(chunk, destination) for chunks [first, first+count) of a storage, placed from `base` in `flat`."""
        rec = self.storages[sid]
        count = rec.n_chunks - first if count is None else count
        view = bytesview.tensor_bytes(flat)
        out = []
        pos = base
        for k in range(rec.first_chunk + first, rec.first_chunk + first + count):
            n = self.chunks[k].raw_len
            out.append((k, view[pos : pos + n]))
            pos += n
        return out

    def read_storages(self, sids: list[int], verify: bool) -> dict[int, torch.UntypedStorage]:
        """CPU storages for `sids`, all their chunks read (in parallel) and checked."""
        flats = {sid: self._alloc(self.storages[sid].nbytes, "", sid=sid) for sid in sids}
        items = [it for sid in sids for it in self._chunk_views(sid, flats[sid])]
        self.read_into(items, verify)
        return {sid: flat.untyped_storage() for sid, flat in flats.items()}

    def read_storage(self, sid: int, verify: bool) -> torch.UntypedStorage:
        return self.read_storages([sid], verify)[sid]

    def _read_to_device(
        self, sids: list[int], device: torch.device, verify: bool, budget: int
    ) -> dict[int, Any]:
        """Storages read through a bounded host staging buffer onto `device`.

        The buffer holds max(budget, one chunk) bytes, or all the storages' bytes when
        fewer (pinned for accelerators); each fill is copied to the device without
        blocking, and the copy is waited for before the buffer is filled again.
        """
        pinned = device.type not in ("cpu", "meta") and torch.accelerator.is_available()
        size = self._staging_size(sids, budget)
        staging = self._alloc(size, "", pinned)
        out: dict[int, Any] = {}
        for sid in sids:
            rec = self.storages[sid]
            dest = torch.empty(rec.nbytes, dtype=torch.uint8, device=device)
            per_fill = max(1, size // self.chunk_size)
            for first in range(0, rec.n_chunks, per_fill):
                count = min(per_fill, rec.n_chunks - first)
                items = self._chunk_views(sid, staging, first, count)
                self.read_into(items, verify)
                start = first * self.chunk_size
                n = sum(len(v) for _, v in items)
                dest[start : start + n].copy_(staging[:n], non_blocking=pinned)
                if pinned:
                    torch.accelerator.synchronize(device)
            out[sid] = dest.untyped_storage()
        return out

    def _mapped_storage(self, sid: int, verify: bool) -> torch.UntypedStorage | None:
        """A storage backed by the file itself, when all its chunks are raw and in this file
        (zero-copy); None otherwise (external chunks are read from their own files)."""
        rec = self.storages[sid]
        chunks = self.chunks[rec.first_chunk : rec.first_chunk + rec.n_chunks]
        if not chunks or any(c.codec != fmt.CODEC_RAW or c.source >= 0 for c in chunks):
            return None
        if self._mm is None:
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
        if verify:
            self._check_mapped(rec.first_chunk, chunks)
        flat = torch.frombuffer(self._mm, dtype=torch.uint8, count=rec.nbytes, offset=chunks[0].offset)
        return flat.untyped_storage()

    def _check_mapped(self, first: int, chunks: list[Chunk]) -> None:
        """Verify raw chunks first, first+1, ... where they lie in the file's mapping."""
        assert self._mm is not None
        if _native.available():
            items = [(first + i, ch) for i, ch in enumerate(chunks)]
            status = _native.check_mapped(self._mm, self.prologue.file_id, items, _native.default_threads())
            if status is not None:
                raise self._native_error(status, [(k, memoryview(b"")) for k, _ in items])
            return
        mv = memoryview(self._mm)
        try:
            for k, ch in enumerate(chunks, first):
                self._check_mapped_chunk(mv, k, ch)
        finally:
            mv.release()

    def _check_mapped_chunk(self, mv: memoryview, k: int, ch: Chunk) -> None:
        key = self.key_of(k)
        stored = mv[ch.offset : ch.offset + ch.stored_len]
        seed = fmt.chunk_seed(
            self.prologue.file_id, k, ch.offset, ch.stored_len, ch.raw_len, ch.codec, ch.filter, ch.width
        )
        if xxhash.xxh3_64_intdigest(stored, seed=seed) != ch.checksum:
            raise self._error(CorruptError, "checksum mismatch", k, key, ch.offset)
        if any(mv[ch.offset + ch.stored_len : ch.offset + ch.stored_len + ch.pad]):
            raise self._error(
                CorruptError, "padding after the chunk is not zero", k, key, ch.offset + ch.stored_len
            )
        if ch.digest and fmt.content_digest(stored) != ch.digest:
            raise self._error(CorruptError, _DIGEST_MISMATCH, k, key, ch.offset)

    def load_subtree(
        self, top: int, map_location: devices.MapLocation, verify: bool, use_mmap: bool = False
    ) -> object:
        needed = tree.storages_under(self.tree, top)
        loaded: dict[int, torch.UntypedStorage] = {}
        host: list[int] = []  # read onto the CPU
        callable_: list[int] = []  # read onto the CPU, then handed to map_location
        on_device: dict[torch.device, list[int]] = {}
        for sid in needed:
            rec = self.storages[sid]
            if rec.kind == "ndarray":  # numpy arrays always live on the CPU
                host.append(sid)
                continue
            try:
                target = devices.planned_device(map_location, rec.device)
            except devices.DeviceError as e:
                raise self._device_error(sid, e) from None
            if target is None:
                callable_.append(sid)
            elif target.type == "meta":
                loaded[sid] = torch.UntypedStorage(rec.nbytes, device="meta")
            elif target.type == "cpu" and not _force_staging():
                host.append(sid)
            else:
                on_device.setdefault(target, []).append(sid)
        if use_mmap:
            unmapped = []
            for sid in host:
                mapped = self._mapped_storage(sid, verify)
                if mapped is None:
                    unmapped.append(sid)
                else:
                    loaded[sid] = mapped
            host = unmapped
        staging = max((self._staging_size(sids, staging_budget()) for sids in on_device.values()), default=0)
        self._check_memory(host + callable_ + [s for sids in on_device.values() for s in sids], staging)
        loaded.update(self.read_storages(host + callable_, verify))
        for sid in callable_:
            try:
                loaded[sid] = devices.apply_callable(map_location, loaded[sid], self.storages[sid].device)  # type: ignore[arg-type]
            except devices.DeviceError as e:
                raise self._device_error(sid, e) from None
        for device, sids in on_device.items():
            loaded.update(self._read_to_device(sids, device, verify, staging_budget()))
        return tree.decode(self.tree, top, loaded.__getitem__, self.path)

    def _staging_size(self, sids: list[int], budget: int) -> int:
        """Bytes of the host buffer a device load of `sids` stages through: sized to the work."""
        return min(max(budget, self.chunk_size), max(1, sum(self.storages[s].nbytes for s in sids)))

    def _device_error(self, sid: int, e: Exception) -> UnsupportedError:
        rec = self.storages[sid]
        return UnsupportedError(
            f"storage {sid} was saved on {rec.device!r}: {e}; pass map_location to load it elsewhere",
            path=self.path,
            key=rec.key,
        )

    def memory_needed(self, sids: list[int], staging: int = 0) -> int:
        """An upper bound of the memory a load of storages `sids` allocates: their bytes, the
        zstd decode buffers (per thread: the largest stored and the largest raw zstd chunk),
        the host staging buffer of device loads, and the index already held."""
        storages = 0
        stored = raw = n_zstd = 0
        for sid in sids:
            rec = self.storages[sid]
            storages += rec.nbytes
            for ch in self.chunks[rec.first_chunk : rec.first_chunk + rec.n_chunks]:
                if ch.codec == fmt.CODEC_ZSTD:
                    n_zstd += 1
                    stored = max(stored, ch.stored_len + ch.pad)
                    raw = max(raw, ch.raw_len)
        threads = min(_native.default_threads(), n_zstd) if _native.available() else min(1, n_zstd)
        return self.index_memory + storages + staging + threads * (stored + raw)

    def _check_memory(self, sids: list[int], staging: int) -> None:
        if self.max_bytes is None:
            return
        need = self.memory_needed(sids, staging)
        if need > self.max_bytes:
            raise LimitError(
                f"loading this needs up to {need} bytes of memory (index {self.index_memory}, "
                f"{len(sids)} storages, decode and staging buffers), above max_bytes={self.max_bytes}",
                path=self.path,
            )

    def iter_chunk_problems(
        self, progress: Callable[[int, int], None] | None = None
    ) -> Iterator[CheckpointError]:
        """Check every chunk; yield one error per damaged chunk and go on.

        Chunks are checked in windows of about 64 MiB (in parallel with the C
        engine); a window that fails is checked again chunk by chunk so that
        every damaged chunk is reported.  A referenced file that cannot be used is
        reported once, at its first chunk, and its other chunks are skipped.
        """
        unusable = set(self._ext_failed)  # reported already (external_problems)
        # 64 MiB, or the largest chunk when larger, but never more than all chunks together
        raw = [ch.raw_len for ch in self.chunks]
        window = min(max(64 << 20, max(raw, default=0)), max(1, sum(raw)))
        buf = hostmem.empty_bytes(window)
        view = bytesview.tensor_bytes(buf)
        k = 0
        n = len(self.chunks)
        while k < n:
            if progress is not None:
                progress(k, n)
            items: list[tuple[int, memoryview]] = []
            pos = 0
            while k < n and (not items or pos + self.chunks[k].raw_len <= window):
                if self.chunks[k].source not in unusable:
                    items.append((k, view[pos : pos + self.chunks[k].raw_len]))
                    pos += self.chunks[k].raw_len
                k += 1
            try:
                self.read_into(items, True)
            except CheckpointError:
                for kk, dest in items:
                    if self.chunks[kk].source in unusable:
                        continue
                    try:
                        self.read_into([(kk, dest)], True)
                    except CheckpointError as e:
                        if self.chunks[kk].source in self._ext_failed:
                            unusable.add(self.chunks[kk].source)
                        yield e

    # -- navigation ---------------------------------------------------------

    def root_items(self) -> list[tuple[object, int]]:
        """(key, node id) of each entry when the root is a dict; empty otherwise."""
        node = self.tree.nodes[self.tree.root]
        if node[0] not in ("dict", "odict"):
            return []
        return [(tree.decode(self.tree, k, _no_storage, self.path), v) for k, v in node[1]]


def _pread_exact(fd: int, offset: int, n: int) -> bytes:
    """Up to n bytes at offset (fewer only where the file ends)."""
    first = os.pread(fd, n, offset) if n else b""
    if len(first) == n or not first:
        return first  # the usual case: one read, no copy
    out = bytearray(first)
    while len(out) < n:
        got = os.pread(fd, n - len(out), offset + len(out))
        if not got:
            break
        out += got
    return bytes(out)


def _no_storage(sid: int) -> torch.UntypedStorage:
    raise AssertionError("dict keys never hold tensors")  # keys are validated to be scalars/tuples
