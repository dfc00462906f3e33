"""ckptfmt: a checksummed, pickle-free checkpoint format for PyTorch training state."""

__version__ = "0.1.0"

from .api import Reader, load, open  # noqa: E402, A004 - public name is fixed
from .errors import (  # noqa: E402
    CheckpointError,
    CorruptError,
    IncompleteError,
    LimitError,
    UnsupportedError,
    UnsupportedObjectError,
)
from .format import FORMAT_MAJOR, FORMAT_MINOR  # noqa: E402
from .verify import Problem, VerifyReport, verify  # noqa: E402
from .writer import save  # noqa: E402


def backend() -> str:
    """Which engine does the byte work: "python" (the reference path)."""
    return "python"


__all__ = [
    "CheckpointError",
    "CorruptError",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "IncompleteError",
    "LimitError",
    "Problem",
    "Reader",
    "UnsupportedError",
    "UnsupportedObjectError",
    "VerifyReport",
    "__version__",
    "backend",
    "load",
    "open",
    "save",
    "verify",
]
