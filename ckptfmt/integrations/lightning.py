"""Lightning checkpoints in ckptfmt: a ``CheckpointIO`` plugin.

Usage (``lightning.pytorch`` or ``pytorch_lightning``, and Fabric)::

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    trainer = Trainer(plugins=[CkptfmtCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    trainer.fit(model)
    trainer.fit(model, ckpt_path="last")          # a later process: resumes bit-exactly

What the plugin changes, compared with Lightning's default ``TorchCheckpointIO``:

* Every ``.ckpt`` is a ckptfmt file: no pickle on save or load, a checksum on
  every chunk (verified on load), and an atomic, durable commit (temp file,
  fsync, rename, directory fsync): a crash mid-save leaves the previous file of
  that name intact, so ``ckpt_path="last"`` never picks a half-written one.
* ``blocking=False``: ``save_checkpoint`` returns once the checkpoint is
  copied into staging memory; the file is written while training goes on and
  holds the values at the time of the call.  An error of such a save is raised
  by the next ``save_checkpoint`` or by ``teardown()`` (the end of ``fit``);
  ``remove_checkpoint`` and loads of a path wait for the save in flight there.
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
  otherwise as their value, dict of fields or tuple.
* ``weights_only`` is accepted and needs nothing: loading never runs code.
* ``storage_options`` may be a dict with ckptfmt's save options ``compression``,
  ``level`` and ``metadata``; anything else is refused like Lightning's own
  plugin does.

``LightningModule.load_from_checkpoint`` reads files with ``torch.load``
whatever plugin wrote them; use :func:`load_from_checkpoint` here for ckptfmt
files, or :func:`load_checkpoint` for the dict.  Local paths only (no fsspec
URLs).  Sharded strategies (FSDP's sharded state, DeepSpeed) bypass
``CheckpointIO`` and are not affected by this plugin.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import ckptfmt

from ..errors import CheckpointError
from . import objects

if TYPE_CHECKING:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _Base
else:

    def _find_base() -> type:
        """Lightning's CheckpointIO: from the `lightning` package if installed, else `lightning_fabric`."""
        for module in (
            "lightning.fabric.plugins.io.checkpoint_io",
            "lightning_fabric.plugins.io.checkpoint_io",
        ):
            try:
                return __import__(module, fromlist=["CheckpointIO"]).CheckpointIO
            except ImportError:
                continue
        raise ImportError(
            "ckptfmt.integrations.lightning needs Lightning: pip install 'ckptfmt[lightning]' "
            "(the `lightning` or the `pytorch-lightning` package)"
        )

    _Base = _find_base()

#: the key under which the RNG state travels in the saved dict
RNG_KEY = "__ckptfmt_rng__"


class CkptfmtCheckpointIO(_Base):
    """A Lightning ``CheckpointIO`` that writes and reads ckptfmt files (see the module docstring).

    Args:
        blocking: False: saves return after the snapshot and are written while training goes on.
        compression: None or "zstd" (per chunk, stored raw where it does not pay).
        restore_rng: capture the global RNG state at each save and restore it on load.
        classes: enum, dataclass and named-tuple classes to rebuild on load (see
            :mod:`ckptfmt.integrations.objects`).
    """

    def __init__(
        self,
        *,
        blocking: bool = True,
        compression: str | None = None,
        restore_rng: bool = True,
        classes: Iterable[type] = (),
    ) -> None:
        super().__init__()
        ckptfmt.writer.check_save_args(compression, None, None)
        self.blocking = blocking
        self.compression = compression
        self.restore_rng = restore_rng
        self.classes = tuple(classes)
        for cls in self.classes:
            objects._check_registrable(cls)
        self._pending: list[ckptfmt.SaveHandle] = []
        self._lock = threading.Lock()

    # -- saving ----------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        self._raise_finished()
        target = _local_path(path)
        options = _save_options(storage_options, self.compression)
        if RNG_KEY in checkpoint:
            raise ValueError(
                f"the checkpoint dict already has the key {RNG_KEY!r}, which this plugin reserves"
            )
        state = dict(checkpoint)
        if self.restore_rng:
            state[RNG_KEY] = ckptfmt.capture_rng()
        state = objects.encode(state)
        directory = os.path.dirname(target)
        if directory:
            os.makedirs(directory, exist_ok=True)
        handle = ckptfmt.save(state, target, blocking=self.blocking, **options)
        if handle is not None:
            with self._lock:
                self._pending.append(handle)

    def _raise_finished(self) -> None:
        """Raise the error of an earlier non-blocking save that has finished (the first one)."""
        with self._lock:
            # one look at each handle: one that finished in between would be in neither list
            seen = [(h, h.done()) for h in self._pending]
            finished = [h for h, done in seen if done]
            self._pending = [h for h, done in seen if not done]
        errors = [e for e in (h.exception() for h in finished) if e is not None]
        if errors:
            raise errors[0]

    def wait(self) -> None:
        """Wait for every save in flight; raise the first error among them."""
        with self._lock:
            pending, self._pending = self._pending, []
        errors = [e for e in (h.exception() for h in pending) if e is not None]
        if errors:
            raise errors[0]

    def teardown(self) -> None:
        self.wait()

    # -- loading and removing --------------------------------------------------------

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a ckptfmt checkpoint (every chunk verified), rebuild allow-listed objects and restore
        the RNG state it holds (unless ``restore_rng=False``).  `weights_only` changes nothing:
        loading never runs code."""
        state = load_checkpoint(path, map_location, classes=self.classes, _keep_rng=True)
        rng = state.pop(RNG_KEY, None)
        if rng is not None and self.restore_rng:
            ckptfmt.restore_rng(rng)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        try:
            ckptfmt.remove(_local_path(path))  # waits for a save in flight on that path
        except FileNotFoundError:
            pass


def _local_path(path: Any) -> str:
    text = os.fspath(path)
    if "://" in text:
        raise NotImplementedError(f"{text}: ckptfmt writes local files only (no fsspec URLs)")
    return text


def _save_options(storage_options: Any, compression: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {"compression": compression}
    if storage_options is None:
        return options
    if not isinstance(storage_options, dict) or set(storage_options) - {"compression", "level", "metadata"}:
        raise TypeError(
            "storage_options must be None or a dict with ckptfmt's save options "
            f"compression, level and metadata; got {storage_options!r}"
        )
    options.update(storage_options)
    return options


def load_checkpoint(
    path: Any,
    map_location: Any | None = None,
    *,
    classes: Iterable[type] = (),
    _keep_rng: bool = False,
) -> dict[str, Any]:
    """The dict a :class:`CkptfmtCheckpointIO` saved, with allow-listed objects rebuilt.

    Restores no RNG state (the reserved RNG entry is left out).  `map_location`
    takes torch.load's forms; None loads onto the CPU.
    """
    target = _local_path(path)
    if not os.path.exists(target):
        raise FileNotFoundError(f"Checkpoint file not found: {target}")
    state = ckptfmt.load(target, map_location=map_location)
    if type(state) is not dict:
        raise CheckpointError(f"holds a {type(state).__name__}, not a Lightning checkpoint dict", path=target)
    state = objects.decode(state, classes=classes, source=target)
    if not _keep_rng:
        state.pop(RNG_KEY, None)
    return state


def load_from_checkpoint(
    cls: type,
    path: Any,
    map_location: Any | None = None,
    *,
    strict: bool | None = None,
    classes: Iterable[type] = (),
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path, ...)`` for a ckptfmt file: a LightningModule (or
    LightningDataModule) built from the saved hyper-parameters (`kwargs` override them),
    its weights loaded.  Uses Lightning's own instantiation (``core.saving._load_state``)."""
    checkpoint = load_checkpoint(path, map_location, classes=classes)
    saving, is_datamodule = _saving_module(cls)
    hparams_key = cls.CHECKPOINT_HYPER_PARAMS_KEY  # type: ignore[attr-defined]
    checkpoint.setdefault(hparams_key, {})
    checkpoint[hparams_key].update(kwargs)
    if is_datamodule:
        return saving._load_state(cls, checkpoint, **kwargs)
    return saving._load_state(cls, checkpoint, strict=strict, **kwargs)


def _saving_module(cls: type) -> tuple[Any, bool]:
    """Lightning's `core.saving` module of the package `cls` comes from, and whether `cls`
    is a data module."""
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            module = __import__(f"{package}.core.saving", fromlist=["_load_state"])
            base = __import__(package, fromlist=["LightningModule", "LightningDataModule"])
        except ImportError:
            continue
        if issubclass(cls, base.LightningDataModule):
            return module, True
        if issubclass(cls, base.LightningModule):
            return module, False
    raise TypeError(f"{cls!r} is not a LightningModule or LightningDataModule class")


def _register_with_other_package() -> None:
    """Make the plugin an instance of both packages' CheckpointIO (`lightning` and
    `pytorch_lightning` each have their own copy of the class), so both Trainers accept it."""
    for module in ("lightning.fabric.plugins.io.checkpoint_io", "lightning_fabric.plugins.io.checkpoint_io"):
        try:
            base = __import__(module, fromlist=["CheckpointIO"]).CheckpointIO
        except ImportError:
            continue
        if not issubclass(CkptfmtCheckpointIO, base):
            base.register(CkptfmtCheckpointIO)


_register_with_other_package()

__all__ = ["RNG_KEY", "CkptfmtCheckpointIO", "load_checkpoint", "load_from_checkpoint"]
