"""ckptfmt verify: files, checkpoint directories and run directories, checked chunk by chunk
(or structure only, with --quick)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..errors import CheckpointError, IncompleteError
from ..fileio import is_url
from . import remote
from .exitcodes import (
    EXIT_OK,
    EXIT_USAGE,
    FILE_FAILED,
    NotCheckpointError,
    UsageError,
    exit_code,
    require_ckptfmt,
)
from .terminal import Progress, say


def problem_dict(p: Any) -> dict[str, Any]:
    """A problem verify reports (files.verify.Problem), as a JSON object."""
    return {"kind": p.kind, "message": p.message, "key": p.key, "chunk": p.chunk, "offset": p.offset}


def _verify_file(
    path: str, quick: bool, trusted: list[Any] | None = None, decrypt: str | None = None
) -> tuple[dict[str, Any], int]:
    """The entry of one file and its exit status."""
    from ..files.verify import verify

    entry: dict[str, Any] = {"path": path}
    try:
        require_ckptfmt(path)
        progress = Progress(f"verifying {path}", 0 if is_url(path) else os.path.getsize(path))
        try:
            report = verify(path, quick=quick, progress=progress, trusted_keys=trusted, decrypt_with=decrypt)
        finally:
            progress.close()
    except NotCheckpointError as e:
        entry.update(status="not-ckptfmt", format=e.kind, error=str(e))
        return entry, exit_code(e)
    except OSError as e:
        entry.update(status="unreadable", error=e.strerror or str(e))
        return entry, exit_code(e)
    entry.update(
        status="ok" if report.ok else "failed",
        chunks=report.chunks,
        problems=[problem_dict(p) for p in report.problems],
    )
    if report.not_checked:
        entry["not_checked"] = report.not_checked
    # each problem verify reports is a CheckpointError it caught (verify.problem_of)
    return entry, EXIT_OK if report.ok else FILE_FAILED


def cmd_verify(args: argparse.Namespace) -> int:
    results = []
    status = EXIT_OK  # the worst status of all entries: 2 over 1 over 0
    trusted = getattr(args, "trusted_key", None) or None
    if trusted:
        from ..files.recordsign import public_keys

        try:
            trusted = public_keys(trusted)  # every key readable before any file is checked
        except (OSError, ValueError, TypeError) as e:
            error = UsageError(f"--trusted-key: {e}")
            say(f"error: {error}", err=True)
            return exit_code(error)
    decrypt = getattr(args, "decrypt_key", None)
    if decrypt:
        from ..files.encryption import load_key

        try:
            load_key(decrypt, "--decrypt-key")  # readable before any file is checked
        except (OSError, ValueError, TypeError) as e:
            error = UsageError(str(e) if str(e).startswith("--decrypt-key") else f"--decrypt-key: {e}")
            say(f"error: {error}", err=True)
            return exit_code(error)
    for path in args.paths:
        if is_url(path) and not remote.is_object(path) and args.step is None and remote.has_record(path):
            try:
                entry = remote.checkpoint_entry(
                    path, problem_dict, decrypt, trusted
                )  # one checkpoint's prefix
            except OSError as err:  # the store failed: nothing is known of the checkpoint
                results.append({"path": path, "status": "unreadable", "error": str(err)})
                status = max(status, exit_code(err))
                continue
            results.append(entry)
            status = max(status, FILE_FAILED if entry["problems"] else EXIT_OK)
            continue
        if is_url(path) and not remote.is_object(path):  # a run's prefix
            try:
                entries = remote.run_entries(path, args.step, problem_dict, trusted, decrypt or None)
            except (OSError, CheckpointError) as err:  # the store refused, or its listing
                results.append({"path": path, "status": "unreadable", "error": str(err)})
                status = max(status, exit_code(err))
                continue
            results += entries
            if any(
                e["status"] in ("failed", "damaged") or args.step is not None and e["status"] != "ok"
                for e in entries
            ):
                status = max(status, FILE_FAILED)
            if any(
                e["status"] == "unreadable" for e in entries
            ):  # the store failed: as when it fails a listing
                status = max(status, EXIT_USAGE)
            continue
        if os.path.isdir(path):
            try:
                entries = _verify_dir(path, args.step, trusted, decrypt)
            except CheckpointError as err:  # no checkpoint in it at all
                results.append({"path": path, "status": "incomplete", "error": err.reason})
                status = max(status, exit_code(err))
                continue
            results += entries
            for ent in entries:
                # a damaged step fails a run's verify; an incomplete one (a save in progress, or
                # one that died before its commit) is not a checkpoint and fails only when asked for
                if ent["status"] in ("failed", "damaged") or (
                    args.step is not None and ent["status"] != "ok"
                ):
                    status = max(status, FILE_FAILED)
            continue
        entry, code = _verify_file(path, args.quick, trusted, decrypt)
        results.append(entry)
        status = max(status, code)
    if args.json:
        print(json.dumps({"files": results, "ok": status == EXIT_OK, "quick": args.quick}, indent=2))
        return status
    for res in results:
        if res["status"] == "ok":
            say(f"{res['path']}: OK" + (f" ({res['not_checked']})" if res.get("not_checked") else ""))
        elif res["status"] == "failed":
            first = res["problems"][0]
            where = ", ".join(f"{k} {first[k]}" for k in ("key", "chunk", "offset") if first[k] is not None)
            more = f" (+{len(res['problems']) - 1} more)" if len(res["problems"]) > 1 else ""
            say(
                f"{res['path']}: FAILED {first['kind']}: {first['message']}"
                + (f" [{where}]" if where else "")
                + more
            )
            for p in res["problems"][1:]:
                say(
                    f"  {p['kind']}: {p['message']} [key {p['key']}, chunk {p['chunk']}, offset {p['offset']}]",
                    err=True,
                )
        elif res["status"] == "incomplete":
            say(f"{res['path']}: INCOMPLETE (not a checkpoint) {res['error']}")
        elif res["status"] == "damaged":
            say(f"{res['path']}: DAMAGED {res['error']}")
        elif res["status"] == "retained":
            say(f"{res['path']}: RETAINED {res['error']}")
        elif res["status"] == "not-ckptfmt":
            say(f"{res['path']}: NOT CKPTFMT {res['error']}")
        else:
            say(f"{res['path']}: UNREADABLE {res['error']}")
    return status


def _has_step_dirs(path: str) -> bool:
    from ..runs.steps import parse_step_dirname

    try:
        return any(parse_step_dirname(name) is not None for name in os.listdir(path))
    except OSError:
        return False


def _verify_dir(
    path: str, step: int | None, trusted: list[Any] | None = None, decrypt: str | None = None
) -> list[dict[str, Any]]:
    """Entries for a run directory (every step, or `step`) and for a checkpoint directory (one
    with a commit record); a directory that is both is verified as both, so an entry inside a
    run cannot hide its steps.  IncompleteError for a directory that holds neither a commit
    record nor step directories (spec section 13.2: a directory without a commit record is
    incomplete).  `trusted`: public keys, one of which must have signed each checkpoint's
    commit record (spec 16.7).  `decrypt`: the key file of encrypted saves (state and rank files)."""
    from ..files import multifile
    from ..runs.scan import StepRecords
    from ..runs.stepcheck import verify_in_run, verify_step

    targets: list[tuple[int | None, str, str | None]] = []
    damaged: set[str] = set()
    own = os.path.lexists(os.path.join(path, multifile.COMMIT_NAME))
    statuses = (
        # the run's steps as its manager lists them (CheckpointManager.statuses), without the
        # manager, which imports torch
        StepRecords(os.path.abspath(path), decrypt).scan().statuses if not own or _has_step_dirs(path) else []
    )
    if not own and not statuses:
        raise IncompleteError("no commit record (COMMIT) and no step directories", path=path)
    if own and (step is None or not statuses):
        targets.append((None, path, None))
    if statuses:
        if step is not None:
            statuses = [s for s in statuses if s.step == step]
            if not statuses:
                return [{"path": path, "status": "incomplete", "error": f"no step {step} in this directory"}]
        targets += [
            (s.step, s.path, None if s.info else ("retained" if s.retained else s.problem)) for s in statuses
        ]
        damaged = {s.path for s in statuses if s.info is None and s.damaged and not s.retained}
    out = []
    for n, full, problem in targets:
        entry: dict[str, Any] = {"path": full, "step": n}
        if problem == "retained":
            entry.update(status="retained", error="kept only for chunks later steps refer to")
        elif problem is not None and full in damaged:  # a commit record that is bad, or names bad files
            entry.update(status="damaged", error=problem)
        elif problem is not None:
            entry.update(status="incomplete", error=problem)
        else:
            # a run's step is opened beneath the run directory, never through a link
            report = (
                verify_step(full, None, trusted, decrypt)
                if n is None
                else verify_in_run(path, os.path.basename(full), n, trusted, decrypt)
            )
            problems = report.problems
            entry.update(
                status="failed" if problems else "ok",
                chunks=report.chunks,
                problems=[problem_dict(p) for p in problems],
            )
        out.append(entry)
    return out
