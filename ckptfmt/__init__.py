"""ckptfmt: a checksummed, pickle-free checkpoint format for PyTorch training state."""

__version__ = "0.1.0"

import logging as _logging  # noqa: E402
from typing import TYPE_CHECKING, Any

from .engine import native as _native  # noqa: E402  (loaded, or its absence reported, on import)
from .errors import (  # noqa: E402
    CheckpointError,
    CheckpointWarning,
    CorruptError,
    DeadlineError,
    DecryptionError,
    IncompleteError,
    LimitError,
    SignatureError,
    SnapshotError,
    StorageError,
    UnsupportedError,
    UnsupportedObjectError,
)
from .format.layout import FORMAT_MAJOR, FORMAT_MINOR  # noqa: E402

if TYPE_CHECKING:
    from .background.inflight import SaveCost, SaveHandle
    from .files.load import Reader, load, open  # noqa: A004 - public name is fixed
    from .files.load_into import FileChangedError, PartialLoadError, load_into
    from .files.save import remove, save
    from .files.targets import LoadReport, MismatchError
    from .files.verify import Problem, VerifyReport, verify
    from .runs.manager import CheckpointManager
    from .runs.resume import ResumeReport
    from .runs.rng import capture_rng, restore_rng
    from .runs.steps import CheckpointInfo

#: the public names that need torch, and the module each comes from: imported on first use, so
#: that ``import ckptfmt`` (and ``python -m ckptfmt verify``, which builds no tensor) does not
#: import torch; each imports its own module only (a first load in a fresh process, a
#: resume, does not wait for the manager's and the writer's modules)
_LAZY = {
    "SaveCost": "background.inflight",
    "SaveHandle": "background.inflight",
    "Reader": "files.load",
    "load": "files.load",
    "open": "files.load",
    "FileChangedError": "files.load_into",
    "PartialLoadError": "files.load_into",
    "load_into": "files.load_into",
    "remove": "files.save",
    "save": "files.save",
    "LoadReport": "files.targets",
    "MismatchError": "files.targets",
    "Problem": "files.verify",
    "VerifyReport": "files.verify",
    "verify": "files.verify",
    "CheckpointManager": "runs.manager",
    "ResumeReport": "runs.resume",
    "capture_rng": "runs.rng",
    "restore_rng": "runs.rng",
    "CheckpointInfo": "runs.steps",
}


def _import_public_name(name: str) -> None:
    """Import the module behind _LAZY[name] and bind its public names here (module globals, so
    that __getattr__ is not asked again); with runs.manager, runs.objectmanager, which
    registers CheckpointManager(url)."""
    import importlib

    module = _LAZY[name]
    if module == "runs.manager":
        importlib.import_module(".runs.objectmanager", __name__)
    imported = importlib.import_module(f".{module}", __name__)
    names = globals()
    for other, where in _LAZY.items():
        if where == module:
            names[other] = getattr(imported, other)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        _import_public_name(name)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# a library is silent unless its user configures logging: each save's cost is logged at INFO
_logging.getLogger("ckptfmt").addHandler(_logging.NullHandler())


def backend() -> str:
    """Which engine does the byte work: "c" (the compiled engine) or "python" (the reference path).

    Set CKPTFMT_BACKEND=python to force the reference path.
    """
    return "c" if _native.available() else "python"


__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "ResumeReport",
    "capture_rng",
    "restore_rng",
    "CorruptError",
    "DeadlineError",
    "DecryptionError",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "IncompleteError",
    "LimitError",
    "FileChangedError",
    "LoadReport",
    "PartialLoadError",
    "MismatchError",
    "Problem",
    "Reader",
    "SignatureError",
    "StorageError",
    "SnapshotError",
    "UnsupportedError",
    "UnsupportedObjectError",
    "VerifyReport",
    "SaveCost",
    "SaveHandle",
    "__version__",
    "configure_staging",
    "remove",
    "backend",
    "load",
    "load_into",
    "open",
    "save",
    "verify",
]


def configure_staging(limit_bytes: int | None = None, slab_bytes: int | None = None) -> None:
    """Set the staging memory non-blocking saves may use (default: a quarter of RAM, at most 8 GiB;
    also CKPTFMT_STAGING_BYTES).  A state larger than the limit is saved in pieces."""
    from .background.staging import POOL

    POOL.configure(limit_bytes, slab_bytes)
