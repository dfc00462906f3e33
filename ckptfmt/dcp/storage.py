"""DCP's StorageWriter and StorageReader on ckptfmt files.

A checkpoint is a directory (spec/FORMAT.md, "Multi-file checkpoints", layout "dcp")::

    rank-00000.ckpt   each rank's items: an ordinary ckptfmt file whose root dict maps
    rank-00001.ckpt   the item's number to a contiguous tensor (a rank's shard, or a whole
    ...               replicated tensor) or to a non-tensor value in ckptfmt's object model
    COMMIT            written last by the coordinator: names every rank file by name, length,
                      file id and index checksum, and holds DCP's Metadata as plain values

Each rank writes and commits its own file in parallel (temp file, fsync, rename,
directory fsync) with the C engine; the coordinator then checks that every file the
ranks reported is there, unchanged, and writes the commit record the same way.
A directory without a commit record that verifies is not a checkpoint.  The
Reader also accepts a single ckptfmt file (one with full tensors, as
``consolidate`` writes) and serves each rank just its slice.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import socket
import uuid
from typing import Any, TypedDict

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.planner import LoadPlanner as _BaseLoadPlanner
from torch.distributed.checkpoint.planner import SavePlanner as _BaseSavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..engine import native as _native
from ..engine.ckptdir import CheckpointDir
from ..errors import CheckpointError, CorruptError, IncompleteError, UnsupportedError, UnsupportedObjectError
from ..fileio import is_url
from ..files import encryption, multifile, places, recordsign
from ..files import save as writer
from ..files.incremental import MIN_REFERENCE_BYTES
from ..files.places import LocalPlace, Place
from ..files.reader import CheckpointFile
from ..gcpause import pausing_in_main_thread
from . import metadata as mdv
from . import regions
from .check import check_items, read_record
from .sources import LAYOUT, RANK_FILE_RE, Source, rank_file_name, rank_note
from .values import ObjectBytes, decode_value, encode_value, raw_bytes_io

#: DCP's default planner's value transform: torch.save (a pickle)
_STOCK_TRANSFORM = DefaultSavePlanner.transform_object


@dataclasses.dataclass(frozen=True)
class _Host:
    """A rank's local plan storage_data: where it runs and how many cores it may use."""

    name: str
    cores: int


@dataclasses.dataclass(frozen=True)
class _RankPlan:
    """A rank's global plan storage_data: its file (saves) and its share of its host's cores."""

    file: str | None
    threads: int | None


def _this_host() -> _Host:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return _Host(socket.gethostname(), cores)


#: a rank keeps at least this many engine threads: while one waits in pwrite or fsync,
#: another hashes (on 2 cores, 2 ranks saved 1 GiB in 0.57 s with two threads each and
#: in 0.72 s with one)
MIN_RANK_THREADS = 2


def _thread_shares(hosts: list[object]) -> list[int | None]:
    """Each rank's engine threads: its host's cores split between the ranks on that host
    (ranks of one machine that each started a thread per core would fight for the cores),
    at least MIN_RANK_THREADS."""
    per_host = collections.Counter(h.name for h in hosts if isinstance(h, _Host))
    return [
        max(MIN_RANK_THREADS, h.cores // per_host[h.name]) if isinstance(h, _Host) else None for h in hosts
    ]


def _plan_threads(storage_data: object) -> int | None:
    return storage_data.threads if isinstance(storage_data, _RankPlan) else None


@dataclasses.dataclass(frozen=True)
class StorageInfo:
    """A WriteResult's storage_data: the rank file holding the item, its key there, and the
    file's identity as its writer committed it (the coordinator checks it before the commit)."""

    file: str
    key: int
    part: multifile.PartRecord | None = None
    refs: tuple[multifile.PartRecord, ...] = ()  # the files of earlier saves it reads chunks from


class SaveOptions(TypedDict, total=False):
    """The options of a save that its Writer takes, named once for ``save``, ``async_save``
    and ``Writer``: ckptfmt's `compression` (with its `level`) and `chunk_size`; the commit
    record's `step`, `metrics` and `metadata` (the checkpoint manager's fields); `overwrite`
    (False refuses a directory that already holds a checkpoint); `sign_with`, an Ed25519
    private key that signs the commit record with every rank file's SHA-256 (spec 16.7); and
    `encrypt_with`, a key that encrypts every rank file (spec section 17; the record, DCP's
    metadata with the names and shapes, stays in clear); `storage_options`, the object-store
    client's settings when the checkpoint is a URL (``s3://bucket/prefix``); `incremental`,
    rank files with content digests (spec section 12), which later saves can refer to; `base`
    (implies `incremental`), an earlier such checkpoint (a directory, or a prefix of the same
    bucket) each rank file is saved against: chunks its file of the same name already stores
    (or a file that one refers to) are referred to, not written again; the record names them."""

    compression: str | None
    level: int | None
    chunk_size: int | None
    step: int | None
    metrics: dict[str, float] | None
    metadata: dict[str, str] | None
    overwrite: bool
    sign_with: Any
    encrypt_with: Any
    storage_options: dict[str, Any] | None
    incremental: bool
    base: str | os.PathLike[str] | None


class _HeldPlace:
    """The checkpoint's place a Writer or Reader opened once (`_place`: a local directory held
    open, or an object prefix), closed with it."""

    _place: Place | None = None

    def close(self) -> None:
        """Close the place (a directory's descriptor; the next save or read opens it again)."""
        if self._place is not None:
            self._place.close()
            self._place = None

    def __del__(self) -> None:
        self.close()


class Writer(_HeldPlace, StorageWriter):
    """Writes a DCP save as one ckptfmt file per rank plus a commit record (see the module doc).

    Use with ``planner=cdcp.SavePlanner()``: DCP's default planner pickles non-tensor
    values, which this writer refuses.  `step`, `metrics` and `metadata` go into the commit
    record (the checkpoint manager's fields); `compression` and `chunk_size` are ckptfmt's.
    ``overwrite=False`` refuses to save into a directory that holds a commit record (DCP's
    FileSystemWriter option; True by default, as there).

    `path` may be an object-store URL (``s3://bucket/prefix``, the client's settings in
    `storage_options`): each rank streams its file into a multipart upload of its own object,
    and the coordinator creates the commit record last, only if absent (spec 13.7).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        compression: str | None = None,
        level: int | None = None,
        chunk_size: int | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        metadata: dict[str, str] | None = None,
        overwrite: bool = True,
        sign_with: Any = None,
        encrypt_with: Any = None,
        storage_options: dict[str, Any] | None = None,
        incremental: bool = False,
        base: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        self.path = places.normalized(path)
        self.storage_options = places.check_place_options(self.path, storage_options)
        self.base = None if base is None else places.normalized(base)
        self.incremental = incremental or base is not None
        if self.base is not None and is_url(self.base) != is_url(self.path):
            raise ValueError(f"{self.path}: base {self.base} must lie where the checkpoint does")
        encryption.sealer(encrypt_with)  # a bad key, or an engine without libcrypto, fails here
        self._encrypt = encrypt_with
        self._sign_key = recordsign.private_key(sign_with)  # a bad key fails before any rank writes
        writer.signer(self._sign_key)  # and an engine without libcrypto
        # The directory is opened once per save and every write, unlink and listing is
        # made beneath that descriptor (spec 13.6); held_writer lends one (`_within`) or says
        # a manager made it (`_step_dir`).
        self._within: CheckpointDir | None = None
        self._step_dir = False
        self._place: Place | None = None
        self.overwrite = overwrite
        self.compression = compression
        self.level = level
        self.meta = writer.check_save_args(compression, level, metadata)
        self.chunk_size = writer.check_chunk_size(chunk_size)
        self.step = step
        self.metrics = dict(metrics or {})
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            path = places.normalized(checkpoint_id)
            if path != self.path:
                self._within = None
                self._step_dir = False
                places.check_place_options(path, self.storage_options)
            self.path = path
        self.close()  # each save opens the directory afresh
        self.save_id = uuid.uuid4().hex

    def _d(self) -> Place:
        """The checkpoint's place, opened on first use in this save (a directory is created
        when absent, unless a manager made it)."""
        if self._place is None:
            if self._within is not None:
                self._place = LocalPlace(self._within.dup())
            elif self._step_dir:
                with multifile.opened(os.path.dirname(self.path)) as parent:
                    try:
                        self._place = LocalPlace(parent.sub(os.path.basename(self.path)))
                    except FileNotFoundError:
                        raise IncompleteError("the step directory is gone", path=self.path) from None
            else:
                self._place = places.place_at(self.path, self.storage_options, create=True)
        return self._place

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        if kwargs.get("use_collectives", True) is False:
            raise UnsupportedError(
                "use_collectives=False (rank-local metadata, no commit record) is not supported: "
                "a ckptfmt checkpoint is complete only with its commit record",
                path=self.path,
            )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        d = self._d()
        # every rank checks, before the coordinator removes the old record (prepare_global_plan)
        if not self.overwrite and d.exists(multifile.COMMIT_NAME):
            raise CheckpointError("a checkpoint is already there (overwrite=False)", path=self.path)
        return dataclasses.replace(plan, storage_data=_this_host())

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes: an older checkpoint in this
        # directory stops being one now, so a save that dies half way never leaves a
        # commit record next to a mix of old and new rank files.
        self._d().withdraw_record()
        shares = _thread_shares([p.storage_data for p in plans])
        return [
            dataclasses.replace(p, storage_data=_RankPlan(rank_file_name(i), t))
            for i, (p, t) in enumerate(zip(plans, shares))
        ]

    def write_data(self, plan: SavePlan, planner: _BaseSavePlanner) -> Future[list[WriteResult]]:
        name = plan.storage_data.file if isinstance(plan.storage_data, _RankPlan) else None
        if not isinstance(name, str) or RANK_FILE_RE.fullmatch(name) is None:
            raise CheckpointError(f"the save plan names no rank file ({name!r})", path=self.path)
        state: dict[int, Any] = {}
        sizes: list[int] = []
        for n, item in enumerate(plan.items):
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                state[n] = _byte_value(planner, item)
                sizes.append(0)
            else:
                t = planner.resolve_data(item)
                if not isinstance(t, torch.Tensor):
                    raise UnsupportedObjectError(f"the planner resolved a {type(t).__name__}", key=fqn)
                t = _compact(t.detach())
                if item.tensor_data is not None and tuple(t.shape) != tuple(item.tensor_data.chunk.sizes):
                    raise CheckpointError(
                        f"the planner resolved shape {list(t.shape)} for a chunk of "
                        f"{list(item.tensor_data.chunk.sizes)}",
                        path=self.path,
                        key=fqn,
                    )
                state[n] = t
                sizes.append(t.numel() * t.element_size())
        fut: Future[list[WriteResult]] = Future()
        if not plan.items:
            fut.set_result([])
            if not self.is_coordinator:
                self.close()
            return fut
        try:
            with _native.threads_at_most(_plan_threads(plan.storage_data)):
                part, refs = self._write_rank_file(name, state)
        finally:
            if not self.is_coordinator:  # the coordinator's finish uses the directory still
                self.close()
        fut.set_result(
            [
                WriteResult(
                    index=item.index, size_in_bytes=size, storage_data=StorageInfo(name, n, part, refs)
                )
                for n, (item, size) in enumerate(zip(plan.items, sizes))
            ]
        )
        return fut

    def _write_rank_file(
        self, name: str, state: dict[int, Any]
    ) -> tuple[multifile.PartRecord, tuple[multifile.PartRecord, ...]]:
        """Write and commit one rank file holding `state` (item number -> value): its identity,
        and those of the files of earlier checkpoints it reads chunks from."""
        d = self._d()
        options: dict[str, Any] = {
            "compression": self.compression,
            "level": self.level,
            "metadata": {**self.meta, "dcp_rank": str(self.rank), "dcp_save_id": self.save_id},
            "chunk_size": self.chunk_size,
            "encrypt_with": self._encrypt,
        }
        if not self.incremental:
            d.save(name, state, **options)
            refs: tuple[multifile.PartRecord, ...] = ()
        else:
            base = self._base_file(name)
            d.save_against(name, state, base, min_reference_bytes=MIN_REFERENCE_BYTES, **options)
            key = encryption.save_and_read_keys(self._encrypt, None)[1]
            refs = tuple(d.describe(rel) for rel in d.references_of(name, key))
        part = d.describe(name)
        if self._sign_key is not None:  # each rank hashes its files, so the coordinator reads none
            part, refs = d.with_digest(part), tuple(d.with_digest(r) for r in refs)
        return part, refs

    def _base_file(self, name: str) -> str | None:
        """The file of `base` that rank file `name` is saved against: the one of that name its
        commit record names, or None (no base, or a base saved by fewer ranks)."""
        if self.base is None:
            return None
        with places.place_at(self.base, self.storage_options) as base:
            record = base.read_record()
            if not any(p.name == name for p in record.files):
                return None
            return str(base.path_of(name))

    @pausing_in_main_thread
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._finish(metadata, results)
        finally:
            self.close()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        d = self._d()
        parts: dict[str, multifile.PartRecord] = {}
        refs: dict[str, multifile.PartRecord] = {}
        where: dict[MetadataIndex, tuple[str, int]] = {}
        for rank, rank_results in enumerate(results):
            for wr in rank_results:
                info = wr.storage_data
                if not isinstance(info, StorageInfo) or info.part is None:
                    raise CheckpointError(
                        f"rank {rank} reported a result this writer did not make", path=self.path
                    )
                parts.setdefault(info.file, info.part)
                where[wr.index] = (info.file, info.key)
                for ref in info.refs:
                    if refs.setdefault(ref.name, ref).file_id != ref.file_id:
                        raise CheckpointError(
                            f"ranks read chunks from two different files at {ref.name}", path=self.path
                        )
        if not parts:  # no rank had an item: a record names at least one file (spec 13.1, 13.5)
            name = rank_file_name(self.rank)
            parts[name] = self._write_rank_file(name, {})[0]  # no chunk: it refers to no file
        names = sorted(parts)
        for name in names:
            try:
                d.check_part(parts[name])
            except CheckpointError as e:
                raise type(e)(
                    f"{e.reason}; the coordinator must see every rank's file "
                    "(is the directory on a filesystem all ranks share?)",
                    path=self.path,
                    key=f"{name}{rank_note(name)}",
                ) from None
        parts = {name: self._digested(d, parts[name]) for name in names}
        refs = {name: self._digested(d, refs[name]) for name in sorted(refs)}
        number = {n: i for i, n in enumerate(names)}
        # DCP's plan cache hands back the Metadata of the save that filled it: name this one
        modules = metadata.storage_meta.modules if metadata.storage_meta is not None else []
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path, save_id=self.save_id, modules=modules)
        value = mdv.to_value(
            metadata,
            {idx: (number[f], k) for idx, (f, k) in where.items()},
            len(results),
            self.path,
        )
        record = multifile.CommitRecord(
            step=self.step,
            layout=LAYOUT,
            files=tuple(parts[n] for n in names),
            references=tuple(refs.values()),
            metrics=self.metrics,
            metadata=self.meta,
            layout_data=value,
        )
        d.write_record(record, sign_with=self._sign_key)
        metadata.version = value["version"]
        metadata.storage_data = {idx: StorageInfo(f, k) for idx, (f, k) in where.items()}
        _remove_stale_rank_files(d, set(names))

    def _digested(self, d: Place, p: multifile.PartRecord) -> multifile.PartRecord:
        """Digests on every entry of a signed record, on none of another."""
        if self._sign_key is None:
            return dataclasses.replace(p, sha256=None)
        return p if p.sha256 is not None else d.with_digest(p)  # None: a rank not given the key

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def held_writer(
    path: str | os.PathLike[str],
    *,
    within: CheckpointDir | None = None,
    step_dir: bool = False,
    **options: Any,
) -> Writer:
    """A Writer for ckptfmt's own callers (the checkpoint manager's step directory): `within`
    lends an open directory (the manager's held, locked step directory; dup'ed, not taken);
    `step_dir` says the directory exists (a manager made it) and is opened beneath its parent
    without following a link.  `options`: Writer's."""
    w = Writer(path, **options)
    w._within, w._step_dir = within, step_dir
    return w


def _byte_value(planner: _BaseSavePlanner, item: Any) -> Any:
    """The object behind a byte item: straight from our planner, else decoded from its bytes.
    An io.BytesIO is stored as its bytes (spec 13.5), also behind DCP's default planner, whose
    only transform, torch.save, would pickle it."""
    from .planners import SavePlanner

    if isinstance(planner, SavePlanner):
        return raw_bytes_io(planner.resolve_object(item))
    if isinstance(planner, DefaultSavePlanner) and type(planner).transform_object is _STOCK_TRANSFORM:
        found = planner.lookup_object(item.index)
        if isinstance(found, io.BytesIO):
            return raw_bytes_io(found)
    data: Any = planner.resolve_data(item)
    if isinstance(data, ObjectBytes):
        return data.value
    raw = data.getbuffer() if isinstance(data, io.BytesIO) else data.read()
    try:
        return decode_value(raw, item.index.fqn)
    except UnsupportedError:
        raise UnsupportedObjectError(
            "DCP's default planner pickled this non-tensor value; ckptfmt stores no pickle: "
            "pass planner=ckptfmt.dcp.SavePlanner()",
            key=item.index.fqn,
        ) from None


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A tensor that is exactly its storage, row-major: a view of a larger buffer (a shard of
    a padded FSDP buffer, a slice) would otherwise save the whole buffer."""
    exact = (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and not t.is_conj()
        and not t.is_neg()
    )
    if exact:
        return t
    return t.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)


def _remove_stale_rank_files(d: Place, keep: set[str]) -> None:
    """Rank files an earlier save (with more ranks) left that the new record does not name
    (a link is removed as a name, never followed), and what crashed saves left."""
    for name in d.names():
        if RANK_FILE_RE.fullmatch(name) and name not in keep:
            d.remove(name)
    d.remove_leftovers()


# -- reading --------------------------------------------------------------------------------------


class Reader(_HeldPlace, StorageReader):
    """Reads a ckptfmt DCP checkpoint directory, or a single ckptfmt file, into any sharding.

    Use with ``planner=cdcp.LoadPlanner()`` when the state holds non-tensor values.
    ``verify`` checks every chunk read against its checksum (on by default);
    ``trusted_keys``: the commit record must be signed by one of these Ed25519 public keys
    and every file read is hashed against it before it is read (spec 16.7; a single file
    must be signed itself), and with them every file a rank's plan reads is checked before
    any value is handed to the planner; ``stats`` counts what the last ``read_data`` read.
    ``decrypt_with``: the key of a save made with ``encrypt_with`` (every rank file is read
    with it; spec section 17).  `path` may be an object-store URL (the client's settings in
    `storage_options`): each rank fetches only the byte ranges of the chunks it needs, every
    read pinned to the ETag its object was checked with.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        trusted_keys: Any = None,
        decrypt_with: Any = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._trusted = recordsign.public_keys(trusted_keys)
        self._decrypt = decrypt_with
        self.path = places.normalized(path)
        self.storage_options = places.check_place_options(self.path, storage_options)
        # A checkpoint directory is opened once (or lent: held_reader): the record and every
        # rank file are read beneath that descriptor.
        self._place: Place | None = None
        self.verify = verify
        self.load_id = uuid.uuid4().hex
        self.stats = regions.ReadStats()
        self._where: dict[MetadataIndex, mdv.Location] | None = None
        self._record: multifile.CommitRecord | None = None
        self._metadata: Metadata | None = None
        self._single = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            path = places.normalized(checkpoint_id)
            if path != self.path:
                places.check_place_options(path, self.storage_options)
                self._metadata = None
                self._where = None
                self.close()
            self.path = path
        self.load_id = uuid.uuid4().hex

    @property
    def record(self) -> multifile.CommitRecord | None:
        """The commit record read_metadata read (None before, or for a single file)."""
        return self._record

    def _open_dir(self) -> Place | None:
        """The checkpoint's place, opened once; None when the path is a single file."""
        if self._place is None:
            self._place = places.checkpoint_place(self.path, self.storage_options)
        return self._place

    @pausing_in_main_thread
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            d = self._open_dir()
            if d is not None:
                self._read_commit(d)
            else:
                self._read_single_file()
            assert self._metadata is not None and self._where is not None
            # built once: cdcp.load reads the metadata before DCP does
            self._metadata.storage_data = {
                idx: StorageInfo(loc.file, loc.key) for idx, loc in self._where.items()
            }
        assert self._metadata is not None
        md = dataclasses.replace(self._metadata)
        md.storage_meta = dataclasses.replace(md.storage_meta or StorageMeta(), load_id=self.load_id)
        return md

    def _read_commit(self, d: Place) -> None:
        self._record, self._metadata, self._where = read_record(d, self._trusted)
        self._single = False

    def check_items(self, fqns: set[str] | None = None) -> tuple[list[CheckpointError], int]:
        """Every item of `fqns` (all: None) checked against its rank file as read_data checks the
        items it reads (check.check_items); and the bytes their tensors' storages hold."""

        if self._where is None:
            self.read_metadata()
        assert self._where is not None
        if self._single:  # one file, already checked whole when opened: its tensors are its own
            with CheckpointFile(self.path, storage_options=self.storage_options) as f:
                return [], sum(s.nbytes for s in f.storages)
        d = self._open_dir()
        assert d is not None and self._record is not None
        return check_items(d, self._record, self._where, fqns, self._trusted, self._decrypt)

    def _read_single_file(self) -> None:
        from .singlefile import file_metadata

        with CheckpointFile(
            self.path,
            trusted_keys=self._trusted,
            decrypt_with=self._decrypt,
            storage_options=self.storage_options,
        ) as f:
            self._metadata, self._where = file_metadata(f, os.path.basename(self.path))
        self._single = True

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._metadata is None:  # DCP always reads the metadata through this reader first
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=_this_host())

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        shares = _thread_shares([p.storage_data for p in plans])
        return [dataclasses.replace(p, storage_data=_RankPlan(None, t)) for p, t in zip(plans, shares)]

    def _open(self, name: str, sources: dict[str, Source]) -> Source:
        src = sources.get(name)
        if src is None:
            if self._single:
                src = Source(
                    self.path,
                    os.path.basename(self.path),
                    os.path.basename(self.path),
                    None,
                    keyed=False,
                    trusted=self._trusted,
                    decrypt=self._decrypt,
                    storage_options=self.storage_options,
                )
            else:
                d = self._open_dir()
                assert d is not None and self._record is not None
                src = Source(
                    d,
                    name,
                    f"{name}{rank_note(name)}",
                    self._record,
                    keyed=True,
                    trusted=self._trusted,
                    decrypt=self._decrypt,
                )
            sources[name] = src
        return src

    def read_data(self, plan: LoadPlan, planner: _BaseLoadPlanner) -> Future[None]:
        from .planners import LoadPlanner

        if self._where is None:
            self.read_metadata()
        assert self._where is not None
        self.stats = regions.ReadStats()
        sources: dict[str, Source] = {}
        jobs: list[regions.RegionJob] = []
        try:
            if self._trusted is not None:  # every file checked before any value reaches the planner
                for req in plan.items:
                    loc = self._where.get(req.storage_index)
                    if loc is not None:
                        self._open(loc.file, sources)
            for req in plan.items:
                fqn = req.storage_index.fqn
                loc = self._where.get(req.storage_index)
                if loc is None:
                    raise CorruptError(
                        f"no saved item at offsets {list(req.storage_index.offset or [])}",
                        path=self.path,
                        key=fqn,
                    )
                src = self._open(loc.file, sources)
                node = src.node(loc.key, fqn)
                if req.type == LoadItemType.BYTE_IO:
                    value = src.f.load_subtree(node, None, self.verify)
                    if isinstance(planner, LoadPlanner):
                        planner.load_bytes(req, ObjectBytes(value))
                    elif type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
                        raise UnsupportedError(
                            "DCP's default load planner would unpickle this value: "
                            "pass planner=ckptfmt.dcp.LoadPlanner()",
                            key=fqn,
                        )
                    else:
                        planner.load_bytes(req, ObjectBytes(value, encode_value(value, fqn)))
                    continue
                meta = src.tensor_meta(node, loc, fqn)
                dest = planner.resolve_tensor(req).detach()
                job = regions.plan_box(
                    src.f,
                    meta,
                    list(req.storage_offsets),
                    list(req.lengths),
                    dest,
                    _committer(planner, req, dest),
                    fqn,
                )
                if job is not None:
                    jobs.append(job)
            with _native.threads_at_most(_plan_threads(plan.storage_data)):
                regions.run_jobs(jobs, self.verify, self.stats)
        finally:
            for src in sources.values():
                src.f.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def held_reader(
    path: str | os.PathLike[str], *, within: CheckpointDir | None = None, **options: Any
) -> Reader:
    """A Reader for ckptfmt's own callers: `within`, the checkpoint's directory the caller
    opened (a step directory the manager opened beneath its run without following a link;
    dup'ed, not taken).  `options`: Reader's."""
    r = Reader(path, **options)
    if within is not None:
        r._place = LocalPlace(within.dup())
    return r


def _committer(planner: _BaseLoadPlanner, req: Any, dest: torch.Tensor) -> Any:
    return lambda: planner.commit_tensor(req, dest)
