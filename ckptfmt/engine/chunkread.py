"""Chunk reads: reading, verifying and decoding chunks into their destinations.

A `ChunkReader` reads each chunk with one ``preadv`` straight into the destination
storage (raw chunks) or into a reused scratch buffer (compressed chunks), checks the
chunk's context-bound checksum and the zero padding behind it, and decodes into the
destination (spec sections 3, 4 and 9 step 8); with the C engine the chunks of one file
are read, verified and decoded in parallel, with the same messages.  Every failure is a
CheckpointError that names the path, key, chunk and offset.

External chunks (required feature bit 0, spec section 12) are read from the files that
hold them: each is opened on first use and checked to be the file the index records
(section 12.5), a bounded set of descriptors stays open, and the chunk is verified with
that file's checksum context and the content digest (section 12.6); errors name both files.

Chunks of encrypted files (section 17) opened with their key are decrypted after their
checksum (over the ciphertext) and padding are checked and before they are decoded; a chunk
whose GCM tag fails is a DecryptionError and its bytes are not decoded.

The records read here come from a validated index (index.py) and are trusted as they are.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence

import xxhash

from ..errors import (
    CheckpointError,
    CorruptError,
    DecryptionError,
    IncompleteError,
    SignatureError,
    StorageError,
)
from ..format import encryption
from ..format import layout as fmt
from ..format.index import Chunk, Index
from . import chunkerrors, chunkrecords, directread, fetchread, forkreset, reffiles, zstdframes
from . import native as _native
from .chunkerrors import DIGEST_MISMATCH as _DIGEST_MISMATCH
from .chunkerrors import SHA_MISMATCH as _SHA_MISMATCH
from .chunkerrors import TAG_MISMATCH as _TAG_MISMATCH
from .ckptdir import CheckpointDir
from .sources import Fetcher, References

log = logging.getLogger("ckptfmt")

#: seconds a read waits at least for another's opening of a referenced file it needs (longer
#: where the opening's storage operations may take longer: References.opening_time)
OPEN_WAIT = 900.0
#: verify: bytes of chunks per engine call, decoded into a window of this size
CHECK_WINDOW = 64 << 20
#: ... and where no chunk needs a destination (no content digests)
CHECK_WINDOW_UNTOUCHED = 1 << 30


def decode_memory(chunks: Sequence[Chunk], native: bool) -> int:
    """The scratch memory reading `chunks` takes besides their destinations: per engine thread
    (one on the Python path) the largest zstd chunk's stored bytes and raw bytes."""
    zstd = [ch for ch in chunks if ch.codec == fmt.CODEC_ZSTD]
    if not zstd:
        return 0
    threads = min(_native.default_threads(), len(zstd)) if native else 1
    return threads * (max(ch.stored_len + ch.pad for ch in zstd) + max(ch.raw_len for ch in zstd))


#: where a chunk's raw bytes go: a buffer of exactly raw_len bytes; with the C engine also the
#: address (an int) of raw_len bytes of host memory its caller keeps alive (chunkrecords.read_chunks),
#: or None when only checked (read_into's check_only)
Destination = memoryview | int | None


class ChunkReader:
    """Reads the chunks of one file, and those of the files its external chunks lie in.

    It owns `fd`, the file's descriptor (closed by `close`, with the referenced files);
    `max_open` bounds the referenced files kept open at once (least recently used are closed).
    """

    def __init__(
        self, fd: int, path: str, index: Index, max_open: int, base: References | None = None
    ) -> None:
        self.fd = fd
        self.path = path
        # the directory reference paths are resolved in (owned): opened on first use when
        # not given, from the directory of `path` as the caller named it
        self._base = base
        self.file_id = index.prologue.file_id
        self.chunks = index.chunks
        self.externals = index.externals
        #: encrypted files opened with their key: the data key (spec section 17)
        self.data_key = index.data_key
        #: an encrypted file: the files its external chunks lie in must be encrypted too, each
        #: read with its own data key, unwrapped by `_opener` (spec 17.9)
        self._encrypted = index.encryption is not None
        self._opener = index.opener
        self._ext_keys: dict[int, tuple[bytes, encryption.EncryptionBlock]] = {}
        #: the key path of chunk k's storage, for messages
        self.key_of = index.key_of
        #: what the index takes while held (fmt.index_memory_bound): part of a load's max_bytes
        self.index_memory = index.memory
        self.max_open = max_open
        # the Python path's buffer for a compressed chunk's stored bytes: one per thread reading
        self._scratch = threading.local()
        # referenced files: open ones (fd, end of data section), most recently used last,
        # and those that could not be used (error class and reason, reported again per chunk)
        self._ext_open: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._ext_failed: dict[int, tuple[type[CheckpointError], str]] = {}
        #: a local referenced file's stamp when first opened: opened again (let go of to keep
        #: few open), it must be that file still, as an object must be its first version
        self._ext_stamps: dict[int, tuple[int, ...]] = {}
        # reads run at once on several threads (a Reader's gets): referenced files are opened
        # under this lock, and each read holds the one it reads from (_holding): a file held is
        # never let go of (max_open), so its descriptor stays valid under the read, and a
        # referenced object's bytes the read fetched stay in the spool it reads them from (let
        # go of and opened again, it would be another spool, without those bytes)
        self._ext_lock = threading.Lock()
        #: reads holding each referenced file, by its number
        self._pins: Counter[int] = Counter()
        #: referenced files being opened (outside the lock), each set once its opening is over
        self._opening: dict[int, threading.Event] = {}
        forkreset.register(self)
        #: where `fd` is a spool of a remote object: fetches chunk bytes before they are read
        self.remote: Fetcher | None = None

    def _forget_in_child(self) -> None:
        """A forked child's copies (forkreset): no read of the parent's is in progress there,
        and a parent thread may have held the lock at the fork (the child would wait on it for
        ever)."""
        self._ext_lock, self._pins, self._opening = threading.Lock(), Counter(), {}

    def close(self) -> None:
        """Close the referenced files that are open (those reads hold too: the caller closes
        once no read is in progress; a forked child's, whose parent's reads never end there),
        then the file."""
        with self._ext_lock:  # a forked child's lock is its own
            self._pins.clear()
        while self._ext_open:
            self._release(self._ext_open.popitem()[1][0])
        if self._base is not None:
            self._base.close()
            self._base = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    # -- referenced files (feature bit 0) -------------------------------------

    def _error(
        self, cls: type[CheckpointError], msg: str, k: int, key: str | None, offset: int | None
    ) -> CheckpointError:
        return chunkerrors.chunk_error(self, cls, msg, k, key, offset)

    def _open_external(self, e: int) -> tuple[int, int]:
        """Open referenced file e and check it is the file recorded; (fd, end of its data section)."""
        ext = self.externals[e]
        what = f"referenced file {ext.name} (external {e})"
        try:
            with self._ext_lock:  # the directory opened once, whichever read opens a file first
                base = self._base_dir()
            # every directory on the way and the file itself opened without following a
            # link, the file without blocking (a FIFO is refused): spec 12.3 and 13.6
            fd = base.open_ref(ext.rel)
        except FileNotFoundError:
            raise IncompleteError(f"{what} is missing", path=self.path) from None
        except StorageError:  # a store that failed to answer: not a damaged checkpoint
            raise
        except CheckpointError as err:  # a link on the way, not a regular file
            raise CorruptError(f"{what}: {err}", path=self.path) from None
        except OSError as err:
            raise OSError(err.errno, f"{err.strerror} (a file {self.path} refers to)", ext.name) from None
        try:
            if base.fetcher_of(fd) is None:  # a local file (an object's is a spool)
                reffiles.check_stamp(self._ext_stamps, e, fd, what, self.path)
            end, key = reffiles.check_opened(
                fd, ext, what, self.path, self._encrypted, self._opener, bool(self.data_key)
            )
        except BaseException:
            self._release(fd)
            raise
        if key is not None:
            self._ext_keys[e] = key
        return fd, end

    def _crypto_of(self, k: int) -> tuple[bytes, bytes, int, bytes]:
        """(data key, file id, chunk number, GCM tag) that decrypt chunk k where it lies."""
        ch = self.chunks[k]
        if ch.source < 0:
            return self.data_key, self.file_id, k, ch.tag
        key, block = self._ext_keys[ch.source]
        if ch.number >= block.nchunks:  # no tag: read as if in clear, which nothing authenticates
            raise self._error(
                CorruptError,
                f"its file's encryption block has tags for {block.nchunks} chunks",
                k,
                None,
                ch.offset,
            )
        return key, self.externals[ch.source].file_id, ch.number, block.tag_of(ch.number)

    def _decrypts(self, k: int) -> bool:
        """Whether chunk k is decrypted as it is read (a file opened with its key)."""
        return bool(self.data_key) and (self.chunks[k].source >= 0 or bool(self.chunks[k].tag))

    def _release(self, fd: int) -> None:
        """Close a referenced file's descriptor through what opened it: an object's spool
        is given back with it, so at most max_open are held."""
        if self._base is not None:
            self._base.release(fd)
        else:
            os.close(fd)

    def _base_dir(self) -> References:
        if self._base is None:
            self._base = CheckpointDir.open(os.path.dirname(self.path) or ".")
        return self._base

    def _external(self, e: int, k: int, key: str | None, hold: bool = False) -> tuple[int, int]:
        """(fd, end of data section) of referenced file e, opened and checked on first use
        (outside _ext_lock: an object's takes requests, which hold up no other read; a read
        that needs it meanwhile waits for that opening, as long as an opening may take:
        References.opening_time); `hold`: held by the caller's read (_holding)."""
        deadline: float | None = None
        while True:
            with self._ext_lock:
                got = self._ext_open.get(e)
                if got is not None:
                    self._ext_open.move_to_end(e)
                    if hold:
                        self._pins[e] += 1
                    return got
                if e in self._ext_failed:
                    cls, reason = self._ext_failed[e]
                    raise cls(reason, path=self.path, key=self.key_of(k) if key is None else key, chunk=k)
                opening = self._opening.get(e)
                if opening is None:
                    self._opening[e] = threading.Event()
                    break
                waits = self._opening_time()
            deadline = time.monotonic() + waits if deadline is None else deadline
            if not opening.wait(max(0.0, deadline - time.monotonic())):
                raise StorageError(
                    f"referenced file {self.externals[e].name} (external {e}): another read's "
                    f"opening of it took more than {waits:g} s",
                    path=self.path,
                )
        return self._opened(e, k, key, hold)

    def _opening_time(self) -> float:
        """Under _ext_lock: how long a read waits for another's opening of a referenced file
        (the base is made by the read opening one, before any read can wait for it)."""
        return OPEN_WAIT if self._base is None else max(OPEN_WAIT, self._base.opening_time())

    def _opened(self, e: int, k: int, key: str | None, hold: bool) -> tuple[int, int]:
        """_external's opening of referenced file e, the reads waiting for it told at its end."""
        try:
            got = self._open_external(e)
        except CheckpointError as err:
            with self._ext_lock:
                self._ext_failed[e] = (type(err), err.reason)
            raise type(err)(
                err.reason, path=self.path, key=self.key_of(k) if key is None else key, chunk=k
            ) from err
        else:
            with self._ext_lock:
                self._ext_open[e] = got
                unheld = self._unheld(keep=e)
                if hold:
                    self._pins[e] += 1
            self._let_go(unheld)
            return got
        finally:
            with self._ext_lock:
                self._opening.pop(e).set()

    def _unheld(self, keep: int = -1) -> list[int]:
        """Under _ext_lock: take out the least recently used referenced files no read holds
        (nor `keep`, just opened for a caller), down to max_open, and return their descriptors,
        which the caller closes once it let go of the lock (_let_go); where reads hold more,
        they stay open until those reads end (each read holds one at a time)."""
        fds = []
        while len(self._ext_open) > self.max_open:
            e = next((e for e in self._ext_open if not self._pins[e] and e != keep), None)
            if e is None:
                break
            fds.append(self._ext_open.pop(e)[0])
        return fds

    def _let_go(self, fds: list[int]) -> None:
        """Close referenced files let go of (_unheld), outside _ext_lock (an object's closing
        waits for its threads, which holds up no other read); a failure is logged, never
        raised in place of the read's result: the read that let go of them is over, or goes on
        with another file."""
        for fd in fds:
            try:
                self._release(fd)
            except Exception:
                log.warning("closing a referenced file of %s failed", self.path, exc_info=True)

    @contextlib.contextmanager
    def _holding(self, source: int, k: int) -> Iterator[None]:
        """Hold referenced file `source` (-1: this file, nothing to hold) open while a read
        reads from it, opened and checked first if it is not open (`k`: a chunk in it, for
        errors); let go of once no read holds it, where more than max_open are open."""
        if source < 0:
            yield
            return
        self._external(source, k, None, hold=True)
        try:
            yield
        finally:
            with self._ext_lock:
                # a count close() cleared (a read that outlived it) stays at none, never below
                if self._pins[source] > 1:
                    self._pins[source] -= 1
                else:
                    del self._pins[source]
                unheld = self._unheld()
            self._let_go(unheld)

    def external_stamp(self, e: int) -> tuple[int, ...] | None:
        """The stamp (fileio.file_stamp) of local referenced file e as it is read; None before
        it was opened, or for an object."""
        return self._ext_stamps.get(e)

    def _source(self, k: int, key: str | None) -> tuple[int, bytes, int]:
        """Where chunk k's stored bytes are: (fd, that file's id, the chunk's number in it)."""
        ch = self.chunks[k]
        if ch.source < 0:
            return self.fd, self.file_id, k
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
        buf = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < need:
            buf = self._scratch.buf = bytearray(need)
        scratch = memoryview(buf)
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
        if ch.sha:
            self._check_signed(file_id, number, ch, stored, k, key)
        if any(pad):
            raise self._error(
                CorruptError, "padding after the chunk is not zero", k, key, ch.offset + ch.stored_len
            )
        if self._decrypts(k):
            stored = self._decrypt(k, ch, stored, key)
            if ch.codec == fmt.CODEC_RAW:
                dest[:] = stored
        if ch.codec == fmt.CODEC_ZSTD:
            try:
                zstdframes.decode(stored, dest, ch.filter == fmt.FILTER_SHUFFLE, ch.width)
            except zstdframes.FrameError as e:
                raise self._error(CorruptError, str(e), k, key, ch.offset) from e.__cause__
        if verify and ch.digest and fmt.content_digest(dest) != ch.digest:
            raise self._error(CorruptError, _DIGEST_MISMATCH, k, key, ch.offset)

    def _decrypt(self, k: int, ch: Chunk, stored: memoryview, key: str | None) -> memoryview:
        """The plaintext of encrypted chunk k's stored bytes; DecryptionError when its tag fails."""
        data_key, file_id, number, tag = self._crypto_of(k)
        plain = encryption.open_chunk(
            data_key, file_id, number, ch.offset, ch.raw_len, ch.codec, ch.filter, ch.width, stored, tag
        )
        if plain is None:
            raise self._error(DecryptionError, _TAG_MISMATCH, k, key, ch.offset)
        return memoryview(plain)

    # -- batched, parallel reads ---------------------------------------------

    def read_into(
        self, items: Sequence[tuple[int, Destination]], verify: bool, check_only: bool = False
    ) -> None:
        """Read chunks into their destinations (exactly raw_len bytes each).

        With the C engine all chunks of one file are read in parallel, each verified
        and decoded straight into place; otherwise one by one on this thread.  Chunks
        are grouped by the file they lie in: this one, then each referenced file.
        check_only (with verify): the destinations' contents are not needed afterwards,
        which spares the engine copying raw chunks into them and un-shuffling; with the
        C engine, a chunk without a content digest then needs no destination (None).
        """
        if not self.externals:  # every chunk lies in this file
            if items:
                self._read_source(-1, list(items), verify, check_only)
            return
        groups: dict[int, list[tuple[int, Destination]]] = {}
        for k, dest in items:
            groups.setdefault(self.chunks[k].source, []).append((k, dest))
        for source, group in groups.items():
            with self._holding(source, group[0][0]):
                self._read_source(source, group, verify, check_only)

    def _read_source(
        self, source: int, group: list[tuple[int, Destination]], verify: bool, check_only: bool
    ) -> None:
        """Read chunks that all lie in file `source` (-1: this one)."""
        fetcher = self._fetcher(source, group[0][0])
        if fetcher is not None:
            self._read_fetched(fetcher, group, verify, check_only)
        else:
            self._read_group(group, verify, check_only)

    def _fetcher(self, source: int, k: int) -> Fetcher | None:
        """What brings file `source`'s bytes (-1: this one) in from a store; None for a local
        file.  Opens a referenced file (`k`: a chunk in it, for errors) if it is not open."""
        if source < 0:
            return self.remote
        if self._base is None and self.remote is None:
            return None  # a local file's references are local files
        fd, _ = self._external(source, k, None)
        return self._base_dir().fetcher_of(fd)

    def _read_fetched(
        self, remote: Fetcher, items: Sequence[tuple[int, Destination]], verify: bool, check_only: bool
    ) -> None:
        """Read chunks of a remote file: those directread fetches straight into their destinations
        so (in one plan with the others), the others window by window (fetchread), the windows
        sized to what the load's max_bytes leaves where it has one (_room)."""
        straight, spooled = directread.split(remote, self.chunks, items, check_only)
        rest = lambda asked: self._read_spooled(remote, spooled, verify, check_only, asked)  # noqa: E731
        direct = (self.path, self.file_id, self.chunks, straight, spooled)
        directread.read_direct(remote, *direct, verify, self.native_error, rest)

    def _read_spooled(
        self, remote: Fetcher, items: list[tuple[int, Destination]], verify: bool, only: bool, asked: bool
    ) -> None:
        read = lambda window: self._read_group(window, verify, only)  # noqa: E731
        stored = [directread.span(self.chunks[k]) for k, _ in items]
        fetchread.read_by_window(remote, stored, items, read, self._room(items), self.path, asked)

    def _room(self, items: Sequence[tuple[int, Destination]]) -> fetchread.Room | None:
        """The load's max_bytes (that of the object this file is) and what reading `items`
        takes besides the spools' windows: the index, the destinations, the decode buffers,
        and what the spools of this object and of the referenced ones open hold already that
        no other read (on another thread) uses; None without a bound."""
        bound = self.remote.max_bytes if self.remote is not None else None
        if bound is None:
            return None
        return fetchread.Room(
            bound=bound,
            index=self.index_memory,
            tensors=sum(self.chunks[k].raw_len for k, d in items if d is not None),
            decode=decode_memory([self.chunks[k] for k, _ in items], _native.available()),
            held=sum(f.idle() for f in self._fetchers()),
        )

    def _fetchers(self) -> list[Fetcher]:
        """What brings this object's bytes in and those of the referenced objects open."""
        fetchers = [] if self.remote is None else [self.remote]
        if self._base is not None:
            with self._ext_lock:
                fds = [fd for fd, _ in self._ext_open.values()]
            for fd in fds:
                fetcher = self._base.fetcher_of(fd)
                if fetcher is not None:
                    fetchers.append(fetcher)
        return fetchers

    def _read_group(
        self, items: Sequence[tuple[int, Destination]], verify: bool, check_only: bool = False
    ) -> None:
        """Read chunks that all lie in one file."""
        if not _native.available():
            for k, dest in items:
                if not isinstance(dest, memoryview):
                    raise ValueError(f"chunk {k}: reading without a buffer as destination needs the C engine")
                self.read_chunk(k, dest, verify, None)
            return
        chunks = self.chunks
        data_key = self.data_key or None
        reads: Sequence[tuple[int, Destination]] = items  # (number in the file read, destination)
        records = [chunks[k] for k, _ in items]
        if chunks[items[0][0]].source < 0:  # this file: a chunk's number here is its own
            fd, file_id = self.fd, self.file_id
        else:
            where = [self._source(k, None) for k, _ in items]
            fd, file_id = where[0][0], where[0][1]
            if data_key:  # an encrypted referenced file: its key and tags
                data_key = self._crypto_of(items[0][0])[0]
                records = [ch._replace(tag=self._crypto_of(k)[3]) for (k, _), ch in zip(items, records)]
            reads = [(number, d) for (_, d), (_, _, number) in zip(items, where)]
        # No readahead advice for the whole range here: one POSIX_FADV_WILLNEED for all of
        # it blocks until all of it is queued (cold 1 GiB loads ran at 0.84 GB/s with it).
        # The engine's threads advise a sliding window of chunks ahead of theirs instead.
        status = chunkrecords.read_chunks(
            fd,
            file_id,
            reads,
            records,
            verify,
            _native.default_threads(),
            check_only=verify and check_only,
            key=data_key,
        )
        if status is not None:
            raise self.native_error(status, items)

    def native_error(
        self, status: tuple[int, int, int, int, int], items: Sequence[tuple[int, Destination]]
    ) -> Exception:
        """The exception for a failed engine read of `items` (status as read_chunks gives it)."""
        return chunkerrors.native_error(self, status, [k for k, _ in items])

    # -- mapped files and whole-file checks ------------------------------------
    def start_check_mapped(
        self, mm: mmap.mmap, ranges: Sequence[tuple[int, int]], background: bool
    ) -> Callable[[], None]:
        """Start checking the raw chunks of `ranges` ((first, count) each) in `mm`, the file's mapping
        (C engine: in parallel, on a thread of its own with `background`; else here, now, signed
        files' SHA-256 too); returns what waits and raises the first damaged chunk's error."""
        ks = [k for first, count in ranges for k in range(first, first + count)]
        if _native.available():
            check = chunkrecords.MappedCheck(mm, self.file_id, ks, self.chunks, background)
            return lambda: self._fail_on(check.wait(), ks)
        with memoryview(mm) as mv:
            for k in ks:
                self._check_mapped_chunk(mv, k, self.chunks[k])
        return lambda: None

    def _fail_on(self, status: chunkrecords.Status | None, ks: list[int]) -> None:
        if status is not None:  # the engine's failure, as read_chunks reports it
            raise self.native_error(status, [(k, memoryview(b"")) for k in ks])

    def _check_signed(
        self, file_id: bytes, number: int, ch: Chunk, stored: memoryview | bytes, k: int, key: str | None
    ) -> None:
        """A signed file's chunk has the SHA-256 its signature binds (a load of others never imports this)."""
        from ..format.signing import chunk_digest

        fields = (ch.offset, ch.stored_len, ch.raw_len, ch.codec, ch.filter, ch.width)
        if ch.sha != chunk_digest(file_id, number, *fields, stored):
            raise self._error(SignatureError, _SHA_MISMATCH, k, key, ch.offset)

    def _check_mapped_chunk(self, mv: memoryview, k: int, ch: Chunk) -> None:
        key = self.key_of(k)
        stored = mv[ch.offset : ch.offset + ch.stored_len]
        seed = fmt.chunk_seed(
            self.file_id, k, ch.offset, ch.stored_len, ch.raw_len, ch.codec, ch.filter, ch.width
        )
        if xxhash.xxh3_64_intdigest(stored, seed=seed) != ch.checksum:
            raise self._error(CorruptError, "checksum mismatch", k, key, ch.offset)
        if ch.sha:
            self._check_signed(self.file_id, k, ch, stored, k, key)
        if any(mv[ch.offset + ch.stored_len : ch.offset + ch.stored_len + ch.pad]):
            raise self._error(
                CorruptError, "padding after the chunk is not zero", k, key, ch.offset + ch.stored_len
            )
        if ch.digest and fmt.content_digest(stored) != ch.digest:
            raise self._error(CorruptError, _DIGEST_MISMATCH, k, key, ch.offset)

    def iter_chunk_problems(
        self, progress: Callable[[int, int], None] | None = None
    ) -> Iterator[CheckpointError]:
        """Check every chunk; yield one error per damaged chunk and go on.

        Chunks are checked in windows of CHECK_WINDOW bytes, or CHECK_WINDOW_UNTOUCHED
        where no chunk needs a destination (in parallel with the C engine); a window
        that fails is checked again in halves, down to single chunks, so that every
        damaged chunk is reported, in order, while the sound ones are checked in few
        calls.  A referenced file that cannot be used is
        reported once, at its first chunk, and its other chunks are skipped.
        """
        unusable = set(self._ext_failed)  # reported already (external_problems)
        # Checking only, the engine writes into a destination just the chunks whose content
        # digest it takes after decoding.  Without any, chunks need no destination, and a
        # call can take far more of them: fewer calls, each with a tail where one thread
        # finishes alone.
        untouched = _native.available() and not any(ch.digest for ch in self.chunks)
        cap = CHECK_WINDOW_UNTOUCHED if untouched else CHECK_WINDOW
        # the cap, or the largest chunk when larger, but never more than all chunks together
        raw = [ch.raw_len for ch in self.chunks]
        window = min(max(cap, max(raw, default=0)), max(1, sum(raw)))
        # an anonymous mapping: pages on first touch, like a fresh tensor, without torch (verify
        # imports neither torch nor numpy)
        view = None if untouched else memoryview(mmap.mmap(-1, window))
        k = 0
        n = len(self.chunks)
        while k < n:
            if progress is not None:
                progress(k, n)
            items: list[tuple[int, Destination]] = []
            pos = 0
            while k < n and (not items or pos + self.chunks[k].raw_len <= window):
                if self.chunks[k].source not in unusable:
                    items.append((k, None if view is None else view[pos : pos + self.chunks[k].raw_len]))
                    pos += self.chunks[k].raw_len
                k += 1
            yield from self._check_halving(items, unusable)

    def _check_halving(
        self, items: list[tuple[int, Destination]], unusable: set[int]
    ) -> Iterator[CheckpointError]:
        """Check `items` in one call; where that fails, each half again, down to single chunks.
        A chunk of a referenced file that cannot be used marks that file `unusable`."""
        items = [(k, d) for k, d in items if self.chunks[k].source not in unusable]
        if not items:
            return
        try:
            self.read_into(items, True, check_only=True)
            return
        except CheckpointError as e:
            if len(items) == 1:
                if self.chunks[items[0][0]].source in self._ext_failed:
                    unusable.add(self.chunks[items[0][0]].source)
                yield e
                return
        half = len(items) // 2
        yield from self._check_halving(items[:half], unusable)
        yield from self._check_halving(items[half:], unusable)
