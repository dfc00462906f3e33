"""ckptfmt consolidate and convert: writing a checkpoint again, self-contained or in another
format (torch.save, safetensors, a torch.distributed.checkpoint directory)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from ..errors import CheckpointError
from ..format.render import short_repr
from ..format.sniff import DESCRIPTIONS, sniff
from .exitcodes import (
    EXIT_OK,
    KNOWN_ERRORS,
    ForeignFileError,
    NotCheckpointError,
    UsageError,
    error_text,
    exit_code,
    require_ckptfmt,
)
from .terminal import fail, say


def cmd_consolidate(args: argparse.Namespace) -> int:
    from ..runs.incremental import consolidate

    entry: dict[str, Any] = {"src": args.src, "dst": args.dst, "ok": False}
    status = EXIT_OK
    try:
        require_ckptfmt(args.src)
        try:
            report = consolidate(args.src, args.dst, compression=args.compression, level=args.level)
        except CheckpointError:  # the file or one it refers to failed while read
            raise
        except ValueError as e:  # the output would replace the input
            raise UsageError(str(e)) from None
        entry.update(
            ok=True,
            chunks=report.chunks,
            external_chunks=report.external_chunks,
            referenced_files=report.referenced_files,
            file_bytes=report.file_bytes,
        )
    except KNOWN_ERRORS as e:
        entry["error"] = error_text(e, args.src)
        status = exit_code(e)
    if args.json:
        print(json.dumps(entry, indent=2))
    elif status != EXIT_OK:
        say(f"error: {entry['error']}", err=True)
    else:
        say(
            f"{args.src} -> {args.dst}: self-contained copy, {entry['chunks']} chunks "
            f"({entry['external_chunks']} read from {entry['referenced_files']} referenced file(s)), "
            f"{entry['file_bytes']} bytes"
        )
    return status


# -- convert ------------------------------------------------------------------


def _flatten_tensors(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        if prefix in out:
            raise ValueError(f"two entries flatten to the key {short_repr(prefix, 80)}")
        out[prefix] = obj
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ValueError(
                    f"key {short_repr(k, 80)} under {short_repr(prefix or 'the top level', 80)} "
                    "is not a string"
                )
            _flatten_tensors(v, f"{prefix}.{k}" if prefix else k, out)
        return
    where = prefix or "the top level"
    raise ValueError(
        f"{where} holds a {type(obj).__name__}; safetensors stores only tensors in (nested) dicts"
    )


def _convert_dir(args: argparse.Namespace) -> int:
    """A torch.distributed.checkpoint directory (ckptfmt's or DCP's own format) -> one file."""
    from ..dcp import consolidate

    try:
        rep = consolidate(args.src, args.dst, compression=args.compression, level=args.level)
    except KNOWN_ERRORS as e:
        return fail(e, args.src)
    say(
        f"{args.src} ({rep.source_format}) -> {args.dst}: {rep.tensors} tensors, {rep.values} values, "
        f"{rep.file_bytes} bytes"
    )
    return EXIT_OK


def _read_foreign(path: str, kind: str) -> tuple[Any, dict[str, str]]:
    """The state and metadata of a torch.save or safetensors file; ForeignFileError when its own
    reader refuses it (torch.load's refusal of a pickle, a broken safetensors header)."""
    try:
        if kind in ("torch-zip", "torch-legacy"):
            return torch.load(path, map_location="cpu", weights_only=True), {}
        try:
            from safetensors import safe_open
        except ImportError:
            raise UsageError("reading safetensors needs the safetensors package") from None
        with safe_open(path, framework="pt") as sf:
            state = {k: sf.get_tensor(k) for k in sf.keys()}  # noqa: SIM118 - safe_open has no __iter__
            return state, dict(sf.metadata() or {})
    except (OSError, UsageError):
        raise
    except Exception as e:
        first = str(e).splitlines()[0][:300] if str(e) else ""
        raise ForeignFileError(f"cannot read as {DESCRIPTIONS[kind]}: {type(e).__name__}: {first}") from None


def _to_safetensors(args: argparse.Namespace) -> int:
    from ..files import load as api

    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UsageError(
            "converting to safetensors needs the safetensors package (pip install safetensors)"
        ) from None
    with api.open(args.src) as r:
        state = r.load()
        meta = r.metadata
    flat: dict[str, torch.Tensor] = {}
    try:
        _flatten_tensors(state, "", flat)
    except ValueError as e:
        raise UsageError(f"cannot convert to safetensors: {e}") from None
    # safetensors refuses tensors that share memory: give each its own copy
    flat = {k: v.detach().contiguous().clone() for k, v in flat.items()}
    save_file(flat, args.dst, metadata=meta or None)
    say(f"{args.src} -> {args.dst}: {len(flat)} tensors written as safetensors")
    return EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    from ..files import save as writer

    if os.path.isdir(args.src):
        return _convert_dir(args)
    try:
        kind = sniff(args.src)
        if kind == "ckptfmt":
            return _to_safetensors(args)
        if kind not in ("torch-zip", "torch-legacy", "safetensors"):
            raise NotCheckpointError(args.src, DESCRIPTIONS[kind])
        state, meta = _read_foreign(args.src, kind)
        writer.save(
            state,
            args.dst,
            compression=args.compression,
            level=args.level,
            metadata={**meta, "converted_from": os.path.basename(args.src)},
        )
    except KNOWN_ERRORS as e:
        return fail(e, args.src)
    say(
        f"{args.src} -> {args.dst}: converted {DESCRIPTIONS[kind]} to ckptfmt"
        + (f" with {args.compression}" if args.compression else "")
    )
    return EXIT_OK
