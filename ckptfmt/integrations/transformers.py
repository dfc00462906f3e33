"""Hugging Face ``Trainer`` checkpoints in ckptfmt, made valid by a commit record.

Usage: replace ``Trainer`` with :class:`CkptfmtTrainer` (or mix
:class:`CkptfmtTrainerMixin` into your own ``Trainer`` subclass, e.g. TRL's)::

    from ckptfmt.integrations.transformers import CkptfmtTrainer

    trainer = CkptfmtTrainer(model=model, args=args, train_dataset=ds)   # same arguments as Trainer
    trainer.train(resume_from_checkpoint=True)    # the newest *complete* checkpoint-N, if any

What changes in each ``output_dir/checkpoint-N/`` folder:

=====================  =============================================================
``model.ckpt``         the model's state dict (instead of ``model.safetensors``)
``optimizer.ckpt``     ``optimizer.state_dict()`` (instead of ``optimizer.pt``)
``scheduler.ckpt``     ``lr_scheduler.state_dict()`` (instead of ``scheduler.pt``)
``scaler.ckpt``        the gradient scaler, when there is one (instead of ``scaler.pt``)
``rng_state.ckpt``     :func:`ckptfmt.capture_rng` (instead of ``rng_state.pth``)
``trainer_state.ckpt`` the text of ``trainer_state.json``
``COMMIT``             written last: names every ``.ckpt`` file above by length,
                       file id and index checksum (``ckptfmt.multifile``)
=====================  =============================================================

plus what the Trainer writes itself, unchanged: ``config.json`` (and
``generation_config.json``), the tokenizer or processor files,
``training_args.bin`` and ``trainer_state.json``.

Completeness.  A folder is a complete checkpoint exactly when its ``COMMIT``
verifies and every file it names is there, unchanged.  ``COMMIT`` is written
after everything else in the folder, including the Trainer's own files, so a
crash at any point of a save leaves a folder without a valid ``COMMIT``.  Only
the ckptfmt files are named and checked; a resume needs nothing else, because
``trainer_state.json``'s content is also in ``trainer_state.ckpt``: when the
JSON file is missing or differs (it is written without fsync), resuming
rewrites it from that copy, with a warning.

Resuming.  ``train(resume_from_checkpoint=True)`` takes the complete
``checkpoint-N`` with the highest N; newer folders that are not complete (a
crash mid-save, a file missing, cut short or replaced) or that fail their
checksums (``ckptfmt_verify_resume=True``, the default, reads every chunk of
the candidate first) are skipped with a :class:`ckptfmt.CheckpointWarning`
that names them and says why.  An explicit
path must be a complete checkpoint (else :class:`ckptfmt.CheckpointError`).
Every file is read by ckptfmt, checksums verified: resuming calls neither
pickle nor ``torch.load``.  The RNG state is restored at the moment the
Trainer restores its own (after fast-forwarding the data loader), so a resume
continues the uninterrupted run's losses bit-exactly where the Trainer's data
order is deterministic (its default seedable sampler).

Folders from anywhere.  A run directory may hold folders downloaded or written by
others; nothing in one makes this module touch anything outside it.  Every entry of
a ``checkpoint-N`` folder is reached through the folder's descriptor
(:mod:`ckptfmt.ckptdir`), never through a link: a ``checkpoint-N`` that is a link is
skipped with a warning (and, at a save of step N, removed as a name: what it points
to is never emptied nor written into); a resume or a load reads only the files the
``COMMIT`` names, each checked as it is opened; ``trainer_state.json`` and
``config.json`` are read without following a link or waiting on a FIFO, and a
``trainer_state.json`` that is not the committed text (a link, a FIFO included) is
replaced through a new temporary name (``O_EXCL | O_NOFOLLOW``), never written
through; :func:`load_model` builds the model ``config.json`` (which the ``COMMIT`` does
not cover) describes on the meta device first and refuses it, before allocating
anything, unless its tensors are exactly those of the committed ``model.ckpt``; the best
model (``load_best_model_at_end``) is looked for by its folder's name in this run's
directory only.  A save writes into a directory it has just
created, checked before each write to be still the one it created (the Trainer's own
files are written by path).

Rotation (``save_total_limit``) runs after each commit and keeps the newest
``save_total_limit`` complete checkpoints and the best one
(``state.best_model_checkpoint``); the newest complete checkpoint is never
deleted, and incomplete folders never count.  Incomplete folders older than the
newest complete one are removed; newer ones are left alone (a later save of that
step replaces them).  A folder is deleted ``COMMIT`` first, so an interrupted
deletion leaves an incomplete folder, never a damaged "complete" one.  At the
end of training, the Trainer's own ``save_total_limit=1`` clean-up (which keeps
only the best checkpoint) is replaced by the same rule.

``ckptfmt_blocking=False``: the ckptfmt files are written while training goes
on (each holds the values at the time of the save); ``COMMIT`` and rotation
follow on a background thread, in the order of the saves, once the files are
durable.  Errors are raised at the next save or at the end of ``train()``.
(With ``push_to_hub`` saves are always blocking: the upload reads the folder.)

The Trainer has no pluggable checkpoint I/O, so this overrides these
``Trainer`` methods (checked to exist when this module is imported; each
override is small and calls the Trainer's own code where it can):
``_save_checkpoint`` (wraps it: stock rotation off, then commit and rotate),
``save_model`` (only for checkpoint folders: ``model.ckpt`` + config),
``_save_optimizer_and_scheduler``, ``_save_scaler``, ``_save_rng_state``,
``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler``,
``_load_rng_state``, ``_load_best_model``, ``_finalize_training`` (wraps it)
and ``train`` (resolves ``resume_from_checkpoint``).  Supported: one process
(CPU or one accelerator).  Multi-process runs, DeepSpeed, FSDP, XLA and
SageMaker are refused with ``NotImplementedError``.

The final model (``trainer.save_model()``) is still written by the Trainer
(safetensors, for ``from_pretrained``).  ``from_pretrained`` does not read
checkpoint folders; :func:`load_model` builds the model of one
(``load_model(folder, AutoModelForCausalLM)``), :func:`load_model_state` gives
its state dict.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import stat
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import ckptfmt

from ..engine import commit
from ..engine.ckptdir import CheckpointDir, LinkError
from ..errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptError,
    IncompleteError,
    LimitError,
    UnsupportedError,
)
from ..files import multifile
from ..files.reader import CheckpointFile
from ..files.save import check_save_args
from ..files.verify import VerifyReport, check_file
from . import objects

try:
    import transformers
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ckptfmt.integrations.transformers needs transformers: pip install 'ckptfmt[transformers]'"
    ) from e

if TYPE_CHECKING:
    _MixinBase = Trainer
else:
    _MixinBase = object

logger = logging.getLogger(__name__)

PREFIX = "checkpoint"
MODEL_NAME = "model.ckpt"
OPTIMIZER_NAME = "optimizer.ckpt"
SCHEDULER_NAME = "scheduler.ckpt"
SCALER_NAME = "scaler.ckpt"
RNG_NAME = "rng_state.ckpt"
TRAINER_STATE_NAME = "trainer_state.ckpt"
TRAINER_STATE_JSON = "trainer_state.json"
CONFIG_JSON = "config.json"
#: the JSON files read from a folder (trainer_state.json, config.json) are bounded: a
#: hostile folder cannot make a read take unbounded memory
MAX_JSON_BYTES = 64 << 20
_DIR_RE = re.compile(rf"{PREFIX}-([0-9]+)")

#: the Trainer methods this module overrides or wraps
HOOKS = (
    "_save_checkpoint",
    "save_model",
    "_save_optimizer_and_scheduler",
    "_save_scaler",
    "_save_rng_state",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
    "_load_best_model",
    "_finalize_training",
    "_get_output_dir",
    "train",
)
_missing = [h for h in HOOKS if not callable(getattr(Trainer, h, None))]
if _missing:  # pragma: no cover - depends on the installed transformers
    raise ImportError(
        f"transformers {transformers.__version__}: Trainer has no {', '.join(_missing)}; "
        "ckptfmt.integrations.transformers supports the versions pinned by ckptfmt[transformers]"
    )


# ---------------------------------------------------------------------------
# checkpoint folders: every entry is reached through the folder's descriptor
# (ckptfmt.ckptdir), never through a path string an entry could redirect


def checkpoint_step(name: str) -> int | None:
    """N for a folder named ``checkpoint-N``, else None."""
    m = _DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def _open_run(run_dir: str) -> CheckpointDir | None:
    """The run directory (the caller's path, trusted), or None when there is none yet."""
    try:
        return CheckpointDir.open(run_dir)
    except FileNotFoundError:
        return None


def _scan(run: CheckpointDir) -> tuple[list[tuple[int, str]], list[str]]:
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
    run = _open_run(run_dir)
    if run is None:
        return
    with run:
        folders, _ = _scan(run)
    for step, name in folders:
        yield step, run.path_of(name)


class _Opened:
    """A checked checkpoint folder held open: its descriptor and its commit record.  Everything
    read from it afterwards goes through this descriptor, so what is read is what was checked."""

    def __init__(self, folder: CheckpointDir, record: multifile.CommitRecord) -> None:
        self.dir = folder
        self.record = record

    @property
    def path(self) -> str:
        return self.dir.path

    def part(self, name: str) -> multifile.PartRecord | None:
        """The record of file `name` when the commit names it (a file it does not name is never read)."""
        return next((p for p in self.record.files if p.name == name), None)

    @contextlib.contextmanager
    def open(self, part: multifile.PartRecord) -> Iterator[CheckpointFile]:
        """The exact file the commit names, checked again as it is opened (length, id, index checksum)."""
        fd = multifile.open_part(self.dir, part, self.path)
        with CheckpointFile(self.dir.path_of(part.name), fd=fd, within=self.dir) as f:
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

    def __enter__(self) -> _Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check(folder: CheckpointDir, verify: bool) -> _Opened:
    """`folder` checked complete (and with `verify`, every chunk checked); it is not closed here."""
    record = multifile.check_complete(folder)
    opened = _Opened(folder, record)
    if opened.part(TRAINER_STATE_NAME) is None:
        raise IncompleteError(f"the commit record names no {TRAINER_STATE_NAME}", path=folder.path)
    if verify:
        opened.verify()
    return opened


def _open_checked(path: str, verify: bool = False) -> _Opened:
    """The folder the caller names (its path is the caller's, resolved once), checked complete."""
    try:
        folder = CheckpointDir.open(path)
    except FileNotFoundError:
        raise IncompleteError("no such checkpoint folder", path=path) from None
    except OSError as e:
        raise IncompleteError(f"cannot open the folder: {e.strerror}", path=path) from None
    try:
        return _check(folder, verify)
    except BaseException:
        folder.close()
        raise


def check_checkpoint(path: str, *, verify: bool = False) -> multifile.CommitRecord:
    """The commit record of a complete checkpoint folder; raises CheckpointError (saying why) otherwise.

    Complete: the commit record verifies and every file it names is there with the recorded
    length, file id and index checksum.  `verify=True` also reads every chunk of every file
    and checks its checksum (damage after the save: bit rot, a bad copy).
    """
    with _open_checked(path, verify) as opened:
        return opened.record


def _why(e: BaseException, folder: str | None = None) -> str:
    """What went wrong, in words; the entry it concerns named when it is one inside `folder`."""
    if not isinstance(e, CheckpointError):
        return f"{type(e).__name__}: {e}"
    if folder is None or e.path is None or os.path.dirname(e.path) != folder:
        return e.reason
    return f"{os.path.basename(e.path)}: {e.reason}"


def _warn_skip(path: str, why: str) -> None:
    warnings.warn(f"skipping {path}: {why}", CheckpointWarning, stacklevel=4)


def _latest(run_dir: str, verify: bool, warn: bool) -> _Opened | None:
    """The newest complete ``checkpoint-N`` folder of `run_dir`, held open, or None."""
    run = _open_run(run_dir)
    if run is None:
        return None
    with run:
        folders, others = _scan(run)
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
                    _warn_skip(run.path_of(name), f"not a complete checkpoint ({_why(e)})")
                continue
            try:
                return _check(folder, verify)
            except (CheckpointError, OSError) as e:
                folder.close()
                if warn:
                    _warn_skip(folder.path, f"not a complete checkpoint ({_why(e, folder.path)})")
    return None


def latest_checkpoint(run_dir: str, *, verify: bool = False, warn: bool = True) -> str | None:
    """The complete ``checkpoint-N`` folder with the highest N in `run_dir`, or None.

    Newer folders that are not complete (with ``verify=True``: or whose files fail
    their checksums) are skipped, each with a CheckpointWarning naming it and why
    (unless ``warn=False``); so are ``checkpoint-N`` entries that are symbolic links
    (never followed: they may lead anywhere).
    """
    found = _latest(run_dir, verify, warn)
    if found is None:
        return None
    found.close()
    return found.path


def load_model_state(path: str, map_location: Any = None) -> dict[str, Any]:
    """The model state dict of a complete checkpoint folder (checksums verified)."""
    with _open_checked(path) as opened:
        state: dict[str, Any] = opened.load_required(MODEL_NAME, map_location)
    return state


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An exception of transformers or torch (about a hostile config) in one bounded line."""
    text = " ".join(_why(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_config(folder: CheckpointDir) -> Any:
    """The model config in ``config.json``, read through the folder (no link, no FIFO, bounded).
    The commit record does not cover it: any value that does not make a config of a model type
    transformers knows is refused (UnsupportedError for an unknown type, else CorruptError)."""
    from transformers import CONFIG_MAPPING

    try:
        raw = folder.read_file(CONFIG_JSON, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise IncompleteError(f"{CONFIG_JSON} is missing", path=folder.path) from None
    try:
        values = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError included; nested too deep
        raise CorruptError(f"{CONFIG_JSON} is not JSON: {_one_line(e)}", path=folder.path) from None
    model_type = values.get("model_type") if isinstance(values, dict) else None
    if not isinstance(model_type, str):
        raise CorruptError(f"{CONFIG_JSON} is not a model config: no model_type", path=folder.path)
    if model_type not in CONFIG_MAPPING:
        raise UnsupportedError(
            f"{CONFIG_JSON}: model_type {model_type[:80]!r} is not a model type transformers "
            f"{transformers.__version__} knows",
            path=folder.path,
        )
    try:
        return CONFIG_MAPPING[model_type].from_dict(values)
    except Exception as e:  # transformers' and huggingface_hub's validation errors, any kind
        raise CorruptError(
            f"{CONFIG_JSON} is not a {model_type} config: {_one_line(e)}", path=folder.path
        ) from None


def _committed_tensors(f: CheckpointFile, where: str) -> dict[str, tuple[list[int], Any]]:
    """name -> (shape, dtype) of the tensors of ``model.ckpt``, from its index (no data read)."""
    from ..format import dtypes

    node = f.tree.nodes[f.tree.root]
    if node[0] not in ("dict", "odict"):
        raise CorruptError(f"{MODEL_NAME} does not hold a state dict", path=where)
    out: dict[str, tuple[list[int], Any]] = {}
    for key, nid in f.root_items():
        entry = f.tree.nodes[nid]
        if type(key) is not str or entry[0] != "tensor":
            raise CorruptError(f"{MODEL_NAME}: {str(key)[:80]!r} is not a named tensor", path=where)
        out[key] = (list(entry[1]["shape"]), dtypes.TORCH_DTYPES[entry[1]["dtype"]])
    return out


#: a model built from a config may register at most this many modules, parameters and buffers
#: per committed tensor (plus SLACK) before it is stopped: a hostile layer count cannot make
#: even the meta model take unbounded time and memory
MODULES_PER_TENSOR = 16
SLACK = 1024


class _TooBig(Exception):
    pass


@contextlib.contextmanager
def _bounded(limit: int) -> Iterator[None]:
    """Stop a model's construction (in this thread) once it registers more than `limit`
    modules, parameters and buffers."""
    from torch.nn.modules import module as torch_module

    me = threading.get_ident()
    count = [0]

    def hook(*_args: Any) -> None:
        if threading.get_ident() == me:
            count[0] += 1
            if count[0] > limit:
                raise _TooBig(f"more than {limit} modules, parameters and buffers")

    handles = [
        torch_module.register_module_module_registration_hook(hook),
        torch_module.register_module_parameter_registration_hook(hook),
        torch_module.register_module_buffer_registration_hook(hook),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _build(cls: Any, config: Any) -> Any:
    return cls.from_config(config) if hasattr(cls, "from_config") else cls(config)


def _meta_model(cls: Any, config: Any, limit: int, where: str) -> Any:
    """The model `config` makes, built on the meta device (nothing allocated); CorruptError when
    transformers or torch refuse the config."""
    import torch

    mapping = getattr(cls, "_model_mapping", None)  # an AutoModel... class
    if mapping is not None and type(config) not in mapping:
        raise UnsupportedError(
            f"{CONFIG_JSON}: {getattr(cls, '__name__', cls)} has no model for model_type "
            f"{config.model_type!r}",
            path=where,
        )
    try:
        with _bounded(limit), torch.device("meta"):
            return _build(cls, copy.deepcopy(config))
    except Exception as e:  # whatever the model's code raises on the values it was given
        raise CorruptError(f"{CONFIG_JSON} does not make a model: {_one_line(e)}", path=where) from None


def _misfit(model: Any, committed: dict[str, tuple[list[int], Any]]) -> str | None:
    """How the model's state dict differs from the committed tensors (names, shapes, dtypes)."""
    import torch

    own = model.state_dict()
    missing = [k for k in own if k not in committed]
    if missing:
        return f"{MODEL_NAME} has no {missing[0][:120]!r} ({len(missing)} of the model's tensors missing)"
    extra = [k for k in committed if k not in own]
    if extra:
        return f"{MODEL_NAME} holds {extra[0][:120]!r}, which the model has not ({len(extra)} such)"
    for k, t in own.items():
        shape, dtype = committed[k]
        if not isinstance(t, torch.Tensor):
            return f"the model's {k[:120]!r} is not a tensor"
        if list(t.shape) != shape or t.dtype != dtype:
            return f"{k[:120]!r} is {dtype} {shape} in {MODEL_NAME}, {t.dtype} {list(t.shape)} in the model"
    return None


def _nbytes(shape: list[int], dtype: Any) -> int:
    import math

    import torch

    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def load_model(path: str, model_class: Any = None) -> Any:
    """A model built from a complete checkpoint folder: its ``config.json`` and ``model.ckpt``.

    `model_class`: an ``AutoModel...`` class (default ``AutoModel``) or a model class
    (``GPT2LMHeadModel``).  The model is on the CPU, in training mode as saved.

    ``config.json`` is not covered by the commit record: the model it makes is first built on
    the meta device (nothing allocated) and every parameter and buffer of its state dict
    compared (name, shape, dtype) with the tensors ``model.ckpt`` holds, read from its index;
    any difference is a CorruptError (a model type transformers does not know: UnsupportedError)
    before anything is allocated.  Only then is the model built on the CPU (its buffers that
    are not in the state dict, such as BERT's ``position_ids``, made by the model's own code)
    and the committed tensors loaded into it.
    """
    from transformers import AutoModel

    cls = AutoModel if model_class is None else model_class
    with _open_checked(path) as opened:
        part = opened.part(MODEL_NAME)
        if part is None:
            raise IncompleteError(f"the commit record names no {MODEL_NAME}", path=opened.path)
        config = _read_config(opened.dir)
        with opened.open(part) as f:
            committed = _committed_tensors(f, opened.path)
            limit = MODULES_PER_TENSOR * len(committed) + SLACK
            skeleton = _meta_model(cls, config, limit, opened.path)
            why = _misfit(skeleton, committed)
            if why is not None:
                raise CorruptError(f"{CONFIG_JSON} does not fit the committed model: {why}", path=opened.path)
            held = sum(_nbytes(*v) for v in committed.values())
            own = set(skeleton.state_dict())
            more = sum(b.numel() * b.element_size() for n, b in skeleton.named_buffers() if n not in own)
            if more > held + (1 << 20):
                raise CorruptError(
                    f"{CONFIG_JSON} makes {more} bytes of buffers that are not in {MODEL_NAME} "
                    f"(which holds {held} bytes)",
                    path=opened.path,
                )
            del skeleton
            state = f.load_subtree(f.tree.root, None, True)
    # the same config, now on the CPU: its tensors are those just checked
    model: Any = _build(cls, config)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # pragma: no cover - the meta model was checked to fit
        raise CorruptError(f"{MODEL_NAME} does not fit the model: {_one_line(e)}", path=path) from None
    return model


def _delete_folder(run: CheckpointDir, name: str) -> None:
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


def _replace_file(folder: CheckpointDir, name: str, write: Callable[[int], object]) -> None:
    """Make entry `name` of `folder` the file `write(fd)` writes, with the commit protocol
    beneath the folder's descriptor (commit.AtomicFile): a temp sibling created
    O_EXCL | O_NOFOLLOW and owned by this process (a link already at that name is never
    written through), fsync, rename over `name` (a link or a FIFO is replaced as a name),
    fsync the folder."""
    with commit.AtomicFile(folder.path_of(name), folder) as f:
        write(f.fd)
        f.commit()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# ---------------------------------------------------------------------------
# the Trainer mixin


def _fresh_folder(run_dir: str, name: str) -> CheckpointDir:
    """A new, empty directory `name` in the run directory, held open.  Whatever had that name
    goes first (an earlier save of this step, crashed or from a run resumed from an older
    step; a link, removed as a name: what it points to is never emptied nor written into)."""
    with CheckpointDir.open(run_dir, create=True) as run:
        _delete_folder(run, name)
        run.mkdir(name)  # fails if anything took the name meanwhile
        return run.sub(name)


class _Save:
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
        self.handles: list[ckptfmt.SaveHandle] = []
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

    def close(self) -> None:
        if self.dir is not None:
            self.dir.close()


class CkptfmtTrainerMixin(_MixinBase):
    """Put before a ``transformers.Trainer`` (sub)class: ``class T(CkptfmtTrainerMixin, Trainer)``.

    Extra keyword arguments: ``ckptfmt_blocking`` (default True),
    ``ckptfmt_compression`` (None or "zstd") and ``ckptfmt_verify_resume``
    (default True: before resuming, read every chunk of the chosen checkpoint and
    check its checksum, going on to older ones if it fails).  See the module docstring.
    """

    def __init__(
        self,
        *args: Any,
        ckptfmt_blocking: bool = True,
        ckptfmt_compression: str | None = None,
        ckptfmt_verify_resume: bool = True,
        **kwargs: Any,
    ) -> None:
        check_save_args(ckptfmt_compression, None, None)
        self.ckptfmt_blocking = ckptfmt_blocking
        self.ckptfmt_verify_resume = ckptfmt_verify_resume
        self.ckptfmt_compression = ckptfmt_compression
        self._ckptfmt_current: _Save | None = None
        self._ckptfmt_resume: _Opened | None = None  # the checked folder train() resumes from
        self._ckptfmt_inflight: list[_Save] = []
        self._ckptfmt_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    # -- what is supported ---------------------------------------------------------------

    def _ckptfmt_check_supported(self) -> None:
        unsupported = [
            what
            for what, on in (
                ("more than one process", self.args.world_size > 1),
                ("DeepSpeed", getattr(self, "is_deepspeed_enabled", False)),
                (
                    "FSDP",
                    getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_fsdp_xla_enabled", False),
                ),
            )
            if on
        ]
        if unsupported:
            raise NotImplementedError(
                f"ckptfmt's Trainer integration does not support {', '.join(unsupported)} yet; "
                "use transformers.Trainer for this run"
            )

    @property
    def _ckptfmt_blocking_now(self) -> bool:
        return self.ckptfmt_blocking or bool(self.args.push_to_hub)

    # -- saving --------------------------------------------------------------------------

    def _ckptfmt_write(self, name: str, state: object) -> None:
        save = self._ckptfmt_current
        if save is None:
            raise RuntimeError(f"{name}: ckptfmt checkpoint files are written only inside _save_checkpoint")
        if not self.args.should_save:
            return
        save.check_in_place()
        handle = ckptfmt.save(
            objects.encode(state),
            os.path.join(save.folder, name),
            compression=self.ckptfmt_compression,
            blocking=self._ckptfmt_blocking_now,
            metadata={
                "writer": "ckptfmt.integrations.transformers",
                "transformers": transformers.__version__,
            },
        )
        save.names.append(name)
        if handle is not None:
            save.handles.append(handle)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._ckptfmt_check_supported()
        self._ckptfmt_raise_failed()
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        folder = os.path.join(run_dir, f"{PREFIX}-{step}")
        if any(s.folder == folder for s in self._ckptfmt_inflight):
            self.wait_for_checkpoints()
        limit = self.args.save_total_limit
        save = _Save(folder, run_dir, step, limit)
        if self.args.should_save:
            # before anything is written, so no stale file (or link) can survive
            save.dir = _fresh_folder(run_dir, f"{PREFIX}-{step}")
        self._ckptfmt_current = save
        self.args.save_total_limit = None  # the Trainer's rotation would run before the commit
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                text = save.check_in_place().read_file(TRAINER_STATE_JSON, MAX_JSON_BYTES)
                self._ckptfmt_write(TRAINER_STATE_NAME, {"trainer_state_json": text.decode("utf-8")})
        except BaseException:
            save.close()
            raise
        finally:
            self.args.save_total_limit = limit
            self._ckptfmt_current = None
        if not self.args.should_save:
            return
        if self._ckptfmt_blocking_now and not self._ckptfmt_inflight:
            self._ckptfmt_commit(save)
            return
        with self._ckptfmt_lock:
            before = self._ckptfmt_inflight[-1].thread if self._ckptfmt_inflight else None
            save.thread = threading.Thread(
                target=self._ckptfmt_commit_after,
                args=(save, before),
                name=f"ckptfmt-commit-{os.path.basename(folder)}",
            )
            self._ckptfmt_inflight.append(save)
        save.thread.start()
        if self._ckptfmt_blocking_now:
            self.wait_for_checkpoints()

    def _ckptfmt_commit_after(self, save: _Save, before: threading.Thread | None) -> None:
        if before is not None:
            before.join()  # commit records in the order of the saves
        try:
            self._ckptfmt_commit(save)
        except BaseException as e:  # kept for the next save or the end of train()
            save.error = e

    def _ckptfmt_commit(self, save: _Save) -> None:
        try:
            errors = [e for e in (h.exception() for h in save.handles) if e is not None]
            if errors:
                raise errors[0]
            folder = save.check_in_place()
            parts = tuple(multifile.describe_in(folder, n) for n in save.names)
            folder.fsync()
            record = multifile.CommitRecord(
                step=save.step,
                layout="hf-trainer",
                files=parts,
                metadata={
                    "writer": "ckptfmt.integrations.transformers",
                    "transformers": transformers.__version__,
                },
            )
            multifile.write_commit(folder.path, record, within=folder)
        finally:
            save.close()
        self._ckptfmt_rotate(save.run_dir, save.limit)

    def _ckptfmt_raise_failed(self) -> None:
        """Raise the error of a finished non-blocking save (the first one), forgetting finished ones."""
        with self._ckptfmt_lock:
            finished = [s for s in self._ckptfmt_inflight if s.thread is not None and not s.thread.is_alive()]
            self._ckptfmt_inflight = [s for s in self._ckptfmt_inflight if s not in finished]
        for s in finished:
            if s.error is not None:
                raise s.error

    def wait_for_checkpoints(self) -> None:
        """Wait until every checkpoint saved so far is committed; raise the first error."""
        with self._ckptfmt_lock:
            pending, self._ckptfmt_inflight = self._ckptfmt_inflight, []
        for s in pending:
            if s.thread is not None:
                s.thread.join()
        for s in pending:
            if s.error is not None:
                raise s.error

    def _ckptfmt_rotate(self, run_dir: str, limit: int | None) -> None:
        """Keep the newest `limit` complete checkpoints and the best one; remove incomplete folders
        older than the newest complete one, except those being saved."""
        if limit is None or limit <= 0:
            return
        with self._ckptfmt_lock:
            busy = {s.folder for s in self._ckptfmt_inflight if s.thread is None or s.thread.is_alive()}
            if self._ckptfmt_current is not None:
                busy.add(self._ckptfmt_current.folder)
        run = _open_run(run_dir)
        if run is None:
            return
        with run:
            complete, incomplete = _sort_folders(run)
            if not complete:
                return
            keep = {name for _, name in complete[-limit:]}
            best = self.state.best_model_checkpoint
            if best is not None:
                keep.add(os.path.basename(os.path.normpath(best)))
            newest_step = complete[-1][0]
            old = [name for _, name in complete if name not in keep]
            old += [name for step, name in incomplete if step < newest_step]
            for name in old:
                if run.path_of(name) not in busy:
                    logger.info(
                        f"Deleting older checkpoint [{run.path_of(name)}] due to args.save_total_limit"
                    )
                    _remove_quietly(run, name)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        save = self._ckptfmt_current
        if save is None or output_dir is None or os.path.abspath(output_dir) != os.path.abspath(save.folder):
            super().save_model(output_dir, _internal_call)  # the final model: the Trainer's own format
            return
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        self._ckptfmt_write(MODEL_NAME, unwrapped.state_dict())
        config = getattr(unwrapped, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(output_dir)
        generation = getattr(unwrapped, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)  # type: ignore[union-attr]
        import torch

        # as the Trainer does (pickled); never read by a resume
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.args.should_save:
            return
        assert self.optimizer is not None
        self._ckptfmt_write(OPTIMIZER_NAME, self.optimizer.state_dict())
        if self.lr_scheduler is not None:
            self._ckptfmt_write(SCHEDULER_NAME, self.lr_scheduler.state_dict())

    def _save_scaler(self, output_dir: str) -> None:
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and self.args.should_save:
            self._ckptfmt_write(SCALER_NAME, scaler.state_dict())

    def _save_rng_state(self, output_dir: str) -> None:
        self._ckptfmt_write(RNG_NAME, ckptfmt.capture_rng())

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        self.wait_for_checkpoints()  # the best model is read from a committed folder
        limit = self.args.save_total_limit
        if limit == 1:
            self.args.save_total_limit = None  # the Trainer would keep only the best checkpoint
        try:
            return super()._finalize_training(*args, **kwargs)
        finally:
            self.args.save_total_limit = limit

    # -- resuming ------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        self._ckptfmt_check_supported()
        source = self._ckptfmt_resume_source(resume_from_checkpoint)
        if source is not None:
            resume_from_checkpoint = source.path
        failed = True
        try:
            if source is not None:
                _restore_trainer_state_json(source)
            result = super().train(resume_from_checkpoint, *args, **kwargs)
            failed = False
        finally:
            self._ckptfmt_resume = None
            if source is not None:
                source.close()
            if failed:
                try:
                    self.wait_for_checkpoints()
                except BaseException as e:  # the training error goes first; this one is logged
                    logger.error(f"a checkpoint save failed too: {e!r}")
        self.wait_for_checkpoints()
        return result

    @contextlib.contextmanager
    def _ckptfmt_source(self, checkpoint: str) -> Iterator[_Opened]:
        """The checked folder `checkpoint`: the one train() holds open, or (a hook called on its
        own) opened and checked here.  Only files its commit record names are read."""
        held = self._ckptfmt_resume
        if held is not None and held.path == checkpoint:
            yield held
            return
        with _open_checked(checkpoint) as opened:
            yield opened

    def _ckptfmt_resume_source(self, resume_from_checkpoint: str | bool | None) -> _Opened | None:
        """The checked folder a train() call resumes from, held open until it returns (and
        remembered for the load hooks), or None when it starts afresh."""
        if resume_from_checkpoint is True:
            run_dir = os.fspath(self.args.output_dir or ".")
            found = _latest(run_dir, self.ckptfmt_verify_resume, warn=True)
            if found is None:
                raise ValueError(f"No complete checkpoint found in output directory ({self.args.output_dir})")
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            path = os.fspath(resume_from_checkpoint)
            try:
                found = _open_checked(path, verify=self.ckptfmt_verify_resume)
            except CheckpointError as e:
                raise CheckpointError(
                    f"not a complete ckptfmt checkpoint ({e.reason}); folders written by "
                    "transformers.Trainer itself are resumed with transformers.Trainer",
                    path=path,
                ) from e
        else:
            return None
        self._ckptfmt_resume = found
        return found

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if model is None:
            model = self.model
        logger.info(f"Loading model from {resume_from_checkpoint}.")
        with self._ckptfmt_source(resume_from_checkpoint) as source:
            state = source.load_required(MODEL_NAME)
        self._issue_warnings_after_load(model.load_state_dict(state, False))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        with self._ckptfmt_source(checkpoint) as source:
            optimizer = source.load(OPTIMIZER_NAME)  # None: not saved (save_only_model)
            if optimizer is None:
                return
            assert self.optimizer is not None
            self.optimizer.load_state_dict(optimizer)
            if self.lr_scheduler is None:
                return
            scheduler = source.load(SCHEDULER_NAME)
            if scheduler is not None:
                where = source.dir.path_of(SCHEDULER_NAME)
                self.lr_scheduler.load_state_dict(objects.decode(scheduler, source=where))

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        with self._ckptfmt_source(checkpoint) as source:
            scaler = source.load(SCALER_NAME)
        if scaler is not None:
            self.accelerator.scaler.load_state_dict(scaler)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        with self._ckptfmt_source(checkpoint) as source:
            rng = source.load(RNG_NAME)
        if rng is None:
            logger.info(f"{checkpoint} has no {RNG_NAME}: the random number generators are not restored")
            return
        ckptfmt.restore_rng(rng)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None:
            return
        # the best folder is looked for in this run's directory only, by its name: the recorded
        # path comes from trainer_state.json, which a folder from elsewhere may point anywhere
        run_dir = self._get_output_dir(trial=getattr(self, "_trial", None))
        try:
            state = _load_best(run_dir, os.path.basename(os.path.normpath(best)))
        except (CheckpointError, OSError) as e:
            logger.warning(f"Could not load the best model from {best}: {_why(e)}")
            return
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        assert self.model is not None
        self._issue_warnings_after_load(self.model.load_state_dict(state, False))


def _load_best(run_dir: str, name: str) -> Any:
    """The model state of complete folder `name` of the run directory (never a link)."""
    if checkpoint_step(name) is None:
        raise CorruptError(f"the best checkpoint {name[:80]!r} is not a {PREFIX}-N folder", path=run_dir)
    with CheckpointDir.open(run_dir) as run, run.sub(name) as folder:
        return _check(folder, False).load_required(MODEL_NAME)


def _sort_folders(run: CheckpointDir) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(step, name) of the complete and of the incomplete ``checkpoint-N`` folders, oldest first
    (links are neither: never followed, never deleted)."""
    complete, incomplete = [], []
    for step, name in _scan(run)[0]:
        try:
            with run.sub(name) as folder:
                _check(folder, False)
            complete.append((step, name))
        except (CheckpointError, OSError):
            incomplete.append((step, name))
    return complete, incomplete


def _remove_quietly(run: CheckpointDir, name: str) -> None:
    """Rotation's deletion: a folder that cannot be removed is logged, training goes on."""
    try:
        _delete_folder(run, name)
    except OSError as e:
        logger.warning(f"could not delete {run.path_of(name)}: {e}")


def _current_json(folder: CheckpointDir, limit: int) -> tuple[str | None, str]:
    """``trainer_state.json`` as it is (None when it cannot be the committed text), and what it
    is when it differs.  Read through the folder: a link is not followed, a FIFO not waited on."""
    try:
        raw = folder.read_file(TRAINER_STATE_JSON, limit)
    except FileNotFoundError:
        return None, "missing"
    except LimitError:
        return None, "not what was committed"
    except (CheckpointError, OSError) as e:
        return None, f"not a regular file of the folder ({_why(e)})"
    try:
        return raw.decode("utf-8"), "not what was committed"
    except UnicodeDecodeError:
        return None, "not what was committed"


def _restore_trainer_state_json(source: str | _Opened) -> None:
    """Make ``trainer_state.json`` what the commit recorded (the Trainer reads the JSON file by
    path, after this: a link or FIFO there is replaced, never read or written through)."""
    with contextlib.ExitStack() as stack:
        if isinstance(source, str):
            source = stack.enter_context(_open_checked(source))
        committed = source.load_required(TRAINER_STATE_NAME)
        text = committed.get("trainer_state_json") if isinstance(committed, dict) else None
        if not isinstance(text, str):
            raise CorruptError(f"{TRAINER_STATE_NAME} holds no trainer state", path=source.path)
        data = text.encode("utf-8")
        current, what = _current_json(source.dir, len(data))
        if current == text:
            return
        where = source.dir.path_of(TRAINER_STATE_JSON)
        warnings.warn(
            f"{where} is {what}: rewriting it from {TRAINER_STATE_NAME}", CheckpointWarning, stacklevel=3
        )
        try:
            _replace_file(source.dir, TRAINER_STATE_JSON, lambda fd: _write_all(fd, data))
        except OSError as e:
            raise CorruptError(
                f"{TRAINER_STATE_JSON} cannot be replaced: {e.strerror}", path=source.path
            ) from None


class CkptfmtTrainer(CkptfmtTrainerMixin, Trainer):
    """``transformers.Trainer`` with ckptfmt checkpoints (see the module docstring)."""


__all__ = [
    "CkptfmtTrainer",
    "CkptfmtTrainerMixin",
    "HOOKS",
    "check_checkpoint",
    "iter_checkpoint_dirs",
    "latest_checkpoint",
    "load_model",
    "load_model_state",
]
