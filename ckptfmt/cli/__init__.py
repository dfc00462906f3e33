"""The ckptfmt command line: verify, ls, inspect, consolidate, convert, diff, info.

Results go to stdout, diagnostics to stderr (one line naming the path); --json prints
exactly one JSON document.  Exit status, the same for every command (EXIT_CODES): 0
success, 1 a file is damaged, incomplete, unsupported or over a limit, or the files
differ (diff), 2 usage error or a path that is missing, unreadable or not a ckptfmt
file.  ERROR_EXIT_CODES is the one table from errors to exit statuses.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import struct
import sys
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..errors import CheckpointError, IncompleteError
from ..format import layout as fmt
from ..format import tree
from ..format.sniff import DESCRIPTIONS, sniff

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_CODES = """exit status:
  0  success; diff: the files are identical
  1  a file is damaged, incomplete, unsupported (its version, a feature, codec or dtype)
     or over a limit: it failed verification; diff: the files differ
  2  usage error, or a path that is missing, unreadable, a directory where a file is
     needed, or not a ckptfmt file (another format, a FIFO, a device)
Every command gives the same status for the same kind of problem.  inspect and
verify --quick check structure, index and referenced files, not chunk data.
"""


#: characters a terminal acts on instead of showing: C0 and C1 controls and DEL (escape
#: sequences, carriage returns that rewrite a line), the bidirectional formatting characters
#: (an override makes text read backwards), line and paragraph separators, and lone
#: surrogates (which JSON carries and a UTF-8 stdout cannot encode)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def terminal_safe(text: str) -> str:
    """`text` with every character a terminal would act on written as a Python escape: names,
    keys and messages come from files, and anyone who can write a file could otherwise move
    the cursor, erase lines or forge rows in what a person reads."""
    return _UNSAFE.sub(_escape, text)


def _say(text: str, *, err: bool = False) -> None:
    """Print one human-readable line (stdout, or stderr for diagnostics), made terminal-safe.
    JSON output does not come here: json.dumps escapes these characters itself."""
    print(terminal_safe(text), file=sys.stderr if err else sys.stdout)


class NotCheckpointError(Exception):
    """The path is not a ckptfmt file: its first bytes are another format's, or it is not a
    regular file (a FIFO, a device)."""

    def __init__(self, path: str, description: str, kind: str | None = None) -> None:
        self.path = path
        self.kind = kind  # what sniff found, when it found a format
        super().__init__(description)


class UsageError(Exception):
    """Arguments that cannot work: an output that would replace its input, a conversion the
    target format cannot hold, a missing optional package."""


class ForeignFileError(Exception):
    """convert: a torch.save or safetensors file that its own reader refuses."""


#: The one table from what went wrong to the exit status; every command goes through it
#: (exit_code).  The first matching row counts: a CheckpointError is also a ValueError.
ERROR_EXIT_CODES: tuple[tuple[type[Exception], int], ...] = (
    # damaged, incomplete, unsupported version/feature/codec/dtype, over a limit (the four
    # error classes of spec section 9), or a state the format cannot store
    (CheckpointError, EXIT_FAILED),
    (ForeignFileError, EXIT_FAILED),
    (NotCheckpointError, EXIT_USAGE),
    (OSError, EXIT_USAGE),  # missing, unreadable, a directory where a file is needed
    (UsageError, EXIT_USAGE),
)
_KNOWN_ERRORS = tuple(cls for cls, _ in ERROR_EXIT_CODES)


def exit_code_for(kind: type[BaseException]) -> int | None:
    """The exit status for errors of class `kind` (ERROR_EXIT_CODES), None if it has no row."""
    for cls, code in ERROR_EXIT_CODES:
        if issubclass(kind, cls):
            return code
    return None


def exit_code(error: BaseException) -> int:
    """The exit status for `error`; an error without a row is a bug and is raised again."""
    code = exit_code_for(type(error))
    if code is None:
        raise error
    return code


def error_text(error: BaseException, path: str) -> str:
    """`error` as one line that names `path` (and any other file the error is about)."""
    if isinstance(error, OSError):
        text = error.strerror or str(error)
        if error.filename is not None and os.fspath(error.filename) != path:
            text = f"{os.fspath(error.filename)}: {text}"
    else:
        text = str(error)
    text = " ".join(text.split())
    return text if text.startswith(path + ":") else f"{path}: {text}"


#: the status of a file whose verification found problems (verify reports CheckpointErrors)
_FILE_FAILED = dict(ERROR_EXIT_CODES)[CheckpointError]


def _fail(error: BaseException, path: str) -> int:
    """Report `error` on stderr in one line naming `path`; its exit status."""
    _say(f"error: {error_text(error, path)}", err=True)
    return exit_code(error)


def _require_ckptfmt(path: str) -> None:
    """NotCheckpointError unless `path`'s first bytes are a ckptfmt file's (or an unfinished
    one's); OSError when it is missing, unreadable or a directory."""
    kind = sniff(path)
    if kind != "ckptfmt":
        raise NotCheckpointError(path, DESCRIPTIONS[kind], kind)


class _Progress:
    """A progress line on stderr, only when stderr is a terminal and the work is large."""

    def __init__(self, label: str, total_bytes: int) -> None:
        self.on = sys.stderr.isatty() and total_bytes >= 256 << 20
        self.label = terminal_safe(label)
        self.last = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.on or not total:
            return
        pct = 100 * done // total
        if pct != self.last:
            self.last = pct
            sys.stderr.write(f"\r{self.label}: {pct:3d}%")
            sys.stderr.flush()

    def close(self) -> None:
        if self.on and self.last >= 0:
            sys.stderr.write("\r" + " " * (len(self.label) + 6) + "\r")


def _problem_dict(p: Any) -> dict[str, Any]:
    return {"kind": p.kind, "message": p.message, "key": p.key, "chunk": p.chunk, "offset": p.offset}


# -- verify -------------------------------------------------------------------


def _verify_file(path: str, quick: bool) -> tuple[dict[str, Any], int]:
    """The entry of one file and its exit status."""
    from ..files.verify import verify

    entry: dict[str, Any] = {"path": path}
    try:
        _require_ckptfmt(path)
        progress = _Progress(f"verifying {path}", os.path.getsize(path))
        try:
            report = verify(path, quick=quick, progress=progress)
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
        problems=[_problem_dict(p) for p in report.problems],
    )
    # each problem verify reports is a CheckpointError it caught (verify.problem_of)
    return entry, EXIT_OK if report.ok else _FILE_FAILED


def cmd_verify(args: argparse.Namespace) -> int:
    results = []
    status = EXIT_OK  # the worst status of all entries: 2 over 1 over 0
    for path in args.paths:
        if os.path.isdir(path):
            try:
                entries = _verify_dir(path, args.step)
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
                    status = max(status, _FILE_FAILED)
            continue
        entry, code = _verify_file(path, args.quick)
        results.append(entry)
        status = max(status, code)
    if args.json:
        print(json.dumps({"files": results, "ok": status == EXIT_OK, "quick": args.quick}, indent=2))
        return status
    for res in results:
        if res["status"] == "ok":
            _say(f"{res['path']}: OK")
        elif res["status"] == "failed":
            first = res["problems"][0]
            where = ", ".join(f"{k} {first[k]}" for k in ("key", "chunk", "offset") if first[k] is not None)
            more = f" (+{len(res['problems']) - 1} more)" if len(res["problems"]) > 1 else ""
            _say(
                f"{res['path']}: FAILED {first['kind']}: {first['message']}"
                + (f" [{where}]" if where else "")
                + more
            )
            for p in res["problems"][1:]:
                _say(
                    f"  {p['kind']}: {p['message']} [key {p['key']}, chunk {p['chunk']}, offset {p['offset']}]",
                    err=True,
                )
        elif res["status"] == "incomplete":
            _say(f"{res['path']}: INCOMPLETE (not a checkpoint) {res['error']}")
        elif res["status"] == "damaged":
            _say(f"{res['path']}: DAMAGED {res['error']}")
        elif res["status"] == "retained":
            _say(f"{res['path']}: RETAINED {res['error']}")
        elif res["status"] == "not-ckptfmt":
            _say(f"{res['path']}: NOT CKPTFMT {res['error']}")
        else:
            _say(f"{res['path']}: UNREADABLE {res['error']}")
    return status


def _has_step_dirs(path: str) -> bool:
    from ..runs.steps import parse_step_dirname

    try:
        return any(parse_step_dirname(name) is not None for name in os.listdir(path))
    except OSError:
        return False


def _verify_dir(path: str, step: int | None) -> list[dict[str, Any]]:
    """Entries for a run directory (every step, or `step`) and for a checkpoint directory (one
    with a commit record); a directory that is both is verified as both, so an entry inside a
    run cannot hide its steps.  IncompleteError for a directory that holds neither a commit
    record nor step directories (spec section 13.2: a directory without a commit record is
    incomplete)."""
    from ..files import multifile
    from ..runs.manager import CheckpointManager
    from ..runs.stepcheck import verify_in_run, verify_step

    targets: list[tuple[int | None, str, str | None]] = []
    damaged: set[str] = set()
    own = os.path.lexists(os.path.join(path, multifile.COMMIT_NAME))
    statuses = CheckpointManager(path).statuses() if not own or _has_step_dirs(path) else []
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
            report = verify_step(full) if n is None else verify_in_run(path, os.path.basename(full), n)
            problems = report.problems
            entry.update(
                status="failed" if problems else "ok",
                chunks=report.chunks,
                problems=[_problem_dict(p) for p in problems],
            )
        out.append(entry)
    return out


# -- ls -------------------------------------------------------------------------


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


def _ls_dcp(args: argparse.Namespace) -> int:
    from ..dcp import describe

    info = describe(args.dir)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return EXIT_OK
    state = "complete" if info["complete"] else f"incomplete: {info['problem']}"
    _say(f"{info['path']}: DCP checkpoint, {state}")
    for f in info["files"]:
        _say(f"  {f['name']}  {f['status']}")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    import datetime

    from ..runs.manager import CheckpointManager

    if not os.path.isdir(args.dir):
        return _fail(NotADirectoryError(errno.ENOTDIR, "not a directory"), args.dir)
    if _is_dcp_dir(args.dir):
        try:
            return _ls_dcp(args)
        except _KNOWN_ERRORS as e:
            return _fail(e, args.dir)
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for s in CheckpointManager(args.dir).statuses():
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
            row.update(status=kind, reason=s.problem)
        rows.append(row)
    if args.json:
        print(json.dumps({"directory": args.dir, "steps": rows}, indent=2))
        return EXIT_OK
    for r in rows:
        if r["status"] == "complete":
            metrics = " ".join(f"{k}={float(v):.6g}" for k, v in r["metrics"].items())
            _say(f"{r['step']:>10}  complete    {_size(r['size']):>10}  {_age(r['age_s']):>6} ago  {metrics}")
        else:
            _say(f"{r['step']:>10}  {r['status']:<10}  {r['reason'] or ''}")
    return EXIT_OK


# -- inspect ------------------------------------------------------------------


def _inspect_tree(f: Any) -> list[dict[str, Any]]:
    from ..format import dtypes, tree

    rows = []
    chunks = f.chunks
    for path, i in tree.iter_paths(f.tree, f.tree.root, "state"):
        node = f.tree.nodes[i]
        kind = node[0]
        row: dict[str, Any] = {"key": path, "type": kind, "depth": f.tree.depth_of(i)}
        if kind in ("tensor", "ndarray"):
            m = node[1]
            rec = f.storages[m["storage"]]
            own = range(rec.first_chunk, rec.first_chunk + rec.n_chunks)
            stored = sum(chunks[k].stored_len for k in own)
            codecs = sorted({fmt.CODEC_NAMES[chunks[k].codec] for k in own}) or ["raw"]
            itemsize = (
                dtypes.torch_itemsize(m["dtype"]) if kind == "tensor" else np.dtype(m["dtype"]).itemsize
            )
            numel = int(np.prod(m["shape"])) if m["shape"] else 1
            row.update(
                dtype=m["dtype"],
                shape=m["shape"],
                bytes=numel * itemsize,
                storage=m["storage"],
                storage_bytes=rec.nbytes,
                stored_bytes=stored,
                codec="+".join(codecs),
                ratio=round(rec.nbytes / stored, 3) if stored else None,
                device=rec.device,
            )
            if f.has_digests:  # an incremental file: how much of it lies in referenced files
                row["external_chunks"] = sum(1 for k in own if chunks[k].source >= 0)
                row["chunks"] = len(own)
        elif kind in ("list", "tuple"):
            row["len"] = len(node[1])
        elif kind in ("dict", "odict"):
            row["len"] = len(node[1])
        elif kind in ("int", "float", "bool", "str", "none", "dtype", "device", "complex"):
            value = tree.decode(f.tree, i, lambda s: None, f.path)  # type: ignore[arg-type, return-value]
            row["value"] = tree.short_repr(value, 60)
        rows.append(row)
    return rows


def _inspect_externals(f: Any) -> dict[str, Any]:
    """The referenced files of an incremental checkpoint and what lies in each (spec section 12)."""
    per = [{"chunks": 0, "raw_bytes": 0, "stored_bytes": 0} for _ in f.externals]
    for ch in f.chunks:
        if ch.source >= 0:
            per[ch.source]["chunks"] += 1
            per[ch.source]["raw_bytes"] += ch.raw_len
            per[ch.source]["stored_bytes"] += ch.stored_len
    externals = [
        {"path": ext.rel, "resolved": ext.name, "file_id": ext.file_id.hex(), "file_length": ext.length, **n}
        for ext, n in zip(f.externals, per)
    ]
    return {
        "content_digests": f.has_digests,
        "externals": externals,
        "external_chunks": sum(n["chunks"] for n in per),
        "external_bytes": sum(n["raw_bytes"] for n in per),
    }


def _print_externals(info: dict[str, Any]) -> None:
    if not info["externals"]:
        _say("externals: none (self-contained, with content digests for incremental saves)")
        return
    _say(
        f"externals: {info['external_chunks']} of {info['chunks']} chunks ({info['external_bytes']} bytes) "
        f"lie in {len(info['externals'])} referenced file(s)"
    )
    for e, x in enumerate(info["externals"]):
        _say(
            f"  [{e}] {x['path']} (file id {x['file_id']}, {x['file_length']} bytes): "
            f"{x['chunks']} chunks, {x['raw_bytes']} bytes"
        )


def cmd_inspect(args: argparse.Namespace) -> int:
    """The tree and the index; like verify --quick, the referenced files of an incremental
    checkpoint are checked too (present, the recorded ones), but no chunk data is read."""
    from ..files.reader import CheckpointFile
    from ..files.verify import problem_of

    try:
        _require_ckptfmt(args.path)
        with CheckpointFile(args.path) as f:
            rows = _inspect_tree(f)
            problems = f.external_problems()
            info = {
                "path": args.path,
                "file_bytes": f.prologue.file_length,
                "format": f"{f.prologue.major}.{f.prologue.minor}",
                "chunk_size": f.chunk_size,
                "chunks": len(f.chunks),
                "storages": len(f.storages),
                "producer": f.producer,
                "metadata": f.metadata,
                "source_devices": f.source_devices,
                **_inspect_externals(f),
                "problems": [_problem_dict(problem_of(p)) for p in problems],
                "tree": rows,
            }
    except _KNOWN_ERRORS as e:
        return _fail(e, args.path)
    status = exit_code(problems[0]) if problems else EXIT_OK
    if args.json:
        print(json.dumps(info, indent=2))
        return status
    _say(
        f"{args.path}: ckptfmt {info['format']}, {info['file_bytes']} bytes, {info['storages']} storages "
        f"in {info['chunks']} chunks of up to {info['chunk_size']} bytes"
    )
    _say("producer: " + ", ".join(f"{k} {v}" for k, v in info["producer"].items()))
    _say("metadata: " + (json.dumps(info["metadata"]) if info["metadata"] else "(none)"))
    if info["content_digests"]:
        _print_externals(info)
    for r in rows:
        depth = r["depth"]
        name = r["key"] if depth == 0 else "  " * (depth - 1) + r["key"][r["key"].rfind("[") :]
        if r["type"] in ("tensor", "ndarray"):
            ratio = f" x{r['ratio']:.2f}" if r["codec"] != "raw" and r["ratio"] else ""
            ext = (
                f", {r['external_chunks']}/{r['chunks']} chunks external" if r.get("external_chunks") else ""
            )
            _say(
                f"{name}: {r['type']} {r['dtype']} {list(r['shape'])} {r['bytes']} B "
                f"{r['codec']}{ratio} (storage {r['storage']}, {r['device']}{ext})"
            )
        elif "len" in r:
            _say(f"{name}: {r['type']} ({r['len']})")
        elif "value" in r:
            _say(f"{name}: {r['value']}")
        else:
            _say(f"{name}: {r['type']}")
    if problems:  # after the tree, which shows what the referenced files should hold
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        _say(f"error: {error_text(problems[0], args.path)}{more}", err=True)
    return status


# -- consolidate --------------------------------------------------------------


def cmd_consolidate(args: argparse.Namespace) -> int:
    from ..runs.incremental import consolidate

    entry: dict[str, Any] = {"src": args.src, "dst": args.dst, "ok": False}
    status = EXIT_OK
    try:
        _require_ckptfmt(args.src)
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
    except _KNOWN_ERRORS as e:
        entry["error"] = error_text(e, args.src)
        status = exit_code(e)
    if args.json:
        print(json.dumps(entry, indent=2))
    elif status != EXIT_OK:
        _say(f"error: {entry['error']}", err=True)
    else:
        _say(
            f"{args.src} -> {args.dst}: self-contained copy, {entry['chunks']} chunks "
            f"({entry['external_chunks']} read from {entry['referenced_files']} referenced file(s)), "
            f"{entry['file_bytes']} bytes"
        )
    return status


# -- convert ------------------------------------------------------------------


def _flatten_tensors(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        if prefix in out:
            raise ValueError(f"two entries flatten to the key {tree.short_repr(prefix, 80)}")
        out[prefix] = obj
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ValueError(
                    f"key {tree.short_repr(k, 80)} under {tree.short_repr(prefix or 'the top level', 80)} "
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
    except _KNOWN_ERRORS as e:
        return _fail(e, args.src)
    _say(
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
    _say(f"{args.src} -> {args.dst}: {len(flat)} tensors written as safetensors")
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
    except _KNOWN_ERRORS as e:
        return _fail(e, args.src)
    _say(
        f"{args.src} -> {args.dst}: converted {DESCRIPTIONS[kind]} to ckptfmt"
        + (f" with {args.compression}" if args.compression else "")
    )
    return EXIT_OK


# -- diff ---------------------------------------------------------------------


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
                out.append({"key": tree.render_key(path, k), "what": "only in A"})
            else:
                _diff(a[k], b[k], tree.render_key(path, k), out)
        for k in b:
            if k not in a:
                out.append({"key": tree.render_key(path, k), "what": "only in B"})
        return
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append({"key": path, "what": "length", "a": len(a), "b": len(b)})
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
        return
    same = struct.pack("<d", a) == struct.pack("<d", b) if isinstance(a, float) else a == b
    if not same:
        out.append({"key": path, "what": "value", "a": tree.short_repr(a, 80), "b": tree.short_repr(b, 80)})


def cmd_diff(args: argparse.Namespace) -> int:
    from ..files import load as api

    states = []
    for p in (args.a, args.b):
        try:
            _require_ckptfmt(p)
            states.append(api.load(p))
        except _KNOWN_ERRORS as e:  # a damaged file is 1, like everywhere (not "differ")
            return _fail(e, p)
    diffs: list[dict[str, Any]] = []
    _diff(states[0], states[1], "state", diffs)
    if args.json:
        print(json.dumps({"a": args.a, "b": args.b, "identical": not diffs, "differences": diffs}, indent=2))
    elif not diffs:
        _say("identical")
    else:
        for d in diffs:
            detail = ", ".join(f"{k} {v}" for k, v in d.items() if k not in ("key", "what"))
            _say(f"{d['key']}: {d['what']}" + (f" ({detail})" if detail else ""))
    return EXIT_OK if not diffs else EXIT_FAILED


# -- info ---------------------------------------------------------------------


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
            _say(f"{k}: {v}")
    return EXIT_OK


# -- entry --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    def sub(name: str, help_: str) -> argparse.ArgumentParser:
        return subs.add_parser(
            name,
            help=help_,
            description=help_,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    ap = argparse.ArgumentParser(
        prog="ckptfmt",
        description="Check, inspect and convert ckptfmt checkpoints.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"ckptfmt {__version__}")
    subs = ap.add_subparsers(dest="command", metavar="COMMAND")
    v = sub(
        "verify",
        "Check files: structure, index and every chunk's checksum and size.  A run directory "
        "(or one step directory) is checked step by step: its commit record and every file it names.",
    )
    v.add_argument("paths", nargs="+", metavar="PATH")
    v.add_argument("--quick", action="store_true", help="check structure and index only, not the chunks")
    v.add_argument("--json", action="store_true", help="print one JSON document")
    v.add_argument("--step", type=int, default=None, help="with a run directory: only this step")
    v.set_defaults(fn=cmd_verify)
    ls = sub("ls", "List a run directory's checkpoints: step, complete or not, size, age, metrics.")
    ls.add_argument("dir", metavar="DIR")
    ls.add_argument("--json", action="store_true", help="print one JSON document")
    ls.set_defaults(fn=cmd_ls)
    i = sub("inspect", "Show the object tree, dtypes, shapes, sizes, codecs and metadata.")
    i.add_argument("path", metavar="PATH")
    i.add_argument("--json", action="store_true", help="print one JSON document")
    i.set_defaults(fn=cmd_inspect)
    c = sub(
        "convert",
        "Convert torch.save or safetensors files to ckptfmt, or ckptfmt to safetensors "
        "(the direction follows the source's format).",
    )
    c.add_argument("src", metavar="SRC", help="a file, or a torch.distributed.checkpoint directory")
    c.add_argument("dst", metavar="DST")
    c.add_argument("--compression", choices=["zstd"], default=None, help="compress chunks (to ckptfmt)")
    c.add_argument("--level", type=int, default=None, help="zstd level (default 1)")
    c.set_defaults(fn=cmd_convert)
    k = sub(
        "consolidate",
        "Write a self-contained copy of a checkpoint: the chunks an incremental checkpoint refers to "
        "are read (and verified) from the files they lie in and stored in the copy.",
    )
    k.add_argument("src", metavar="IN")
    k.add_argument("dst", metavar="OUT")
    k.add_argument("--compression", choices=["zstd"], default=None, help="compress the copy's chunks")
    k.add_argument("--level", type=int, default=None, help="zstd level (default 1)")
    k.add_argument("--json", action="store_true", help="print one JSON document")
    k.set_defaults(fn=cmd_consolidate)
    d = sub("diff", "Compare two checkpoints: keys, types, shapes, dtypes and values.")
    d.add_argument("a", metavar="A")
    d.add_argument("b", metavar="B")
    d.add_argument("--json", action="store_true", help="print one JSON document")
    d.set_defaults(fn=cmd_diff)
    n = sub("info", "Show package, format and library versions and the active backend.")
    n.add_argument("--json", action="store_true", help="print one JSON document")
    n.set_defaults(fn=cmd_info)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors and 0 for --help
        return int(e.code or 0)
    if not getattr(args, "fn", None):
        ap.print_help(sys.stderr)
        return exit_code(UsageError("no command given"))
    if getattr(args, "level", None) is not None and not args.compression:
        error = UsageError("--level needs --compression zstd")
        _say(f"error: {error}", err=True)
        return exit_code(error)
    try:
        return int(args.fn(args))
    except BrokenPipeError:
        return EXIT_OK
