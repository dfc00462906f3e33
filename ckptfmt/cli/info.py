"""ckptfmt info: the package, format and library versions and the active backend."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..format import layout as fmt
from .exitcodes import EXIT_OK
from .terminal import say


def info_dict() -> dict[str, Any]:
    import xxhash
    import zstandard

    from .. import backend
    from ..engine import native as _native

    engine = _native.versions()
    return {
        "ckptfmt": __version__,
        "format": f"{fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR}",
        "backend": backend(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "zstandard": zstandard.__version__,
        "zstandard_zstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        "xxhash": xxhash.XXHASH_VERSION,
        "engine": "built" if _native.built() else f"not built: {_native.NOT_BUILT}",
        "engine_zstd": engine.get("zstd", "-"),
        "engine_xxhash": engine.get("xxhash", "-"),
    }


def cmd_info(args: argparse.Namespace) -> int:
    data = info_dict()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for k, v in data.items():
            say(f"{k}: {v}")
    return EXIT_OK
