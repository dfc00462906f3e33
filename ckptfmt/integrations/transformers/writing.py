"""Writing and removing ``checkpoint-N`` folders: a fresh folder for a save, the save in
progress (its files, checked to be still in the folder it created, then its commit record),
deletion commit record first, and rotation (save_total_limit)."""

from __future__ import annotations

import logging
import os
import stat
import threading
from typing import Any

from ...background.inflight import SaveHandle
from ...engine.ckptdir import CheckpointDir, LinkError
from ...errors import CorruptError
from ...files import multifile, recordsign
from .reading import open_run, sort_folders

logger = logging.getLogger(__name__)


def delete_folder(run: CheckpointDir, name: str) -> None:
    """Delete entry `name` of the run directory: a checkpoint folder its commit record first (an
    interrupted deletion leaves an incomplete folder, never one whose record names missing
    files); a link or anything else as a name only, never followed."""
    st = run.lstat(name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        try:
            with run.sub(name) as folder:
                if folder.unlink(multifile.COMMIT_NAME):
                    folder.fsync()
        except (LinkError, FileNotFoundError):
            pass  # swapped for something else since the lstat: removed below as a name
    run.remove_tree(name)


def fresh_folder(run_dir: str, name: str) -> CheckpointDir:
    """A new, empty directory `name` in the run directory, held open.  Whatever had that name
    goes first (an earlier save of this step, crashed or from a run resumed from an older
    step; a link, removed as a name: what it points to is never emptied nor written into)."""
    with CheckpointDir.open(run_dir, create=True) as run:
        delete_folder(run, name)
        run.mkdir(name)  # fails if anything took the name meanwhile
        return run.sub(name)


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
        finally:
            self.close()

    def close(self) -> None:
        if self.dir is not None:
            self.dir.close()


def remove_quietly(run: CheckpointDir, name: str) -> None:
    """Rotation's deletion: a folder that cannot be removed is logged, training goes on."""
    try:
        delete_folder(run, name)
    except OSError as e:
        logger.warning(f"could not delete {run.path_of(name)}: {e}")


def rotate(run_dir: str, limit: int, busy: set[str], best: str | None) -> None:
    """Keep the newest `limit` complete checkpoints and the best one (`best`, a folder path);
    remove incomplete folders older than the newest complete one, except those being saved
    (`busy`, folder paths)."""
    run = open_run(run_dir)
    if run is None:
        return
    with run:
        complete, incomplete = sort_folders(run)
        if not complete:
            return
        keep = {name for _, name in complete[-limit:]}
        if best is not None:
            keep.add(os.path.basename(os.path.normpath(best)))
        newest_step = complete[-1][0]
        old = [name for _, name in complete if name not in keep]
        old += [name for step, name in incomplete if step < newest_step]
        for name in old:
            if run.path_of(name) not in busy:
                logger.info(f"Deleting older checkpoint [{run.path_of(name)}] due to args.save_total_limit")
                remove_quietly(run, name)
