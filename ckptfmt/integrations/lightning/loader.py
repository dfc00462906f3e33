""":func:`enable`: Lightning's own checkpoint loader reads ckptfmt files.

``LightningModule.load_from_checkpoint`` reads files with Lightning's loader, which has no
extension point: it is wrapped, in every module that holds it under some name, so that a
file that starts with ckptfmt's magic bytes is read by :func:`load_checkpoint` (no pickle,
no RNG restored); anything else goes to Lightning's loader unchanged.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

from ...background import inflight
from ...format.sniff import HEAD_BYTES, sniff_head
from ...storage.client import check_options
from . import transfer
from .loading import load_checkpoint, sniff_target
from .paths import FSSPEC, RemotePathError, target

#: every module that holds Lightning's checkpoint loader (`cloud_io._load`) under some name
_LOADERS = (
    ("lightning", "lightning.fabric.utilities.cloud_io", "_load"),
    ("lightning", "lightning.fabric.plugins.io.torch_io", "pl_load"),
    ("lightning", "lightning.pytorch.core.saving", "pl_load"),
    ("lightning_fabric", "lightning_fabric.utilities.cloud_io", "_load"),
    ("lightning_fabric", "lightning_fabric.plugins.io.torch_io", "pl_load"),
    ("pytorch_lightning", "pytorch_lightning.core.saving", "pl_load"),
)

#: the settings of the loader enable() wraps (the last enable() call's)
_SETTINGS: dict[str, Any] = {"storage_options": {}, "decrypt_with": None}


def enable(storage_options: dict[str, Any] | None = None, *, decrypt_with: Any = None) -> None:
    """Make Lightning's loader read ckptfmt files: ``LitModel.load_from_checkpoint(path)``,
    and Lightning's default CheckpointIO, in ``lightning`` and ``pytorch_lightning``.

    A local file, an ``s3://`` object (reached with `storage_options`, or the ``AWS_*``
    environment) or a file on another fsspec filesystem that starts with ckptfmt's magic
    bytes is read by :func:`load_checkpoint`, with `decrypt_with` for encrypted ones;
    anything else goes to Lightning's loader unchanged.  Calling it again wraps nothing
    more (it replaces the settings)."""
    _SETTINGS["storage_options"] = check_options(storage_options)
    _SETTINGS["decrypt_with"] = decrypt_with
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
            return load_checkpoint(
                path_or_url,
                map_location,
                storage_options=dict(_SETTINGS["storage_options"]),
                decrypt_with=_SETTINGS["decrypt_with"],
            )
        return load(path_or_url, map_location=map_location, weights_only=weights_only)

    _load.__ckptfmt_wraps__ = load  # type: ignore[attr-defined]
    return _load


def _is_ckptfmt_file(path: Any) -> bool:
    if not isinstance(path, (str, os.PathLike)):
        return False  # a file object: Lightning's loader
    text = os.fspath(path)
    if not isinstance(text, str):
        return False
    try:
        where = target(text)
        if where.kind == FSSPEC:
            return _fs_head_kind(where.path) == "ckptfmt"
        inflight.wait_for_path(where.path)
        return sniff_target(where, _SETTINGS["storage_options"]) == "ckptfmt"
    except (OSError, RemotePathError, ImportError, ValueError):
        return False  # missing, a directory, unknown: Lightning's loader says so in its words


def _fs_head_kind(url: str) -> str:
    """:func:`sniff_head` of a file on an fsspec filesystem; "unknown" where it cannot be read
    (Lightning's loader then says why, in its words) and for http(s) URLs, which Lightning
    fetches itself (torch.hub)."""
    if url.startswith(("http://", "https://")):
        return "unknown"
    try:
        return _read_head_kind(url)
    except Exception:
        return "unknown"


def _read_head_kind(url: str) -> str:
    fs, path = transfer.open_fs(url)
    inflight.wait_for_path(transfer.inflight_key(fs, path))
    size = transfer.file_size(fs, path, url)
    with fs.open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    return sniff_head(head, size)
