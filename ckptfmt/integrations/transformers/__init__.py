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

plus ``training_args.json`` (the training arguments, ``TrainingArguments.to_json_string()``,
read back with :func:`load_training_args`; in place of the Trainer's pickled
``training_args.bin``: a checkpoint folder holds no pickle) and what the Trainer writes
itself, unchanged: ``config.json`` (and ``generation_config.json``), the tokenizer or
processor files and ``trainer_state.json``.

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
path must be a complete checkpoint.  Nothing to resume from (no complete folder, a path that
is missing, empty or incomplete) raises a ckptfmt error that is also a ``ValueError`` (as the
Trainer raises), mostly :class:`ckptfmt.IncompleteError`.
Every file is read by ckptfmt, checksums verified: resuming calls neither
pickle nor ``torch.load``.  The RNG state is restored at the moment the
Trainer restores its own (after fast-forwarding the data loader), so a resume
continues the uninterrupted run's losses bit-exactly where the Trainer's data
order is deterministic (its default seedable sampler).

Switching an existing run.  ``CkptfmtTrainer(..., ckptfmt_read_trainer_checkpoints=True)``
resumes from a ``checkpoint-N`` folder the stock Trainer wrote (an explicit path, or with
``resume_from_checkpoint=True`` the newest folder of either kind): the model's weights are
read through safetensors only (a folder holding only ``pytorch_model.bin`` is refused), the
optimizer, scheduler, scaler and RNG state by the Trainer's own code, which calls
``torch.load(weights_only=True)`` only; the next save is ckptfmt's.  Without the opt-in such
a resume raises :class:`ckptfmt.UnsupportedError` saying how to opt in (with a newer stock
folder beside an older complete ckptfmt one, a warning says so and the ckptfmt one is
taken).  The opt-in cannot be combined with ``ckptfmt_trusted_keys``.  A stock folder is
one that is not ckptfmt's (no valid commit record, no mark) and holds a regular
``trainer_state.json``.

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

What ckptfmt may delete.  Every ``checkpoint-N`` folder ckptfmt creates bears its mark,
``.ckptfmt-folder``, from the moment it has its name (it is made under a temporary name,
the mark written inside, then renamed).  ckptfmt deletes only a folder whose commit record
verifies, one holding its mark (a save or a deletion cut short), an empty one, and its
own temporary folders whose process is gone.  Anything else in ``output_dir`` (the stock
Trainer's ``checkpoint-N``, another tool's folder) is never deleted: rotation leaves it with
a warning, and a save whose ``checkpoint-N`` name such a folder holds raises
:class:`ckptfmt.UnsupportedError` (move it away) rather than write into it.

Rotation (``save_total_limit``) runs after each commit and follows the Trainer's own rule
(``transformers.trainer_utils.rotate_checkpoints``: folders ordered as ``sort_checkpoints``
orders them, by modification time or else by step, the newest and the best one
(``state.best_model_checkpoint``) kept, the oldest others deleted until
``save_total_limit`` are left).  Folders ckptfmt did not write count as the Trainer counts
them, but are left; the newest complete checkpoint is never deleted.  ckptfmt's incomplete
folders do not count: those older than the newest complete one are removed, newer ones are
left alone (a later save of that step replaces them).  A folder is deleted ``COMMIT`` first
and its mark last, so an interrupted deletion leaves an incomplete folder that is still
provably ckptfmt's, never a damaged "complete" one.  At the end of training with
``save_total_limit=1`` and a best checkpoint, every folder but the best is deleted, as the
Trainer does (ckptfmt's only).

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
(safetensors, for ``from_pretrained``).  ``from_pretrained`` reads checkpoint folders once
:func:`enable` has been called (module ``pretrained``: ``model.ckpt`` checked against the
commit record, then given to transformers' own ``from_pretrained`` as its ``state_dict``;
:func:`disable` undoes it).  Keeping a ``model.safetensors`` in each folder instead was
measured (bench/hf_from_pretrained.py, GPT-2 6x512, 2 shared cores: +33% bytes and about
+20-33% save time of the folder's ckptfmt files when written beside ``model.ckpt``; in its
place it would need a commit record part that is not a ckptfmt file) and not chosen.
:func:`load_model` builds the model of one
(``load_model(folder, AutoModelForCausalLM)``), :func:`load_model_state` gives
its state dict.  Both, with :func:`check_checkpoint` and :func:`latest_checkpoint`, take
``decrypt_with`` (the key of an encrypted folder) and ``trusted_keys`` (Ed25519 public keys,
one of which must have signed its commit record: each file is hashed against it before it is
read with the key).

The modules: ``trainer`` (the mixin and its Trainer hooks), ``reading`` (a
``checkpoint-N`` folder opened and checked, the newest complete one), ``writing``
(a folder being saved, its commit record, deletion and rotation), ``trainer_state``
(``trainer_state.json`` made the committed text on resume), ``models``
(:func:`load_model`) and ``names`` (the folder and file names).
"""

from __future__ import annotations

from .models import load_model
from .pretrained import disable, enable
from .reading import (
    check_checkpoint,
    iter_checkpoint_dirs,
    latest_checkpoint,
    load_model_state,
    load_training_args,
)
from .trainer import HOOKS, CkptfmtTrainer, CkptfmtTrainerMixin

__all__ = [
    "CkptfmtTrainer",
    "CkptfmtTrainerMixin",
    "HOOKS",
    "check_checkpoint",
    "disable",
    "enable",
    "iter_checkpoint_dirs",
    "latest_checkpoint",
    "load_model",
    "load_model_state",
    "load_training_args",
]
