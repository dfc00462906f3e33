"""ckptfmt diff: two checkpoints compared key by key (types, shapes, dtypes, bit-exact values)."""

from __future__ import annotations

import argparse
import json
import struct
from typing import Any

import numpy as np
import torch

from ..format.render import render_key, short_repr
from .exitcodes import EXIT_FAILED, EXIT_OK, KNOWN_ERRORS, require_ckptfmt
from .terminal import fail, say


def _diff(a: Any, b: Any, path: str, out: list[dict[str, Any]]) -> None:
    if type(a) is not type(b):
        out.append({"key": path, "what": "type", "a": type(a).__name__, "b": type(b).__name__})
        return
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(
                {
                    "key": path,
                    "what": "tensor",
                    "a": f"{a.dtype} {list(a.shape)}",
                    "b": f"{b.dtype} {list(b.shape)}",
                }
            )
            return
        if a.numel() == 0:
            return
        size = a.element_size()
        ua = a.detach().cpu().reshape(-1).contiguous().view(torch.uint8).view(-1, size)
        ub = b.detach().cpu().reshape(-1).contiguous().view(torch.uint8).view(-1, size)
        differing = int((ua != ub).any(1).sum())
        if differing:
            entry: dict[str, Any] = {"key": path, "what": "values", "differing": differing}
            wide = torch.complex128 if a.dtype.is_complex else torch.float64
            xa, xb = a.detach().cpu().to(wide), b.detach().cpu().to(wide)
            d = (xa - xb).abs()
            d = torch.where(
                xa.isnan() & xb.isnan(), torch.zeros_like(d), torch.nan_to_num(d, nan=float("inf"))
            )
            entry["max_abs_diff"] = float(d.max())
            out.append(entry)
        return
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            out.append(
                {
                    "key": path,
                    "what": "array",
                    "a": f"{a.dtype} {list(a.shape)}",
                    "b": f"{b.dtype} {list(b.shape)}",
                }
            )
        return
    if isinstance(a, dict):
        for k in a:
            if k not in b:
                out.append({"key": render_key(path, k), "what": "only in A"})
            else:
                _diff(a[k], b[k], render_key(path, k), out)
        for k in b:
            if k not in a:
                out.append({"key": render_key(path, k), "what": "only in B"})
        return
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append({"key": path, "what": "length", "a": len(a), "b": len(b)})
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
        return
    same = struct.pack("<d", a) == struct.pack("<d", b) if isinstance(a, float) else a == b
    if not same:
        out.append({"key": path, "what": "value", "a": short_repr(a, 80), "b": short_repr(b, 80)})


def cmd_diff(args: argparse.Namespace) -> int:
    from ..files import load as api

    states = []
    for p in (args.a, args.b):
        try:
            require_ckptfmt(p)
            states.append(api.load(p))
        except KNOWN_ERRORS as e:  # a damaged file is 1, like everywhere (not "differ")
            return fail(e, p)
    diffs: list[dict[str, Any]] = []
    _diff(states[0], states[1], "state", diffs)
    if args.json:
        print(json.dumps({"a": args.a, "b": args.b, "identical": not diffs, "differences": diffs}, indent=2))
    elif not diffs:
        say("identical")
    else:
        for d in diffs:
            detail = ", ".join(f"{k} {v}" for k, v in d.items() if k not in ("key", "what"))
            say(f"{d['key']}: {d['what']}" + (f" ({detail})" if detail else ""))
    return EXIT_OK if not diffs else EXIT_FAILED
