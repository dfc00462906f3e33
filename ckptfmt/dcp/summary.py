"""A DCP checkpoint directory at a glance (``ckptfmt ls``, ``inspect``): complete or why not,
its rank files, its contents; without torch for ckptfmt's own layout (the record's checks are
metadata.check_value's, the rank files' check.check_items')."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ..errors import CheckpointError, IncompleteError
from ..fileio import is_url
from ..files import multifile, places
from ..files.names import RANK_FILE_RE, rank_of
from ..files.places import Place
from .check import check_items, checked_record
from .sources import DCP_METADATA_NAME


def describe(
    directory: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A DCP checkpoint directory (or object prefix, with `storage_options`) at a glance:
    complete or why not, its rank files, its contents.

    Reads the commit record (its dcp member checked as a load checks it) and each rank file's
    prologue, footer and index (each item checked against the record, check.check_items), no
    chunk data: complete here means every check a load makes before reading data passes.
    """
    path = places.normalized(directory)
    out: dict[str, Any] = {"path": path, "complete": False, "problem": None, "files": []}
    if (
        not is_url(path)
        and not os.path.lexists(os.path.join(path, multifile.COMMIT_NAME))
        and os.path.lexists(os.path.join(path, DCP_METADATA_NAME))
    ):
        from .convert import describe_dcp_format  # DCP's own format: read with torch

        return describe_dcp_format(path, out)
    out["format"] = "ckptfmt-dcp"
    with contextlib.ExitStack() as stack:
        present: list[str] = []
        try:
            # the record and rank files read beneath the directory (or prefix)
            d = stack.enter_context(places.place_at(path, storage_options))
            present = [n for n in d.names() if RANK_FILE_RE.fullmatch(n)]
            record = d.read_record()
        except CheckpointError as e:
            out["problem"] = str(e)
            out["files"] = [{"name": n, "rank": rank_of(n), "status": "unnamed"} for n in present]
            return out
        return _describe_record(d, record, present, out)


def _describe_record(
    d: Place, record: multifile.CommitRecord, present: list[str], out: dict[str, Any]
) -> dict[str, Any]:
    path = d.path
    out.update(step=record.step, layout=record.layout, created=record.created)
    problems = []
    checked = None
    try:
        checked = checked_record(record, path)
    except CheckpointError as e:
        problems.append(str(e))
    else:
        out.update(world_size=checked.world_size, tensors=len(checked.tensors), values=len(checked.values))
    for part in record.files:
        entry: dict[str, Any] = {"name": part.name, "rank": rank_of(part.name), "length": part.length}
        try:
            d.check_part(part)
            entry["status"] = "ok"
        except CheckpointError as e:
            entry["status"] = "missing" if isinstance(e, IncompleteError) else "damaged"
            entry["problem"] = e.reason
            problems.append(e.reason)
        out["files"].append(entry)
    if checked is not None and not problems:
        for bad in check_items(d, record, checked.items())[0]:
            for entry in out["files"]:
                if entry["name"] == os.path.basename(bad.path or ""):
                    entry.update(status="damaged", problem=bad.reason)
            problems.append(str(bad))
    named = {p.name for p in record.files}
    out["files"] += [{"name": n, "rank": rank_of(n), "status": "unnamed"} for n in present if n not in named]
    out["complete"] = not problems
    out["problem"] = "; ".join(problems) or None
    out["bytes"] = sum(p.length for p in record.files)
    return out
