"""DCP's StorageReader on ckptfmt checkpoints: a directory a Writer saved (storage.py), read
beneath one opened descriptor, or a single ckptfmt file holding full tensors, each rank served
just its slice.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.planner import LoadPlanner as _BaseLoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..engine import native as _native
from ..engine.ckptdir import CheckpointDir
from ..errors import CheckpointError, CorruptError, UnsupportedError
from ..files import multifile, places, recordsign
from ..files.places import LocalPlace, Place
from ..files.reader import CheckpointFile
from ..gcpause import pausing_in_main_thread
from . import metadata as mdv
from . import regions
from .check import check_items, read_record
from .rankplan import HeldPlace, RankPlan, StorageInfo, plan_threads, this_host, thread_shares
from .sources import Source, rank_note
from .values import ObjectBytes, encode_value


class Reader(HeldPlace, StorageReader):
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
            with self._single_file() as f:
                return [], sum(s.nbytes for s in f.storages)
        d = self._open_dir()
        assert d is not None and self._record is not None
        items = ((idx.fqn, loc) for idx, loc in self._where.items())
        return check_items(d, self._record, items, fqns, self._trusted, self._decrypt)

    def _single_file(self) -> CheckpointFile:
        """The one ckptfmt file this Reader reads, opened with its keys and store options."""
        return CheckpointFile(
            self.path,
            trusted_keys=self._trusted,
            decrypt_with=self._decrypt,
            storage_options=self.storage_options,
        )

    def _read_single_file(self) -> None:
        from .singlefile import file_metadata

        with self._single_file() as f:
            self._metadata, self._where = file_metadata(f, os.path.basename(self.path))
        self._single = True

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._metadata is None:  # DCP always reads the metadata through this reader first
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=this_host())

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        shares = thread_shares([p.storage_data for p in plans])
        return [dataclasses.replace(p, storage_data=RankPlan(None, t)) for p, t in zip(plans, shares)]

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
            with _native.threads_at_most(plan_threads(plan.storage_data)):
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
