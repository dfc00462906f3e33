"""Lightning checkpoints in ckptfmt: a ``CheckpointIO`` plugin.

Usage (``lightning.pytorch`` or ``pytorch_lightning``, and Fabric)::

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, enable

    trainer = Trainer(plugins=[CkptfmtCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    # callbacks=[..., SaveCostMonitor()] charts each save's stall, bytes and GB/s in the loggers
    trainer.fit(model)
    trainer.fit(model, ckpt_path="last")          # a later process: resumes bit-exactly
    enable()                                      # once: LitModel.load_from_checkpoint(path) reads them

What the plugin changes, compared with Lightning's default ``TorchCheckpointIO``:

* Every ``.ckpt`` is a ckptfmt file: no pickle on save or load, a checksum on
  every chunk (verified on load), and an atomic, durable commit (temp file,
  fsync, rename, directory fsync): a crash mid-save leaves the previous file of
  that name intact, so ``ckpt_path="last"`` never picks a half-written one.
* ``blocking=False``: ``save_checkpoint`` returns once the checkpoint is
  copied into staging memory; the file is written while training goes on and
  holds the values at the time of the call.  An error of such a save is raised
  by the next ``save_checkpoint`` or by ``teardown()`` (the end of ``fit``),
  which waits for every save and its thread; loads of a path wait for the
  save in flight there.  ``remove_checkpoint`` (ModelCheckpoint's ``save_top_k``
  drops the checkpoint a new save replaces as soon as that save returns) deletes
  nothing until every save in flight has committed: the deletion is made at the
  plugin's next call (a save, a removal, ``teardown``; at exit, once the saves
  in flight committed, for a process that exits without ``teardown``), and not
  at all where one of those saves failed, so a process killed at any moment
  keeps a committed checkpoint (one checkpoint more than ``save_top_k`` may be
  on disk meanwhile; after a kill or a failed save that file stays, to be
  deleted by hand).  A deletion that fails is logged (WARNING, the ``ckptfmt``
  logger) and the next save made all the same.  Lightning chooses file names by asking fsspec which files exist
  (``ModelCheckpoint`` adds ``-vN`` to a name that is taken): a non-blocking plugin registers, through fsspec's
  ``register_implementation``, a local filesystem that answers ``exists``,
  ``isfile`` and ``ls`` for a save in flight as for the file it will be (and
  ``info``/``modified`` once it is), so no save takes the name of another.
* The RNG state: Lightning's checkpoint holds none, so its resume draws other
  dropout masks and another shuffle order than the uninterrupted run.  The
  plugin stores :func:`ckptfmt.capture_rng` (Python, numpy, torch CPU and every
  accelerator generator) under the reserved key ``"__ckptfmt_rng__"`` at each
  save, and ``load_checkpoint`` removes that key and restores the generators
  (``restore_rng=False`` turns this off).  That is the right moment for
  ``fit(ckpt_path=...)``: Lightning loads the checkpoint after ``setup`` and
  model creation, and from there until the first training batch draws nothing
  from the global generators (the sanity check is skipped on resume and runs
  inside ``isolate_rng`` anyway), so the first resumed step continues the
  uninterrupted run's random streams.  ``validate``/``test``/``predict`` with
  a ``ckpt_path`` restore the generators too.  Generators you own (a
  DataLoader's ``generator=``) are yours to save, in a callback's state.
* Objects: Lightning's dict may hold ``hyper_parameters`` and callback states
  with objects beyond tensors and containers.  The allow-list of
  :mod:`ckptfmt.integrations.objects` (Namespace, AttributeDict, Path, enum,
  dataclass, named tuple, set) is stored as tagged dicts and rebuilt on load
  without importing any class named by the file; anything else is refused,
  before any byte is written, with an error naming its place.  Enum,
  dataclass and named-tuple classes come back as themselves when registered
  (``classes=`` here, or :func:`ckptfmt.integrations.objects.register`),
  otherwise as their value, dict of fields or tuple.  Hyper-parameters read
  from a file are checked before Lightning sees them (a dict of str names,
  no dunder names): a malformed entry raises :class:`ckptfmt.CorruptError`.
* Callback states keyed by the callback's class (``state_key`` returning a
  class, an older Lightning pattern) are stored under the class's
  ``__qualname__``, as Lightning keys its own, and come back keyed by the
  class again where that class is already imported (nothing is imported).
* Switching a run to the plugin: ``read_torch_checkpoints=True`` reads the
  ``.ckpt`` files Lightning's default plugin wrote, with
  ``torch.load(weights_only=True)`` only; the next save writes ckptfmt.
* The plugin is picklable (``ddp_spawn``, ``deepcopy``): its saves in flight
  and their lock belong to one process and are created anew after unpickling.
* ``s3://`` paths (``default_root_dir``, ``dirpath``, ``ckpt_path``, ``load_from_checkpoint``)
  are written and read by ckptfmt itself (``storage_options=`` here: the client's settings,
  else the ``AWS_*`` environment): a streaming multipart upload that appears whole or not
  at all, ETag-pinned, checked ranged reads; ``remove_checkpoint`` deletes the one object.
  Lightning itself asks what exists through fsspec, that is s3fs (configured as usual,
  e.g. ``AWS_ENDPOINT_URL``): the plugin registers s3fs's filesystem with no listings cache
  (it writes behind s3fs's back) that sees an object in flight as the object it will be.
  ``gs://``, ``az://`` and ``abfs://`` paths the same way (the client's settings, else the
  store's usual credentials: google-auth's chain, AZURE_STORAGE_CONNECTION_STRING),
  Lightning's questions through gcsfs and adlfs.
* Every other fsspec protocol (``hdfs://``, ``memory://`` ...) goes
  through that protocol's filesystem, configured as for Lightning: a save is written by
  ckptfmt to a local temporary file (``TMPDIR``) and uploaded with the filesystem's
  ``put_file`` (atomic where the store's upload is); a load fetches the file into a local
  temporary file and reads it there, every chunk verified; temporary files are always
  removed.  Non-blocking saves upload from a thread once the file is written, and the
  filesystems of :data:`filesystems.VIEWED` show them in flight (a save to another
  protocol is written blocking, with a warning).  A failed upload raises
  :class:`ckptfmt.StorageError` naming the URL.  A protocol fsspec does not know raises
  :class:`RemotePathError`.
* ``encrypt_with=``/``decrypt_with=``: every checkpoint encrypted (AES-256-GCM, spec section
  17) and read back with the key; without it, loading raises :class:`ckptfmt.DecryptionError`.
  ``enable(decrypt_with=key)`` gives Lightning's loader the key.
* ``weights_only`` is accepted and needs nothing: loading never runs code.
* The ``storage_options`` of ``Trainer.save_checkpoint``: ckptfmt's save options
  ``compression``, ``level`` and ``metadata`` anywhere; other entries are the client's
  settings on ``s3://`` and the filesystem's options on other fsspec URLs; on a local path,
  or anything but a dict, they are refused with a ValueError.

``LightningModule.load_from_checkpoint`` reads files with Lightning's loader,
which has no extension point: :func:`enable` teaches that loader (in
``lightning`` and ``pytorch_lightning``) to read ckptfmt files, recognised by
their first bytes; other files go to Lightning's loader as before.
:func:`load_from_checkpoint` here does the same without :func:`enable`, and
:func:`load_checkpoint` gives the dict.  Sharded strategies (FSDP's sharded state,
DeepSpeed) bypass ``CheckpointIO`` and are not affected by this plugin.
"""

from __future__ import annotations

from .callback_keys import CLASS_KEYS_KEY
from .loader import enable
from .loading import RNG_KEY, load_checkpoint, load_from_checkpoint
from .paths import RemotePathError
from .plugin import CkptfmtCheckpointIO

__all__ = [
    "CLASS_KEYS_KEY",
    "RNG_KEY",
    "CkptfmtCheckpointIO",
    "RemotePathError",
    "SaveCostMonitor",
    "enable",
    "load_checkpoint",
    "load_from_checkpoint",
]


def __getattr__(name: str) -> object:
    # SaveCostMonitor subclasses the Trainer's Callback: imported on use, so that Fabric alone
    # (lightning_fabric without the Trainer) can use the plugin
    if name == "SaveCostMonitor":
        from .costs import SaveCostMonitor

        return SaveCostMonitor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
