"""Reading ckptfmt files: CheckpointFile, an open file with its validated index.

This is the reference reader.  It ties three parts together: the index rules
(index.py: the prologue, footer and index are validated before any chunk is read),
chunk reads (chunkread.py: each chunk read, verified and decoded into its
destination, external chunks from the files they lie in), host memory for storages
(hostalloc.py), and what is here: where storages are placed (host memory, a mapping of
the file, a device through a bounded staging buffer), the memory a load may take, and navigation of the object tree.
Every number taken from the file is validated before use; every failure is a
CheckpointError that names the path, key, chunk and offset.

Opening a file and checking its chunks (verify, inspect, sign) needs neither torch nor
numpy; the methods that place storages import torch and what builds on it when they run.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..engine import native as _native
from ..engine.chunkread import ChunkReader, Destination
from ..engine.ckptdir import CheckpointDir
from ..engine.sources import References
from ..errors import (
    CheckpointError,
    CorruptError,
    IncompleteError,
    LimitError,
    SignatureError,
    UnsupportedError,
)
from ..fileio import is_url, open_regular
from ..format import layout as fmt
from ..format import tree

# imported with the reader, not by its first load (decode needs no torch to import): a first load in a
# fresh process is short for many small tensors, and pays every import left on its path
from ..format.decode import decode, decode_key, decode_plain, decode_raw
from ..format.index import Authenticator, Chunk, External, parse_index
from ..format.indexjson import parse_index_json
from ..gcpause import pausing_in_main_thread
from . import hostalloc

if TYPE_CHECKING:
    import torch

    from ..format import devices
    from ..format.encryption import Opener
    from ..storage.download import RemoteObject
    from ..storage.references import ObjectReferences

__all__ = [
    "MAX_OPEN_EXTERNALS",
    "CheckpointFile",
    "Chunk",
    "External",
    "open_regular",
    "parse_index_json",
    "staging_budget",
]

#: referenced files kept open at once by one reader (least recently used are closed);
#: read at each open, so that it may be lowered for a process
MAX_OPEN_EXTERNALS = 16
#: a verified mapping's check runs beside the building of the tensors (on a thread of its own)
#: from this many storages on: fewer do not repay the thread's start and join (about half a
#: millisecond: a 4-tensor load took 1.2 ms with the thread against 0.5 without, 10^4 tensors
#: 125 ms against 130)
_CHECK_BESIDE_AT = 2048


def _force_staging() -> bool:
    """CKPTFMT_FORCE_STAGING=1 routes CPU loads through the staged device path (tests use it without a GPU)."""
    return bool(os.environ.get("CKPTFMT_FORCE_STAGING"))


def _checked_storage_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """storage_options checked (storage.client.check_options); the object-store modules are
    imported only when options are given: a local load of many small tensors is short, and
    a process's first load pays every import on its path."""
    if options is None:
        return {}
    from ..storage.client import check_options

    return check_options(options)


def _trusted_set(trusted_keys: Any) -> frozenset[bytes] | None:
    """signing.trusted_set; None when no signature is demanded, without importing the signature
    handling (files/signing.py, format/signing.py): a load of many small tensors is short, and a
    process's first load pays every import on its path."""
    if trusted_keys is None:
        return None
    from . import signing

    return signing.trusted_set(trusted_keys)


def _authenticator(trusted: frozenset[bytes] | None, path: str) -> Authenticator | None:
    """signing.authenticator; None when no signature is demanded."""
    if trusted is None:
        return None
    from . import signing

    return signing.authenticator(trusted, path)


def _opener(decrypt_with: Any) -> Opener | None:
    """The reader's way into encrypted files, from the user's key (files.encryption.opener);
    None, without importing the key handling, when no key is given."""
    if decrypt_with is None:
        return None
    from . import encryption

    return encryption.opener(decrypt_with)


def staging_budget() -> int:
    """Host bytes a load onto an accelerator may stage at once (the staging pool's limit)."""
    from ..background.staging import POOL

    return POOL.limit


class CheckpointFile:
    """An open ckptfmt file with its validated index.

    `max_bytes` bounds the memory this reader allocates for the index (estimated before
    it is parsed, fmt.index_memory_bound) and, per load, for the storages it reads and
    their decode buffers: LimitError before anything above it is allocated.

    The index's records are attributes (`prologue`, `footer`, `chunk_size`, `producer`,
    `metadata`, `source_devices`, `storages`, `has_digests`, `externals`, `chunks`, `tree`,
    `index_memory`); chunks are read by its ChunkReader, which owns the file's descriptor.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        fd: int | None = None,
        within: CheckpointDir | None = None,
        trusted_keys: Any = None,
        storage_options: dict[str, Any] | None = None,
        decrypt_with: Any = None,
        ciphertext_only: bool = False,
        reference_etags: dict[str, str] | None = None,
        etag: str | None = None,
        read_ahead: bool = False,
    ) -> None:
        """`fd`: the file, already opened and checked by the caller (it is owned from here on;
        `path` then only names it in messages).  `within`: the directory holding it, through
        which its reference paths are resolved (spec 12.3); default the directory of `path`.
        `trusted_keys`: the file must be signed by one of these keys (spec section 16): the
        signature is checked here, before any chunk is read (SignatureError), and every chunk
        read is then checked against its signed digest, whatever `verify` a caller passes.
        `storage_options`: for an object-store URL (storage/): the client's settings; the
        object's bytes are fetched as they are read, each range pinned to its first ETag.
        `decrypt_with`: the key of an encrypted file (spec section 17, files/encryption.py):
        its data key is unwrapped and its index's tag checked here, each chunk's tag as it is
        read.  `ciphertext_only` (verify without a key): see format.index.parse_index.
        `reference_etags`: on a store, the versions referenced objects must be read at (by
        reference path; storage/references.py).  `etag`: on a store, the version of the object
        the caller checked (hashed against a signed record) before: another one is refused.
        `read_ahead` (an object-store URL): the caller reads every chunk (a load, a verify): the
        first reads take whole requests, whose bytes the chunk reads reuse (storage/download.py)."""
        self.path = os.fspath(path)
        options = _checked_storage_options(storage_options)
        trusted = _trusted_set(trusted_keys)  # bad keys fail before the file is opened
        opener = _opener(decrypt_with)
        if trusted is not None and _native.available() and not _native.crypto_available():
            raise CheckpointError(
                "checking signatures needs the C engine built with OpenSSL's libcrypto (libssl-dev); "
                "this one was built without it (CKPTFMT_BACKEND=python checks them in Python)",
                path=self.path,
            )
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
            if fd is not None:
                os.close(fd)
            raise ValueError(f"max_bytes must be None or a non-negative int, not {max_bytes!r}")
        self.max_bytes = max_bytes
        remote: RemoteObject | None = None
        if fd is None and is_url(self.path):
            from ..storage.download import RemoteObject

            remote = RemoteObject(self.path, options, max_bytes=max_bytes, etag=etag, read_ahead=read_ahead)
            fd = remote.dup_fd()
        elif fd is None:
            fd = open_regular(self.path)
        try:
            try:
                index = parse_index(
                    fd,
                    self.path,
                    max_bytes,
                    opener,
                    ciphertext_only,
                    _authenticator(trusted, self.path),
                )
            except (CorruptError, IncompleteError, UnsupportedError) as e:
                if trusted is None:
                    raise
                # a signature was demanded: a file whose structure fails is not the one signed
                raise SignatureError(
                    f"not a file signed by a trusted key: {e.reason}", path=self.path, offset=e.offset
                ) from e
            if trusted is not None:
                from . import signing

                index = signing.check(index, trusted, self.path)
        except BaseException:
            os.close(fd)
            if remote is not None:
                remote.close()
            raise
        #: a signature by a trusted key was demanded and checked: every chunk read is verified
        self.signed = trusted is not None
        #: an encrypted file (section 17); its chunks are decrypted when opened with the key
        self.encrypted = index.encryption is not None
        self.index = index
        self.prologue = index.prologue
        self.footer = index.footer
        self.chunk_size = index.chunk_size
        self.producer = index.producer
        self.metadata = index.metadata
        self.source_devices = index.source_devices
        self.storages = index.storages
        self.has_digests = index.has_digests
        self.externals = index.externals
        self.chunks = index.chunks
        self.tree = index.tree
        #: what the index may take while it is parsed and held (an upper bound)
        self.index_memory = index.memory
        base: References | None = within.dup() if within is not None else None
        #: the objects this one refers to (on a store), which know the versions they are read at
        self._objects: ObjectReferences | None = None
        if remote is not None:  # references are objects beside it (an incremental run's steps)
            from ..storage.references import ObjectReferences

            base = self._objects = ObjectReferences(self.path.rsplit("/", 1)[0], options, reference_etags)
        self._chunk_reader = ChunkReader(fd, self.path, index, MAX_OPEN_EXTERNALS, base)
        self._chunk_reader.remote = remote
        #: an object-store URL: bytes are fetched as read; nothing can be memory-mapped
        self.remote = remote is not None
        #: the version of the object every range is read from (an object-store URL), else None
        self.etag = remote.etag if remote is not None else None
        self._mm: mmap.mmap | None = None

    @property
    def chunk_reader(self) -> ChunkReader:
        """What reads this file's chunks (engine/chunkread.py), for batched reads (engine/batched.py)."""
        return self._chunk_reader

    @property
    def _fd(self) -> int:
        """The file's descriptor (-1 once closed)."""
        return self._chunk_reader.fd

    def close(self) -> None:
        self._mm = None  # tensors made from the mapping keep it alive
        self._chunk_reader.close()

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- navigation ---------------------------------------------------------

    def chunk_keys(self) -> list[str]:
        """The key path of the first tensor using each chunk (renders every path: for tests and
        tools; the reader itself names a chunk's key only in an error, with key_of)."""
        return [rec.key for rec in self.storages for _ in range(rec.n_chunks)]

    def key_of(self, k: int) -> str:
        """The key path of the first tensor using chunk k, rendered now (at most render.PATH_CHARS)."""
        return self.index.key_of(k)

    def root_items(self) -> list[tuple[object, int]]:
        """(key, node id) of each entry when the root is a dict; empty otherwise."""
        node = self.tree.nodes[self.tree.root]
        if node[0] not in ("dict", "odict"):
            return []
        return [(decode_key(self.tree, k, self.path), v) for k, v in node[1]]

    # -- chunk reads (chunkread.ChunkReader) ----------------------------------

    def read_into(
        self, items: Sequence[tuple[int, Destination]], verify: bool, check_only: bool = False
    ) -> None:
        """Read chunks into their destinations (exactly raw_len bytes each), checked: ChunkReader.read_into.
        A file opened with trusted keys is always verified."""
        self._chunk_reader.read_into(items, verify or self.signed, check_only)

    def external_problem(self, k: int) -> Exception | None:
        """Why external chunk k cannot be read, or None: ChunkReader.external_problem."""
        return self._chunk_reader.external_problem(k)

    def reference_version(self, rel: str) -> str | None:
        """The version (ETag, generation) the object that reference `rel` names is read at,
        once this file opened it (external_problem or a read opens it); None before, or for
        a local file."""
        return None if self._objects is None else self._objects.version_of(rel)

    def external_problems(self) -> list[CheckpointError]:
        """Every referenced file that cannot be used: ChunkReader.external_problems."""
        return self._chunk_reader.external_problems()

    def iter_chunk_problems(
        self, progress: Callable[[int, int], None] | None = None
    ) -> Iterator[CheckpointError]:
        """Check every chunk; yield one error per damaged chunk: ChunkReader.iter_chunk_problems."""
        return self._chunk_reader.iter_chunk_problems(progress)

    # -- placement ----------------------------------------------------------

    def _chunk_views(
        self, sid: int, flat: torch.Tensor, first: int = 0, count: int | None = None
    ) -> list[tuple[int, memoryview]]:
        """(chunk, destination) for chunks [first, first+count) of a storage, placed from the start of `flat`."""
        from ..engine import bytesview

        rec = self.storages[sid]
        count = rec.n_chunks - first if count is None else count
        view = bytesview.tensor_bytes(flat)
        out = []
        pos = 0
        for k in range(rec.first_chunk + first, rec.first_chunk + first + count):
            n = self.chunks[k].raw_len
            out.append((k, view[pos : pos + n]))
            pos += n
        return out

    def read_storages(self, sids: list[int], verify: bool) -> dict[int, torch.UntypedStorage]:
        """CPU storages for `sids`, all their chunks read (in parallel) and checked."""
        storages = hostalloc.alloc_storages(self.path, self.storages, sids)
        self.read_into(self._destinations(sids, storages), verify)
        return storages

    def _destinations(
        self,
        sids: list[int],
        storages: dict[int, torch.UntypedStorage] | dict[int, torch.UntypedStorage | torch.Tensor],
    ) -> list[tuple[int, Destination]]:
        """(chunk, destination) for every chunk of `sids`, placed in order in their storages
        (or in tensors that span exactly their storage: hostalloc.alloc_host).
        With the C engine a destination is the address of the chunk's place: the engine writes
        there directly, without a buffer export per chunk (many small storages make many);
        each storage holds exactly its chunks' raw bytes (index.py checks every raw length
        against the storage's size), and `storages` keeps them alive for the read."""
        chunks = self.chunks
        records = self.storages
        out: list[tuple[int, Destination]] = []
        if not _native.available():
            import torch

            from ..engine import bytesview

            for sid in sids:
                st = storages[sid]
                whole = st.untyped_storage() if isinstance(st, torch.Tensor) else st
                out.extend(self._chunk_views(sid, bytesview.storage_as_uint8(whole)))
            return out
        for sid in sids:
            rec = records[sid]
            if not rec.n_chunks:
                continue
            addr = storages[sid].data_ptr()
            if rec.n_chunks == 1:
                out.append((rec.first_chunk, addr))
                continue
            for k in range(rec.first_chunk, rec.first_chunk + rec.n_chunks):
                out.append((k, addr))
                addr += chunks[k].raw_len
        return out

    def storage_bytes(self, sid: int, verify: bool) -> bytes:
        """Storage `sid`'s bytes, its chunks read and checked, without torch (decode_raw's
        reads: small storages only, such as RNG states; a load places storages instead)."""
        rec = self.storages[sid]
        buf = bytearray(rec.nbytes)
        view = memoryview(buf)
        items: list[tuple[int, Destination]] = []
        pos = 0
        for k in range(rec.first_chunk, rec.first_chunk + rec.n_chunks):
            n = self.chunks[k].raw_len
            items.append((k, view[pos : pos + n]))
            pos += n
        self.read_into(items, verify)
        return bytes(buf)

    def load_raw(self, top: int, verify: bool) -> object:
        """The subtree at `top` as decode_raw builds it (no torch, no numpy): tensors and arrays
        as RawArrays whose bytes are read, and checked, only when asked for."""
        return decode_raw(self.tree, top, lambda sid: self.storage_bytes(sid, verify), self.path)

    def load_plain(self, top: int, verify: bool) -> object:
        """The subtree at `top` as decode_plain builds it (no torch, no numpy): arrays as
        StoredArrays, their bytes read and checked now, within max_bytes (a commit record)."""
        self._check_memory(tree.storages_under(self.tree, top), 0)
        return decode_plain(self.tree, top, lambda sid: self.storage_bytes(sid, verify), self.path)

    def read_storage(self, sid: int, verify: bool) -> torch.UntypedStorage:
        return self.read_storages([sid], verify)[sid]

    def _read_to_device(
        self, sids: list[int], device: torch.device, verify: bool, budget: int
    ) -> dict[int, Any]:
        """Storages read through bounded host staging onto `device`.

        Staging is max(budget, one chunk) bytes, or all the storages' bytes when fewer, in
        two buffers from the staging pool (pinned for accelerators, and reused by the next
        load or non-blocking save): while one buffer's bytes are copied to the device
        without blocking, the next chunks are read into the other.  A buffer is refilled
        only after the event recorded behind its copy has completed.
        """
        import torch

        from ..background.staging import POOL

        pinned = device.type not in ("cpu", "meta") and torch.accelerator.is_available()
        size = self._staging_size(sids, budget)
        # two buffers of whole chunks when the budget holds two chunks; one otherwise
        halves = 2 if size >= 2 * self.chunk_size else 1
        per_buffer = size // halves // self.chunk_size * self.chunk_size or size
        buffers = [POOL.acquire(per_buffer, pinned) for _ in range(halves)]
        fences: list[Any] = [None] * halves
        out: dict[int, Any] = {}
        done = False
        try:
            fill = 0
            for sid in sids:
                rec = self.storages[sid]
                dest = torch.empty(rec.nbytes, dtype=torch.uint8, device=device)
                per_fill = max(1, per_buffer // self.chunk_size)
                for first in range(0, rec.n_chunks, per_fill):
                    b = fill % halves
                    fill += 1
                    if fences[b] is not None:
                        fences[b].synchronize()  # its last copy has read the buffer
                    count = min(per_fill, rec.n_chunks - first)
                    items = self._chunk_views(sid, buffers[b], first, count)
                    self.read_into(items, verify)
                    start = first * self.chunk_size
                    n = sum(len(v) for _, v in items)
                    dest[start : start + n].copy_(buffers[b][:n], non_blocking=pinned)
                    if pinned:
                        fences[b] = torch.accelerator.current_stream(device).record_event()
                out[sid] = dest.untyped_storage()
            for fence in fences:
                if fence is not None:
                    fence.synchronize()
            done = True
        finally:
            for buf, fence in zip(buffers, fences):
                if done or fence is None:
                    POOL.release(buf)
                else:  # a copy may still be reading it: never reuse it
                    POOL.discard(buf)
        return out

    def _mappable(self, sid: int) -> bool:
        """Whether a storage can be backed by the file itself: all its chunks raw and in this
        file (external chunks are read from their own files)."""
        rec = self.storages[sid]
        if rec.n_chunks == 1:  # the common storage, checked without a slice
            ch = self.chunks[rec.first_chunk]
            return ch.codec == fmt.CODEC_RAW and ch.source < 0
        chunks = self.chunks[rec.first_chunk : rec.first_chunk + rec.n_chunks]
        return bool(chunks) and all(c.codec == fmt.CODEC_RAW and c.source < 0 for c in chunks)

    def _mapped_storages(
        self, sids: list[int], verify: bool, made: dict[int, torch.Tensor] | None = None
    ) -> dict[int, torch.UntypedStorage]:
        """Storages backed by the file itself (zero-copy), for mappable `sids`.  With `verify`
        every chunk of all of them is checked in one engine call, so that its threads share
        the whole load, not one storage at a time; the tensors are built meanwhile (building
        them reads no page) and returned only once the check has passed.  With `made`, a storage
        whose first tensor spans exactly its bytes is mapped as that tensor instead, put in
        `made` by node (one call less per tensor; the storage is then that tensor's)."""
        if not sids:
            return {}
        if self._mm is None:
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
        if len(self._mm) < self.footer.index_offset:  # every chunk lies before the index
            raise IncompleteError(
                f"the file shrank to {len(self._mm)} bytes after it was opened; its chunks end at "
                f"{self.footer.index_offset}",
                path=self.path,
            )
        wait = None
        if verify:
            ranges = [(self.storages[sid].first_chunk, self.storages[sid].n_chunks) for sid in sids]
            wait = self._chunk_reader.start_check_mapped(self._mm, ranges, len(sids) >= _CHECK_BESIDE_AT)
        try:
            out = self._map_storages(sids, made)
        except BaseException:
            if wait is not None:  # no check outlives the load: the failure raised is this one
                with contextlib.suppress(Exception):
                    wait()
            raise
        if wait is not None:
            wait()
        return out

    def _map_storages(
        self, sids: list[int], made: dict[int, torch.Tensor] | None
    ) -> dict[int, torch.UntypedStorage]:
        """The storages (or, in `made`, first tensors) of `sids` over the mapping, unchecked."""
        import torch

        from ..format.dtypes import TORCH_DTYPES

        out = {}
        nodes = self.tree.nodes
        frombuffer, mm, uint8 = torch.frombuffer, self._mm, torch.uint8
        for sid in sids:
            rec = self.storages[sid]
            offset = self.chunks[rec.first_chunk].offset
            if not rec.whole or made is None:
                out[sid] = frombuffer(mm, dtype=uint8, count=rec.nbytes, offset=offset).untyped_storage()
                continue
            m = nodes[rec.node][1]
            dtype = TORCH_DTYPES[m["dtype"]]
            count = rec.nbytes // dtype.itemsize
            # in place: a tensor of its own, not a view of the 1-D one
            made[rec.node] = frombuffer(mm, dtype=dtype, count=count, offset=offset).as_strided_(
                m["shape"], m["stride"]
            )
        return out

    @pausing_in_main_thread
    def load_subtree(
        self, top: int, map_location: devices.MapLocation, verify: bool, use_mmap: bool = False
    ) -> object:
        if use_mmap and self.encrypted:
            raise ValueError(
                f"{self.path}: mmap=True cannot map an encrypted file: its pages hold ciphertext, so a "
                "mapping would expose ciphertext, not tensors (spec 17.6); load it without mmap, which "
                "decrypts into memory"
            )
        if use_mmap and self.remote:
            raise ValueError(f"{self.path}: mmap=True needs a local file; an object is read into memory")
        # every storage is used by some node of the tree (validate.py): the root needs them all
        needed = (
            list(range(len(self.storages))) if top == self.tree.root else tree.storages_under(self.tree, top)
        )
        if not needed:  # plain values (a commit record, a resume entry): no torch needed
            return decode(self.tree, top, {}.__getitem__, self.path)  # type: ignore[arg-type]
        import torch

        from ..format import devices

        host, callable_, on_device, loaded = self._placement(needed, map_location)
        made: dict[int, torch.Tensor] = {}  # tensors built as their storage's memory is had, by node
        if use_mmap:  # a signed file's chunks are checked against their digests through the mapping
            mappable = [sid for sid in host if self._mappable(sid)]
            mapped = set(mappable)
            loaded.update(self._mapped_storages(mappable, verify or self.signed, made))
            host = [sid for sid in host if sid not in mapped]
        staging = max((self._staging_size(sids, staging_budget()) for sids in on_device.values()), default=0)
        self._check_memory(host + callable_ + [s for sids in on_device.values() for s in sids], staging)
        places = hostalloc.alloc_host(self.path, self.storages, self.tree.nodes, host, made)
        if callable_:  # map_location is handed storages
            places.update(hostalloc.alloc_storages(self.path, self.storages, callable_))
        self.read_into(self._destinations(host + callable_, places), verify)
        for sid, place in places.items():
            if type(place) is not torch.Tensor:
                loaded[sid] = place  # type: ignore[assignment]
        for sid in callable_:
            try:
                loaded[sid] = devices.apply_callable(map_location, loaded[sid], self.storages[sid].device)  # type: ignore[arg-type]
            except devices.DeviceError as e:
                raise self._device_error(sid, e) from None
        for device, sids in on_device.items():
            loaded.update(self._read_to_device(sids, device, verify, staging_budget()))
        if not made:
            return decode(self.tree, top, loaded.__getitem__, self.path)
        records = self.storages

        def storage(sid: int) -> torch.UntypedStorage:
            """A loaded storage; for one allocated as its first tensor, that tensor's (the other
            tensors sharing it are views of it)."""
            st = loaded.get(sid)
            return st if st is not None else made_by_node[records[sid].node].untyped_storage()

        made_by_node = dict(made)  # decode takes its tensors out of `made` as it uses them
        return decode(self.tree, top, storage, self.path, made)

    def _placement(
        self, needed: list[int], map_location: devices.MapLocation
    ) -> tuple[list[int], list[int], dict[torch.device, list[int]], dict[int, torch.UntypedStorage]]:
        """Where each storage of `needed` goes: read onto the CPU; read onto the CPU, then handed
        to map_location (a callable); read onto a device, by device; or made on the meta device
        (returned made).  map_location is asked once per saved device, in the order of `needed`
        (its error names the first storage saved there); numpy arrays always live on the CPU."""
        import torch

        from ..format import devices

        records = self.storages
        targets: dict[str, torch.device | None] = {}  # by saved device: the same for each storage
        for device in dict.fromkeys(records[sid].device for sid in needed if records[sid].kind != "ndarray"):
            try:
                targets[device] = devices.planned_device(map_location, device)
            except devices.DeviceError as e:
                sid = next(sid for sid in needed if records[sid].device == device)
                raise self._device_error(sid, e) from None
        cpu = not _force_staging()
        if cpu and all(t is not None and t.type == "cpu" for t in targets.values()):
            return needed, [], {}, {}  # all onto the CPU (a load of many small tensors: no loop)
        loaded: dict[int, torch.UntypedStorage] = {}
        host: list[int] = []
        callable_: list[int] = []
        on_device: dict[torch.device, list[int]] = {}
        for sid in needed:
            rec = records[sid]
            if rec.kind == "ndarray":
                host.append(sid)
                continue
            target = targets[rec.device]
            if target is None:
                callable_.append(sid)
            elif target.type == "meta":
                loaded[sid] = torch.UntypedStorage(rec.nbytes, device="meta")
            elif cpu and target.type == "cpu":
                host.append(sid)
            else:
                on_device.setdefault(target, []).append(sid)
        return host, callable_, on_device, loaded

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
