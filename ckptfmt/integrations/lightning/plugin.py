"""``CkptfmtCheckpointIO``: the Lightning ``CheckpointIO`` plugin that writes ckptfmt files
(see the package's docstring for what it changes), and its saves in flight in one process."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import ckptfmt

from ...background import inflight
from ...errors import CheckpointWarning
from ...files.encryption import save_and_read_keys
from ...files.save import check_save_args, signer
from ...files.signing import trusted_set
from ...storage.client import check_options
from ...storage.listing import delete_object
from ...storage.urls import parse_url
from .. import objects
from . import filesystems, transfer
from .callback_keys import CLASS_KEYS_KEY, with_class_keys_named
from .loading import RNG_KEY, load_with_rng, reading
from .paths import FSSPEC, LOCAL, OBJECT, Target, split_storage_options, target
from .removals import PendingRemovals

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

_RESERVED = (RNG_KEY, CLASS_KEYS_KEY)


class CkptfmtCheckpointIO(_Base):
    """A Lightning ``CheckpointIO`` that writes and reads ckptfmt files (see the module docstring).

    Args:
        blocking: False: saves return after the snapshot and are written while training goes on.
        compression: None or "zstd" (per chunk, stored raw where it does not pay).
        restore_rng: capture the global RNG state at each save and restore it on load.
        classes: enum, dataclass and named-tuple classes to rebuild on load (see
            :mod:`ckptfmt.integrations.objects`).
        read_torch_checkpoints: also load files written by ``torch.save`` (Lightning's default
            plugin), with ``torch.load(weights_only=True)``: a run switches to ckptfmt at its next save.
        sign_with: an Ed25519 private key (as ``ckptfmt.save`` takes it) that signs every
            checkpoint; give a path or the key's bytes where the plugin is pickled (ddp_spawn).
        trusted_keys: Ed25519 public keys; a checkpoint is loaded only when one of them signed
            it (``ckptfmt.load``'s rule; a ``torch.save`` file, never signed, is refused).
        encrypt_with: a key (as ``ckptfmt.save`` takes it: 32 bytes, a key file's path, or a
            key service's callable) that encrypts every checkpoint (not with `sign_with`).
        decrypt_with: the key that reads them (default `encrypt_with`, unless that is a key
            service's callable); an encrypted checkpoint without it raises DecryptionError.
        storage_options: the object-store client's settings for ``s3://`` paths (``ckptfmt.save``'s
            `storage_options`: endpoint_url, region_name, credentials ...; the ``AWS_*``
            environment applies too).  Other fsspec URLs use fsspec's own configuration, as
            Lightning does.  See ``save_checkpoint`` for the per-call ``storage_options``.
    """

    def __init__(
        self,
        *,
        blocking: bool = True,
        compression: str | None = None,
        restore_rng: bool = True,
        classes: Iterable[type] = (),
        read_torch_checkpoints: bool = False,
        sign_with: Any = None,
        trusted_keys: Any = None,
        storage_options: dict[str, Any] | None = None,
        encrypt_with: Any = None,
        decrypt_with: Any = None,
    ) -> None:
        super().__init__()
        check_save_args(compression, None, None)
        self.storage_options = check_options(storage_options)
        signer(sign_with)  # a bad key, or an engine without libcrypto, fails here
        trusted_set(trusted_keys)
        # the checkpoint manager's rule: checked before anything is written, decrypt_with
        # defaulting to encrypt_with
        self.encrypt_with, self.decrypt_with = save_and_read_keys(encrypt_with, decrypt_with)
        self.sign_with = sign_with
        self.trusted_keys = trusted_keys
        self.blocking = blocking
        self.compression = compression
        self.restore_rng = restore_rng
        self.classes = tuple(classes)
        self.read_torch_checkpoints = read_torch_checkpoints
        for cls in self.classes:
            objects._check_registrable(cls)
        self._process: _ProcessSaves | None = None
        filesystems.show_saves_in_flight(blocking)

    def __repr__(self) -> str:  # keys never appear in reprs
        return f"{type(self).__name__}(blocking={self.blocking}, compression={self.compression!r})"

    # -- pickling: the saves in flight and their lock stay in the process that started them --

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_process"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        filesystems.show_saves_in_flight(self.blocking)

    def _saves(self) -> _ProcessSaves:
        """This process's saves in flight (created here after unpickling, or in a forked child)."""
        process = self._process
        if process is None or process.pid != os.getpid():
            process = self._process = _ProcessSaves()
        return process

    # -- saving ----------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save `checkpoint` at `path` (a local path, an ``s3://`` URL or another fsspec URL).

        `storage_options` (``Trainer.save_checkpoint(..., storage_options=...)``): a dict whose
        ``compression``, ``level`` and ``metadata`` are ckptfmt's save options anywhere; its other
        entries are the object-store client's settings on ``s3://`` (over the plugin's own) and
        the filesystem's options on other fsspec URLs; on a local path they are refused
        (ValueError), as is anything but a dict."""
        saves = self._saves()
        saves.removals.run_ready()  # a failed removal is logged: this save is made all the same
        self._raise_finished()
        where = target(path)
        save_options, place_options = split_storage_options(storage_options, where)
        state = self._encoded(checkpoint)
        options = {
            "compression": self.compression,
            "sign_with": self.sign_with,
            "encrypt_with": self.encrypt_with,
            **save_options,
        }
        blocking = self.blocking
        if where.kind == FSSPEC:
            handle, key, blocking = self._save_through_fs(state, where, place_options, options)
        else:
            saves.removals.cancel(_removal_key(where))  # what this save writes is never removed
            if where.kind == LOCAL and os.path.dirname(where.path):
                os.makedirs(os.path.dirname(where.path), exist_ok=True)
            if where.kind == OBJECT:  # an object store has no directories to make
                options["storage_options"] = {**self.storage_options, **place_options}
            handle = ckptfmt.save(state, where.path, blocking=self.blocking, **options)
            key = filesystems.local_key(where.path) if where.kind == LOCAL else where.path
        step = checkpoint.get("global_step")
        self._saves().costed(step if isinstance(step, int) else None, handle)
        if not blocking:  # a blocking save is committed: not in flight
            filesystems.IN_FLIGHT.add(key, handle)
            self._saves().add(handle)

    def finished_costs(self) -> list[tuple[int | None, ckptfmt.SaveCost]]:
        """The costs of this process's saves that finished since the last call, in the order
        of the saves, with the trainer's global step at each (see SaveCostMonitor); failed
        saves have none and are left out."""
        return self._saves().finished_costs()

    def _encoded(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What is saved of Lightning's dict: callback class keys named, the RNG state added,
        allow-listed objects tagged."""
        for key in _RESERVED:
            if key in checkpoint:
                raise ValueError(
                    f"the checkpoint dict already has the key {key!r}, which this plugin reserves"
                )
        state = with_class_keys_named(checkpoint)
        if self.restore_rng:
            state[RNG_KEY] = ckptfmt.capture_rng()
        return objects.encode(state)  # type: ignore[no-any-return]

    def _save_through_fs(
        self, state: Any, where: Target, fs_options: dict[str, Any], options: dict[str, Any]
    ) -> tuple[ckptfmt.SaveHandle, str, bool]:
        """Save through a local file uploaded with fsspec: the handle, its in-flight key, and
        whether it was blocking (a filesystem that cannot show saves in flight makes it so)."""
        fs, fs_path = transfer.open_fs(where.path, fs_options)
        blocking = self.blocking
        if not blocking and not filesystems.shows_in_flight(fs):
            _warn_blocking(fs)
            blocking = True
        key = filesystems.url_key(fs, fs_path)
        self._saves().removals.cancel(key)  # what this save writes is never removed

        def write(local: str, block: bool) -> ckptfmt.SaveHandle:
            return ckptfmt.save(state, local, blocking=block, **options)

        return transfer.save(write, fs, fs_path, where.path, key, blocking=blocking), key, blocking

    def _raise_finished(self) -> None:
        """Raise the error of an earlier non-blocking save that has finished (the first one)."""
        errors = [e for e in (h.exception() for h in self._saves().take(finished_only=True)) if e is not None]
        if errors:
            raise errors[0]

    def wait(self) -> None:
        """Wait for every save in flight and every save thread, then make the removals they
        held back; raise the first save error, else the first removal error (logged too)."""
        saves = self._saves()
        errors = [e for e in (h.exception() for h in saves.take(finished_only=False)) if e is not None]
        saves.join_threads()
        errors += saves.removals.run_ready()  # every save has ended: each removal is made or dropped
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
        loading never runs code (a torch file, where allowed, is read with weights_only=True)."""
        how = reading(
            map_location,
            self.classes,
            self.read_torch_checkpoints,
            self.trusted_keys,
            self.storage_options,
            self.decrypt_with,
        )
        state = load_with_rng(path, how)
        rng = state.pop(RNG_KEY, None)
        if rng is not None and self.restore_rng:
            ckptfmt.restore_rng(rng)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at `path` once every save in flight has committed (the one
        that replaces it among them: see removals.py), after any save in flight there; an
        absent one is no error.  A removal that fails is logged (WARNING, the ``ckptfmt``
        logger) and the file kept; one dropped by a kill or a failed save leaves one file
        more than ``save_top_k``, to be deleted by hand."""
        where = target(path)
        saves = self._saves()
        saves.removals.defer(
            _removal_key(where), lambda: _remove_now(where, self.storage_options), saves.unseen()
        )
        saves.removals.run_ready()


def _removal_key(where: Target) -> str:
    """The file `where` as a removal and a save name it, whichever spelling they were given."""
    if where.kind == FSSPEC:
        return filesystems.url_key(*transfer.open_fs(where.path))  # as _remove_now opens it
    return filesystems.local_key(where.path) if where.kind == LOCAL else where.path


def _remove_now(where: Target, storage_options: dict[str, Any]) -> None:
    """Delete the checkpoint at `where` after any save in flight there; an absent one is no error."""
    if where.kind == FSSPEC:
        fs, fs_path = transfer.open_fs(where.path)
        inflight.wait_for_path(transfer.inflight_key(fs, fs_path))
        transfer.remove(fs, fs_path)
    elif where.kind == OBJECT:
        inflight.wait_for_path(where.path)
        delete_object(parse_url(where.path), storage_options)  # an absent object is no error
    else:
        try:
            ckptfmt.remove(where.path)  # waits for a save in flight on that path
        except FileNotFoundError:
            pass


_WARNED: set[type] = set()


def _warn_blocking(fs: Any) -> None:
    if type(fs) not in _WARNED:
        _WARNED.add(type(fs))
        warnings.warn(
            f"CkptfmtCheckpointIO(blocking=False) writes to {type(fs).__name__} blocking: only a "
            "filesystem that ckptfmt registered shows a save in flight to Lightning, and without "
            "that a later save could take its name",
            CheckpointWarning,
            stacklevel=4,
        )


#: saves whose cost waits for finished_costs(), at most
_COSTS_KEPT = 1024


class _ProcessSaves:
    """One plugin's non-blocking saves in flight in one process, and their threads.

    A save's thread lives on for a moment after its handle is done (it frees the file the
    save replaced): taken handles leave their threads here, for teardown to join."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._handles: list[ckptfmt.SaveHandle] = []
        self._threads: list[threading.Thread] = []
        self._costed: list[tuple[int | None, ckptfmt.SaveHandle]] = []  # costs not yet reported
        self.removals = PendingRemovals()

    def costed(self, step: int | None, handle: ckptfmt.SaveHandle) -> None:
        with self._lock:
            self._costed.append((step, handle))
            del self._costed[:-_COSTS_KEPT]  # nobody asking: keep the newest only

    def finished_costs(self) -> list[tuple[int | None, ckptfmt.SaveCost]]:
        with self._lock:
            # the finished prefix only, so costs are reported in the order of the saves
            n = next((i for i, (_, h) in enumerate(self._costed) if not h.done()), len(self._costed))
            done, self._costed = self._costed[:n], self._costed[n:]
        return [(step, cost) for step, h in done if (cost := h.cost) is not None]

    def add(self, handle: ckptfmt.SaveHandle) -> None:
        with self._lock:
            self._handles.append(handle)
            if handle._thread is not None:
                self._threads.append(handle._thread)

    def unseen(self) -> list[ckptfmt.SaveHandle]:
        """The saves whose end nobody has taken yet: those in flight, and those that ended
        since the last look (a failed one among them not yet raised)."""
        with self._lock:
            return list(self._handles)

    def take(self, *, finished_only: bool) -> list[ckptfmt.SaveHandle]:
        """Remove and return the finished handles, or all of them."""
        with self._lock:
            # one look at each handle: one that finished in between would be in neither list
            seen = [(h, not finished_only or h.done()) for h in self._handles]
            self._handles = [h for h, take in seen if not take]
        return [h for h, take in seen if take]

    def join_threads(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()


def register_with_other_package() -> None:
    """Make the plugin an instance of both packages' CheckpointIO (`lightning` and
    `pytorch_lightning` each have their own copy of the class), so both Trainers accept it."""
    for module in ("lightning.fabric.plugins.io.checkpoint_io", "lightning_fabric.plugins.io.checkpoint_io"):
        try:
            base = __import__(module, fromlist=["CheckpointIO"]).CheckpointIO
        except ImportError:
            continue
        if not issubclass(CkptfmtCheckpointIO, base):
            base.register(CkptfmtCheckpointIO)


register_with_other_package()
