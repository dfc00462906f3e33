"""DCP's StorageWriter on ckptfmt files (its StorageReader: reader.py).

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
Reader (reader.py) also accepts a single ckptfmt file (one with full tensors, as
``consolidate`` writes) and serves each rank just its slice.
"""

from __future__ import annotations

import dataclasses
import io
import os
import posixpath
import uuid
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypedDict

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.planner import SavePlanner as _BaseSavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..background.forksave import ForkSnapshot
from ..engine import native as _native
from ..engine.ckptdir import CheckpointDir
from ..errors import (
    CheckpointError,
    CheckpointWarning,
    IncompleteError,
    UnsupportedError,
    UnsupportedObjectError,
)
from ..fileio import is_url
from ..files import encryption, multifile, places, recordsign
from ..files import save as writer
from ..files.incremental import MIN_REFERENCE_BYTES
from ..files.names import RANK_FILE_RE, rank_file_name, rank_of, save_token
from ..files.places import LocalPlace, Place
from ..gcpause import pausing_in_main_thread
from . import forkstage
from . import metadata as mdv
from .rankplan import HeldPlace, RankPlan, StorageInfo, plan_threads, this_host, thread_shares
from .sources import LAYOUT, rank_note
from .values import ObjectBytes, decode_value, raw_bytes_io

#: DCP's default planner's value transform: torch.save (a pickle)
_STOCK_TRANSFORM = DefaultSavePlanner.transform_object


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
    (or a file that one refers to) are referred to, not written again; the record names them.
    `decrypt_with`: the key that reads the files of earlier saves (an incremental save's base,
    stale rank files), by default `encrypt_with`; needed where that is a key service's
    wrapping callable, which cannot unwrap."""

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
    decrypt_with: Any


@dataclasses.dataclass(frozen=True)
class WriterOptions:
    """A Writer's options (SaveOptions' names), checked once by `writer_options` before any
    rank writes: how each rank file is written (`compression`, `level`, `chunk_size`,
    `encrypt_with`, `incremental` against `base`, the object store's `storage_options`), what
    the commit record holds (`step`, `metrics`, `metadata`, signed with `sign_key`, the loaded
    private key), and whether a checkpoint already there may be replaced (`overwrite`)."""

    compression: str | None = None
    level: int | None = None
    chunk_size: int = 0
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    step: int | None = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    overwrite: bool = True
    sign_key: Any = None
    encrypt_with: Any = None
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    incremental: bool = False
    base: str | None = None
    decrypt_with: Any = None  # the key that reads earlier saves' files (SaveOptions)

    def __post_init__(self) -> None:  # held read-only: the options of every rank file of a save
        for name in ("metadata", "metrics", "storage_options"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def rank_file_options(self, rank: int, save_id: str) -> dict[str, Any]:
        """files.save's keywords for one rank's file (its metadata names the rank and the save)."""
        return {
            "compression": self.compression,
            "level": self.level,
            "metadata": {**self.metadata, "dcp_rank": str(rank), "dcp_save_id": save_id},
            "chunk_size": self.chunk_size,
            "encrypt_with": self.encrypt_with,
        }


def writer_options(
    path: str,
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
    decrypt_with: Any = None,
) -> WriterOptions:
    """Check a save's options (SaveOptions) for the checkpoint at `path` (normalized) and make
    them one value: a bad key, an engine without libcrypto, a base elsewhere fail here."""
    store = places.check_place_options(path, storage_options)
    base_path = None if base is None else places.normalized(base)
    if base_path is not None and is_url(base_path) != is_url(path):
        raise ValueError(f"{path}: base {base_path} must lie where the checkpoint does")
    encryption.sealer(encrypt_with)  # a bad key, or an engine without libcrypto, fails here
    incremental = incremental or base_path is not None
    if incremental:  # the base is read: a key service's wrapping callable alone fails here
        decrypt_with = encryption.save_and_read_keys(encrypt_with, decrypt_with)[1]
    elif decrypt_with is None and not callable(encrypt_with):
        decrypt_with = encrypt_with
    sign_key = recordsign.private_key(sign_with)  # a bad key fails before any rank writes
    writer.signer(sign_key)  # and an engine without libcrypto
    return WriterOptions(
        compression=compression,
        level=level,
        chunk_size=writer.check_chunk_size(chunk_size),
        metadata=writer.check_save_args(compression, level, metadata),
        step=step,
        metrics=dict(metrics or {}),
        overwrite=overwrite,
        sign_key=sign_key,
        encrypt_with=encrypt_with,
        storage_options=store or {},
        incremental=incremental,
        base=base_path,
        decrypt_with=decrypt_with,
    )


class Writer(HeldPlace, StorageWriter):
    """Writes a DCP save as one ckptfmt file per rank plus a commit record (see the module doc).

    Use with ``planner=cdcp.SavePlanner()``: DCP's default planner pickles non-tensor
    values, which this writer refuses.  `step`, `metrics` and `metadata` go into the commit
    record (the checkpoint manager's fields); `compression` and `chunk_size` are ckptfmt's.
    ``overwrite=False`` refuses to save into a directory that holds a commit record (DCP's
    FileSystemWriter option; True by default, as there).

    `path` may be an object-store URL (``s3://bucket/prefix``, the client's settings in
    `storage_options`): each rank streams its file into a multipart upload of its own object,
    and the coordinator creates the commit record last, only if absent (spec 13.7).
    The options are checked once, into `self.options` (WriterOptions).
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
        decrypt_with: Any = None,
    ) -> None:
        super().__init__()
        self.path = places.normalized(path)
        self.options = writer_options(
            self.path,
            compression=compression,
            level=level,
            chunk_size=chunk_size,
            step=step,
            metrics=metrics,
            metadata=metadata,
            overwrite=overwrite,
            sign_with=sign_with,
            encrypt_with=encrypt_with,
            storage_options=storage_options,
            incremental=incremental,
            base=base,
            decrypt_with=decrypt_with,
        )
        # The directory is opened once per save and every write, unlink and listing is
        # made beneath that descriptor (spec 13.6); held_writer lends one (`_within`) or says
        # a manager made it (`_step_dir`).
        self._within: CheckpointDir | None = None
        self._step_dir = False
        self._place: Place | None = None
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self._snapshot: ForkSnapshot | None = None  # forkstage.ForkStager's, for this save

    def take_fork_snapshot(self, snapshot: ForkSnapshot) -> None:
        """The child that will write this rank's file from a fork snapshot (forkstage.py)."""
        self.drop_fork_snapshot()
        self._snapshot = snapshot

    def drop_fork_snapshot(self) -> None:
        """Kill the fork snapshot's child unless it was handed its file (a save that failed
        before writing, or had nothing to write on this rank)."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None:
            snapshot.discard()

    @property
    def storage_options(self) -> dict[str, Any]:
        """The object-store client's settings (checked: WriterOptions)."""
        return dict(self.options.storage_options)

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
            elif self._step_dir and not is_url(self.path):
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
        self._refuse_self_as_base()
        # every rank checks, before the coordinator removes the old record (prepare_global_plan)
        if not self.options.overwrite and d.exists(multifile.COMMIT_NAME):
            raise CheckpointError("a checkpoint is already there (overwrite=False)", path=self.path)
        return dataclasses.replace(plan, storage_data=this_host())

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes: an older checkpoint in this
        # directory stops being one now, so a save that dies half way never leaves a
        # commit record next to a mix of old and new rank files.  A manager's step on a
        # store is never withdrawn: a record there is another writer's, which this save's
        # record (created only if absent) then loses to, and each rank names its file itself
        # (_own_name), so no object another record names is written over (spec 13.7).
        if not self._own_names:
            self._d().withdraw_record()
        shares = thread_shares([p.storage_data for p in plans])
        return [
            dataclasses.replace(p, storage_data=RankPlan(rank_file_name(i), t))
            for i, (p, t) in enumerate(zip(plans, shares))
        ]

    @property
    def _own_names(self) -> bool:
        """Whether each rank names its file with digits of its own: a manager's step on a store
        (held_writer's `step_dir` with a URL)."""
        return self._step_dir and is_url(self.path)

    def _own_name(self, rank: int) -> str:
        """Rank `rank`'s file name in this save: in a manager's step on a store, with 16 random
        hex digits drawn now (the plan's names may come from DCP's plan cache, the same for
        every save); plain elsewhere."""
        return rank_file_name(rank, save_token() if self._own_names else None)

    def write_data(self, plan: SavePlan, planner: _BaseSavePlanner) -> Future[list[WriteResult]]:
        snapshot, self._snapshot = self._snapshot, None
        try:
            return self._write_data(plan, planner, snapshot)
        finally:
            if snapshot is not None:
                snapshot.discard()  # a child handed its file is the save's to wait for

    def _write_data(
        self, plan: SavePlan, planner: _BaseSavePlanner, snapshot: ForkSnapshot | None
    ) -> Future[list[WriteResult]]:
        planned = plan.storage_data.file if isinstance(plan.storage_data, RankPlan) else None
        m = RANK_FILE_RE.fullmatch(planned) if isinstance(planned, str) else None
        if m is None:
            raise CheckpointError(f"the save plan names no rank file ({planned!r})", path=self.path)
        name = self._own_name(int(m.group(1)))
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
                t = _compact(t.detach()) if snapshot is None else forkstage.exact(t.detach(), fqn)
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
            with _native.threads_at_most(plan_threads(plan.storage_data)):
                part, refs = self._write_rank_file(name, state, snapshot)
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
        self, name: str, state: dict[int, Any], snapshot: ForkSnapshot | None = None
    ) -> tuple[multifile.PartRecord, tuple[multifile.PartRecord, ...]]:
        """Write and commit one rank file holding `state` (item number -> value): its identity,
        and those of the files of earlier checkpoints it reads chunks from.  `snapshot`: the
        child that writes its chunks from a fork snapshot (this thread waits for it)."""
        d = self._d()
        options = self.options.rank_file_options(self.rank, self.save_id)
        if not self.options.incremental:
            handle = d.save(name, state, snapshot, **options)
            refs: tuple[multifile.PartRecord, ...] = ()
        else:
            base = self._base_file(name)
            handle = d.save_against(
                name,
                state,
                base,
                snapshot,
                min_reference_bytes=MIN_REFERENCE_BYTES,
                decrypt_with=self.options.decrypt_with,
                **options,
            )
        if snapshot is not None and handle is not None:
            # the child's failure (SnapshotError) fails this rank's write; a bounded wait: the
            # save's thread waits for the child until inflight.DEADLINE, then kills it
            handle.wait()
        if self.options.incremental:
            recorded = d.externals_of(name, self.options.decrypt_with)
            refs = tuple(d.describe(rel) for rel in sorted(recorded))
            # a base saved again while this save read it: its record would name other files
            multifile.check_named(name, recorded.values(), refs, d.path_of(name))
        part = d.describe(name)
        if self.options.sign_key is not None:  # each rank hashes its files, so the coordinator reads none
            part, refs = d.with_digest(part), tuple(d.with_digest(r) for r in refs)
        return part, refs

    def _refuse_self_as_base(self) -> None:
        """A save against its own directory cannot be honoured: the coordinator withdraws that
        directory's record before any rank reads it as the base.  Refused on every rank before
        anything is touched (a link to the directory is the directory)."""
        base = self.options.base
        if base is None:
            return
        if is_url(self.path):
            same = base.rstrip("/") == self.path.rstrip("/")
        else:
            try:
                same = os.path.samefile(base, self.path)
            except OSError:  # no base there: the save says so when it reads it
                same = False
        if same:
            raise ValueError(f"{self.path}: a checkpoint cannot be saved against itself (base={base})")
        self._refuse_replacing_a_source(base)

    def _refuse_replacing_a_source(self, base: str) -> None:
        """Refuse a save against a base whose record names files of this directory it reads
        chunks from: the coordinator would withdraw this directory's record and the ranks
        replace those files, breaking the base (and each rank's file would refuse it too, once
        the record was gone)."""
        try:
            with places.place_at(base, self.storage_options) as place:
                record = place.read_record()
                here = [p.name for p in record.references if _same_dir(place.path_of(p.name), self.path)]
        except (CheckpointError, OSError):  # no base there, or a damaged one: the save says so later
            return
        if here:
            raise UnsupportedError(
                f"cannot be saved against {base}: it reads chunks from files of this checkpoint "
                f"({', '.join(here[:3])}), which the save would replace",
                path=self.path,
            )

    def _base_file(self, name: str) -> str | None:
        """The file of `base` that rank file `name` is saved against: the one of the same rank
        its commit record names (a name may hold its save's own digits), or None (no base, or
        a base saved by fewer ranks).  A base of
        another layout (one state file: a CheckpointManager step, ckptfmt.save) has no rank
        file to refer to: every chunk is written, with a warning."""
        if self.options.base is None:
            return None
        with places.place_at(self.options.base, self.storage_options) as base:
            record = base.read_record()
            if record.layout != LAYOUT:
                warnings.warn(
                    f"{self.path} cannot refer to {self.options.base}: it is not a checkpoint of ckptfmt.dcp "
                    f"(its layout is {record.layout!r}); every chunk is written",
                    CheckpointWarning,
                    stacklevel=2,
                )
                return None
            rank = rank_of(name)
            same = [p.name for p in record.files if rank_of(p.name) == rank]  # names may differ by save
            return str(base.path_of(same[0])) if rank is not None and len(same) == 1 else None

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
            name = self._own_name(self.rank)
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
        for name in sorted(refs):  # an earlier step another job removed meanwhile: never named
            try:
                d.check_part(refs[name])
            except CheckpointError as e:
                raise type(e)(
                    f"a file of an earlier checkpoint this save reads chunks from was removed or saved "
                    f"again meanwhile ({e.reason}): not committed",
                    path=self.path,
                    key=name,
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
            step=self.options.step,
            layout=LAYOUT,
            files=tuple(parts[n] for n in names),
            references=tuple(refs.values()),
            metrics=dict(self.options.metrics),
            metadata=dict(self.options.metadata),
            layout_data=value,
        )
        d.write_record(record, sign_with=self.options.sign_key)
        metadata.version = value["version"]
        metadata.storage_data = {idx: StorageInfo(f, k) for idx, (f, k) in where.items()}
        if self._own_names:  # a manager's step on a store: its manager deletes what others left
            d.remove_leftovers()  # (later steps may read it: ObjectRun.sweep_step)
        else:
            _remove_stale_rank_files(d, set(names), self.options.decrypt_with)

    def _digested(self, d: Place, p: multifile.PartRecord) -> multifile.PartRecord:
        """Digests on every entry of a signed record, on none of another."""
        if self.options.sign_key is None:
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
    `step_dir` says the place is a step a manager readied: a directory that exists, opened
    beneath its parent without following a link, or a prefix on a store, whose record is
    never withdrawn and whose rank files are named with this save's own token (spec 13.7).
    `options`: Writer's."""
    w = Writer(path, **options)
    w._within, w._step_dir = within, step_dir
    return w


def _same_dir(reference: str, directory: str) -> bool:
    """Whether the file a reference leads to (a path or URL through "..") lies in `directory`."""
    if is_url(reference) or is_url(directory):
        scheme, _, rest = reference.partition("://")
        return f"{scheme}://{posixpath.dirname(posixpath.normpath(rest))}" == directory.rstrip("/")
    try:
        return os.path.samefile(os.path.dirname(reference), directory)
    except OSError:  # either is not there: no file of the one is in the other
        return False


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


def _remove_stale_rank_files(d: Place, keep: set[str], key: Any = None) -> None:
    """Rank files an earlier save (with more ranks) left that the new record does not name, each
    once it is proven a rank file a DCP save of ckptfmt wrote (a file a person or another tool
    put there under such a name, or a link, is kept), and what crashed saves left.  `key`: the
    save's key, which reads the stale files of earlier saves made with it."""
    for name in d.names():
        if RANK_FILE_RE.fullmatch(name) and name not in keep and _written_by_a_save(d, name, key):
            d.remove(name)
    d.remove_leftovers()


def _written_by_a_save(d: Place, name: str, key: Any) -> bool:
    """Whether file `name` is a rank file a DCP save wrote: a ckptfmt file (opened without
    following a link) whose metadata names the rank and the save (WriterOptions.rank_file_options)."""
    try:
        with d.open_file(name, key) as f:
            return "dcp_rank" in f.metadata and "dcp_save_id" in f.metadata
    except (CheckpointError, OSError):  # not a ckptfmt file, a link, another key's: not provably ours
        return False
