"""The step-saving protocol: what a save of one step across ranks (runs/sharded.py) asks of the
run it saves into.

A save of several ranks is readied by rank 0 (old steps cleaned up, the step's place made),
written by every rank through DCP, committed by DCP's coordinator, told committed, then
archived and rotated by rank 0, or removed when it fails.  The run does the readying, the commit bookkeeping and
the rotation; runs/sharded.py does the rest through this protocol alone, so it imports no
manager: ``CheckpointManager._steps()`` (a local directory, runs/manager.py) and
``ObjectRunManager._steps()`` (an object store, runs/objectmanager.py) each hand one out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..background.inflight import SaveHandle
    from .scan import RunScan
    from .steps import CheckpointInfo, StepJob


@dataclass(frozen=True)
class StepOptions:
    """How a run writes its steps, as its manager was made (checked there): `compression` of
    each file, `blocking` saves, `incremental` ones (content digests, against the newest
    step), the `snapshot` of non-blocking saves, `sign_key` (a private key signing each commit
    record, or None), `encrypt` (the key encrypting each state file, or None) and `decrypt`
    (the key reading earlier steps' files: an incremental step's base; None where `encrypt`
    reads them too)."""

    compression: str | None
    blocking: bool
    incremental: bool
    snapshot: str
    sign_key: Any
    encrypt: Any
    decrypt: Any = None


class StepSaver(Protocol):
    """A run as a save of several ranks sees it."""

    @property
    def directory(self) -> str:
        """The run's directory or URL (errors name it)."""
        ...

    @property
    def options(self) -> StepOptions: ...

    @property
    def storage_options(self) -> dict[str, Any] | None:
        """The object store's client settings; None for a local directory."""
        ...

    def step_path(self, step: int) -> str:
        """Where step `step` lies."""
        ...

    def prepare_step(self, job: StepJob, scan: RunScan | None) -> list[CheckpointInfo]:
        """Ready `job`'s step on rank 0 (`scan`: the save's scan of a local run): clean up what
        failed saves left, make the step's place (a local directory: job.path, and job.lock_fd
        holding it locked); the run's complete steps, oldest first."""
        ...

    def wait_all(self) -> None:
        """Wait until every save in flight has committed or failed."""
        ...

    def commit_when_written(self, job: StepJob) -> SaveHandle | None:
        """Commit bookkeeping once `job`'s files are written (non-blocking: on a commit thread,
        in the order of the saves); its handle, None when blocking."""
        ...

    def abandon(self, job: StepJob) -> None:
        """A failed save: remove what it made."""
        ...

    def committed(self) -> None:
        """After a blocking save committed on every rank: archive its copy, rotate."""
        ...

    def step_committed(self, job: StepJob) -> None:
        """On rank 0, once the coordinator's commit record of `job`'s step is in (blocking or
        not; before cost_known and rotation): what the run does with a committed step.  Never
        raises: what it cannot do it warns about, the step being committed whatever it does."""
        ...

    def cost_known(self, job: StepJob) -> None:
        """A blocking save of `job` committed (its record written; on the coordinator, still
        held): its handle's cost is known now, for the manager's save_cost()."""
        ...
