"""Reading and checking ``checkpoint-N`` folders: a folder opened through its descriptor and
checked complete (its commit record, every file it names), the newest complete folder of a run
directory, the model state of one.  Every entry is reached through the folder's descriptor
(ckptfmt.engine.ckptdir), never through a path string an entry could redirect."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import warnings
from collections.abc import Collection, Iterator
from typing import Any

from ...engine import marks
from ...engine.ckptdir import CheckpointDir
from ...errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptError,
    IncompleteError,
    SignatureError,
    UnsupportedError,
)
from ...files import multifile, recordsign
from ...files.reader import CheckpointFile
from ...files.verify import VerifyReport, check_file
from .names import (
    MAX_JSON_BYTES,
    MODEL_NAME,
    PREFIX,
    TRAINER_STATE_JSON,
    TRAINER_STATE_NAME,
    TRAINING_ARGS_JSON,
    checkpoint_step,
)


def open_run(run_dir: str) -> CheckpointDir | None:
    """The run directory (the caller's path, trusted), or None when there is none yet."""
    try:
        return CheckpointDir.open(run_dir)
    except FileNotFoundError:
        return None


def scan_run(run: CheckpointDir) -> tuple[list[tuple[int, str]], list[str]]:
    """(step, name) of the ``checkpoint-N`` directories, oldest first, and the names of the
    ``checkpoint-N`` entries that are not directories (links above all: never followed)."""
    folders, others = [], []
    for name in run.names():
        step = checkpoint_step(name)
        if step is None:
            continue
        if run.is_dir(name):
            folders.append((step, name))
        else:
            others.append(name)
    return sorted(folders), others


def iter_checkpoint_dirs(run_dir: str) -> Iterator[tuple[int, str]]:
    """(step, path) of every ``checkpoint-N`` folder in `run_dir`, oldest step first (links skipped)."""
    run = open_run(run_dir)
    if run is None:
        return
    with run:
        folders, _ = scan_run(run)
    for step, name in folders:
        yield step, run.path_of(name)


class OpenedFolder:
    """A checked checkpoint folder held open: its descriptor and its commit record.  Everything
    read from it afterwards goes through this descriptor, so what is read is what was checked."""

    def __init__(
        self, folder: CheckpointDir, record: multifile.CommitRecord, trusted: Any = None, decrypt: Any = None
    ) -> None:
        self.dir = folder
        self.record = record
        self.trusted = trusted  # public keys: the record is signed, each file hashed as opened
        self.decrypt = decrypt  # the key of an encrypted checkpoint's files (spec section 17)

    @property
    def path(self) -> str:
        return self.dir.path

    def part(self, name: str) -> multifile.PartRecord | None:
        """The record of file `name` when the commit names it (a file it does not name is never read)."""
        return next((p for p in self.record.files if p.name == name), None)

    @contextlib.contextmanager
    def open(self, part: multifile.PartRecord) -> Iterator[CheckpointFile]:
        """The exact file the commit names, checked again as it is opened (length, id, index
        checksum; and its SHA-256 against a signed record)."""
        if self.trusted is None:
            fd = multifile.open_part(self.dir, part, self.path)
        else:
            fd = recordsign.open_trusted_part(self.dir, part, self.path)
        with CheckpointFile(
            self.dir.path_of(part.name), fd=fd, within=self.dir, decrypt_with=self.decrypt
        ) as f:
            yield f

    def load(self, name: str, map_location: Any = None) -> Any:
        """The state in file `name` (checksums verified), or None when the commit does not name it."""
        part = self.part(name)
        if part is None:
            return None
        with self.open(part) as f:
            return f.load_subtree(f.tree.root, map_location, True)

    def load_required(self, name: str, map_location: Any = None) -> Any:
        if self.part(name) is None:
            raise IncompleteError(f"the commit record names no {name}", path=self.path)
        return self.load(name, map_location)

    def verify(self) -> None:
        """Read every chunk of every file the commit names and check its checksum."""
        for part in self.record.files:
            report = VerifyReport(self.dir.path_of(part.name))
            with self.open(part) as f:
                check_file(f, report)
            if not report.ok:
                raise CorruptError(f"{part.name} is damaged: {report.problems[0]}", path=self.path)

    def close(self) -> None:
        self.dir.close()

    def __enter__(self) -> OpenedFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_folder(
    folder: CheckpointDir, verify: bool, trusted: Any = None, decrypt: Any = None
) -> OpenedFolder:
    """`folder` checked complete (and with `verify`, every chunk checked); it is not closed here.
    `trusted`: public keys, one of which must have signed its commit record (spec 16.7).
    `decrypt`: the key its files are read with (an encrypted checkpoint)."""
    # signed: the record's signature first, so that a changed record is a SignatureError
    signed = None if trusted is None else recordsign.read_trusted(folder, trusted)
    record = multifile.check_complete(folder)
    if signed is not None and signed != record:
        raise SignatureError("the commit record changed while it was read", path=folder.path)
    opened = OpenedFolder(folder, record, trusted, decrypt)
    if opened.part(TRAINER_STATE_NAME) is None:
        raise IncompleteError(f"the commit record names no {TRAINER_STATE_NAME}", path=folder.path)
    if verify:
        opened.verify()
    return opened


def open_checked(path: str, verify: bool = False, trusted: Any = None, decrypt: Any = None) -> OpenedFolder:
    """The folder the caller names (its path is the caller's, resolved once), checked complete."""
    folder = multifile.open_dir(path, "checkpoint folder")
    try:
        return check_folder(folder, verify, trusted, decrypt)
    except BaseException:
        folder.close()
        raise


def check_checkpoint(
    path: str, *, verify: bool = False, trusted_keys: Any = None, decrypt_with: Any = None
) -> multifile.CommitRecord:
    """The commit record of a complete checkpoint folder; raises CheckpointError (saying why) otherwise.

    Complete: the commit record verifies and every file it names is there with the recorded
    length, file id and index checksum.  `verify=True` also reads every chunk of every file
    and checks its checksum (damage after the save: bit rot, a bad copy).  `trusted_keys`:
    the record must be signed by one of these Ed25519 public keys (spec 16.7; with `verify`,
    every file is hashed against it); `decrypt_with`: the key of an encrypted checkpoint,
    which `verify` reads with it (every GCM tag checked).
    """
    with open_checked(path, verify, recordsign.public_keys(trusted_keys), decrypt_with) as opened:
        return opened.record


def why(e: BaseException, folder: str | None = None) -> str:
    """What went wrong, in words; the entry it concerns named when it is one inside `folder`."""
    if not isinstance(e, CheckpointError):
        return f"{type(e).__name__}: {e}"
    if folder is None or e.path is None or os.path.dirname(e.path) != folder:
        return e.reason
    return f"{os.path.basename(e.path)}: {e.reason}"


def _warn_skip(path: str, why: str) -> None:
    warnings.warn(f"skipping {path}: {why}", CheckpointWarning, stacklevel=4)


def open_latest(
    run_dir: str,
    verify: bool,
    warn: bool,
    trusted: Any = None,
    decrypt: Any = None,
    quiet: Collection[str] = (),
) -> OpenedFolder | None:
    """The newest complete ``checkpoint-N`` folder of `run_dir`, held open, or None; with
    `trusted` public keys, the newest whose commit record one of them signed.  Folders named
    in `quiet` are passed over without a warning."""
    run = open_run(run_dir)
    if run is None:
        return None
    with run:
        folders, others = scan_run(run)
        for name in others if warn else ():
            _warn_skip(
                run.path_of(name),
                "a symbolic link or other entry where a checkpoint folder must be (never followed)",
            )
        for _step, name in reversed(folders):
            try:
                folder = run.sub(name)  # O_NOFOLLOW: swapped for a link since the scan, it is refused
            except (CheckpointError, OSError) as e:
                if warn:
                    _warn_skip(run.path_of(name), f"not a complete checkpoint ({why(e)})")
                continue
            try:
                return check_folder(folder, verify, trusted, decrypt)
            except (CheckpointError, OSError) as e:
                folder.close()
                if warn and name not in quiet:
                    _warn_skip(folder.path, f"not a complete checkpoint ({why(e, folder.path)})")
    return None


def is_trainer_folder(folder: CheckpointDir) -> bool:
    """Whether an open ``checkpoint-N`` folder is one the stock Trainer wrote, as far as can be
    told: not ckptfmt's (folder_kind FOREIGN) and holding a regular ``trainer_state.json``."""
    if folder_kind(folder) != FOREIGN:
        return False
    st = folder.lstat(TRAINER_STATE_JSON)
    return st is not None and stat.S_ISREG(st.st_mode)


def trainer_folders(run_dir: str) -> list[tuple[int, str]]:
    """(step, name) of the run directory's ``checkpoint-N`` folders the stock Trainer wrote
    (is_trainer_folder), oldest step first."""
    run = open_run(run_dir)
    if run is None:
        return []
    out = []
    with run:
        for step, name in scan_run(run)[0]:
            with contextlib.suppress(CheckpointError, OSError), run.sub(name) as folder:
                if is_trainer_folder(folder):
                    out.append((step, name))
    return out


def latest_checkpoint(
    run_dir: str,
    *,
    verify: bool = False,
    warn: bool = True,
    trusted_keys: Any = None,
    decrypt_with: Any = None,
) -> str | None:
    """The complete ``checkpoint-N`` folder with the highest N in `run_dir`, or None.

    Newer folders that are not complete (with ``verify=True``: or whose files fail
    their checksums) are skipped, each with a CheckpointWarning naming it and why
    (unless ``warn=False``); so are ``checkpoint-N`` entries that are symbolic links
    (never followed: they may lead anywhere).  `trusted_keys`: only folders whose commit
    record one of these Ed25519 public keys signed count (spec 16.7).  `decrypt_with`: the key
    of encrypted checkpoints, which ``verify=True`` reads (spec section 17).
    """
    found = open_latest(run_dir, verify, warn, recordsign.public_keys(trusted_keys), decrypt_with)
    if found is None:
        return None
    found.close()
    return found.path


def load_model_state(
    path: str, map_location: Any = None, *, decrypt_with: Any = None, trusted_keys: Any = None
) -> dict[str, Any]:
    """The model state dict of a complete checkpoint folder (checksums verified); `decrypt_with`:
    the key of an encrypted checkpoint; `trusted_keys`: Ed25519 public keys, one of which must
    have signed its commit record (``model.ckpt`` is hashed against it before it is read)."""
    with open_checked(path, False, recordsign.public_keys(trusted_keys), decrypt_with) as opened:
        state: dict[str, Any] = opened.load_required(MODEL_NAME, map_location)
    return state


def load_best(run_dir: str, name: str, trusted: Any = None, decrypt: Any = None) -> Any:
    """The model state of complete folder `name` of the run directory (never a link)."""
    if checkpoint_step(name) is None:
        raise CorruptError(f"the best checkpoint {name[:80]!r} is not a {PREFIX}-N folder", path=run_dir)
    with CheckpointDir.open(run_dir) as run, run.sub(name) as folder:
        return check_folder(folder, False, trusted, decrypt).load_required(MODEL_NAME)


#: what a ``checkpoint-N`` folder of a run directory is to ckptfmt
COMPLETE = "complete"  # its commit record verifies: a checkpoint ckptfmt wrote
ABANDONED = "abandoned"  # ckptfmt's mark and no valid commit record: a save or a deletion cut short
EMPTY = "empty"  # no entry at all: removing it loses nothing
FOREIGN = "foreign"  # anything else (the stock Trainer's, another tool's): never deleted


def folder_kind(folder: CheckpointDir) -> str:
    """COMPLETE, ABANDONED, EMPTY or FOREIGN (see above) for an open ``checkpoint-N`` folder."""
    try:
        check_folder(folder, False)
        return COMPLETE
    except (CheckpointError, OSError):
        pass
    if marks.is_marked(folder):
        return ABANDONED
    return FOREIGN if folder.names() else EMPTY


def classify_folders(run: CheckpointDir) -> list[tuple[int, str, str]]:
    """(step, name, kind) of the ``checkpoint-N`` directories, oldest step first (links are
    not among them: never followed, never deleted); one that cannot be opened is FOREIGN."""
    out = []
    for step, name in scan_run(run)[0]:
        try:
            with run.sub(name) as folder:
                kind = folder_kind(folder)
        except (CheckpointError, OSError):
            kind = FOREIGN
        out.append((step, name, kind))
    return out


def load_training_args(path: str) -> dict[str, Any]:
    """The training arguments a checkpoint folder was saved with (``training_args.json``, the
    pickle-free form of the Trainer's ``training_args.bin``: ``TrainingArguments.to_dict()``,
    tokens redacted).  The commit record does not cover it: it is read bounded, without
    following a link; anything but a JSON object is a CorruptError."""
    try:
        with CheckpointDir.open(path) as folder:
            raw = folder.read_file(TRAINING_ARGS_JSON, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise IncompleteError(f"no {TRAINING_ARGS_JSON}", path=path) from None
    try:
        values = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptError(f"{TRAINING_ARGS_JSON} is not JSON: {why(e)[:200]}", path=path) from None
    if not isinstance(values, dict):
        raise CorruptError(f"{TRAINING_ARGS_JSON} is not a JSON object", path=path)
    return values


#: the files the stock Trainer keeps a model's weights in, in safetensors
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def check_safetensors_weights(path: str) -> None:
    """A folder of the stock Trainer resumed from must hold its weights in safetensors (never a
    pickled ``pytorch_model.bin``): UnsupportedError otherwise."""
    with CheckpointDir.open(path) as folder:
        for name in SAFETENSORS_WEIGHTS:
            st = folder.lstat(name)
            if st is not None and stat.S_ISREG(st.st_mode):
                return
    raise UnsupportedError(
        "this folder of transformers.Trainer holds no model.safetensors: only weights in "
        "safetensors are read",
        path=path,
    )
