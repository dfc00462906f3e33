"""ckptfmt: a checksummed, pickle-free checkpoint format for PyTorch training state."""

__version__ = "0.1.0"

import logging as _logging  # noqa: E402

from .background.inflight import SaveCost, SaveHandle  # noqa: E402
from .background.staging import POOL as _POOL  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointError,
    CheckpointWarning,
    CorruptError,
    DecryptionError,
    IncompleteError,
    LimitError,
    SignatureError,
    SnapshotError,
    StorageError,
    UnsupportedError,
    UnsupportedObjectError,
)
from .files.load import Reader, load, open  # noqa: E402, A004 - public name is fixed
from .files.load_into import FileChangedError, PartialLoadError, load_into  # noqa: E402
from .files.save import remove, save  # noqa: E402
from .files.targets import LoadReport, MismatchError  # noqa: E402
from .files.verify import Problem, VerifyReport, verify  # noqa: E402
from .format.layout import FORMAT_MAJOR, FORMAT_MINOR  # noqa: E402
from .runs import objectmanager as _objectmanager  # noqa: E402,F401  (registers CheckpointManager(url))
from .runs.manager import CheckpointManager  # noqa: E402
from .runs.resume import ResumeReport  # noqa: E402
from .runs.rng import capture_rng, restore_rng  # noqa: E402
from .runs.steps import CheckpointInfo  # noqa: E402

# a library is silent unless its user configures logging: each save's cost is logged at INFO
_logging.getLogger("ckptfmt").addHandler(_logging.NullHandler())


def backend() -> str:
    """Which engine does the byte work: "c" (the compiled engine) or "python" (the reference path).

    Set CKPTFMT_BACKEND=python to force the reference path.
    """
    from .engine import native as _native

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
    _POOL.configure(limit_bytes, slab_bytes)
