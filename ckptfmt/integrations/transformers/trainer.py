"""The Trainer subclass: ``CkptfmtTrainerMixin`` overrides the Trainer's checkpoint hooks
(HOOKS, checked to exist at import) so that ``checkpoint-N`` folders hold ckptfmt files made
valid by a commit record, and resumes read them back checked."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import ckptfmt

from ...engine.ckptdir import CheckpointDir
from ...errors import CheckpointError, CheckpointWarning, IncompleteError, UnsupportedError
from ...files import recordsign
from ...files.encryption import run_keys
from ...files.save import check_save_args, signer
from .. import objects
from .names import (
    MAX_JSON_BYTES,
    MODEL_NAME,
    OPTIMIZER_NAME,
    PREFIX,
    RNG_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    TRAINER_STATE_JSON,
    TRAINER_STATE_NAME,
    TRAINING_ARGS_JSON,
    checkpoint_step,
)
from .reading import (
    OpenedFolder,
    check_safetensors_weights,
    is_trainer_folder,
    load_best,
    open_checked,
    open_latest,
    trainer_folders,
    why,
)
from .trainer_state import restore_trainer_state_json
from .writing import FolderSave, foreign_save_names, fresh_folder, keep_only_best, rotate

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
    "_prepare_for_training",
    "train",
)
_missing = [h for h in HOOKS if not callable(getattr(Trainer, h, None))]
if _missing:  # pragma: no cover - depends on the installed transformers
    raise ImportError(
        f"transformers {transformers.__version__}: Trainer has no {', '.join(_missing)}; "
        "ckptfmt.integrations.transformers supports the versions pinned by ckptfmt[transformers]"
    )


logger = logging.getLogger(__name__)

_OPT_IN = (
    "pass ckptfmt_read_trainer_checkpoints=True to CkptfmtTrainer to resume from it (its weights "
    "read through safetensors, the rest through torch.load(weights_only=True))"
)


def _writer_metadata() -> dict[str, Any]:
    """What each file and commit record says about its writer."""
    return {"writer": "ckptfmt.integrations.transformers", "transformers": transformers.__version__}


def _step_of(folder: str) -> int:
    """N of a ``checkpoint-N`` folder's path (0 for any other name)."""
    return checkpoint_step(os.path.basename(os.path.normpath(folder))) or 0


class CkptfmtTrainerMixin(_MixinBase):
    """Put before a ``transformers.Trainer`` (sub)class: ``class T(CkptfmtTrainerMixin, Trainer)``.

    Extra keyword arguments: ``ckptfmt_blocking`` (default True),
    ``ckptfmt_compression`` (None or "zstd") and ``ckptfmt_verify_resume``
    (default True: before resuming, read every chunk of the chosen checkpoint and
    check its checksum, going on to older ones if it fails); ``ckptfmt_sign_with`` (an
    Ed25519 private key: every checkpoint folder's commit record is signed, spec 16.7) and
    ``ckptfmt_trusted_keys`` (Ed25519 public keys: only folders one of them signed are
    resumed from or loaded, the newest unsigned ones skipped with a warning);
    ``ckptfmt_encrypt_with`` (a key as ``ckptfmt.save`` takes it: every ckptfmt file of a
    checkpoint folder is encrypted, spec section 17) and ``ckptfmt_decrypt_with`` (the key
    resumes and loads read with; default ``ckptfmt_encrypt_with``);
    ``ckptfmt_read_trainer_checkpoints`` (default False: a resume from a folder the stock
    Trainer wrote raises, saying so; True: it resumes from one, its weights read through
    safetensors only and the rest by the Trainer's own code, ``torch.load(weights_only=True)``,
    and the run goes on in ckptfmt from its next save); ``ckptfmt_report_cost`` (default True:
    each checkpoint's cost, ``ckptfmt/save_blocked_s``, ``save_durable_s``, ``save_bytes``,
    ``save_GBps`` and ``ckptfmt/save_step``, goes to the Trainer's callbacks' ``on_log``, so
    TensorBoard, W&B and the other ``report_to`` integrations chart it like any metric; it is
    not added to ``state.log_history``, which resumed and uninterrupted runs compare).  See the
    module docstring.
    """

    def __init__(
        self,
        *args: Any,
        ckptfmt_blocking: bool = True,
        ckptfmt_compression: str | None = None,
        ckptfmt_verify_resume: bool = True,
        ckptfmt_sign_with: Any = None,
        ckptfmt_trusted_keys: Any = None,
        ckptfmt_encrypt_with: Any = None,
        ckptfmt_decrypt_with: Any = None,
        ckptfmt_read_trainer_checkpoints: bool = False,
        ckptfmt_report_cost: bool = True,
        **kwargs: Any,
    ) -> None:
        check_save_args(ckptfmt_compression, None, None)
        # a bad key, or an engine without libcrypto, fails here, not at the first save
        self._ckptfmt_encrypt, self._ckptfmt_decrypt = run_keys(
            ckptfmt_encrypt_with, ckptfmt_decrypt_with, "a CkptfmtTrainer"
        )
        self._ckptfmt_sign_key = recordsign.private_key(ckptfmt_sign_with)
        signer(self._ckptfmt_sign_key)  # an engine without libcrypto fails here, not at a commit
        self._ckptfmt_trusted = recordsign.public_keys(ckptfmt_trusted_keys)
        if ckptfmt_read_trainer_checkpoints and self._ckptfmt_trusted is not None:
            raise UnsupportedError(
                "ckptfmt_read_trainer_checkpoints=True cannot be honoured with ckptfmt_trusted_keys: "
                "a folder of transformers.Trainer has no signed commit record"
            )
        self.ckptfmt_read_trainer_checkpoints = ckptfmt_read_trainer_checkpoints
        self.ckptfmt_report_cost = ckptfmt_report_cost
        self._ckptfmt_unreported: list[FolderSave] = []  # committed saves whose cost is not yet logged
        self._ckptfmt_stock: str | None = None  # the stock Trainer's folder train() resumes from
        self.ckptfmt_blocking = ckptfmt_blocking
        self.ckptfmt_verify_resume = ckptfmt_verify_resume
        self.ckptfmt_compression = ckptfmt_compression
        self._ckptfmt_current: FolderSave | None = None
        self._ckptfmt_resume: OpenedFolder | None = None  # the checked folder train() resumes from
        self._ckptfmt_inflight: list[FolderSave] = []
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
            metadata=_writer_metadata(),
            encrypt_with=self._ckptfmt_encrypt,
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
        save = FolderSave(folder, run_dir, step, limit)
        with self._ckptfmt_lock:  # busy from before its folder exists until its commit ends
            self._ckptfmt_current = save
        try:
            self._ckptfmt_write_folder(save, model, trial)
        except BaseException:
            with self._ckptfmt_lock:
                self._ckptfmt_current = None
            raise
        if not self.args.should_save:
            with self._ckptfmt_lock:
                self._ckptfmt_current = None
            return
        save.returned = time.perf_counter()
        if self._ckptfmt_blocking_now and not self._ckptfmt_inflight:
            with self._ckptfmt_lock:
                self._ckptfmt_current = None  # no commit thread runs: its rotation counts it
            self._ckptfmt_commit(save)
            save.returned = time.perf_counter()
            self._ckptfmt_report_costs()
            return
        with self._ckptfmt_lock:  # in flight before it stops being the current save
            before = self._ckptfmt_inflight[-1].thread if self._ckptfmt_inflight else None
            save.thread = threading.Thread(
                target=self._ckptfmt_commit_after,
                args=(save, before),
                name=f"ckptfmt-commit-{os.path.basename(folder)}",
            )
            self._ckptfmt_inflight.append(save)
            self._ckptfmt_current = None
        save.thread.start()
        if self._ckptfmt_blocking_now:
            self.wait_for_checkpoints()
            save.returned = time.perf_counter()
        self._ckptfmt_report_costs()

    def _ckptfmt_write_folder(self, save: FolderSave, model: Any, trial: Any) -> None:
        """The Trainer's own save into a fresh folder, the Trainer's rotation off meanwhile
        (it would run before the commit), and trainer_state.json's committed copy."""
        limit = self.args.save_total_limit
        if self.args.should_save:
            # before anything is written, so no stale file (or link) can survive
            save.dir = fresh_folder(save.run_dir, f"{PREFIX}-{save.step}")
        self.args.save_total_limit = None
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

    def _ckptfmt_commit_after(self, save: FolderSave, before: threading.Thread | None) -> None:
        if before is not None:
            before.join()  # commit records in the order of the saves
        try:
            self._ckptfmt_commit(save)
        except BaseException as e:  # kept for the next save or the end of train()
            save.error = e
        finally:
            save.done = True

    def _ckptfmt_commit(self, save: FolderSave) -> None:
        save.commit(_writer_metadata(), self._ckptfmt_sign_key)
        with self._ckptfmt_lock:
            self._ckptfmt_unreported.append(save)
        self._ckptfmt_rotate(save.run_dir, save.limit)

    def _ckptfmt_report_costs(self) -> None:
        """Hand each committed save's cost to the callbacks' on_log (main thread only: the
        callbacks are not thread-safe), in the order of the saves."""
        with self._ckptfmt_lock:
            ready = [s for s in self._ckptfmt_unreported if s.returned is not None]
            self._ckptfmt_unreported = [s for s in self._ckptfmt_unreported if s not in ready]
        if not self.ckptfmt_report_cost:
            return
        for save in ready:
            cost = save.cost()
            if cost is not None:
                logs: dict[str, float] = {**cost.metrics(), "ckptfmt/save_step": float(save.step)}
                self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        super().log(logs, *args, **kwargs)
        self._ckptfmt_report_costs()  # a non-blocking save's cost goes out with the next logs

    def _ckptfmt_raise_failed(self) -> None:
        """Raise the error of a finished non-blocking save (the first one), forgetting finished ones."""
        with self._ckptfmt_lock:
            finished = [s for s in self._ckptfmt_inflight if s.done]
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
        if threading.current_thread() is threading.main_thread():
            self._ckptfmt_report_costs()
        for s in pending:
            if s.error is not None:
                raise s.error

    def _ckptfmt_busy(self) -> set[str]:
        """The folders being saved (never counted nor touched by a rotation)."""
        with self._ckptfmt_lock:
            busy = {s.folder for s in self._ckptfmt_inflight if not s.done}
            if self._ckptfmt_current is not None:
                busy.add(self._ckptfmt_current.folder)
        return busy

    def _ckptfmt_rotate(self, run_dir: str, limit: int | None) -> None:
        """save_total_limit by the Trainer's rules, deleting only ckptfmt's folders (writing.rotate)."""
        if limit is None or limit <= 0:
            return
        rotate(run_dir, limit, self._ckptfmt_busy(), self.state.best_model_checkpoint)

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
        # the Trainer pickles its arguments (training_args.bin); a checkpoint folder holds no pickle
        save.check_in_place()
        with open(os.path.join(output_dir, TRAINING_ARGS_JSON), "w", encoding="utf-8") as f:
            f.write(self._ckptfmt_args_json(save.limit))

    def _ckptfmt_args_json(self, limit: int | None) -> str:
        """The training arguments as JSON, save_total_limit as the user set it (while a folder is
        saved the Trainer's own rotation is switched off by setting it to None)."""
        args = copy.copy(self.args)
        args.save_total_limit = limit
        return str(args.to_json_string())

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

    def _finalize_training(self, trial: Any, *args: Any, **kwargs: Any) -> Any:
        self.wait_for_checkpoints()  # the best model is read from a committed folder
        limit = self.args.save_total_limit
        if limit == 1:
            self.args.save_total_limit = None  # the Trainer's clean-up deletes by path: ours follows
        try:
            result = super()._finalize_training(trial, *args, **kwargs)
        finally:
            self.args.save_total_limit = limit
        best = self.state.best_model_checkpoint
        if self.args.should_save and best is not None and limit == 1:
            keep_only_best(self._get_output_dir(trial=trial), best, self._ckptfmt_busy())
        return result

    # -- resuming ------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        self._ckptfmt_check_supported()
        source = self._ckptfmt_resume_source(resume_from_checkpoint)
        if source is not None:
            resume_from_checkpoint = source.path
        elif self._ckptfmt_stock is not None:
            resume_from_checkpoint = self._ckptfmt_stock
        failed = True
        try:
            if source is not None:
                restore_trainer_state_json(source)
            result = super().train(resume_from_checkpoint, *args, **kwargs)
            failed = False
        finally:
            self._ckptfmt_resume = None
            self._ckptfmt_stock = None
            if source is not None:
                source.close()
            if failed:
                try:
                    self.wait_for_checkpoints()
                except BaseException as e:  # the training error goes first; this one is logged
                    logger.error(f"a checkpoint save failed too: {e!r}")
        self.wait_for_checkpoints()
        return result

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        # the training state is set (step resumed from, max_steps, save_steps); no step taken yet
        self._ckptfmt_refuse_foreign_save_names()
        return super()._prepare_for_training(*args, **kwargs)

    def _ckptfmt_refuse_foreign_save_names(self) -> None:
        """Before the first step: UnsupportedError when a step this run is set to save
        (save_strategy "steps": every save_steps steps and the last) has its ``checkpoint-N``
        name held by a folder ckptfmt did not write (a resume from an older step of a run the
        stock Trainer wrote), rather than after training up to that step, whose save would
        refuse the name (writing.clear_name) and end the run."""
        args, state = self.args, self.state
        if not args.should_save or args.save_strategy != "steps" or not state.save_steps:
            return
        run_dir = self._get_output_dir(trial=getattr(self, "_trial", None))
        names = foreign_save_names(run_dir, state.global_step, state.max_steps, state.save_steps)
        if not names:
            return
        more = ""
        if len(names) > 1:
            more = f" (nor {', '.join(names[1:4])}{', ...' if len(names) > 4 else ''}, saved too)"
        raise UnsupportedError(
            f"{names[0]} exists and ckptfmt did not write it{more}: this run from step "
            f"{state.global_step} saves that step (every {state.save_steps} steps and step "
            f"{state.max_steps}) and never deletes nor writes into such a folder; move it away "
            "before training",
            path=run_dir,
        )

    @contextlib.contextmanager
    def _ckptfmt_source(self, checkpoint: str) -> Iterator[OpenedFolder]:
        """The checked folder `checkpoint`: the one train() holds open, or (a hook called on its
        own) opened and checked here.  Only files its commit record names are read."""
        held = self._ckptfmt_resume
        if held is not None and held.path == checkpoint:
            yield held
            return
        with open_checked(checkpoint, trusted=self._ckptfmt_trusted, decrypt=self._ckptfmt_decrypt) as opened:
            yield opened

    def _ckptfmt_resume_source(self, resume_from_checkpoint: str | bool | None) -> OpenedFolder | None:
        """The checked folder a train() call resumes from, held open until it returns (and
        remembered for the load hooks), or None when it starts afresh or resumes from a folder
        of the stock Trainer (``_ckptfmt_stock``, with ckptfmt_read_trainer_checkpoints)."""
        if resume_from_checkpoint is True:
            found = self._ckptfmt_open_latest(os.fspath(self.args.output_dir or "."))
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            path = os.fspath(resume_from_checkpoint)
            try:
                found = open_checked(
                    path,
                    verify=self.ckptfmt_verify_resume,
                    trusted=self._ckptfmt_trusted,
                    decrypt=self._ckptfmt_decrypt,
                )
            except CheckpointError as e:
                if self._ckptfmt_take_stock(path):
                    return None
                kind = type(e) if isinstance(e, ValueError) else IncompleteError  # as the Trainer's
                raise kind(  # the Trainer's words first: code that matches them keeps working
                    f"Can't find a valid checkpoint at this path: not a complete ckptfmt checkpoint ({e.reason})",
                    path=path,
                ) from e
        else:
            return None
        self._ckptfmt_resume = found
        return found

    def _ckptfmt_open_latest(self, run_dir: str) -> OpenedFolder | None:
        """The newest complete ckptfmt folder of `run_dir`, held open; None (``_ckptfmt_stock``
        set) when a folder of the stock Trainer is newer and may be read; IncompleteError (a
        ValueError, as the Trainer's) when there is neither."""
        stock = trainer_folders(run_dir)
        found = open_latest(
            run_dir,
            self.ckptfmt_verify_resume,
            warn=True,
            trusted=self._ckptfmt_trusted,
            decrypt=self._ckptfmt_decrypt,
            quiet={name for _, name in stock},
        )
        newest = stock[-1] if stock else None
        if newest is None or (found is not None and _step_of(found.path) >= newest[0]):
            if found is None:
                raise IncompleteError(
                    "No valid checkpoint found in output directory: no complete ckptfmt checkpoint",
                    path=run_dir,
                )
            return found
        newest_path = os.path.join(run_dir, newest[1])
        if self.ckptfmt_read_trainer_checkpoints:
            if found is not None:
                found.close()
            self._ckptfmt_stock = newest_path
            return None
        if found is None:
            raise UnsupportedError(
                f"no complete ckptfmt checkpoint in the output directory; {newest[1]} was written by "
                f"transformers.Trainer: {_OPT_IN}",
                path=run_dir,
            )
        warnings.warn(
            f"resuming from {found.path}, not from the newer {newest_path}, which transformers.Trainer "
            f"wrote: {_OPT_IN}",
            CheckpointWarning,
            stacklevel=4,
        )
        return found

    def _ckptfmt_take_stock(self, path: str) -> bool:
        """Whether `path` is a folder of the stock Trainer that this run resumes from (then
        ``_ckptfmt_stock``); UnsupportedError when it is one and reading it was not asked for."""
        try:
            with CheckpointDir.open(path) as folder:
                stock = is_trainer_folder(folder)
        except (CheckpointError, OSError):
            return False
        if stock and not self.ckptfmt_read_trainer_checkpoints:
            raise UnsupportedError(f"written by transformers.Trainer, not ckptfmt: {_OPT_IN}", path=path)
        if stock:
            self._ckptfmt_stock = path
        return stock

    def _ckptfmt_is_stock(self, checkpoint: str | None) -> bool:
        """Whether a load hook is asked for the stock Trainer's folder this run resumes from."""
        return checkpoint is not None and checkpoint == self._ckptfmt_stock

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._ckptfmt_is_stock(resume_from_checkpoint):
            check_safetensors_weights(resume_from_checkpoint)
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # safetensors
            return
        if model is None:
            model = self.model
        logger.info(f"Loading model from {resume_from_checkpoint}.")
        with self._ckptfmt_source(resume_from_checkpoint) as source:
            state = source.load_required(MODEL_NAME)
        self._issue_warnings_after_load(model.load_state_dict(state, False))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._ckptfmt_is_stock(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)  # torch.load(weights_only=True) only
            return
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
        if self._ckptfmt_is_stock(checkpoint):
            super()._load_scaler(checkpoint)  # torch.load(weights_only=True) only
            return
        if checkpoint is None:
            return
        with self._ckptfmt_source(checkpoint) as source:
            scaler = source.load(SCALER_NAME)
        if scaler is not None:
            self.accelerator.scaler.load_state_dict(scaler)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._ckptfmt_is_stock(checkpoint):
            super()._load_rng_state(checkpoint)  # torch.load(weights_only=True) only
            return
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
        name = os.path.basename(os.path.normpath(best))
        if self.ckptfmt_read_trainer_checkpoints and self._ckptfmt_stock_best(run_dir, name):
            return
        try:
            state = load_best(run_dir, name, self._ckptfmt_trusted, self._ckptfmt_decrypt)
        except (CheckpointError, OSError) as e:
            logger.warning(f"Could not load the best model from {best}: {why(e)}")
            return
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        assert self.model is not None
        self._issue_warnings_after_load(self.model.load_state_dict(state, False))

    def _ckptfmt_stock_best(self, run_dir: str, name: str) -> bool:
        """Whether the best model was folder `name` of the stock Trainer in this run's directory,
        now loaded by the Trainer's own code (safetensors weights only)."""
        path = os.path.join(run_dir, name)
        try:
            with CheckpointDir.open(run_dir) as run, run.sub(name) as folder:
                if checkpoint_step(name) is None or not is_trainer_folder(folder):
                    return False
            check_safetensors_weights(path)
        except (CheckpointError, OSError):
            return False
        recorded, self.state.best_model_checkpoint = self.state.best_model_checkpoint, path
        try:
            super()._load_best_model()
        finally:
            self.state.best_model_checkpoint = recorded
        return True


class CkptfmtTrainer(CkptfmtTrainerMixin, Trainer):
    """``transformers.Trainer`` with ckptfmt checkpoints (see the module docstring)."""
