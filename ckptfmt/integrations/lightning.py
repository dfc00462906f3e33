"""Lightning checkpoints in ckptfmt: a ``CheckpointIO`` plugin.

Usage (``lightning.pytorch`` or ``pytorch_lightning``, and Fabric)::

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, enable

    trainer = Trainer(plugins=[CkptfmtCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
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
  which waits for every save and its thread; ``remove_checkpoint`` and loads
  of a path wait for the save in flight there.  Lightning chooses file names
  by asking fsspec which files exist (``ModelCheckpoint`` adds ``-vN`` to a
  name that is taken): a non-blocking plugin registers, through fsspec's
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
  Other fsspec protocols raise :class:`RemotePathError`.
* ``weights_only`` is accepted and needs nothing: loading never runs code.
* ``storage_options`` may be a dict with ckptfmt's save options ``compression``,
  ``level`` and ``metadata``; anything else is refused like Lightning's own
  plugin does.

``LightningModule.load_from_checkpoint`` reads files with Lightning's loader,
which has no extension point: :func:`enable` teaches that loader (in
``lightning`` and ``pytorch_lightning``) to read ckptfmt files, recognised by
their first bytes; other files go to Lightning's loader as before.
:func:`load_from_checkpoint` here does the same without :func:`enable`, and
:func:`load_checkpoint` gives the dict.  Sharded strategies (FSDP's sharded state,
DeepSpeed) bypass ``CheckpointIO`` and are not affected by this plugin.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import io
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations
from fsspec.registry import registry as fsspec_classes

import ckptfmt

from ..background import inflight
from ..engine.commit import temp_prefix
from ..errors import CheckpointError, CorruptError, SignatureError, UnsupportedError
from ..fileio import is_url
from ..files.save import check_save_args, signer
from ..files.signing import trusted_set
from ..format.sniff import sniff
from ..storage.client import check_options
from ..storage.download import RemoteObject
from ..storage.listing import delete_object
from ..storage.urls import parse_url
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
#: the key under which callback states keyed by a class record that class: {qualname: module}
CLASS_KEYS_KEY = "__ckptfmt_callback_classes__"
_RESERVED = (RNG_KEY, CLASS_KEYS_KEY)
#: the hyper-parameter entries of a LightningModule and a LightningDataModule: (values, name, type)
_HPARAMS_KEYS = (
    ("hyper_parameters", "hparams_name", "hparams_type"),
    ("datamodule_hyper_parameters", "datamodule_hparams_name", "datamodule_hparams_type"),
)


class RemotePathError(UnsupportedError):
    """A URL of an fsspec protocol ckptfmt does not serve (anything but local paths and ``s3://``)."""


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
        storage_options: the object-store client's settings for ``s3://`` paths (``ckptfmt.save``'s
            `storage_options`: endpoint_url, region_name, credentials ...; the ``AWS_*``
            environment applies too).  Not the per-call ``storage_options`` Lightning passes to
            ``save_checkpoint``, which are ckptfmt's save options.
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
    ) -> None:
        super().__init__()
        check_save_args(compression, None, None)
        self.storage_options = check_options(storage_options)
        signer(sign_with)  # a bad key, or an engine without libcrypto, fails here
        trusted_set(trusted_keys)
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
        _show_saves_in_flight(blocking)

    # -- pickling: the saves in flight and their lock stay in the process that started them --

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_process"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _show_saves_in_flight(self.blocking)

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
        self._raise_finished()
        target = _target(path)
        options = _save_options(storage_options, self.compression)
        for key in _RESERVED:
            if key in checkpoint:
                raise ValueError(
                    f"the checkpoint dict already has the key {key!r}, which this plugin reserves"
                )
        state = _with_class_keys_named(checkpoint)
        if self.restore_rng:
            state[RNG_KEY] = ckptfmt.capture_rng()
        state = objects.encode(state)
        directory = os.path.dirname(target)
        if directory and not is_url(target):  # an object store has no directories to make
            os.makedirs(directory, exist_ok=True)
        handle = ckptfmt.save(
            state,
            target,
            blocking=self.blocking,
            sign_with=self.sign_with,
            storage_options=self.storage_options,
            **options,
        )
        if handle is not None:
            _IN_FLIGHT.add(target, handle)
            self._saves().add(handle)

    def _raise_finished(self) -> None:
        """Raise the error of an earlier non-blocking save that has finished (the first one)."""
        errors = [e for e in (h.exception() for h in self._saves().take(finished_only=True)) if e is not None]
        if errors:
            raise errors[0]

    def wait(self) -> None:
        """Wait for every save in flight and every save thread; raise the first error among them."""
        saves = self._saves()
        errors = [e for e in (h.exception() for h in saves.take(finished_only=False)) if e is not None]
        saves.join_threads()
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
        state = load_checkpoint(
            path,
            map_location,
            classes=self.classes,
            read_torch_checkpoints=self.read_torch_checkpoints,
            trusted_keys=self.trusted_keys,
            storage_options=self.storage_options,
            _keep_rng=True,
        )
        rng = state.pop(RNG_KEY, None)
        if rng is not None and self.restore_rng:
            ckptfmt.restore_rng(rng)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        target = _target(path)
        if is_url(target):
            inflight.wait_for_path(target)
            delete_object(parse_url(target), self.storage_options)  # an absent object is no error
            return
        try:
            ckptfmt.remove(target)  # waits for a save in flight on that path
        except FileNotFoundError:
            pass


class _ProcessSaves:
    """One plugin's non-blocking saves in flight in one process, and their threads.

    A save's thread lives on for a moment after its handle is done (it frees the file the
    save replaced): taken handles leave their threads here, for teardown to join."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._handles: list[ckptfmt.SaveHandle] = []
        self._threads: list[threading.Thread] = []

    def add(self, handle: ckptfmt.SaveHandle) -> None:
        with self._lock:
            self._handles.append(handle)
            if handle._thread is not None:
                self._threads.append(handle._thread)

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


# -- what Lightning sees of a save in flight ---------------------------------------------


class _SavesInFlight:
    """The files this process's non-blocking plugins are writing, by real path, and the objects
    by URL."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[str, ckptfmt.SaveHandle] = {}

    def add(self, path: str, handle: ckptfmt.SaveHandle) -> None:
        with self._lock:
            self._handles[_in_flight_key(path)] = handle

    def running(self) -> dict[str, ckptfmt.SaveHandle]:
        """The saves still running (finished ones are dropped: the file answers for itself)."""
        with self._lock:
            for key in [k for k, h in self._handles.items() if h.done()]:
                del self._handles[key]
            return dict(self._handles)

    def reset(self) -> None:
        """In a forked child: the parent's saves are not this process's, and the lock may be held."""
        self._lock = threading.Lock()
        self._handles = {}


_IN_FLIGHT = _SavesInFlight()
os.register_at_fork(after_in_child=_IN_FLIGHT.reset)


class _LocalFileSystem(LocalFileSystem):  # type: ignore[misc]  # fsspec has no type hints
    """fsspec's local filesystem, seeing a non-blocking save in flight as the file it will be.

    ModelCheckpoint picks a free name with ``exists`` and finds ``last`` files with ``ls``;
    without this, a name still being written looks free and a second save overwrites the first.
    Details (``info``: size, times) wait for the save, so they are those of the written file."""

    def exists(self, path: Any, **kwargs: Any) -> bool:
        return self._in_flight(path) is not None or bool(super().exists(path, **kwargs))

    def lexists(self, path: Any, **kwargs: Any) -> bool:
        return self._in_flight(path) is not None or bool(super().lexists(path, **kwargs))

    def isfile(self, path: Any) -> bool:
        return self._in_flight(path) is not None or bool(super().isfile(path))

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        if not isinstance(path, os.DirEntry):
            handle = self._in_flight(path)
            if handle is not None:
                handle.exception()  # waits; the error is the plugin's to raise, at its next save
        return dict(super().info(path, **kwargs))

    def ls(self, path: Any, detail: bool = False, **kwargs: Any) -> list[Any]:
        directory = os.path.realpath(self._strip_protocol(path))
        running = {k: h for k, h in _IN_FLIGHT.running().items() if os.path.dirname(k) == directory}
        if detail:  # sizes and times of files being written: those they will have
            for handle in running.values():
                handle.exception()
            return list(super().ls(path, detail=True, **kwargs))
        names = list(super().ls(path, detail=False, **kwargs))
        if not running:
            return names
        temps = tuple(os.path.basename(temp_prefix(k)) for k in running)
        shown = [n for n in names if not os.path.basename(n).startswith(temps)]
        base = self._strip_protocol(path).rstrip("/")
        present = {os.path.basename(n) for n in shown}
        shown += [f"{base}/{os.path.basename(k)}" for k in running if os.path.basename(k) not in present]
        return shown

    def _in_flight(self, path: Any) -> ckptfmt.SaveHandle | None:
        key = os.path.realpath(self._strip_protocol(path))
        return _IN_FLIGHT.running().get(key)


def _in_flight_key(path: str) -> str:
    """A local file by its real path; an object by its URL (as _target wrote it)."""
    return path if is_url(path) else os.path.realpath(path)


@functools.cache
def _s3_filesystem_class() -> type:
    """s3fs's filesystem, seeing a non-blocking save in flight as the object it will be, and
    keeping no listings cache: the plugin writes and deletes objects through ckptfmt's own
    client, behind s3fs's back, so a cached listing would show a taken name as free (and
    ModelCheckpoint would give a second save the name of the first).  Made on first use, so
    that s3fs (and aiobotocore) are imported only where ``s3://`` paths are used."""
    import s3fs
    from fsspec.asyn import sync_wrapper

    class _S3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]  # s3fs has no type hints
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("use_listings_cache", False)
            super().__init__(*args, **kwargs)

        async def _exists(self, path: Any, **kwargs: Any) -> bool:
            if self._in_flight(path) is not None or self._in_flight_beneath(path):
                return True
            return bool(await super()._exists(path, **kwargs))

        async def _isfile(self, path: Any) -> bool:
            return self._in_flight(path) is not None or bool(await super()._isfile(path))

        async def _info(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            handle = self._in_flight(path)
            if handle is not None:  # details are the written object's; its error is the plugin's
                await asyncio.to_thread(handle.exception)
            return dict(await super()._info(path, *args, **kwargs))

        async def _ls(self, path: Any, detail: bool = False, **kwargs: Any) -> list[Any]:
            running = self._in_flight_beneath(path, directly=True)
            if detail:  # sizes and times of objects being written: those they will have
                for handle in running.values():
                    await asyncio.to_thread(handle.exception)
                return list(await super()._ls(path, detail=True, **kwargs))
            try:
                names = list(await super()._ls(path, detail=False, **kwargs))
            except FileNotFoundError:
                if not running:
                    raise
                names = []  # only saves in flight there yet
            present = set(names)
            return names + [n for n in (k[len("s3://") :] for k in running) if n not in present]

        def _in_flight(self, path: Any) -> ckptfmt.SaveHandle | None:
            return _IN_FLIGHT.running().get(self._url(path))

        def _in_flight_beneath(self, path: Any, *, directly: bool = False) -> dict[str, ckptfmt.SaveHandle]:
            prefix = self._url(path).rstrip("/") + "/"
            return {
                k: h
                for k, h in _IN_FLIGHT.running().items()
                if k.startswith(prefix) and not (directly and "/" in k[len(prefix) :])
            }

        def _url(self, path: Any) -> str:
            return "s3://" + str(self._strip_protocol(path))

        # s3fs binds some blocking methods to its own coroutines: bind them to those above
        exists = sync_wrapper(_exists)
        isfile = sync_wrapper(_isfile)
        info = sync_wrapper(_info)
        ls = sync_wrapper(_ls)

    # pickled by name (ddp_spawn pickles ModelCheckpoint and its filesystem): found again
    # through this module's __getattr__
    _S3FileSystem.__qualname__ = "_S3FileSystem"
    _S3FileSystem.__module__ = __name__
    return _S3FileSystem


#: where fsspec finds the class above (imported, and so made, when s3:// is first used)
_S3_CLASS_PATH = f"{__name__}:_S3FileSystem"


def __getattr__(name: str) -> Any:
    if name == "_S3FileSystem":
        return _s3_filesystem_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _show_saves_in_flight(blocking: bool) -> None:
    """Register the filesystems above with fsspec where fsspec's own are in use (one that
    someone else registered is left alone): for ``s3://`` always (objects this plugin writes
    must never hide behind a cached listing), for local paths when saves do not block.
    Lightning asks every question about a path through fsspec's ``url_to_fs``, which looks
    the protocol up there."""
    if not blocking:
        for protocol in ("file", "local"):
            current = fsspec.get_filesystem_class(protocol)
            if current is LocalFileSystem:
                fsspec.register_implementation(protocol, _LocalFileSystem, clobber=True)
    _show_objects_in_flight()


def _show_objects_in_flight() -> None:
    known = known_implementations.get("s3", {}).get("class")
    current = fsspec_classes.get("s3")
    if current is None and known == "s3fs.S3FileSystem":
        # s3fs not imported yet: fsspec imports the class named here when s3:// is first used
        errtxt = known_implementations["s3"].get("err")  # "Install s3fs ..." where it is missing
        fsspec.register_implementation("s3", _S3_CLASS_PATH, clobber=True, errtxt=errtxt)
    elif current is not None and f"{current.__module__}.{current.__qualname__}" == "s3fs.core.S3FileSystem":
        fsspec.register_implementation("s3", _s3_filesystem_class(), clobber=True)


# -- paths and options -------------------------------------------------------------------


def _target(path: Any) -> str:
    """The local path or the ``s3://`` URL that a path Lightning gives names."""
    text = os.fspath(path)
    if text.startswith("file://"):
        return text[len("file://") :]
    if text.startswith("s3://"):
        return str(parse_url(text))
    if "://" in text:
        raise RemotePathError(
            f"ckptfmt reads and writes local files and s3:// URLs (S3 and S3-compatible stores), "
            f"not {text.split('://', 1)[0]}:// ones; give a local or s3:// dirpath/default_root_dir, "
            "or use Lightning's default CheckpointIO (no CkptfmtCheckpointIO plugin) for this store",
            path=text,
        )
    return text


def _names_only(options: Any) -> str:
    """What a message shows of misplaced storage_options: the names, never the values (they
    may be credentials meant for the store)."""
    if isinstance(options, dict):
        return "a dict of " + ", ".join(sorted(repr(k)[:40] for k in options))
    return f"a {type(options).__name__}"


def _save_options(storage_options: Any, compression: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {"compression": compression}
    if storage_options is None:
        return options
    if not isinstance(storage_options, dict) or set(storage_options) - {"compression", "level", "metadata"}:
        raise TypeError(
            "storage_options must be None or a dict with ckptfmt's save options "
            f"compression, level and metadata; got {_names_only(storage_options)}"
        )
    options.update(storage_options)
    return options


# -- callback states keyed by a class ----------------------------------------------------


def _with_class_keys_named(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of `checkpoint` whose callback states keyed by a class are keyed by the
    class's ``__qualname__`` (Lightning's own key for a callback), with the classes recorded."""
    state = dict(checkpoint)
    callbacks = state.get("callbacks")
    if not isinstance(callbacks, dict) or not any(isinstance(k, type) for k in callbacks):
        return state
    renamed: dict[Any, Any] = {}
    classes: dict[str, str] = {}
    for key, value in callbacks.items():
        if isinstance(key, type):
            name = key.__qualname__
            if name in callbacks or name in classes:
                raise ValueError(
                    f"state['callbacks']: the class key {key!r} and another key are both named {name!r}"
                )
            classes[name] = key.__module__
            key = name
        renamed[key] = value
    state["callbacks"] = renamed
    state[CLASS_KEYS_KEY] = classes
    return state


def _with_class_keys_restored(state: dict[str, Any], source: str) -> None:
    """Key the recorded callback states by their class again, where that class is already
    imported and is a class (nothing is imported: a name that does not resolve stays a str)."""
    classes = state.pop(CLASS_KEYS_KEY, None)
    if classes is None:
        return
    callbacks = state.get("callbacks")
    if not isinstance(classes, dict) or not isinstance(callbacks, dict):
        raise CorruptError(
            f"state[{CLASS_KEYS_KEY!r}] needs a dict and state['callbacks'] a dict", path=source
        )
    for name, module in classes.items():
        if type(name) is not str or type(module) is not str:
            raise CorruptError(f"state[{CLASS_KEYS_KEY!r}]: names and modules must be str", path=source)
        cls = _imported_class(module, name)
        if cls is not None and name in callbacks:
            callbacks[cls] = callbacks.pop(name)


def _imported_class(module: str, qualname: str) -> type | None:
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part.startswith("__"):
            return None
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


# -- loading -----------------------------------------------------------------------------


def _check_hparams(state: dict[str, Any], source: str) -> None:
    """Refuse hyper-parameter entries that Lightning would fail on with a TypeError or an
    AttributeError, or pass to a constructor as dunder names: a dict of str names, and a str
    (or nothing) for the name and the type (a type itself cannot be stored by this plugin)."""
    for values_key, name_key, type_key in _HPARAMS_KEYS:
        values = state.get(values_key)
        if values is not None:
            _expect(values, dict, values_key, source)
            for name in values:
                if type(name) is not str or (name.startswith("__") and name.endswith("__")):
                    raise CorruptError(f"{name!r} is not a hyper-parameter name", path=source, key=values_key)
        for key in (name_key, type_key):
            if state.get(key) is not None:
                _expect(state[key], str, key, source)


def _expect(value: object, kind: type, key: str, source: str) -> None:
    if not isinstance(value, kind):
        raise CorruptError(f"must be a {kind.__name__}, not {type(value).__name__}", path=source, key=key)


def _load_torch(target: str, map_location: Any, options: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint written by torch.save (Lightning's default plugin), read without running
    code; an object is fetched whole first (torch.load reads a zip archive's end first)."""
    source: Any = io.BytesIO(_object_bytes(target, options)) if is_url(target) else target
    state = torch.load(source, map_location=map_location or "cpu", weights_only=True)
    if type(state) is not dict:
        raise CheckpointError(f"holds a {type(state).__name__}, not a Lightning checkpoint dict", path=target)
    return state


def _object_bytes(url: str, options: dict[str, Any]) -> bytes:
    """All of the object at `url` (ETag-pinned, checked ranged reads)."""
    remote = RemoteObject(url, options)
    try:
        remote.fetch([(0, remote.size)])
        assert remote.spool is not None
        with remote.spool.view(0, remote.size) as view:
            return bytes(view)
    finally:
        remote.close()


def _sniff_target(target: str, options: dict[str, Any]) -> str:
    """:func:`sniff` of a local file, or of an object: its prologue is fetched into a spool
    (as for a load) and sniffed there (FileNotFoundError for an absent one)."""
    if not is_url(target):
        if not os.path.exists(target):
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        return sniff(target)
    remote = RemoteObject(target, options)
    try:
        return sniff(f"/proc/self/fd/{remote.fd}")
    finally:
        remote.close()


def load_checkpoint(
    path: Any,
    map_location: Any | None = None,
    *,
    classes: Iterable[type] = (),
    read_torch_checkpoints: bool = False,
    trusted_keys: Any = None,
    storage_options: dict[str, Any] | None = None,
    _keep_rng: bool = False,
) -> dict[str, Any]:
    """The dict a :class:`CkptfmtCheckpointIO` saved, with allow-listed objects rebuilt.

    Restores no RNG state (the reserved RNG entry is left out).  `map_location`
    takes torch.load's forms; None loads onto the CPU.  `read_torch_checkpoints`:
    a file written by torch.save is read with ``torch.load(weights_only=True)``.
    `trusted_keys`: the file must be signed by one of these Ed25519 public keys (SignatureError).
    `path` may be an ``s3://`` URL, reached with `storage_options` (see ``ckptfmt.load``).
    """
    target = _target(path)
    options = check_options(storage_options)
    inflight.wait_for_path(target)
    kind = _sniff_target(target, options)
    if kind in ("torch-zip", "torch-legacy"):
        if trusted_keys is not None:
            raise SignatureError(
                "written by torch.save, which carries no signature, and a signature by a trusted key is required",
                path=target,
            )
        if not read_torch_checkpoints:
            raise UnsupportedError(
                "written by torch.save (Lightning's default CheckpointIO), not a ckptfmt file; "
                "CkptfmtCheckpointIO(read_torch_checkpoints=True) reads it (torch.load(weights_only=True))",
                path=target,
            )
        state = _load_torch(target, map_location, options)
    else:
        state = ckptfmt.load(
            target, map_location=map_location, trusted_keys=trusted_keys, storage_options=options
        )
        if type(state) is not dict:
            raise CheckpointError(
                f"holds a {type(state).__name__}, not a Lightning checkpoint dict", path=target
            )
        state = objects.decode(state, classes=classes, source=target)
        _with_class_keys_restored(state, target)
    _check_hparams(state, target)
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
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path, ...)`` for a ckptfmt file: a LightningModule (or
    LightningDataModule) built from the saved hyper-parameters (`kwargs` override them),
    its weights loaded.  Uses Lightning's own instantiation (``core.saving._load_state``).
    `path` may be an ``s3://`` URL, reached with `storage_options`."""
    checkpoint = load_checkpoint(path, map_location, classes=classes, storage_options=storage_options)
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


# -- enable(): Lightning's own loader reads ckptfmt files ------------------------------------

#: every module that holds Lightning's checkpoint loader (`cloud_io._load`) under some name
_LOADERS = (
    ("lightning", "lightning.fabric.utilities.cloud_io", "_load"),
    ("lightning", "lightning.fabric.plugins.io.torch_io", "pl_load"),
    ("lightning", "lightning.pytorch.core.saving", "pl_load"),
    ("lightning_fabric", "lightning_fabric.utilities.cloud_io", "_load"),
    ("lightning_fabric", "lightning_fabric.plugins.io.torch_io", "pl_load"),
    ("pytorch_lightning", "pytorch_lightning.core.saving", "pl_load"),
)


#: the object-store client's settings of the loader enable() wraps (the last enable() call's)
_LOADER_STORAGE_OPTIONS: dict[str, Any] = {}


def enable(storage_options: dict[str, Any] | None = None) -> None:
    """Make Lightning's loader read ckptfmt files: ``LitModel.load_from_checkpoint(path)``,
    and Lightning's default CheckpointIO, in ``lightning`` and ``pytorch_lightning``.

    Lightning offers no extension point there, so its loader is wrapped: a local file or an
    ``s3://`` object (reached with `storage_options`, or the ``AWS_*`` environment) that
    starts with ckptfmt's magic bytes is read by :func:`load_checkpoint` (no pickle, no RNG
    restored); anything else goes to Lightning's loader unchanged.  Calling it again wraps
    nothing more (it replaces the storage options)."""
    options = check_options(storage_options)
    _LOADER_STORAGE_OPTIONS.clear()
    _LOADER_STORAGE_OPTIONS.update(options)
    for package, module_name, attr in _LOADERS:
        if importlib.util.find_spec(package) is None:
            continue
        module = importlib.import_module(module_name)
        current = getattr(module, attr)
        if getattr(current, "__ckptfmt_wraps__", None) is None:
            setattr(module, attr, _reading_ckptfmt(current))


def _reading_ckptfmt(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def _load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if _is_ckptfmt_file(path_or_url):
            return load_checkpoint(path_or_url, map_location, storage_options=dict(_LOADER_STORAGE_OPTIONS))
        return load(path_or_url, map_location=map_location, weights_only=weights_only)

    _load.__ckptfmt_wraps__ = load  # type: ignore[attr-defined]
    return _load


def _is_ckptfmt_file(path: Any) -> bool:
    if not isinstance(path, (str, os.PathLike)):
        return False  # a file object: Lightning's loader
    text = os.fspath(path)
    if not isinstance(text, str) or ("://" in text and not text.startswith(("file://", "s3://"))):
        return False
    target = _target(text)
    inflight.wait_for_path(target)
    try:
        return _sniff_target(target, _LOADER_STORAGE_OPTIONS) == "ckptfmt"
    except OSError:
        return False  # missing or a directory: Lightning's loader says so in its words


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

__all__ = [
    "CLASS_KEYS_KEY",
    "RNG_KEY",
    "CkptfmtCheckpointIO",
    "RemotePathError",
    "enable",
    "load_checkpoint",
    "load_from_checkpoint",
]
