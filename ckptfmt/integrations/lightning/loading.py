"""Reading the checkpoints the plugin wrote: the dict Lightning expects, and a module built
from one (``load_from_checkpoint``), from a local file, an ``s3://`` object or another
fsspec URL; ``torch.save`` files too, where allowed, with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

import ckptfmt

from ...background import inflight
from ...errors import CheckpointError, CorruptError, SignatureError, UnsupportedError
from ...format.sniff import HEAD_BYTES, sniff, sniff_head
from ...storage.client import check_options
from ...storage.download import RemoteObject
from .. import objects
from . import transfer
from .callback_keys import with_class_keys_restored
from .paths import FSSPEC, LOCAL, Target, target

#: the key under which the RNG state travels in the saved dict
RNG_KEY = "__ckptfmt_rng__"
#: the hyper-parameter entries of a LightningModule and a LightningDataModule: (values, name, type)
_HPARAMS_KEYS = (
    ("hyper_parameters", "hparams_name", "hparams_type"),
    ("datamodule_hyper_parameters", "datamodule_hparams_name", "datamodule_hparams_type"),
)
_TORCH_KINDS = ("torch-zip", "torch-legacy")


@dataclass(frozen=True)
class Reading:
    """How to read one checkpoint (load_checkpoint's arguments, checked: `reading`)."""

    map_location: Any
    classes: tuple[type, ...]
    read_torch_checkpoints: bool
    trusted_keys: Any
    storage_options: dict[str, Any]
    decrypt_with: Any


def load_checkpoint(
    path: Any,
    map_location: Any | None = None,
    *,
    classes: Iterable[type] = (),
    read_torch_checkpoints: bool = False,
    trusted_keys: Any = None,
    storage_options: dict[str, Any] | None = None,
    decrypt_with: Any = None,
) -> dict[str, Any]:
    """The dict a :class:`CkptfmtCheckpointIO` saved, with allow-listed objects rebuilt.

    Restores no RNG state (the reserved RNG entry is left out).  `map_location`
    takes torch.load's forms; None loads onto the CPU.  `read_torch_checkpoints`:
    a file written by torch.save is read with ``torch.load(weights_only=True)``.
    `trusted_keys`: the file must be signed by one of these Ed25519 public keys (SignatureError).
    `decrypt_with`: the key of an encrypted checkpoint (DecryptionError without it).
    `path` may be an ``s3://`` URL, reached with `storage_options` (see ``ckptfmt.load``),
    or a URL of another fsspec protocol, fetched with its filesystem into a local temporary file.
    """
    how = reading(map_location, classes, read_torch_checkpoints, trusted_keys, storage_options, decrypt_with)
    state = load_with_rng(path, how)
    state.pop(RNG_KEY, None)
    return state


def reading(
    map_location: Any,
    classes: Iterable[type],
    read_torch_checkpoints: bool,
    trusted_keys: Any,
    storage_options: dict[str, Any] | None,
    decrypt_with: Any,
) -> Reading:
    """load_checkpoint's arguments, checked, as one value."""
    return Reading(
        map_location,
        tuple(classes),
        read_torch_checkpoints,
        trusted_keys,
        check_options(storage_options),
        decrypt_with,
    )


def load_with_rng(path: Any, how: Reading) -> dict[str, Any]:
    """load_checkpoint for the plugin, which restores the RNG state: the dict keeps its
    reserved RNG entry."""
    where = target(path)
    if where.kind == FSSPEC:
        fs, fs_path = transfer.open_fs(where.path)
        inflight.wait_for_path(transfer.inflight_key(fs, fs_path))
        with transfer.fetched(fs, fs_path, where.path) as local:
            state = _read(Target(LOCAL, local), where.name, how)
    else:
        inflight.wait_for_path(where.path)
        state = _read(where, where.name, how)
    _check_hparams(state, where.name)
    return state


def _read(where: Target, name: str, how: Reading) -> dict[str, Any]:
    """The dict in the local file or ``s3://`` object `where`; errors name `name`."""
    kind = sniff_target(where, how.storage_options)
    if kind in _TORCH_KINDS:
        _check_torch_allowed(name, how)
        if where.kind == LOCAL:
            return _load_torch(where.path, name, how.map_location)
        with transfer.object_copy(where.path, how.storage_options) as local:
            return _load_torch(local, name, how.map_location)
    state = ckptfmt.load(
        where.path,
        map_location=how.map_location,
        trusted_keys=how.trusted_keys,
        storage_options=how.storage_options if where.kind != LOCAL else None,
        decrypt_with=how.decrypt_with,
    )
    if type(state) is not dict:
        raise CheckpointError(f"holds a {type(state).__name__}, not a Lightning checkpoint dict", path=name)
    state = objects.decode(state, classes=how.classes, source=name)
    with_class_keys_restored(state, name)
    return state


def _check_torch_allowed(name: str, how: Reading) -> None:
    if how.trusted_keys is not None:
        raise SignatureError(
            "written by torch.save, which carries no signature, and a signature by a trusted key is required",
            path=name,
        )
    if not how.read_torch_checkpoints:
        raise UnsupportedError(
            "written by torch.save (Lightning's default CheckpointIO), not a ckptfmt file; "
            "CkptfmtCheckpointIO(read_torch_checkpoints=True) reads it (torch.load(weights_only=True))",
            path=name,
        )


def _load_torch(local: str, name: str, map_location: Any) -> dict[str, Any]:
    """A checkpoint written by torch.save (Lightning's default plugin), read without running
    code.  A file torch.load cannot read (cut short, damaged, not torch's archive) is a
    CorruptError, one holding what weights_only refuses to build an UnsupportedError, each
    naming it: torch's own errors (RuntimeError, UnpicklingError) do not name the file.  What
    is not about the file's bytes is raised unchanged: OSError, running out of memory (host or
    device), a `map_location` naming a device this process cannot use."""
    import pickle

    try:
        state = torch.load(local, map_location=map_location or "cpu", weights_only=True)
    except (OSError, MemoryError, _DeviceOutOfMemory):
        raise
    except pickle.UnpicklingError as e:
        kind, text = _unpickler_refusal(e, local)
        raise kind(f"torch.load(weights_only=True) {text}", path=name) from e
    except Exception as e:  # whatever torch's reader and unpickler raise on damaged bytes
        if map_location is not None and not _devices_usable(map_location):
            raise  # torch's error about the caller's map_location, not about the file
        raise CorruptError(
            f"torch.load(weights_only=True) cannot read it: {type(e).__name__}: {_first_line(e)}", path=name
        ) from e
    if type(state) is not dict:
        raise CheckpointError(f"holds a {type(state).__name__}, not a Lightning checkpoint dict", path=name)
    return state


#: torch's out-of-memory error of a device (a RuntimeError: not a damaged file)
_DeviceOutOfMemory: type[BaseException] = getattr(torch, "OutOfMemoryError", MemoryError)

#: what torch's weights-only unpickler says when it refuses a type the file names, as opposed
#: to bytes it cannot parse (an unknown opcode, a truncated pickle)
_REFUSED_TYPE = re.compile(
    r"unsupported global|GLOBAL \S+ whose module|Can only (create new object|build)|must be imported to load",
    re.IGNORECASE,
)
_UNPICKLER_LINE = "WeightsUnpickler error:"
_CONTROL = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|[\x00-\x1f\x7f]")


def _unpickler_refusal(e: BaseException, local: str) -> tuple[type[CheckpointError], str]:
    """The ckptfmt error for torch.load's UnpicklingError under weights_only, and its text: the
    unpickler's own message (after torch's banner, which is the same for every failure) refusing
    a type is an UnsupportedError, any other a CorruptError (damaged pickle bytes); so is a
    refused type read from a pickle cut short (its last name cut, ``torch.FloatStor``)."""
    text = str(e)
    at = text.find(_UNPICKLER_LINE)
    inner = text[at + len(_UNPICKLER_LINE) :] if at >= 0 else text
    lines = (" ".join(_CONTROL.sub(" ", line).split()) for line in inner.splitlines())
    first = next((line for line in lines if line), "") or " ".join(_CONTROL.sub(" ", _first_line(e)).split())
    first = first if len(first) <= 300 else first[:297] + "..."
    if _REFUSED_TYPE.search(first) and not _pickle_cut_short(local):
        return UnsupportedError, f"refuses it: {first}"
    return CorruptError, f"cannot read it: {first}"


def _pickle_cut_short(local: str) -> bool:
    """Whether the pickle of torch's archive `local` does not end with pickle's STOP opcode."""
    import zipfile

    try:
        with zipfile.ZipFile(local) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                return False  # not torch's archive as torch.save writes it: leave torch's verdict
            size = archive.getinfo(names[0]).file_size
            with archive.open(names[0]) as pkl:
                pkl.seek(max(size - 1, 0))
                return pkl.read(1) != b"."
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def _devices_usable(map_location: Any) -> bool:
    """Whether the devices the caller's `map_location` names (a device, its name, or a dict's
    values; a function is the caller's own) can hold a tensor in this process."""
    targets = map_location.values() if isinstance(map_location, dict) else [map_location]
    for device in targets:
        if isinstance(device, (str, torch.device)):
            try:
                torch.empty(0, device=device)
            except Exception:  # torch: not compiled with it, no driver, no such device, bad name
                return False
    return True


def _first_line(e: BaseException, limit: int = 300) -> str:
    """An error's first line, bounded (torch's messages run to paragraphs)."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sniff_target(where: Target, options: dict[str, Any]) -> str:
    """:func:`sniff` of a local file, or of an ``s3://`` object from its first bytes (one
    ranged read); FileNotFoundError for an absent one."""
    if where.kind == LOCAL:
        if not os.path.exists(where.path):
            raise FileNotFoundError(f"Checkpoint file not found: {where.path}")
        return sniff(where.path)
    remote = RemoteObject(where.path, options, fetch_index=False)  # its first bytes only
    try:
        end = min(remote.size, HEAD_BYTES)
        remote.fetch([(0, end)])
        assert remote.spool is not None
        with remote.spool.view(0, end) as head:
            return sniff_head(bytes(head), remote.size)
    finally:
        remote.close()


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


def load_from_checkpoint(
    cls: type,
    path: Any,
    map_location: Any | None = None,
    *,
    strict: bool | None = None,
    classes: Iterable[type] = (),
    storage_options: dict[str, Any] | None = None,
    decrypt_with: Any = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path, ...)`` for a ckptfmt file: a LightningModule (or
    LightningDataModule) built from the saved hyper-parameters (`kwargs` override them),
    its weights loaded.  Uses Lightning's own instantiation (``core.saving._load_state``).
    `path` may be an ``s3://`` URL, reached with `storage_options`, or another fsspec URL;
    `decrypt_with`: the key of an encrypted checkpoint."""
    checkpoint = load_checkpoint(
        path, map_location, classes=classes, storage_options=storage_options, decrypt_with=decrypt_with
    )
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
