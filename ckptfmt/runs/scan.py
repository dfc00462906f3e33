"""Reading a run's directory: one listing of it that says what every step directory is
(complete with its info, or why not), which entries are temporary step directories and
which are named like step directories without being one.

A save takes one scan and every decision it makes before its step directory exists (is the
step new, what a dead save left, what rotation retires, what an incremental save refers
to) reads it.  The commit records behind the scans are cached across them while the
files they name keep their identity.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..engine import marks
from ..engine.ckptdir import CheckpointDir
from ..errors import CheckpointError, IncompleteError
from ..files import multifile
from ..format.timestamps import parse_utc
from .stepcheck import check_step
from .steps import CheckpointInfo, StepStatus, is_step_temp_name, looks_like_step_dirname, parse_step_dirname


@dataclass
class RunScan:
    """One listing of a run directory: its step directories (by step), the names of its
    temporary step directories, and entries named like step directories that are not one."""

    statuses: list[StepStatus] = field(default_factory=list)
    temp_names: list[str] = field(default_factory=list)
    foreign: list[tuple[str, str]] = field(default_factory=list)  # (path, why it is not a step)
    busy: set[int] = field(default_factory=set)  # steps the scanning manager had in flight

    def complete(self) -> list[CheckpointInfo]:
        """The complete checkpoints, oldest first."""
        return [s.info for s in self.statuses if s.info is not None]

    def newest_step(self) -> int | None:
        """The step of the newest complete checkpoint (None when there is none)."""
        done = self.complete()
        return done[-1].step if done else None

    def referenced(self) -> set[str]:
        """Files that complete checkpoints read chunks from (never deleted)."""
        return {r for c in self.complete() for r in c.references}

    def forget(self, path: str) -> None:
        """Step directory `path` is gone (deleted or retired since the scan)."""
        self.statuses = [s for s in self.statuses if s.path != path]


@dataclass
class _Cached:
    stamp: tuple[Any, ...]
    record: multifile.CommitRecord


class StepRecords:
    """The checked commit records of a run's steps, cached while the directory and the files
    each names keep their identity (inode, size, mtime) and are not links."""

    def __init__(self, directory: str, decrypt: Any = None, trusted: Any = None) -> None:
        """`decrypt`: the key of an encrypted run's state files (check_step reads their index);
        `trusted`: the public keys a run demands (check_step checks signatures first)."""
        self.directory = directory
        self.decrypt = decrypt
        self.trusted = trusted
        self._cache: dict[str, _Cached] = {}

    def record(self, d: CheckpointDir, step: int) -> multifile.CommitRecord:
        """Step directory `d`'s checked commit record (check_step)."""
        cached = self._cache.get(d.path)
        try:
            if cached is not None and cached.stamp == _stamp(d, cached.record):
                return cached.record
        except (OSError, CheckpointError):
            pass  # a component changed kind: check it all again, which says why
        record = check_step(d, step, self.decrypt, self.trusted)
        self._cache[d.path] = _Cached(_stamp(d, record), record)
        return record

    def forget(self, path: str) -> None:
        """Drop the record of step directory `path` (it is being deleted or retired)."""
        self._cache.pop(path, None)

    @contextlib.contextmanager
    def run(self) -> Iterator[CheckpointDir | None]:
        """The run directory, opened once for one pass over it (None when it is gone)."""
        try:
            run = CheckpointDir.open(self.directory)
        except FileNotFoundError:
            yield None
            return
        with run:
            yield run

    def scan(self) -> RunScan:
        """One listing of the run directory, every step directory in it checked."""
        out = RunScan()
        with self.run() as run:
            if run is None:
                return out
            for name in run.names():
                step = parse_step_dirname(name)
                if step is not None and run.is_dir(name):
                    out.statuses.append(self._status(run, name, step))
                elif is_step_temp_name(name):
                    out.temp_names.append(name)
                why = _not_a_step(run, name, step)
                if why is not None:
                    out.foreign.append((run.path_of(name), why))
            out.statuses.sort(key=lambda s: s.step)
            referenced = out.referenced()
            for s in out.statuses:
                if s.info is None:
                    s.retained = _all_files_referenced(run, os.path.basename(s.path), referenced)
        return out

    def _status(self, run: CheckpointDir, name: str, step: int) -> StepStatus:
        """What step directory `name` is, by the one check of check_step."""
        status = StepStatus(step, run.path_of(name))
        try:
            with run.sub(name) as d:
                try:
                    status.info = _info(step, d, self.record(d, step))
                except (CheckpointError, OSError) as e:
                    status.problem = _why(e, d.path)
                    status.damaged = not isinstance(e, IncompleteError) or d.exists(multifile.COMMIT_NAME)
                    status.error = type(e) if isinstance(e, CheckpointError) else IncompleteError
                    status.ours = marks.ours_without_record(d)
                    if not status.ours:
                        status.problem += " (ckptfmt did not make this folder: it is never deleted)"
        except (CheckpointError, OSError) as e:  # swapped for a link since it was listed
            status.problem = _why(e, status.path)
            status.ours = False
            status.damaged = True
            status.error = type(e) if isinstance(e, CheckpointError) else IncompleteError
        if status.info is None:
            self.forget(status.path)
        return status


def _not_a_step(run: CheckpointDir, name: str, step: int | None) -> str | None:
    """Why an entry named like a step directory is not one (never counted, never deleted);
    None for a step directory or an entry not named like one."""
    if not looks_like_step_dirname(name):
        return None
    if step is None:
        return "not a step directory name (step-NNNNNNNNN: at least 9 digits, no extra zeros)"
    st = run.lstat(name)
    if st is not None and stat.S_ISLNK(st.st_mode):
        return "a symbolic link, not a step directory (never followed)"
    if st is not None and not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    return None


def _info(step: int, d: CheckpointDir, record: multifile.CommitRecord) -> CheckpointInfo:
    path = d.path
    size = sum(p.length for p in record.files)
    st = d.lstat(multifile.COMMIT_NAME)
    size += st.st_size if st is not None else 0
    return CheckpointInfo(
        step=step,
        path=path,
        metrics=dict(record.metrics),
        metadata=dict(record.metadata),
        size=size,
        created=parse_utc(record.created),
        files=tuple(os.path.join(path, p.name) for p in record.files),
        references=tuple(os.path.normpath(os.path.join(path, p.name)) for p in record.references),
        layout=record.layout,
    )


def _stamp(d: CheckpointDir, record: multifile.CommitRecord | None) -> tuple[Any, ...]:
    """The identity of the step directory, its commit record and every file the record names."""
    out: list[tuple[int, int, int, int] | None] = [_ident(d, ".")]
    out.append(_ident(d, multifile.COMMIT_NAME))
    for p in record.files + record.references if record else ():
        holder, name = d.walk(p.name) if "/" in p.name else (d.dup(), p.name)
        with holder:
            out.append(_ident(holder, name))
    return tuple(out)


def _ident(d: CheckpointDir, name: str) -> tuple[int, int, int, int] | None:
    """What entry `name` is now (kind, inode, size, mtime), a link not followed; None when absent."""
    st = d.lstat(name) if name != "." else os.fstat(d.fd)
    return None if st is None else (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns)


def _all_files_referenced(run: CheckpointDir, name: str, referenced: set[str]) -> bool:
    try:
        with run.sub(name) as d:
            names = [n for n in d.names() if not n.startswith(".")]
            return bool(names) and all(d.path_of(n) in referenced for n in names)
    except (OSError, CheckpointError):
        return False


def _why(e: CheckpointError | OSError, directory: str) -> str:
    """An error's reason, naming the file inside the step directory it concerns."""
    if not isinstance(e, CheckpointError):
        return f"{e.filename or directory}: {e.strerror}"
    text = str(e)
    if e.path and os.path.abspath(e.path) != directory:
        text = text.replace(e.path, os.path.relpath(e.path, directory), 1)
    elif e.path:
        text = text[len(e.path) + 2 :] if text.startswith(e.path + ": ") else text
    return text
