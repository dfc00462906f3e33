"""A run's step directories: their names, what a complete step is, and the save that holds one.

Shared by the manager and its sharded steps (``sharded``), so that neither imports the other
for these.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..background import inflight
from ..engine.ckptdir import CheckpointDir
from ..engine.commit import parse_temp_name
from ..errors import CheckpointError
from ..files.names import STATE_NAME

_STEP_RE = re.compile(r"step-([0-9]{9,20})")
#: names that look like step directories; those that are not canonical ones are warned about
_STEP_LIKE_RE = re.compile(r"step-[0-9]+")
#: the largest step whose directory name parse_step_dirname() accepts (20 digits)
MAX_STEP = 10**20 - 1


def step_dirname(step: int) -> str:
    return f"step-{step:09d}"


def looks_like_step_dirname(name: str) -> bool:
    """Whether `name` looks like a step directory's (step-<digits>), canonical or not."""
    return _STEP_LIKE_RE.fullmatch(name) is not None


def is_step_temp_name(name: str) -> bool:
    """Whether `name` is a temporary step directory's: a temp name (engine.commit) of a
    step directory name."""
    parsed = parse_temp_name(name)
    return parsed is not None and _STEP_RE.fullmatch(parsed[0]) is not None


def parse_step_dirname(name: str) -> int | None:
    """The step of a canonical step directory name, else None."""
    m = _STEP_RE.fullmatch(name)
    if m is None or step_dirname(int(m.group(1))) != name:
        return None
    return int(m.group(1))


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint of a run."""

    step: int
    path: str  # the step directory
    metrics: dict[str, float]
    metadata: dict[str, str]
    size: int  # bytes of the step's own files, commit record included
    created: datetime.datetime
    files: tuple[str, ...] = ()  # the step's part files, absolute
    references: tuple[str, ...] = ()  # files of earlier steps it reads chunks from
    layout: str = "state"  # "state": one state file; "dcp": one file per rank (ckptfmt.dcp)

    @property
    def state_path(self) -> str:
        """The state file's path or URL (on a store its name may be a save's own, spec 13.7)."""
        if self.layout == "state" and len(self.files) == 1:
            return self.files[0]
        return os.path.join(self.path, STATE_NAME)


@dataclass
class StepStatus:
    """What one step directory is: complete (with its info) or why not."""

    step: int
    path: str
    info: CheckpointInfo | None = None
    problem: str | None = None
    retained: bool = False  # no commit record, kept only for files later steps refer to
    damaged: bool = False  # it has a commit record, but the record or a file it names is bad
    locked: bool | None = None  # a live save holds it (None: not checked or unknown)
    error: type[CheckpointError] = CheckpointError  # the kind of `problem` (CorruptError, ...)
    #: without a valid commit record, whether ckptfmt may delete it: it bears ckptfmt's mark
    #: (engine.marks) or is empty; another tool's folder never is
    ours: bool = True
    #: on a store, a step with a commit record beyond the newest that statuses() reads
    #: (objectrun.MAX_STATUS_RECORDS): neither judged nor deleted, nor anything older
    unread: bool = False
    #: on a store, a step whose commit record the store failed to serve (a 503, an archived
    #: object's 403): neither complete nor damaged, and never deleted on that basis
    unknown: bool = False


@dataclass
class StepJob:
    """One save of one step, from its snapshot to its commit."""

    step: int
    path: str
    lock_fd: int
    metrics: dict[str, float]
    metadata: dict[str, str]
    handle: inflight.SaveHandle
    thread: threading.Thread | None = None
    file_handle: Any = None
    base: str | None = None  # the state file an incremental save refers to
    #: who writes the commit record: "state", the manager once the state file is written;
    #: "dcp", DCP's coordinator as the last act of a save of several ranks
    layout: str = "state"
    #: whether this process holds the step directory: it archives and rotates after the
    #: commit, or removes the step when the save fails (rank 0 of a save of several ranks)
    coordinator: bool = True
    written: bool = False  # the save's state file was begun (object stores: it made the object)
    #: the state file's name in the step (on a store, own_state_name() where the step was not empty)
    state_name: str = STATE_NAME
    #: on a store, the step held objects of other saves when this one began: once committed, the
    #: save deletes those its record does not name (no record can name them any more)
    sweep: bool = False
    #: the step's commit record, once its saver has read it (a save of several ranks on a store)
    record: Any = None
    #: on a store, the commit record's write was sent and has no definite answer (a timeout, a
    #: reset, an answer cut short): the record may still land, naming the state object
    record_unknown: bool = False
    began: float = dataclasses.field(default_factory=time.perf_counter)  # the save call, roughly


def held(job: StepJob) -> CheckpointDir:
    """The step directory a save holds open and locked (job.lock_fd), to write beneath.  It
    only lends the descriptor: whoever keeps it dups it, and it is never closed through this."""
    return CheckpointDir(job.lock_fd, job.path)


def listed_references(statuses: list[StepStatus]) -> set[str]:
    """The objects the records of the complete steps of `statuses` refer to (no request)."""
    return {url for s in statuses if s.info is not None for url in s.info.references}


def newest_unread(statuses: list[StepStatus]) -> int:
    """The newest unread or unknown step of `statuses` (-1 when none): a step older than it
    may hold objects it refers to (references lead to older steps only), so none is deleted."""
    return max((s.step for s in statuses if s.unread or s.unknown), default=-1)


def newest_unknown(statuses: list[StepStatus]) -> StepStatus | None:
    """The newest step of `statuses` whose record the store failed to serve, if any."""
    return max((s for s in statuses if s.unknown), key=lambda s: s.step, default=None)
