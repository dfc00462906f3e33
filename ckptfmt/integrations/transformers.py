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

import logging
import os
import re
import shutil
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import ckptfmt

from .. import multifile
from ..errors import CheckpointError, CheckpointWarning, CorruptError, IncompleteError
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
# checkpoint folders


def checkpoint_step(name: str) -> int | None:
    """N for a folder named ``checkpoint-N``, else None."""
    m = _DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def iter_checkpoint_dirs(run_dir: str) -> Iterator[tuple[int, str]]:
    """(step, path) of every ``checkpoint-N`` folder in `run_dir`, oldest step first."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return
    found = []
    for name in names:
        step = checkpoint_step(name)
        path = os.path.join(run_dir, name)
        if step is not None and os.path.isdir(path) and not os.path.islink(path):
            found.append((step, path))
    yield from sorted(found)


def check_checkpoint(path: str, *, verify: bool = False) -> multifile.CommitRecord:
    """The commit record of a complete checkpoint folder; raises CheckpointError (saying why) otherwise.

    Complete: the commit record verifies and every file it names is there with the recorded
    length, file id and index checksum.  `verify=True` also reads every chunk of every file
    and checks its checksum (damage after the save: bit rot, a bad copy).
    """
    record = multifile.check_complete(path)
    if not any(p.name == TRAINER_STATE_NAME for p in record.files):
        raise IncompleteError(f"the commit record names no {TRAINER_STATE_NAME}", path=path)
    if verify:
        for part in record.files:
            report = ckptfmt.verify(os.path.join(path, part.name))
            if not report.ok:
                raise CorruptError(f"{part.name} is damaged: {report.problems[0]}", path=path)
    return record


def _why(e: BaseException) -> str:
    if isinstance(e, CheckpointError):
        return e.reason
    return f"{type(e).__name__}: {e}"


def latest_checkpoint(run_dir: str, *, verify: bool = False, warn: bool = True) -> str | None:
    """The complete ``checkpoint-N`` folder with the highest N in `run_dir`, or None.

    Newer folders that are not complete (with ``verify=True``: or whose files fail
    their checksums) are skipped, each with a CheckpointWarning naming it and why
    (unless ``warn=False``).
    """
    for _step, path in reversed(list(iter_checkpoint_dirs(run_dir))):
        try:
            check_checkpoint(path, verify=verify)
        except (CheckpointError, OSError) as e:
            if warn:
                warnings.warn(
                    f"skipping {path}: not a complete checkpoint ({_why(e)})", CheckpointWarning, stacklevel=2
                )
            continue
        return path
    return None


def load_model_state(path: str, map_location: Any = None) -> dict[str, Any]:
    """The model state dict of a complete checkpoint folder (checksums verified)."""
    check_checkpoint(path)
    state: dict[str, Any] = ckptfmt.load(os.path.join(path, MODEL_NAME), map_location=map_location)
    return state


def load_model(path: str, model_class: Any = None) -> Any:
    """A model built from a complete checkpoint folder: its ``config.json`` and ``model.ckpt``.

    `model_class`: an ``AutoModel...`` class (default ``AutoModel``) or a model class
    (``GPT2LMHeadModel``).  The model is on the CPU, in training mode as saved.
    """
    from transformers import AutoConfig, AutoModel

    state = load_model_state(path)
    config = AutoConfig.from_pretrained(path)
    cls = AutoModel if model_class is None else model_class
    model: Any = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    model.load_state_dict(state)
    return model


def _delete_folder(path: str) -> None:
    """Delete a checkpoint folder, its commit record first: an interrupted deletion leaves
    an incomplete folder, never one whose record names missing files."""
    try:
        os.unlink(os.path.join(path, multifile.COMMIT_NAME))
        multifile.fsync_path(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------
# the Trainer mixin


class _Save:
    """One checkpoint folder being saved: its ckptfmt files and their handles."""

    def __init__(self, folder: str, run_dir: str, step: int, limit: int | None) -> None:
        self.folder = folder
        self.run_dir = run_dir
        self.step = step
        self.limit = (
            limit  # save_total_limit when the save began (the Trainer's own rotation is off meanwhile)
        )
        self.names: list[str] = []
        self.handles: list[ckptfmt.SaveHandle] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None


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
        ckptfmt.writer.check_save_args(ckptfmt_compression, None, None)
        self.ckptfmt_blocking = ckptfmt_blocking
        self.ckptfmt_verify_resume = ckptfmt_verify_resume
        self.ckptfmt_compression = ckptfmt_compression
        self._ckptfmt_current: _Save | None = None
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
        os.makedirs(save.folder, exist_ok=True)
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
        if self.args.should_save and os.path.lexists(folder):
            # an earlier save of this step (a crashed one, or from a run that was resumed from an
            # older step): it goes before anything is written, so no stale file can survive
            _delete_folder(folder)
        limit = self.args.save_total_limit
        save = _Save(folder, run_dir, step, limit)
        self._ckptfmt_current = save
        self.args.save_total_limit = None  # the Trainer's rotation would run before the commit
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                with open(os.path.join(folder, TRAINER_STATE_JSON), encoding="utf-8") as f:
                    self._ckptfmt_write(TRAINER_STATE_NAME, {"trainer_state_json": f.read()})
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
        errors = [e for e in (h.exception() for h in save.handles) if e is not None]
        if errors:
            raise errors[0]
        parts = tuple(multifile.describe_part(os.path.join(save.folder, n), n) for n in save.names)
        multifile.fsync_path(save.folder)
        record = multifile.CommitRecord(
            step=save.step,
            layout="hf-trainer",
            files=parts,
            metadata={
                "writer": "ckptfmt.integrations.transformers",
                "transformers": transformers.__version__,
            },
        )
        multifile.write_commit(save.folder, record)
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
        complete: list[str] = []
        incomplete: list[tuple[int, str]] = []
        for step, path in iter_checkpoint_dirs(run_dir):
            try:
                check_checkpoint(path)
                complete.append(path)
            except (CheckpointError, OSError):
                incomplete.append((step, path))
        if not complete:
            return
        keep = set(complete[-limit:])
        best = self.state.best_model_checkpoint
        if best is not None:
            keep.add(os.path.join(run_dir, os.path.basename(os.path.normpath(best))))
        newest_step = checkpoint_step(os.path.basename(complete[-1]))
        assert newest_step is not None
        for path in complete:
            if path not in keep and path not in busy:
                logger.info(f"Deleting older checkpoint [{path}] due to args.save_total_limit")
                _delete_folder(path)
        for step, path in incomplete:
            if step < newest_step and path not in busy:
                _delete_folder(path)

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
        if resume_from_checkpoint is True:
            found = latest_checkpoint(
                os.fspath(self.args.output_dir or "."), verify=self.ckptfmt_verify_resume
            )
            if found is None:
                raise ValueError(f"No complete checkpoint found in output directory ({self.args.output_dir})")
            resume_from_checkpoint = found  # checked already by latest_checkpoint
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
            try:
                check_checkpoint(resume_from_checkpoint, verify=self.ckptfmt_verify_resume)
            except CheckpointError as e:
                raise CheckpointError(
                    f"not a complete ckptfmt checkpoint ({e.reason}); folders written by "
                    "transformers.Trainer itself are resumed with transformers.Trainer",
                    path=resume_from_checkpoint,
                ) from e
        if isinstance(resume_from_checkpoint, str):
            _restore_trainer_state_json(resume_from_checkpoint)
        failed = True
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
            failed = False
        finally:
            if failed:
                try:
                    self.wait_for_checkpoints()
                except BaseException as e:  # the training error goes first; this one is logged
                    logger.error(f"a checkpoint save failed too: {e!r}")
        self.wait_for_checkpoints()
        return result

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if model is None:
            model = self.model
        logger.info(f"Loading model from {resume_from_checkpoint}.")
        state = ckptfmt.load(os.path.join(resume_from_checkpoint, MODEL_NAME))
        self._issue_warnings_after_load(model.load_state_dict(state, False))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            return
        assert self.optimizer is not None
        self.optimizer.load_state_dict(ckptfmt.load(os.path.join(checkpoint, OPTIMIZER_NAME)))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(objects.decode(ckptfmt.load(scheduler), source=scheduler))

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not os.path.isfile(os.path.join(checkpoint, SCALER_NAME)):
            return
        self.accelerator.scaler.load_state_dict(ckptfmt.load(os.path.join(checkpoint, SCALER_NAME)))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, RNG_NAME)
        if not os.path.isfile(path):
            logger.info(f"{path} is missing: the random number generators are not restored")
            return
        ckptfmt.restore_rng(ckptfmt.load(path))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None:
            return
        try:
            state = load_model_state(best)
        except (CheckpointError, OSError) as e:
            logger.warning(f"Could not load the best model from {best}: {_why(e)}")
            return
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        assert self.model is not None
        self._issue_warnings_after_load(self.model.load_state_dict(state, False))


def _restore_trainer_state_json(folder: str) -> None:
    """Make ``trainer_state.json`` what the commit recorded (the Trainer reads the JSON file)."""
    committed = ckptfmt.load(os.path.join(folder, TRAINER_STATE_NAME))
    text = committed.get("trainer_state_json") if isinstance(committed, dict) else None
    if not isinstance(text, str):
        raise CheckpointError(f"{TRAINER_STATE_NAME} holds no trainer state", path=folder)
    path = os.path.join(folder, TRAINER_STATE_JSON)
    try:
        with open(path, encoding="utf-8") as f:
            current: str | None = f.read()
    except (FileNotFoundError, UnicodeDecodeError):
        current = None
    if current == text:
        return
    warnings.warn(
        f"{path} is {'missing' if current is None else 'not what was committed'}: rewriting it from "
        f"{TRAINER_STATE_NAME}",
        CheckpointWarning,
        stacklevel=3,
    )
    tmp = f"{path}.ckptfmt-tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    multifile.fsync_path(folder)


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
