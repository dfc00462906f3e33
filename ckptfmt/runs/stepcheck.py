"""The step rule (spec 13.4) and the verification of steps: what makes a step directory of a
run a checkpoint, made by latest(), ls, load, load_into and verify alike, and the reading of
every chunk that verify adds to it."""

from __future__ import annotations

import os
from typing import Any

from ..engine.ckptdir import CheckpointDir
from ..errors import CheckpointError, CorruptError, LimitError, SignatureError, StorageError, UnsupportedError
from ..files import multifile, recordsign
from ..files.places import ObjectPlace
from ..files.reader import CheckpointFile
from ..files.verify import Problem, VerifyReport, check_file, problem_of
from . import resumecheck
from .steps import STATE_NAME, parse_step_dirname


def check_step(
    d: CheckpointDir, step: int | None, decrypt: Any = None, trusted: Any = None
) -> multifile.CommitRecord:
    """The one check of a run's step directory (spec 13.4), made by latest(), ls, load, load_into
    and verify alike: complete (13.2), its record for the step its name says (`step`; None for a
    directory whose name is not a step's, which only verify is given), and parts as its layout
    requires.  `decrypt`: the key of an encrypted run's state files (their index is read).
    `trusted`: public keys (recordsign.public_keys); a state file is then read only once a
    trusted key is found to have signed the record and every file it names matches its signed
    SHA-256, so that a changed byte anywhere is a SignatureError, never a failure of a key or
    of a file's structure met first (a step whose record no trusted key signed is not read:
    loads refuse it on its record alone)."""
    record = _complete(d, trusted)
    if step is not None and record.step != step:
        raise CorruptError(f"the commit record is for step {record.step}, not {step}", path=d.path)
    if record.layout == "state":
        if [p.name for p in record.files] != [STATE_NAME]:
            raise CorruptError(f"a 'state' commit record must name exactly {STATE_NAME}", path=d.path)
        if trusted is None or _signed_files_match(d, record, trusted):
            _check_state_index(d, record, decrypt)
    elif record.layout == "dcp":
        from ..dcp.check import checked_record

        checked_record(record, d.path)  # the record's dcp member, as a load checks it (no file read)
    elif step is not None:
        raise UnsupportedError(f"a {record.layout!r} checkpoint is not a step of a run", path=d.path)
    return record


def _complete(d: CheckpointDir, trusted: Any) -> multifile.CommitRecord:
    """multifile.check_complete; once a commit record is there, a damaged record or file is,
    to a reader that demands a signature, not what a trusted key signed (SignatureError, as
    spec 16.4 reports a signed file whose structure fails); without one the save is incomplete."""
    try:
        return multifile.check_complete(d)
    except LimitError:
        raise
    except CheckpointError as e:
        if trusted is None or isinstance(e, SignatureError) or not d.exists(multifile.COMMIT_NAME):
            raise
        raise SignatureError(f"not a checkpoint a trusted key signed: {e.reason}", path=d.path) from e


def _signed_files_match(d: CheckpointDir, record: multifile.CommitRecord, trusted: Any) -> bool:
    """False when no trusted key signed `d`'s record; True when one did and every file the
    record names has its signed SHA-256; SignatureError when a file differs or the signed
    record is not the one checked."""
    try:
        signed = recordsign.read_trusted(d, trusted)
    except SignatureError:
        return False
    if signed != record:
        raise SignatureError("the commit record changed while it was read", path=d.path)
    recordsign.check_files(d, record.files + record.references, d.path)
    return True


def _check_state_index(d: CheckpointDir, record: multifile.CommitRecord, decrypt: Any = None) -> None:
    """The state file's index (no chunk is read): a manager's state file (a dict with the
    entries state, rng and resume) that reads chunks only from files the record names."""
    part = record.files[0]
    fd = multifile.open_part(d, part, d.path)
    with CheckpointFile(d.path_of(part.name), fd=fd, within=d, decrypt_with=decrypt) as f:
        multifile.check_references(f, record, d.path)
        if not {"state", "rng", "resume"} <= {key for key, _ in f.root_items()}:
            raise CorruptError("not a checkpoint manager's state file", path=f.path)


def resume_entries(f: CheckpointFile, build_rng: bool = True) -> tuple[dict[str, Any], Any]:
    """A state file's resume fingerprint and RNG states, checked (CorruptError naming the entry)
    as load_into checks them before anything of the caller's changes: on the values as stored
    (resumecheck: no torch, no numpy), which is all verify asks (`build_rng` False: the RNG
    states come back as None).  A load then builds the RNG states, and rng.check_capture adds
    what only this machine can tell: the sizes of its own devices' states."""
    root = dict(f.root_items())
    fp = resumecheck.check_fingerprint(f.load_raw(root["resume"], True), f.path)
    resumecheck.check_rng_entry(f.load_raw(root["rng"], True), f.path)
    if not build_rng:
        return fp, None
    from .rng import check_capture

    rng_state = f.load_subtree(root["rng"], None, True)
    if rng_state is not None:
        check_capture(rng_state, f.path)
    return fp, rng_state


def verify_in_run(
    run_dir: str, name: str, step: int, trusted: Any = None, decrypt: Any = None
) -> VerifyReport:
    """verify_step of step directory `name` of a run, opened beneath the run directory
    without following a link (the step may have been swapped for one since it was listed)."""
    try:
        with CheckpointDir.open(run_dir) as run, run.sub(name) as d:
            return verify_step(d, step, trusted, decrypt)
    except (CheckpointError, OSError) as e:
        report = VerifyReport(os.path.join(run_dir, name))
        report.problems.append(problem_of(e) if isinstance(e, CheckpointError) else _os_problem(e))
        return report


def _os_problem(e: OSError) -> Problem:
    return Problem("incomplete", f"{e.filename or ''}: {e.strerror}".lstrip(": "))


def verify_step(
    path: str | CheckpointDir, step: int | None = None, trusted: Any = None, decrypt: Any = None
) -> VerifyReport:
    """Verify a checkpoint directory with the checks a load makes (check_step), then every
    chunk of its commit record, of every file it names and of every file they refer to.

    `step`: the step its record must be for; None: the step its name says when it is named
    like a step directory (step-NNNNNNNNN), so verify fails exactly where latest() skips.
    `trusted`: public keys, one of which must have signed the commit record, whose SHA-256
    of every file must then match (spec 16.7); a failure is a "signature" problem.
    `decrypt`: the key of an encrypted run's state files (every GCM tag is then checked)."""
    where = path.path if isinstance(path, CheckpointDir) else path
    if step is None:
        step = parse_step_dirname(os.path.basename(os.path.normpath(where)))
    report = VerifyReport(where)
    try:
        with multifile.opened(path) as d:
            if trusted is not None:  # before any file is read with the key
                recordsign.check_directory(d, trusted)
            record = check_step(d, step, decrypt)
            _verify_parts(d, record, report, decrypt)
            if record.layout == "dcp" and report.ok:
                report.problems += _dcp_problems(d, decrypt)
            if record.layout == "dcp" and report.ok and step is not None:  # a run's sharded step
                report.problems += _sharded_rng_problems(d, decrypt)
    except StorageError:  # the store failed, not the checkpoint: nothing is known of it
        raise
    except CheckpointError as e:
        report.problems.append(problem_of(e))
    return report


def verify_objects(place: ObjectPlace, decrypt: Any = None, trusted: Any = None) -> VerifyReport:
    """verify_step of a checkpoint under an object-store prefix (spec 13.7): its commit record
    (for the step its name says, its layout's member checked), every chunk of the record and of
    every file it names, each file read through the open its identity was checked on (pinned to
    that object's ETag) and reading chunks only from files the record names, then, for layout
    "dcp", everything cdcp.load checks.  With `trusted` keys the record must be signed by one,
    and each file and each object it refers to is hashed against it, as a load does."""
    report = VerifyReport(place.path)
    step = parse_step_dirname(place.path.rsplit("/", 1)[-1])
    try:
        record = place.read_record(trusted)
        if step is not None and record.step != step:
            raise CorruptError(f"the commit record is for step {record.step}, not {step}", path=place.path)
        if record.layout == "dcp":
            from ..dcp.check import checked_record

            checked_record(record, place.path)
        commit = place.path_of(multifile.COMMIT_NAME)
        with CheckpointFile(commit, storage_options=place.options) as f:
            _add_part(report, multifile.COMMIT_NAME, f, None)
        for part in record.files:
            with place.open_named(record, part.name, part.name, trusted=trusted, decrypt=decrypt) as f:
                _add_part(report, part.name, f, record.layout)
        if record.layout == "dcp" and report.ok:
            report.problems += _dcp_problems(place, decrypt)
        if record.layout == "dcp" and report.ok and step is not None:  # a run's sharded step
            report.problems += _sharded_rng_problems(place, decrypt)
    except StorageError:  # the store failed, not the checkpoint: nothing is known of it
        raise
    except CheckpointError as e:
        report.problems.append(problem_of(e))
    return report


def _add_part(report: VerifyReport, name: str, f: CheckpointFile, layout: str | None) -> None:
    """Every chunk of the open part `f` checked, its problems added to `report` by its `name`
    (a state file's resume entries too: verify fails where load_into refuses)."""
    one = VerifyReport(f.path)
    if layout == "state":
        _check_resume_entries(f, one)
    check_file(f, one)
    report.chunks += one.chunks
    report.bytes_checked += one.bytes_checked
    report.problems += [
        Problem(p.kind, f"{name}: {p.message}", p.key, p.chunk, p.offset) for p in one.problems
    ]


def _dcp_problems(path: CheckpointDir | ObjectPlace, decrypt: Any = None) -> list[Problem]:
    """What cdcp.load would refuse in a step of layout "dcp" whose files' bytes verified: its
    record's dcp member, and every item against its rank file, as load checks them."""
    from ..dcp.check import verify_directory

    out = []
    for e in verify_directory(path, decrypt):
        name = os.path.basename(e.path or "")  # the record or the rank file it is about
        text = e.reason if not name or e.reason.startswith(name) else f"{name}: {e.reason}"
        out.append(Problem(problem_of(e).kind, text, e.key))
    return out


def _sharded_rng_problems(path: CheckpointDir | ObjectPlace, decrypt: Any = None) -> list[Problem]:
    """The RNG states of a run's sharded step (runs/sharded.py saves {"rng": {"rank-NNNNN":
    (capture,)}}: a value item per rank), each checked as that rank's resume checks its own
    before anything of the caller's is filled (sharded._checked_rng), on the values as stored
    (no torch): verify fails where a resume on any rank would."""
    from ..dcp.check import checked_record
    from ..dcp.sources import Source, rank_note
    from ..files import places

    try:
        with places.held(path) as d:
            record = d.read_record()
            checked = checked_record(record, d.path)
            paths = checked.planner_data or {}
            for fqn, loc in checked.items():
                p = tuple(paths.get(fqn, (fqn,)))
                if (
                    len(p) < 2
                    or p[0] != "rng"
                    or type(p[1]) is not str
                    or not resumecheck.RANK_KEY_RE.fullmatch(p[1])
                ):
                    continue  # no rank's resume reads it
                if len(p) != 2 or loc.sizes is not None:
                    raise CorruptError(
                        f"the RNG states of {p[1]} are not what a manager saves", path=d.path, key=fqn
                    )
                src = Source(
                    d, loc.file, f"{loc.file}{rank_note(loc.file)}", record, keyed=True, decrypt=decrypt
                )
                try:  # its arrays' bytes are read as they are checked
                    saved = src.f.load_raw(src.node(loc.key, fqn), True)
                    if type(saved) is not tuple or len(saved) != 1:
                        raise CorruptError(
                            f"the RNG states of {p[1]} are not what a manager saves", path=d.path, key=fqn
                        )
                    resumecheck.check_rng_entry(saved[0], d.path, f"rng.{p[1]}")
                finally:
                    src.f.close()
    except StorageError:  # the store failed, not the checkpoint: nothing is known of it
        raise
    except CheckpointError as e:
        return [problem_of(e)]
    return []


def _verify_parts(
    d: CheckpointDir, record: multifile.CommitRecord, report: VerifyReport, decrypt: Any = None
) -> None:
    """Every chunk of the record and of every part, each read through the descriptor its
    identity was checked on; a part reading a file the record does not name fails as a load does."""
    commit = multifile.PartRecord(multifile.COMMIT_NAME, 0, b"", 0)
    for part in (commit, *record.files, *record.references):
        holder, leaf = d.walk(part.name)
        with holder:
            if part is commit:
                fd = d.open_file(part.name)
            else:
                fd = multifile.open_part(d, part, d.path)
            # every file a record names is encrypted in an encrypted save (a state file, rank
            # files, and the files an incremental state file reads chunks from)
            key = None if part is commit else decrypt
            with CheckpointFile(d.path_of(part.name), fd=fd, within=holder, decrypt_with=key) as f:
                if part in record.files:
                    multifile.check_references(f, record, d.path)
                _add_part(report, part.name, f, record.layout if part in record.files else None)


def _check_resume_entries(f: CheckpointFile, report: VerifyReport) -> None:
    """resume_entries' checks, as a problem of `report` (verify fails where load_into refuses)."""
    try:
        resume_entries(f, build_rng=False)
    except StorageError:  # the store failed, not the checkpoint: nothing is known of it
        raise
    except CheckpointError as e:
        report.problems.append(problem_of(e))
