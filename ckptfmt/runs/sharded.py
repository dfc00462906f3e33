"""The checkpoint manager's steps when a run spans several ranks or holds sharded tensors.

When torch.distributed is initialised with more than one rank, or the state holds
DTensors or sharded tensors (FSDP2, also at world size 1: a one-process run, or a job
resumed on fewer ranks), ``CheckpointManager`` saves each step through this module:
every rank calls ``save(step, state)``; rank 0
makes and locks the step directory; every rank writes its shard with
``ckptfmt.dcp.save``; DCP's coordinator writes the step's commit record (layout
"dcp", with the step and metrics) last, and rank 0 then tells the run the step is
committed (StepSaver.step_committed).  The step directory is therefore complete
under exactly the rule a single process's step is (its commit record verifies and
names files that are there, unchanged), so ``latest()``, rotation, ``ckptfmt ls``
and ``verify`` treat both alike, and a rank killed mid-save leaves a step without a
commit record that ``latest()`` skips.

The saved tree is ``{"state": <state dicts>, "rng": {"rank-NNNNN": (<that rank's RNG
states>,)}}``: each rank that saved restores its own generators on resume (ranks beyond
the saving world size keep theirs).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

from ..background import inflight
from ..background.inflight import SaveHandle
from ..dcp.api import load_within, save_in_background, save_within
from ..dcp.convert import load_full, skeleton
from ..dcp.reader import Reader, held_reader
from ..engine.ckptdir import CheckpointDir
from ..errors import CheckpointError, CheckpointWarning, CorruptError, IncompleteError
from ..fileio import is_url
from ..files import multifile
from . import resume
from .resumecheck import rng_key
from .steps import StepJob, held
from .stepsave import StepSaver

if TYPE_CHECKING:
    from .scan import RunScan
    from .steps import CheckpointInfo


def holds_distributed_tensors(state: Any) -> bool:
    """Whether `state` holds a DTensor or a ShardedTensor: as a module's parameter or buffer, an
    optimizer's parameter, in another stateful object's state dict, or in its own containers.
    Such a state saves through DCP whatever the world size (one state file cannot hold it)."""
    if isinstance(state, torch.nn.Module):
        return any(_is_distributed(t) for t in itertools.chain(state.parameters(), state.buffers()))
    if isinstance(state, torch.optim.Optimizer):
        return any(_is_distributed(p) for g in state.param_groups for p in g["params"])
    if resume.is_stateful(state):
        return holds_distributed_tensors(state.state_dict())
    if isinstance(state, dict):
        return any(holds_distributed_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(holds_distributed_tensors(v) for v in state)
    return _is_distributed(state)


def _is_distributed(obj: object) -> bool:
    if isinstance(obj, DTensor):
        return True
    # the deprecated ShardedTensor: only when its module is loaded (importing it warns)
    api = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    return api is not None and isinstance(obj, api.ShardedTensor)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_step(
    steps: StepSaver,
    step: int,
    state: Any,
    metrics: dict[str, float],
    meta: dict[str, str],
    scan: RunScan | None = None,
) -> SaveHandle | None:
    """Save `state` as step `step` of the run `steps` saves into; every rank calls it.  Rank 0
    readies the step (`scan`: the save's scan of a local run directory); every rank writes its
    shard; DCP's coordinator writes the step's commit record (layout "dcp"; on an object store
    created only if absent) last; rank 0 rotates.  See _save_shards."""
    job = _job(steps, step, steps.step_path(step), metrics, meta)
    payload = _payload(state)

    failing = "could not make the directory of" if steps.storage_options is None else "cannot save"
    base = _prepared(steps, job, lambda: steps.prepare_step(job, scan), f"rank 0 {failing} step {step}")
    # Every write, unlink and listing is made beneath the step directory's descriptor: rank 0
    # writes beneath the directory it made and holds locked; the other ranks open it beneath
    # the run directory without following a link (spec 13.6).
    local = steps.storage_options is None
    return _save_shards(steps, job, payload, held(job) if job.coordinator and local else None, base)


def _prepared(
    steps: StepSaver, job: StepJob, prepare: Callable[[], list[CheckpointInfo]], failing: str
) -> str | None:
    """Run `prepare` (which readies the step and returns the run's complete steps) on rank 0,
    then tell every rank how it went: CheckpointError (`failing`, and why) on every rank if it
    failed, else the step an incremental save refers to (None: none, or not incremental)."""
    incremental = steps.options.incremental
    if incremental:  # the step to refer to must be committed: every rank's save of it
        steps.wait_all()
    told: list[Any] = [None, None]  # what went wrong on rank 0, the step to save against
    if job.coordinator:
        try:
            complete = prepare()
            told[1] = _base_step(complete) if incremental else None
        except (OSError, CheckpointError, ValueError) as e:
            told[0] = str(e)
    dist.broadcast_object_list(told, src=0)
    if told[0] is not None:
        raise CheckpointError(f"{failing}: {told[0]}", path=steps.directory)
    return told[1]  # type: ignore[no-any-return]


def _base_step(complete: list[CheckpointInfo]) -> str | None:
    """The step an incremental save of several ranks refers to: the newest complete one when
    it was saved by ranks (each rank file is saved against the one of the same name)."""
    return complete[-1].path if complete and complete[-1].layout == "dcp" else None


def _job(steps: StepSaver, step: int, path: str, metrics: dict[str, float], meta: dict[str, str]) -> StepJob:
    """This rank's part of the save of `step`: rank 0 is its coordinator (it holds the step
    directory, rotates and removes a failed step); DCP's coordinator writes the record."""
    job = StepJob(step, path, -1, metrics, meta, SaveHandle(path))
    job.layout = "dcp"
    job.coordinator = dist.get_rank() == 0
    return job


def _payload(state: Any) -> dict[str, Any]:
    """What a rank saves: its part of the state, and its RNG states (a tuple is a leaf to DCP:
    the RNG states stay one value, DCP would drop their empty dicts)."""
    from .rng import capture_rng

    return {"state": resume.to_storable(state), "rng": {rng_key(dist.get_rank()): (capture_rng(),)}}


def _save_shards(
    steps: StepSaver, job: StepJob, payload: dict[str, Any], within: CheckpointDir | None, base: str | None
) -> SaveHandle | None:
    """Write this rank's shard of `job`'s step.  Blocking: returns once the step is committed
    and rotated on every rank.  Non-blocking: returns a SaveHandle once the shard is staged;
    the rest runs in DCP's background thread, and the coordinator rotates (or removes the
    failed step) after the commit, in the order of the saves, as a single process does.  An
    incremental run saves each rank file against the same rank's file of step `base`."""
    run = steps.options
    options: dict[str, Any] = {
        "step": job.step,
        "metrics": job.metrics,
        "metadata": job.metadata,
        "compression": run.compression,
        "sign_with": run.sign_key,
        "encrypt_with": run.encrypt,
        "decrypt_with": run.decrypt,
        "storage_options": steps.storage_options,
        "incremental": run.incremental,
        "base": base,
    }
    try:
        if not run.blocking:
            future = save_in_background(
                payload, job.path, within=within, step_dir=True, snapshot=run.snapshot, **options
            )
            told = (lambda: steps.step_committed(job)) if job.coordinator else None
            job.file_handle = _FutureHandle(future, told, job.path)
            return steps.commit_when_written(job)
        save_within(payload, job.path, within=within, step_dir=True, **options)
    except BaseException:
        if job.coordinator and job.file_handle is None:
            steps.abandon(job)
        raise
    if job.coordinator:
        steps.step_committed(job)
    steps.cost_known(job)
    if job.coordinator:
        if job.lock_fd >= 0:
            os.close(job.lock_fd)
            job.lock_fd = -1
        try:
            steps.committed()  # the archive copies the step in the background, as for one process
        except (OSError, CheckpointError) as e:
            warnings.warn(f"rotation in {steps.directory} failed: {e}", CheckpointWarning, stacklevel=4)
    dist.barrier()  # when save() returns on any rank, the step is committed and rotated
    return None


class _FutureHandle:
    """A background DCP save seen as the file handle a manager's commit thread waits for.
    `committed` (rank 0's StepSaver.step_committed) runs once, on the first wait() that sees
    the save done (DCP's coordinator wrote the record): in the commit thread, before the
    manager's bookkeeping and rotation, in the order of the saves."""

    def __init__(
        self, future: concurrent.futures.Future[Any], committed: Callable[[], None] | None, path: str
    ) -> None:
        self._future = future
        self._committed = committed
        self._path = path

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        self._wait_done(timeout)
        self._future.result()
        told, self._committed = self._committed, None
        if told is not None:
            told()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait_done(timeout)
        return self._future.exception()

    def _wait_done(self, timeout: float | None) -> None:
        """As SaveHandle's waits: at most inflight.wait_seconds(timeout), then DeadlineError."""

        def finished(seconds: float) -> bool:
            return bool(concurrent.futures.wait([self._future], timeout=seconds).done)

        inflight.Deadline(timeout).wait(finished, "the sharded save", self._path)


def _subset(md: Metadata, prefix: tuple[str, ...]) -> Metadata:
    """The metadata of the entries whose key path starts with `prefix`."""
    pd = md.planner_data if isinstance(md.planner_data, dict) else {}
    keep = {
        k: v for k, v in md.state_dict_metadata.items() if tuple(pd.get(k, (k,)))[: len(prefix)] == prefix
    }
    return Metadata(state_dict_metadata=keep, planner_data={k: pd[k] for k in keep if k in pd})


def _open_step(info: CheckpointInfo) -> CheckpointDir:
    """The step directory, opened beneath its run directory without following a link (a step
    swapped for a link after the manager checked it is refused, never read through)."""
    with multifile.opened(os.path.dirname(info.path)) as run:
        try:
            return run.sub(os.path.basename(info.path))
        except FileNotFoundError:
            raise IncompleteError("the step directory is gone", path=info.path) from None
        except OSError as e:
            raise IncompleteError(f"cannot open the step directory: {e.strerror}", path=info.path) from None


@contextlib.contextmanager
def _reading(info: CheckpointInfo, storage_options: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """What makes ckptfmt.dcp read step `info` where it lies: beneath its directory, opened
    without following a link, or on an object store with `storage_options`."""
    if is_url(info.path):
        yield {"storage_options": storage_options}
        return
    with _open_step(info) as d:
        yield {"within": d}


def _step_reader(info: CheckpointInfo, where: dict[str, Any], trusted: Any, decrypt: Any) -> Reader:
    """A Reader of step `info` (`where`: _reading's), its record read and checked to be that
    step's (`trusted`: public keys, one of which must have signed it; `decrypt`: the key of an
    encrypted run)."""
    reader = held_reader(info.path, trusted_keys=trusted, decrypt_with=decrypt, **where)
    try:
        reader.read_metadata()
        record = reader.record
        if record is None or record.step != info.step:
            raise CorruptError(
                f"the commit record is not step {info.step}'s",
                path=os.path.join(info.path, multifile.COMMIT_NAME),
            )
    except BaseException:
        reader.close()
        raise
    return reader


def load_step(
    info: CheckpointInfo,
    trusted: Any = None,
    storage_options: dict[str, Any] | None = None,
    decrypt: Any = None,
) -> Any:
    """The whole saved state of a sharded step, full tensors, in this process."""
    with _reading(info, storage_options) as where:
        reader = _step_reader(info, where, trusted, decrypt)
        try:
            # bounded and checked as consolidate is; every error a CheckpointError, never DCP's own
            return load_full(reader, _subset(reader.read_metadata(), ("state",)), info.path).get("state")
        finally:
            reader.close()


def load_step_into(
    info: CheckpointInfo,
    state: Any,
    restore_rng: bool,
    trusted: Any = None,
    storage_options: dict[str, Any] | None = None,
    decrypt: Any = None,
) -> resume.ResumeReport:
    """Fill `state` (in place, in this run's sharding) from a sharded step; restore this rank's
    RNG states when the step holds them (same world size).  Every rank calls it.  `trusted`:
    public keys, one of which must have signed the step (spec 16.7); `decrypt`: the key of an
    encrypted run."""
    from .rng import restore_rng as restore

    rank = _rank()
    with _reading(info, storage_options) as where:  # every local read beneath the step directory
        reader = _step_reader(info, where, trusted, decrypt)
        try:
            md = reader.read_metadata()
        finally:
            reader.close()
        for obj in _stateful(state):
            if isinstance(obj, torch.optim.Optimizer) and not obj.state:
                _init_optimizer_state(obj)
        saved = _checked_rng(md, info.path, rank, where, trusted, decrypt)  # before DCP fills the caller's
        target: dict[str, Any] = {"state": resume.to_storable(state)}
        load_within(target, info.path, trusted_keys=trusted, decrypt_with=decrypt, **where)
    _push_back(state, target["state"])
    report = resume.ResumeReport(step=info.step, path=info.path)
    if restore_rng and saved is not None:
        restore(saved)
        report.rng_restored = True
    return report


def _checked_rng(md: Any, path: str, rank: int, where: dict[str, Any], trusted: Any, decrypt: Any) -> Any:
    """This rank's RNG states from a sharded step (None when it holds none), read and checked
    to be what restore_rng restores before anything of the caller's is filled: a malformed
    capture fails the load while the caller's objects are as they were."""
    from .rng import check_capture

    key = rng_key(rank)
    rng = skeleton(_subset(md, ("rng", key))).get("rng")
    # every rank takes part in the load (a collective), a rank the step holds no RNG states
    # of (a step saved on fewer ranks) with nothing to read
    target: dict[str, Any] = {"rng": rng} if rng else {}
    load_within(target, path, trusted_keys=trusted, decrypt_with=decrypt, **where)
    if not rng:
        return None
    saved = target["rng"][key]
    if type(saved) is not tuple or len(saved) != 1:
        raise CorruptError(f"the RNG states of rank {rank} are not what a manager saves", path=path)
    check_capture(saved[0], path, f"rng.{key}")
    return saved[0]


def _stateful(state: Any) -> list[Any]:
    return [obj for _, obj in resume._walk(state)]


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """A fresh optimizer has no state tensors for DCP to load into: make them, as DCP's
    get_optimizer_state_dict does."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(opt)


def _push_back(state: Any, loaded: Any) -> None:
    """Hand the loaded values to `state`: load_state_dict for stateful objects, assignment for
    plain values in dicts and lists (tensors were filled in place)."""
    if resume.is_stateful(state):
        state.load_state_dict(loaded)
    elif isinstance(state, dict):
        for k in state:
            if resume.is_stateful(state[k]) or isinstance(state[k], (dict, list)):
                _push_back(state[k], loaded[k])
            elif not isinstance(state[k], torch.Tensor):
                state[k] = loaded[k]
    elif isinstance(state, list):
        for i, v in enumerate(state):
            if resume.is_stateful(v) or isinstance(v, (dict, list)):
                _push_back(v, loaded[i])
            elif not isinstance(v, torch.Tensor):
                state[i] = loaded[i]
