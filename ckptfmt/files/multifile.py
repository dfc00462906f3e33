"""Multi-file checkpoints: a directory of part files made valid by one commit record.

A checkpoint that spans several files (a training step's state, one file per
rank, files that refer to chunks of earlier steps) is a directory.  Its parts
are written first, each one an ordinary ckptfmt file committed on its own.  The
commit record, ``COMMIT``, is written last: a ckptfmt file (so it is
checksummed like any other) that names every part by name, length, file id and
index checksum.  The directory is a complete checkpoint exactly when its commit
record verifies and every file it names is there with that length, id and
index checksum.  spec/FORMAT.md section "Multi-file checkpoints" is the
normative text; this module is that section in code.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.ckptdir import CheckpointDir, LinkError
from ..errors import CheckpointError, CorruptError, IncompleteError, LimitError, UnsupportedError
from ..fileio import open_regular, pread_exact
from ..format import layout as fmt
from ..format.index import External
from ..format.timestamps import MICROSECONDS, format_utc, utc_now
from .names import COMMIT_NAME
from .reader import CheckpointFile

if TYPE_CHECKING:
    from .save import FileSaveOptions

#: the record's own layout version; a reader rejects versions it does not know
RECORD_VERSION = 1
#: what the parts of a checkpoint mean: "state" is one file holding the whole state;
#: "dcp" is a torch.distributed.checkpoint save (ckptfmt/dcp/): one file per rank, and
#: the record carries DCP's global metadata in one more member, named "dcp";
#: "hf-trainer" is a Hugging Face Trainer checkpoint-N folder (integrations/transformers/)
LAYOUTS = ("state", "dcp", "hf-trainer")
#: layouts whose record has a member of their own (its value is checked by the layout's code)
LAYOUT_MEMBERS = {"dcp": "dcp"}
#: a part's name, and each component of a reference path (spec: no leading dot,
#: so temporaries and hidden files can never be named)
_NAME_RE = fmt.REF_NAME_RE
#: parts and references one record may name
MAX_PARTS = 1 << 16
MAX_METRICS = 1024
_BASE_MEMBERS = frozenset(
    {"ckptfmt_commit", "step", "layout", "created", "files", "references", "metrics", "metadata"}
)


@dataclass(frozen=True)
class PartRecord:
    """One file of a checkpoint as the commit record names it."""

    name: str  # a name in the checkpoint's directory, or "../<dir>/<name>" for a reference
    length: int
    file_id: bytes
    index_checksum: int
    #: SHA-256 of the file's whole bytes: carried by every entry of a signed record (spec 16.7)
    sha256: bytes | None = None

    def as_value(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "length": self.length,
            "file_id": self.file_id,
            "index_checksum": self.index_checksum,
        }
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out


@dataclass(frozen=True)
class CommitRecord:
    """The contents of a COMMIT file."""

    step: int | None
    layout: str
    files: tuple[PartRecord, ...]
    references: tuple[PartRecord, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    created: str = ""
    layout_data: Any = None  # the layout's own member (LAYOUT_MEMBERS), plain ckptfmt values

    def as_value(self) -> dict[str, Any]:
        out = {
            "ckptfmt_commit": RECORD_VERSION,
            "step": self.step,
            "layout": self.layout,
            "created": self.created or _now(),
            "files": [p.as_value() for p in self.files],
            "references": [p.as_value() for p in self.references],
            "metrics": dict(self.metrics),
            "metadata": dict(self.metadata),
        }
        member = LAYOUT_MEMBERS.get(self.layout)
        if member is not None:
            out[member] = self.layout_data
        return out


def _now() -> str:
    return format_utc(utc_now(), MICROSECONDS)


def valid_part_name(name: str, *, reference: bool) -> bool:
    """A part is a plain name; a reference is a reference path of the spec's section 12
    (NAME, DIR/NAME, ../NAME or ../DIR/NAME)."""
    if reference:
        return reference_parts(name) is not None
    return _NAME_RE.fullmatch(name) is not None


@dataclass(frozen=True)
class ReferencePath:
    """A reference path (spec section 12) taken apart: whether it leads up (``../``), the
    directory it names (None when none) and the file's name."""

    up: bool
    directory: str | None
    name: str


def reference_parts(path: str) -> ReferencePath | None:
    """`path` taken apart as a reference path, or None when it is not one."""
    if fmt.REF_PATH_RE.fullmatch(path) is None:
        return None
    up = path.startswith("../")
    directory, _, name = path.removeprefix("../").rpartition("/")
    return ReferencePath(up, directory or None, name)


# -- reading one part's identity ---------------------------------------------------


def describe_open_part(fd: int, path: str, name: str) -> PartRecord:
    """The identity of the committed ckptfmt file open as `fd`, from its prologue and footer."""
    size = os.fstat(fd).st_size
    prologue = fmt.parse_prologue(pread_exact(fd, 0, fmt.PROLOGUE_SIZE), size, path)
    at = prologue.file_length - fmt.FOOTER_SIZE
    footer = fmt.parse_footer(pread_exact(fd, at, fmt.FOOTER_SIZE), prologue, path)
    return PartRecord(name, prologue.file_length, prologue.file_id, footer.index_checksum)


def identity_of(f: CheckpointFile, name: str) -> PartRecord:
    """The identity of the open file `f`, as a record names it by `name`."""
    return PartRecord(name, f.prologue.file_length, f.prologue.file_id, f.footer.index_checksum)


def describe_in(d: CheckpointDir, name: str) -> PartRecord:
    """The identity of file `name` (a part name or reference path) beneath `d`, for a record."""
    fd = d.open_ref(name)
    try:
        return describe_open_part(fd, d.path_of(name), name)
    finally:
        os.close(fd)


def describe_part(path: str, name: str) -> PartRecord:
    """The identity of a committed ckptfmt file a writer has just made (by path)."""
    fd = open_regular(path, follow_symlinks=False)
    try:
        return describe_open_part(fd, path, name)
    finally:
        os.close(fd)


def open_part(directory: CheckpointDir, rec: PartRecord, owner: str, label: str | None = None) -> int:
    """A descriptor of the file `rec` names, resolved beneath `directory` without following a
    link, once it is checked to be there with the recorded length, id and index checksum.
    The caller owns the descriptor: reading through it reads exactly the file checked.
    `label`: how messages name the part (default its name)."""
    what = rec.name if label is None else label
    try:
        fd = directory.open_ref(rec.name)
    except FileNotFoundError:
        raise IncompleteError(f"{what} named by the commit record is missing", path=owner) from None
    except CheckpointError as e:  # a link on the way, not a regular file
        raise CorruptError(f"{what} is not a file of the checkpoint: {e.reason}", path=owner) from None
    except OSError as e:
        raise IncompleteError(f"{what} cannot be read: {e.strerror}", path=owner) from None
    try:
        try:
            found = describe_open_part(fd, directory.path_of(rec.name), rec.name)
        except CheckpointError as e:
            raise CorruptError(f"{what} is damaged: {e}", path=owner) from None
        check_identity(found, rec, what, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_identity(found: PartRecord, rec: PartRecord, what: str, owner: str) -> None:
    """Raise unless the file found is the one the record names: length, id, index checksum."""
    if found.length != rec.length:
        raise CorruptError(f"{what} is {found.length} bytes, the commit record says {rec.length}", path=owner)
    if found.file_id != rec.file_id or found.index_checksum != rec.index_checksum:
        raise CorruptError(f"{what} is not the file the commit record names (another save?)", path=owner)


def check_references(f: CheckpointFile, record: CommitRecord, owner: str) -> None:
    """Every file `f` reads chunks from is one the commit record names (spec 13.1): a load
    never reads a file the record does not bind by name, length and file id."""
    check_named(os.path.basename(f.path), f.externals, record.references, owner)


def check_named(
    reader: str, externals: Iterable[External], references: Iterable[PartRecord], owner: str
) -> None:
    """The one check of a file's references against a commit record, made by loads (through
    check_references) and by each writer before it commits: every file `reader` reads chunks
    from (`externals`, from its index) is one of `references` by name, file id and length.
    A writer that meets another file there (a base saved again while the save read it) would
    otherwise commit a record naming a file whose chunks are not the ones referred to."""
    named = {p.name: p for p in references}  # names are unique in a record (_parse_record)
    for ext in externals:
        part = named.get(ext.rel)
        if part is None:
            raise CorruptError(
                f"{reader} reads chunks from {ext.rel}, which the commit record does not name", path=owner
            )
        if (part.file_id, part.length) != (ext.file_id, ext.length):
            raise CorruptError(
                f"{reader} reads chunks from {ext.rel} of file id {ext.file_id.hex()} and {ext.length} "
                f"bytes; the commit record names one of file id {part.file_id.hex()} and {part.length} bytes",
                path=owner,
            )


def check_part(directory: str | os.PathLike[str] | CheckpointDir, rec: PartRecord, owner: str) -> None:
    """Raise unless the file `rec` names is there with the recorded length, id and index checksum."""
    with opened(directory) as d:
        os.close(open_part(d, rec, owner))


@contextlib.contextmanager
def opened(directory: str | os.PathLike[str] | CheckpointDir) -> Iterator[CheckpointDir]:
    """`directory` as an open CheckpointDir: one given is lent (not closed here); a path is
    opened here and closed after."""
    if isinstance(directory, CheckpointDir):
        yield directory
        return
    with open_dir(os.fspath(directory)) as d:
        yield d


def open_dir(path: str, noun: str = "checkpoint directory") -> CheckpointDir:
    """The checkpoint directory at `path`, opened (no link followed); IncompleteError naming it
    (a `noun`: what the caller calls it) when it is absent or cannot be opened."""
    try:
        return CheckpointDir.open(path)
    except FileNotFoundError:
        raise IncompleteError(f"no such {noun}", path=path) from None
    except OSError as e:
        raise IncompleteError(f"cannot open the {noun.split()[-1]}: {e.strerror}", path=path) from None


# -- the record ------------------------------------------------------------------------


def write_commit(
    directory: str,
    record: CommitRecord,
    within: CheckpointDir | None = None,
    sign_with: Any = None,
    options: FileSaveOptions | None = None,
) -> None:
    """Write the commit record last: temp file, fsync, rename, fsync the directory (beneath
    the open directory `within` when given); `sign_with`: a private key that signs the
    record file (spec 16.7: its entries must then carry their files' SHA-256).  `options`:
    the record's save options, built once by a writer that commits many records (a run's
    manager: save.save_options(sign_with=key)), instead of `sign_with`."""
    from .save import save_file, save_options

    if options is None:
        options = save_options(sign_with=sign_with)
    elif sign_with is not None:
        raise ValueError("write_commit takes sign_with or options, not both")
    path = os.path.join(directory, COMMIT_NAME)
    save_file(record.as_value(), path, options, within=within)


#: a commit record larger than this is refused before it is parsed (records name at most
#: 65536 parts; a "dcp" record holds a few int64 per tensor chunk)
MAX_RECORD_BYTES = 256 << 20
#: the memory a record may take to parse and decode: a fixed allowance plus this much per
#: byte of record, so a small record cannot expand into gigabytes (zstd members)
RECORD_MEMORY_BASE = 64 << 20
RECORD_MEMORY_PER_BYTE = 32


def read_commit(directory: str | os.PathLike[str] | CheckpointDir, trusted_keys: Any = None) -> CommitRecord:
    """Read and validate a directory's commit record (checksums verified); its size and the
    memory it may expand into are bounded before anything in it is decoded.  `trusted_keys`:
    the record file must be signed by one of them (spec 16.7; SignatureError otherwise)."""
    with opened(directory) as d:
        path = d.path_of(COMMIT_NAME)
        try:
            fd = d.open_file(COMMIT_NAME)
        except FileNotFoundError:
            raise IncompleteError("no commit record: the save did not finish", path=d.path) from None
        except LinkError as e:  # never followed
            raise CorruptError(f"commit record: {e.reason}", path=path) from None
        except OSError as e:  # no permission, ...: never a bare OSError
            raise UnsupportedError(f"commit record cannot be opened: {e.strerror}", path=path) from None
        size = os.fstat(fd).st_size
        if size > MAX_RECORD_BYTES:
            os.close(fd)
            raise LimitError(f"commit record of {size} bytes exceeds the limit {MAX_RECORD_BYTES}", path=path)
        with CheckpointFile(
            path, fd=fd, max_bytes=record_memory(size), within=d, trusted_keys=trusted_keys
        ) as f:
            return record_from(f)


def record_memory(size: int) -> int:
    """The memory a commit record of `size` bytes may take to parse and decode."""
    return RECORD_MEMORY_BASE + RECORD_MEMORY_PER_BYTE * size


def record_from(f: CheckpointFile) -> CommitRecord:
    """The commit record in the open file `f` (opened with max_bytes=record_memory(size)),
    its members checked before any payload is decoded."""
    if f.externals:
        raise _fail(f.path, "refers to chunks of other files")
    _check_members(f.path, f)
    # arrays (a DCP record's columns) as their stored bytes: no torch or numpy, and a record
    # read twice compares equal
    return _parse_record(f.load_plain(f.tree.root, True), f.path)


def _check_members(path: str, f: CheckpointFile) -> None:
    """The record's kind and top-level names, checked before any member's payload is decoded."""
    kind = f.tree.nodes[f.tree.root][0]
    if kind not in ("dict", "odict"):
        raise _fail(path, f"the record must be dict, not {kind}")
    allowed = _BASE_MEMBERS | set(LAYOUT_MEMBERS.values())
    if any(type(k) is not str or k not in allowed for k, _ in f.root_items()):
        raise _fail(
            path, "fields must be exactly " + ", ".join(sorted(_BASE_MEMBERS)) + " (and a layout's own)"
        )


def _fail(path: str, what: str) -> CorruptError:
    return CorruptError(f"commit record: {what}", path=path)


def _typed(path: str, value: object, kind: type | tuple[type, ...], what: str) -> Any:
    if type(value) not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _fail(path, f"{what} must be {getattr(kind, '__name__', kind)}, not {type(value).__name__}")
    return value


def _parse_part(path: str, raw: object, where: str, reference: bool) -> PartRecord:
    d = _typed(path, raw, dict, where)
    if set(d) - {"sha256"} != {"name", "length", "file_id", "index_checksum"}:
        raise _fail(path, f"{where} must have exactly name, length, file_id, index_checksum (and sha256)")
    name = _typed(path, d["name"], str, f"{where}.name")
    if not valid_part_name(name, reference=reference):
        raise _fail(path, f"{where}.name {name[:80]!r} is not an allowed file name")
    length = _typed(path, d["length"], int, f"{where}.length")
    file_id = _typed(path, d["file_id"], bytes, f"{where}.file_id")
    check = _typed(path, d["index_checksum"], int, f"{where}.index_checksum")
    if not (fmt.PROLOGUE_SIZE + fmt.FOOTER_SIZE <= length < 1 << 63) or len(file_id) != 16:
        raise _fail(path, f"{where} has an impossible length or file id")
    if not 0 <= check < 1 << 64:
        raise _fail(path, f"{where}.index_checksum is out of range")
    sha = d.get("sha256")
    if sha is not None and (type(sha) is not bytes or len(sha) != 32):
        raise _fail(path, f"{where}.sha256 must be 32 bytes")
    return PartRecord(name, length, file_id, check, sha)


def _parse_record(value: object, path: str) -> CommitRecord:
    d = _typed(path, value, dict, "the record")
    expected = set(_BASE_MEMBERS)
    member = LAYOUT_MEMBERS.get(d["layout"]) if type(d.get("layout")) is str else None
    if member is not None:
        expected.add(member)
    if set(d) != expected or any(type(k) is not str for k in d):
        raise _fail(path, "fields must be exactly " + ", ".join(sorted(expected)))
    version = _typed(path, d["ckptfmt_commit"], int, "ckptfmt_commit")
    if version != RECORD_VERSION:
        raise UnsupportedError(f"commit record version {version} is not supported", path=path)
    step = d["step"]
    if step is not None and (type(step) is not int or step < 0):
        raise _fail(path, "step must be a non-negative int or None")
    layout = _typed(path, d["layout"], str, "layout")
    if layout not in LAYOUTS:
        raise UnsupportedError(f"commit record layout {layout[:40]!r} is not supported", path=path)
    created = _typed(path, d["created"], str, "created")
    files = _typed(path, d["files"], list, "files")
    refs = _typed(path, d["references"], list, "references")
    if not files or len(files) + len(refs) > MAX_PARTS:
        raise _fail(path, f"names {len(files)} files and {len(refs)} references")
    parts = tuple(_parse_part(path, p, f"files[{i}]", False) for i, p in enumerate(files))
    references = tuple(_parse_part(path, p, f"references[{i}]", True) for i, p in enumerate(refs))
    if len({p.sha256 is None for p in parts + references}) != 1:
        raise _fail(path, "sha256 must be on every file and reference, or on none")
    if len({p.name for p in parts}) != len(parts) or any(p.name == COMMIT_NAME for p in parts):
        raise _fail(path, "a file is named twice, or the record names itself")
    # each referenced file once: a name repeated would make every check and verify read it again
    names = {os.path.normpath(p.name) for p in references}
    if len(names) != len(references) or names & {p.name for p in parts}:
        raise _fail(path, "a referenced file is named twice, or is also one of the files")
    return CommitRecord(
        step,
        layout,
        parts,
        references,
        _metrics(path, d["metrics"]),
        _metadata(path, d["metadata"]),
        created,
        d[member] if member is not None else None,
    )


def _metrics(path: str, raw: object) -> dict[str, float]:
    d = _typed(path, raw, dict, "metrics")
    if len(d) > MAX_METRICS:
        raise _fail(path, f"{len(d)} metrics exceed the limit {MAX_METRICS}")
    for k, v in d.items():
        if type(k) is not str or type(v) not in (int, float):
            raise _fail(path, "metrics must map str to int or float")
        if type(v) is int and not -(1 << 63) <= v < 1 << 63:  # compared and printed as floats
            raise _fail(path, f"metric {k[:40]!r} is an int outside the 64-bit range")
    return dict(d)


def _metadata(path: str, raw: object) -> dict[str, str]:
    d = _typed(path, raw, dict, "metadata")
    if len(d) > fmt.Limits.MAX_METADATA_ENTRIES or any(
        type(k) is not str or type(v) is not str for k, v in d.items()
    ):
        raise _fail(path, "metadata must map str to str")
    return dict(d)


def check_complete(directory: str | os.PathLike[str] | CheckpointDir) -> CommitRecord:
    """The directory's commit record, after checking every file it names; raises CheckpointError."""
    with opened(directory) as d:
        record = read_commit(d)
        for part in record.files + record.references:
            check_part(d, part, d.path)
    return record
