"""ckptfmt ls: the steps of a run directory, or the files of a DCP checkpoint directory."""

from __future__ import annotations

import argparse
import errno
import json
import os
from typing import Any

from ..errors import CheckpointError
from ..fileio import is_url
from . import remote
from .exitcodes import EXIT_OK, EXIT_USAGE, KNOWN_ERRORS
from .terminal import fail, say


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _is_dcp_dir(path: str) -> bool:
    """A torch.distributed.checkpoint directory: DCP's own `.metadata`, or a COMMIT of layout dcp."""
    from ..files import multifile

    if os.path.exists(os.path.join(path, ".metadata")):
        return True
    if not os.path.exists(os.path.join(path, multifile.COMMIT_NAME)):
        return False
    try:
        return multifile.read_commit(path).layout == "dcp"
    except (CheckpointError, OSError):
        return False


def show_dcp(path: str, as_json: bool) -> int:
    """A DCP checkpoint (a directory or object prefix) at a glance: ls's and inspect's output."""
    from ..dcp import describe

    info = describe(path)
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return EXIT_OK
    state = "complete" if info["complete"] else f"incomplete: {info['problem']}"
    say(f"{info['path']}: DCP checkpoint, {state}")
    for f in info["files"]:
        say(f"  {f['name']}  {f['status']}")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    from ..format.timestamps import utc_now
    from ..runs.scan import StepRecords

    if is_url(args.dir):
        try:
            if remote.has_record(args.dir):  # one checkpoint's prefix
                return show_dcp(args.dir, args.json)
            statuses = remote.run_rows(args.dir)
        except KNOWN_ERRORS as e:
            return fail(e, args.dir)
    elif not os.path.isdir(args.dir):
        return fail(NotADirectoryError(errno.ENOTDIR, "not a directory"), args.dir)
    elif _is_dcp_dir(args.dir):
        try:
            return show_dcp(args.dir, args.json)
        except KNOWN_ERRORS as e:
            return fail(e, args.dir)
    else:
        statuses = StepRecords(os.path.abspath(args.dir)).scan().statuses  # CheckpointManager.statuses()
    now = utc_now()
    rows = []
    for s in statuses:
        row: dict[str, Any] = {"step": s.step, "path": s.path}
        if s.info is not None:
            row.update(
                status="complete",
                size=s.info.size,
                metrics=s.info.metrics,
                created=s.info.created.isoformat(),
                age_s=round((now - s.info.created).total_seconds(), 3),
                references=[os.path.relpath(r, s.path) for r in s.info.references],
            )
        else:
            kind = "retained" if s.retained else ("damaged" if s.damaged else "incomplete")
            row.update(status="unreadable" if s.unknown else kind, reason=s.problem)
        rows.append(row)
    # a step whose record the store failed to serve is listed, and the store's failure told
    code = EXIT_USAGE if any(r["status"] == "unreadable" for r in rows) else EXIT_OK
    if args.json:
        print(json.dumps({"directory": args.dir, "steps": rows}, indent=2))
        return code
    for r in rows:
        if r["status"] == "complete":
            metrics = " ".join(f"{k}={float(v):.6g}" for k, v in r["metrics"].items())
            say(f"{r['step']:>10}  complete    {_size(r['size']):>10}  {_age(r['age_s']):>6} ago  {metrics}")
        else:
            say(f"{r['step']:>10}  {r['status']:<10}  {r['reason'] or ''}")
    return code
