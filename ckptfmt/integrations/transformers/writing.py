"""Writing and removing ``checkpoint-N`` folders: a fresh folder for a save (bearing ckptfmt's
mark), the save in progress (its files, checked to be still in the folder it created, then its
commit record), deletion commit record first and mark last, and rotation (save_total_limit) by
the Trainer's own rules, deleting only what ckptfmt wrote."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from typing import Any

from ...background.inflight import SaveCost, SaveHandle
from ...engine import commit, marks
from ...engine.ckptdir import CheckpointDir, LinkError
from ...errors import CheckpointError, CorruptError, UnsupportedError
from ...files import multifile, recordsign
from .names import MARK_NAME, WRITER, checkpoint_step
from .reading import ABANDONED, COMPLETE, FOREIGN, classify_folders, folder_kind, open_run

logger = logging.getLogger(__name__)


def delete_folder(run: CheckpointDir, name: str) -> None:
    """Delete ckptfmt's folder `name` (COMPLETE, ABANDONED or EMPTY: the caller has looked).
    The mark is made sure of first (a folder of an older ckptfmt has none), then the commit
    record goes, then every other entry, the mark last: an interrupted deletion leaves a
    folder that is still provably ckptfmt's and no longer a checkpoint, never one whose
    record names missing files.  Swapped for a link since it was looked at, it is left."""
    try:
        folder = run.sub(name)
    except (LinkError, FileNotFoundError):
        return
    with folder:
        marks.put_mark(folder, WRITER)
        if folder.unlink(multifile.COMMIT_NAME):
            folder.fsync()
        for entry in folder.names():
            if entry != MARK_NAME:
                folder.remove_tree(entry)
        marks.remove_mark_if_alone(folder)
    run.rmdir(name)


def clear_name(run: CheckpointDir, name: str) -> None:
    """Make entry `name` of the run directory free for a new save of its step: ckptfmt's
    folder (an earlier save of this step, crashed or from a run resumed from an older step)
    and an empty one are deleted, a link or a FIFO is removed as a name (what a link points to
    is never emptied nor written into; neither holds data); a regular file or any other folder
    is not ckptfmt's and is never deleted: an UnsupportedError says so."""
    st = run.lstat(name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode) and not stat.S_ISREG(st.st_mode):
        run.unlink(name)
        return
    kind = FOREIGN
    if stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(CheckpointError, OSError), run.sub(name) as folder:
            kind = folder_kind(folder)
    if kind == FOREIGN:
        raise UnsupportedError(
            f"{name} exists and ckptfmt did not write it (no commit record, no {MARK_NAME}): it is "
            "never deleted nor written into; move it away to save this step here",
            path=run.path_of(name),
        )
    delete_folder(run, name)


def foreign_save_names(run_dir: str, start: int, end: int, every: int) -> list[str]:
    """The ``checkpoint-N`` folders of `run_dir` that ckptfmt did not write (FOREIGN: clear_name
    refuses them) at the steps a run from step `start` to `end` saving every `every` steps
    saves: N in (start, end], a multiple of `every` or `end` itself; oldest first."""
    run = open_run(run_dir)
    if run is None:
        return []
    with run:
        return [
            name
            for step, name, kind in classify_folders(run)
            if kind == FOREIGN and start < step <= end and (step % every == 0 or step == end)
        ]


def fresh_folder(run_dir: str, name: str) -> CheckpointDir:
    """A new directory `name` in the run directory, held open, holding only ckptfmt's mark:
    made under a temporary name (engine.commit's, owned by this process) with the mark inside,
    then renamed, so that every ``checkpoint-N`` folder ckptfmt makes bears the mark from
    the moment it has its name.  Whatever had the name goes first (clear_name)."""
    with CheckpointDir.open(run_dir, create=True) as run:
        clear_name(run, name)
        tmp, _ = commit.new_temp(run, name, run.mkdir)
        try:
            with run.sub(tmp) as made:
                marks.put_mark(made, WRITER)
                made_id = os.fstat(made.fd)
            run.rename(tmp, name)  # fails if a non-empty entry took the name meanwhile
            run.fsync()
        except BaseException:
            with contextlib.suppress(CheckpointError, OSError):
                run.remove_tree(tmp)
            raise
        finally:
            commit.disown(tmp)
        folder = run.sub(name)
        now = os.fstat(folder.fd)
        if (now.st_dev, now.st_ino) != (made_id.st_dev, made_id.st_ino):
            folder.close()
            raise CorruptError("the new checkpoint folder was replaced as it was named", path=folder.path)
        return folder


class FolderSave:
    """One checkpoint folder being saved: its ckptfmt files and their handles."""

    def __init__(self, folder: str, run_dir: str, step: int, limit: int | None) -> None:
        self.folder = folder
        self.run_dir = run_dir
        self.step = step
        self.limit = (
            limit  # save_total_limit when the save began (the Trainer's own rotation is off meanwhile)
        )
        self.dir: CheckpointDir | None = None  # the folder this save created, held open
        self.names: list[str] = []
        self.handles: list[SaveHandle] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.done = False  # its commit thread has ended (whether it committed or failed)
        #: perf_counter() when the save began, when _save_checkpoint returned, when committed
        self.began = time.perf_counter()
        self.returned: float | None = None
        self.committed: float | None = None

    def cost(self) -> SaveCost | None:
        """What the folder's save cost, once committed: the caller's wait, the time until the
        commit record was durable, the bytes of its ckptfmt files."""
        if self.committed is None or self.returned is None:
            return None
        costs = [h.cost for h in self.handles]
        nbytes = sum(c.bytes for c in costs if c is not None)
        returned = min(self.returned, self.committed)
        return SaveCost(self.folder, nbytes, returned - self.began, self.committed - self.began)

    def check_in_place(self) -> CheckpointDir:
        """The folder, once its path is seen to still lead to it.  The Trainer and ckptfmt.save
        write by path: before each such write, a folder swapped for a link (or anything
        else) since it was created is refused rather than written through."""
        if self.dir is None:
            raise RuntimeError(f"{self.folder}: the checkpoint folder is not open")
        try:
            now = os.lstat(self.folder)
        except FileNotFoundError:
            now = None
        own = os.fstat(self.dir.fd)
        if (
            now is None
            or not stat.S_ISDIR(now.st_mode)
            or (now.st_dev, now.st_ino) != (own.st_dev, own.st_ino)
        ):
            raise CorruptError(
                "the checkpoint folder was replaced while it was being saved", path=self.folder
            )
        return self.dir

    def commit(self, metadata: dict[str, Any], sign_key: Any = None) -> None:
        """Write the commit record naming this save's files, once every one is written and
        durable (the first error of a non-blocking write is raised instead); the folder is
        closed either way.  `sign_key`: a private key that signs the record (spec 16.7)."""
        try:
            errors = [e for e in (h.exception() for h in self.handles) if e is not None]
            if errors:
                raise errors[0]
            folder = self.check_in_place()
            parts = tuple(multifile.describe_in(folder, n) for n in self.names)
            folder.fsync()
            record = multifile.CommitRecord(
                step=self.step, layout="hf-trainer", files=parts, metadata=metadata
            )
            if sign_key is not None:
                recordsign.write_signed(folder, record, sign_key)
            else:
                multifile.write_commit(folder.path, record, within=folder)
            self.committed = time.perf_counter()
        finally:
            self.close()

    def close(self) -> None:
        if self.dir is not None:
            self.dir.close()


def remove_quietly(run: CheckpointDir, name: str) -> None:
    """Rotation's deletion: a folder that cannot be removed is logged, training goes on."""
    logger.info(f"Deleting older checkpoint [{run.path_of(name)}] due to args.save_total_limit")
    try:
        delete_folder(run, name)
    except OSError as e:
        logger.warning(f"could not delete {run.path_of(name)}: {e}")


def _leave(run: CheckpointDir, name: str) -> None:
    logger.warning(
        f"not deleting {run.path_of(name)} (save_total_limit): ckptfmt did not write it "
        f"(no commit record, no {MARK_NAME})"
    )


def trainer_order(run: CheckpointDir, kinds: dict[str, str], best: str | None = None) -> list[str]:
    """The names of the run directory's checkpoint folders in the order the Trainer's rotation
    takes them (transformers' sort_checkpoints: by modification time, by step where times are
    too close), links left out; `kinds` gains FOREIGN for folders that sort_checkpoints counts
    without a ``checkpoint-N`` name (``checkpoint-3-old``)."""
    from transformers.trainer_utils import sort_checkpoints

    names = []
    for path in sort_checkpoints(run.path, use_mtime=best is None, best_model_checkpoint=best):
        name = os.path.basename(path)
        if name not in kinds and run.is_dir(name):
            kinds[name] = FOREIGN
        if name in kinds:
            names.append(name)
    return names


def trainer_deletions(ordered: list[str], limit: int, protected: set[str]) -> list[str]:
    """The folders transformers' rotate_checkpoints deletes from `ordered` (oldest first): the
    oldest ones not protected (the newest, the best) until `limit` are left, or as many as
    are protected."""
    if len(ordered) <= limit:
        return []
    protected = protected | {ordered[-1]}
    remaining, out = len(ordered), []
    for name in ordered:
        if remaining <= max(limit, len(protected)):
            break
        if name not in protected:
            out.append(name)
            remaining -= 1
    return out


def _remove_abandoned(run: CheckpointDir, kinds: dict[str, str], busy: set[str]) -> None:
    """Remove ckptfmt's abandoned folders older than the newest complete one and the temporary
    folders of saves whose process is gone; none being saved."""
    steps = [checkpoint_step(n) or 0 for n, k in kinds.items() if k == COMPLETE]
    newest = max(steps, default=-1)
    for name, kind in kinds.items():
        if kind == ABANDONED and (checkpoint_step(name) or 0) < newest and run.path_of(name) not in busy:
            remove_quietly(run, name)
    for name in run.names():
        parsed = commit.parse_temp_name(name)
        if (
            parsed is not None
            and checkpoint_step(parsed[0]) is not None
            and commit.abandoned_temp_dir(run, name)
        ):
            with contextlib.suppress(CheckpointError, OSError):
                run.remove_tree(name)


def rotate(run_dir: str, limit: int, busy: set[str], best: str | None) -> None:
    """save_total_limit by the Trainer's own rule (trainer_order, trainer_deletions; the best
    folder `best` and the newest complete one kept), deleting only ckptfmt's folders: one it did
    not write counts as the Trainer counts it and is left with a warning.  ckptfmt's abandoned
    folders do not count; those older than the newest complete one are removed.  Folders being
    saved (`busy`, paths) are neither counted nor touched."""
    run = open_run(run_dir)
    if run is None:
        return
    with run:
        kinds = {name: kind for _, name, kind in classify_folders(run)}
        _remove_abandoned(run, kinds, busy)
        ordered = [
            n for n in trainer_order(run, kinds) if kinds[n] != ABANDONED and run.path_of(n) not in busy
        ]
        protected = {n for n in (_best_name(run_dir, best), _newest_complete(kinds)) if n is not None}
        for name in trainer_deletions(ordered, limit, protected):
            if kinds[name] == FOREIGN:
                _leave(run, name)
            else:
                remove_quietly(run, name)


def keep_only_best(run_dir: str, best: str, busy: set[str]) -> None:
    """The Trainer's end of training with save_total_limit=1 and a best checkpoint: every
    checkpoint folder but the best one deleted (ckptfmt's only; others left with a warning).
    Where the best checkpoint is not a complete folder of this run (training went on from a
    folder of another run; the best folder was damaged since its save, and as ckptfmt's
    incomplete folder older than a complete one, removed by the rotation), the newest
    complete folder is kept too: the Trainer's rule would leave this run no checkpoint."""
    run = open_run(run_dir)
    if run is None:
        return
    with run:
        kinds = {name: kind for _, name, kind in classify_folders(run)}
        best_name = _best_name(run_dir, best)
        keep = {best_name}
        if kinds.get(best_name or "") != COMPLETE:
            newest = _newest_complete(kinds)
            if best_name is not None and newest is not None:
                logger.warning(
                    f"the best checkpoint {run.path_of(best_name)} is not complete: keeping "
                    f"{run.path_of(newest)} too (save_total_limit=1)"
                )
            keep.add(newest)
        for name in trainer_order(run, kinds, best):
            if name in keep or run.path_of(name) in busy:
                continue
            if kinds[name] == FOREIGN:
                _leave(run, name)
            else:
                remove_quietly(run, name)


def _best_name(run_dir: str, best: str | None) -> str | None:
    """The name of the best checkpoint's folder where it is in `run_dir`, else None (a folder
    of another run that happens to have the same name is not the best one)."""
    if best is None:
        return None
    parent, name = os.path.split(os.path.normpath(best))
    try:
        same = os.path.samefile(parent or ".", run_dir)
    except OSError:
        same = os.path.normpath(os.path.abspath(parent or ".")) == os.path.normpath(os.path.abspath(run_dir))
    return name if same else None


def _newest_complete(kinds: dict[str, str]) -> str | None:
    complete = [(checkpoint_step(n) or 0, n) for n, k in kinds.items() if k == COMPLETE]
    return max(complete)[1] if complete else None
