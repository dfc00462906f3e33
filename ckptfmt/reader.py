"""Reading ckptfmt files: structure checks, the index, verified chunk reads.

This is the reference reader.  It reads each chunk with one ``preadv`` straight
into the destination storage (raw chunks) or into a reused scratch buffer
(compressed chunks), checks the chunk's context-bound checksum and the zero
padding behind it, and decodes into the destination.  Every number taken from
the file is validated before use; every failure is a CheckpointError that
names the path, key, chunk and offset.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from . import _native, devices, tree
from . import format as fmt
from .errors import CheckpointError, CorruptError, IncompleteError, LimitError, UnsupportedError
from .format import Limits

_INDEX_FIELDS = ("chunk_size", "producer", "source_devices", "metadata", "storages", "chunks", "nodes")
_HEX16 = frozenset("0123456789abcdef")
#: zstd window limit: frames needing more memory than this are rejected (2**27 = 128 MiB)
_ZSTD_MAX_WINDOW = 1 << 27


def _force_staging() -> bool:
    """CKPTFMT_FORCE_STAGING=1 routes CPU loads through the staged device path (tests use it without a GPU)."""
    return bool(os.environ.get("CKPTFMT_FORCE_STAGING"))


def staging_budget() -> int:
    """Host bytes a load onto an accelerator may stage at once (the staging pool's limit)."""
    from .staging import POOL

    return POOL.limit


@dataclass(frozen=True)
class Chunk:
    offset: int
    stored_len: int
    raw_len: int
    codec: int
    filter: int
    width: int
    checksum: int
    pad: int  # zero bytes after the chunk, up to the next chunk or the index


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


def parse_index_json(raw: bytes, path: str) -> dict[str, Any]:
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
    if type(obj) is not dict or set(obj) != set(_INDEX_FIELDS):
        raise CorruptError(
            "index must be an object with exactly the fields " + ", ".join(_INDEX_FIELDS), path=path
        )
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
    """An open ckptfmt file with its validated index."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.path) from None
        try:
            self._parse()
        except BaseException:
            os.close(self._fd)
            raise
        self._scratch = bytearray()
        self._mm: mmap.mmap | None = None

    # -- structure ----------------------------------------------------------

    def _read(self, offset: int, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = os.pread(self._fd, n - len(out), offset + len(out))
            if not got:
                break
            out += got
        return bytes(out)

    def _parse(self) -> None:
        path = self.path
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsupportedError("not a regular file", path=path)
        size = st.st_size
        self.prologue = fmt.parse_prologue(self._read(0, fmt.PROLOGUE_SIZE), size, path)
        length = self.prologue.file_length
        self.footer = fmt.parse_footer(
            self._read(length - fmt.FOOTER_SIZE, fmt.FOOTER_SIZE), self.prologue, path
        )
        ioff, ilen = self.footer.index_offset, self.footer.index_length
        region = self._read(ioff, length - fmt.FOOTER_SIZE - ioff)
        if len(region) != length - fmt.FOOTER_SIZE - ioff:
            raise IncompleteError("file shrank while its index was read", path=path, offset=ioff)
        raw, padding = region[:ilen], region[ilen:]
        if fmt.index_checksum(self.prologue.file_id, ioff, raw) != self.footer.index_checksum:
            raise CorruptError("index checksum mismatch", path=path, offset=ioff)
        if any(padding):
            raise CorruptError("padding after the index is not zero", path=path, offset=ioff + ilen)
        index = parse_index_json(raw, path)
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
        self.chunks = self._parse_chunks(c, index["chunks"])
        self.tree = tree.validate_tree(index["nodes"], self.storages, path)

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
            if tree._DEVICE_RE.fullmatch(device) is None:
                raise c.fail(f"storage {sid} has invalid device {device[:40]!r}")
            n = -(-nbytes // self.chunk_size)
            out.append(tree.StorageRecord(nbytes, device, first, n))
            first += n
        self._n_chunks_expected = first
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
        out: list[Chunk] = []
        expect = fmt.PROLOGUE_SIZE
        end_of_data = self.footer.index_offset
        for k, item in enumerate(items):
            if type(item) is not list or len(item) != 7:
                raise c.fail(f"chunk {k} is not a 7-field record")
            off, slen, rlen, codec, filt, width, check = item
            where = f"chunk {k}"
            c.int_(off, f"{where} offset", expect, expect)
            c.int_(rlen, f"{where} raw length", raw_lens[k], raw_lens[k])
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
            if type(check) is not str or len(check) != 16 or not _HEX16.issuperset(check):
                raise c.fail(f"{where} checksum must be 16 lowercase hex digits")
            end = off + slen
            if end > end_of_data:
                raise CorruptError(
                    f"chunk ends at {end}, inside the index at {end_of_data}",
                    path=self.path,
                    chunk=k,
                    offset=off,
                )
            expect = fmt.align_up(end)
            out.append(Chunk(off, slen, rlen, codec, filt, width, int(check, 16), 0))
        if expect != end_of_data:
            raise CorruptError(
                f"data ends at {expect} but the index starts at {end_of_data}", path=self.path, offset=expect
            )
        for k, ch in enumerate(out):
            nxt = out[k + 1].offset if k + 1 < len(out) else end_of_data
            out[k] = Chunk(
                ch.offset,
                ch.stored_len,
                ch.raw_len,
                ch.codec,
                ch.filter,
                ch.width,
                ch.checksum,
                nxt - ch.offset - ch.stored_len,
            )
        return out

    # -- data ---------------------------------------------------------------

    def close(self) -> None:
        self._mm = None  # tensors made from the mapping keep it alive
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chunk_keys(self) -> list[str]:
        """The key path of the first tensor using each chunk."""
        return [rec.key for rec in self.storages for _ in range(rec.n_chunks)]

    def _readv(self, bufs: list[memoryview], offset: int, k: int, key: str | None) -> None:
        """Fill `bufs` from `offset`; a file that ends first is incomplete."""
        got = 0
        for buf in bufs:
            view = buf
            while len(view):
                n = os.preadv(self._fd, [view], offset + got)
                if n == 0:
                    raise IncompleteError(
                        "file ended while reading chunk (it shrank after it was opened)",
                        path=self.path,
                        key=key,
                        chunk=k,
                        offset=offset + got,
                    )
                view = view[n:]
                got += n

    def read_chunk(self, k: int, dest: memoryview, verify: bool, key: str | None) -> None:
        """Read chunk k, check it, and leave its raw bytes in `dest` (exactly raw_len bytes)."""
        ch = self.chunks[k]
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
            self._readv([dest, scratch[:pad_need]], ch.offset, k, key)
            pad = scratch[:pad_need]
        else:
            self._readv([scratch[:need]], ch.offset, k, key)
            stored = scratch[: ch.stored_len]
            pad = scratch[ch.stored_len : need]
        if verify:
            seed = fmt.chunk_seed(
                self.prologue.file_id, k, ch.offset, ch.stored_len, ch.raw_len, ch.codec, ch.filter, ch.width
            )
            if xxhash.xxh3_64_intdigest(stored, seed=seed) != ch.checksum:
                raise CorruptError("checksum mismatch", path=self.path, key=key, chunk=k, offset=ch.offset)
        if any(pad):
            raise CorruptError(
                "padding after the chunk is not zero",
                path=self.path,
                key=key,
                chunk=k,
                offset=ch.offset + ch.stored_len,
            )
        if ch.codec == fmt.CODEC_ZSTD:
            self._decompress(k, ch, stored, dest, key)

    def _decompress(self, k: int, ch: Chunk, stored: memoryview, dest: memoryview, key: str | None) -> None:
        def bad(msg: str) -> CorruptError:
            return CorruptError(msg, path=self.path, key=key, chunk=k, offset=ch.offset)

        try:
            params = zstandard.get_frame_parameters(stored)
            if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
                raise bad("zstd frame does not declare its decoded size")
            if params.content_size != ch.raw_len:
                raise bad(f"zstd frame declares {params.content_size} bytes, the index {ch.raw_len}")
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

    @functools.cached_property
    def _chunk_keys(self) -> list[str]:
        return self.chunk_keys()

    def _alloc(self, nbytes: int, key: str, pinned: bool = False) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        except (RuntimeError, MemoryError) as e:
            raise LimitError(
                f"cannot allocate {nbytes} bytes for this storage: {str(e)[:100]}", path=self.path, key=key
            ) from e

    def read_into(self, items: list[tuple[int, memoryview]], verify: bool) -> None:
        """Read chunks into their destinations (exactly raw_len bytes each).

        With the C engine all chunks are read in parallel, each verified and
        decoded straight into place; otherwise one by one on this thread.
        """
        if not items:
            return
        # ask the kernel to start reading the whole range now: the threads then
        # mostly find their chunks in the page cache instead of waiting in turn
        first = min(self.chunks[k].offset for k, _ in items)
        last = max(self.chunks[k].offset + self.chunks[k].stored_len for k, _ in items)
        os.posix_fadvise(self._fd, first, last - first, os.POSIX_FADV_WILLNEED)
        if _native.available():
            status = _native.read_chunks(
                self._fd,
                self.prologue.file_id,
                [(k, self.chunks[k], d) for k, d in items],
                verify,
                _native.default_threads(),
            )
            if status is not None:
                raise self._native_error(status)
            return
        for k, dest in items:
            self.read_chunk(k, dest, verify, self._chunk_keys[k])

    def _native_error(self, status: tuple[int, int, int, int, int]) -> Exception:
        code, err, k, reason, value = status
        key = self._chunk_keys[k] if 0 <= k < len(self.chunks) else None
        ch = self.chunks[k] if key is not None else None
        off = ch.offset if ch is not None else None
        if code == _native.ERR_IO:
            return OSError(err, f"{os.strerror(err)} while reading chunk {k} at offset {value}", self.path)
        if code == _native.ERR_NOMEM:
            return MemoryError(f"{self.path}: out of memory while reading chunks")
        if code == _native.ERR_SHORT:
            return IncompleteError(
                "file ended while reading chunk (it shrank after it was opened)",
                path=self.path,
                key=key,
                chunk=k,
                offset=value,
            )
        assert ch is not None
        # the same messages and offsets as the reference path (read_chunk)
        messages = {
            _native.WHY_CHECKSUM: ("checksum mismatch", off),
            _native.WHY_PADDING: ("padding after the chunk is not zero", ch.offset + ch.stored_len),
            _native.WHY_NO_SIZE: ("zstd frame does not declare its decoded size", off),
            _native.WHY_DECLARED: (f"zstd frame declares {value} bytes, the index {ch.raw_len}", off),
            _native.WHY_DECODED: (f"zstd data decodes to {value} bytes, expected {ch.raw_len}", off),
        }
        msg, where = messages.get(reason, ("zstd data does not decode", off))
        return CorruptError(msg, path=self.path, key=key, chunk=k, offset=where)

    def _chunk_views(
        self, sid: int, flat: torch.Tensor, first: int = 0, count: int | None = None, base: int = 0
    ) -> list[tuple[int, memoryview]]:
        """(chunk, destination) for chunks [first, first+count) of a storage, placed from `base` in `flat`."""
        rec = self.storages[sid]
        count = rec.n_chunks - first if count is None else count
        view = flat.numpy().data.cast("B")
        out = []
        pos = base
        for k in range(rec.first_chunk + first, rec.first_chunk + first + count):
            n = self.chunks[k].raw_len
            out.append((k, view[pos : pos + n]))
            pos += n
        return out

    def read_storages(self, sids: list[int], verify: bool) -> dict[int, torch.UntypedStorage]:
        """CPU storages for `sids`, all their chunks read (in parallel) and checked."""
        flats = {sid: self._alloc(self.storages[sid].nbytes, self.storages[sid].key) for sid in sids}
        items = [it for sid in sids for it in self._chunk_views(sid, flats[sid])]
        self.read_into(items, verify)
        return {sid: flat.untyped_storage() for sid, flat in flats.items()}

    def read_storage(self, sid: int, verify: bool) -> torch.UntypedStorage:
        return self.read_storages([sid], verify)[sid]

    def _read_to_device(
        self, sids: list[int], device: torch.device, verify: bool, budget: int
    ) -> dict[int, Any]:
        """Storages read through a bounded host staging buffer onto `device`.

        The buffer holds max(budget, one chunk) bytes (pinned for accelerators);
        each fill is copied to the device without blocking, and the copy is
        waited for before the buffer is filled again.
        """
        pinned = device.type not in ("cpu", "meta") and torch.accelerator.is_available()
        size = max(budget, self.chunk_size)
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
        """A storage backed by the file itself, when all its chunks are raw (zero-copy)."""
        rec = self.storages[sid]
        chunks = self.chunks[rec.first_chunk : rec.first_chunk + rec.n_chunks]
        if not chunks or any(c.codec != fmt.CODEC_RAW for c in chunks):
            return None
        if self._mm is None:
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
        if verify:
            mv = memoryview(self._mm)
            for i, ch in enumerate(chunks):
                k = rec.first_chunk + i
                seed = fmt.chunk_seed(
                    self.prologue.file_id,
                    k,
                    ch.offset,
                    ch.stored_len,
                    ch.raw_len,
                    ch.codec,
                    ch.filter,
                    ch.width,
                )
                if (
                    xxhash.xxh3_64_intdigest(mv[ch.offset : ch.offset + ch.stored_len], seed=seed)
                    != ch.checksum
                ):
                    raise CorruptError(
                        "checksum mismatch", path=self.path, key=rec.key, chunk=k, offset=ch.offset
                    )
                if any(mv[ch.offset + ch.stored_len : ch.offset + ch.stored_len + ch.pad]):
                    raise CorruptError(
                        "padding after the chunk is not zero",
                        path=self.path,
                        key=rec.key,
                        chunk=k,
                        offset=ch.offset + ch.stored_len,
                    )
            mv.release()
        flat = torch.frombuffer(self._mm, dtype=torch.uint8, count=rec.nbytes, offset=chunks[0].offset)
        return flat.untyped_storage()

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
            target = devices.planned_device(map_location, rec.device)
            if target is None:
                callable_.append(sid)
            elif target.type == "meta":
                loaded[sid] = torch.UntypedStorage(rec.nbytes, device="meta")
            elif target.type == "cpu" and not _force_staging():
                host.append(sid)
            else:
                on_device.setdefault(target, []).append(sid)
        if use_mmap:
            for sid in list(host):
                mapped = self._mapped_storage(sid, verify)
                if mapped is not None:
                    loaded[sid] = mapped
                    host.remove(sid)
        loaded.update(self.read_storages(host + callable_, verify))
        for sid in callable_:
            loaded[sid] = devices.apply_callable(map_location, loaded[sid], self.storages[sid].device)  # type: ignore[arg-type]
        for device, sids in on_device.items():
            loaded.update(self._read_to_device(sids, device, verify, staging_budget()))
        return tree.decode(self.tree, top, loaded.__getitem__, self.path)

    def iter_chunk_problems(
        self, progress: Callable[[int, int], None] | None = None
    ) -> Iterator[CheckpointError]:
        """Check every chunk; yield one error per damaged chunk and go on.

        Chunks are checked in windows of about 64 MiB (in parallel with the C
        engine); a window that fails is checked again chunk by chunk so that
        every damaged chunk is reported.
        """
        window = max(64 << 20, self.chunk_size)
        buf = torch.empty(window, dtype=torch.uint8)
        view = buf.numpy().data.cast("B")
        k = 0
        n = len(self.chunks)
        while k < n:
            if progress is not None:
                progress(k, n)
            items: list[tuple[int, memoryview]] = []
            pos = 0
            while k < n and (not items or pos + self.chunks[k].raw_len <= window):
                items.append((k, view[pos : pos + self.chunks[k].raw_len]))
                pos += self.chunks[k].raw_len
                k += 1
            try:
                self.read_into(items, True)
            except CheckpointError:
                for kk, dest in items:
                    try:
                        self.read_into([(kk, dest)], True)
                    except CheckpointError as e:
                        yield e

    # -- navigation ---------------------------------------------------------

    def root_items(self) -> list[tuple[object, int]]:
        """(key, node id) of each entry when the root is a dict; empty otherwise."""
        node = self.tree.nodes[self.tree.root]
        if node[0] not in ("dict", "odict"):
            return []
        return [(tree.decode(self.tree, k, _no_storage, self.path), v) for k, v in node[1]]


def _no_storage(sid: int) -> torch.UntypedStorage:
    raise AssertionError("dict keys never hold tensors")  # keys are validated to be scalars/tuples
