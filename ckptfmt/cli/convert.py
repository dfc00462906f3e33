"""ckptfmt consolidate and convert: writing a checkpoint again, self-contained or in another
format (torch.save, safetensors, a torch.distributed.checkpoint directory)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedError
from ..fileio import is_url
from ..format.render import short_repr
from ..format.sniff import DESCRIPTIONS, sniff
from . import remote
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


def _consolidation_source(src: str) -> tuple[str, str]:
    """What `src` is to consolidate: ("dcp", src) for a DCP checkpoint (a directory or object
    prefix with a commit record of layout "dcp"), ("file", path) for a checkpoint file, or a
    run's step (a directory or prefix with a record of layout "state": its state file)."""
    from ..files import multifile
    from ..files.names import STATE_NAME, STATE_NAME_RE
    from ..files.places import place_at

    if is_url(src):
        multi = not remote.is_object(src) and remote.has_record(src)
    else:
        multi = os.path.isdir(src) and os.path.lexists(os.path.join(src, multifile.COMMIT_NAME))
    if not multi:  # a file, or what the file commands refuse as one
        return "file", src
    with place_at(src) as place:
        record = place.read_record()
        if record.layout == "dcp":
            return "dcp", src
        names = [p.name for p in record.files]
        # a run's step: on a store its state object may have its save's own name (spec 13.7)
        if record.layout == "state" and (
            names == [STATE_NAME] or (is_url(src) and len(names) == 1 and STATE_NAME_RE.fullmatch(names[0]))
        ):
            place.check_part(record.files[0])
            return "file", place.path_of(names[0])
    raise UnsupportedError(f"a {record.layout!r} checkpoint: not one consolidate reads", path=src)


def _consolidate_dcp(src: str, dst: str, args: argparse.Namespace) -> dict[str, Any]:
    from ..dcp import consolidate

    return dataclasses.asdict(
        consolidate(src, dst, compression=args.compression, level=args.level, decrypt_with=args.decrypt_key)
    )


def _consolidate_file(src: str, dst: str, args: argparse.Namespace) -> dict[str, Any]:
    from ..files.consolidate import consolidate

    require_ckptfmt(src)
    return dataclasses.asdict(
        consolidate(src, dst, compression=args.compression, level=args.level, decrypt_with=args.decrypt_key)
    )


def cmd_consolidate(args: argparse.Namespace) -> int:
    entry: dict[str, Any] = {"src": args.src, "dst": args.dst, "ok": False}
    status = EXIT_OK
    try:
        kind, source = _consolidation_source(args.src)
        try:
            found = (_consolidate_dcp if kind == "dcp" else _consolidate_file)(source, args.dst, args)
        except CheckpointError:  # the file or one it refers to failed while read
            raise
        except ValueError as e:  # the output would replace the input
            raise UsageError(str(e)) from None
        entry.update(ok=True, **found)
    except KNOWN_ERRORS as e:
        entry["error"] = error_text(e, args.src)
        status = exit_code(e)
    if args.json:
        print(json.dumps(entry, indent=2))
    elif status != EXIT_OK:
        say(f"error: {entry['error']}", err=True)
    elif "tensors" in entry:
        say(
            f"{args.src} -> {args.dst}: one file with full tensors ({entry['source_format']}), "
            f"{entry['tensors']} tensors, {entry['values']} values, {entry['file_bytes']} bytes"
        )
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
        rep = consolidate(
            args.src,
            args.dst,
            compression=args.compression,
            level=args.level,
            decrypt_with=getattr(args, "decrypt_key", None),
        )
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
    if args.decrypt_key is not None:  # a file converted would be written in clear
        return fail(
            UsageError("--decrypt-key: only a torch.distributed.checkpoint directory is converted encrypted"),
            args.src,
        )
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
