"""Incremental checkpoints: save against a base file, refer to chunks already on disk.

A chunk whose raw bytes are already stored in `base`, or in a file that `base`
refers to, is not written again: the new file's record names the file that
physically holds those bytes (spec/FORMAT.md section 12, required feature bit 0).
"Already stored" is decided by content, the chunk's length and XXH3-128 digest
computed from the bytes being saved, never by a version counter: changes made
through ``.data`` or under ``torch.no_grad()`` are seen like any other.

References are never chained: a file that refers to another refers to where the
bytes lie, so an intermediate checkpoint that nothing refers to can be deleted.
Overwriting or deleting a file that a kept checkpoint refers to breaks that
checkpoint (reads then fail naming both files); ``referenced_files`` tells which
files a checkpoint needs.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import posixpath
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

from ..background import inflight
from ..background.inflight import SaveHandle
from ..engine import native as _native
from ..engine.ckptdir import CheckpointDir
from ..engine.writeoptions import ChunkRecord
from ..errors import CheckpointError, CheckpointWarning, CorruptError, UnsupportedError
from ..fileio import is_url, open_regular, pread_exact
from ..format import layout as fmt
from ..storage import references
from ..storage.client import check_options
from ..storage.download import RemoteObject
from ..storage.urls import parse_url
from . import basecheck, encryption
from . import save as writer
from .encryption import save_and_read_keys
from .reader import CheckpointFile

log = logging.getLogger("ckptfmt")

#: The checkpoint manager writes chunks smaller than this again.  Referring to one saves
#: next to nothing, and would keep a whole earlier file alive (rotation never deletes a
#: file that a kept checkpoint refers to) for a few unchanged bytes such as an RNG
#: state or a bias.
MIN_REFERENCE_BYTES = 64 << 10


@dataclass(frozen=True)
class _Held:
    """A chunk already on disk: which candidate file holds it, its number and record there,
    and its number in the base (through which its stored bytes are checked)."""

    file: int
    number: int
    record: ChunkRecord
    chunk: int


@dataclass(frozen=True)
class _Candidate:
    """A file the new one may refer to."""

    rel: str  # reference path from the new file's directory
    file_id: bytes
    length: int
    holder: basecheck.Holder  # the file's identity, which verdicts on its chunks are kept by


def _lexical_reference(target: str, held: str) -> str | None:
    """The reference path from local file `target` to `held` by their names alone (section
    12's grammar), or None; nothing on the way is looked up."""
    rel = os.path.relpath(os.path.abspath(held), os.path.dirname(os.path.abspath(target)))
    if fmt.REF_PATH_RE.fullmatch(rel) is None or os.path.abspath(target) == os.path.abspath(held):
        return None
    return rel


def _reference_path(target: str, held: str) -> str | None:
    """The path a reader of `target` resolves to `held` (section 12's grammar), or None.

    A path outside the grammar, or one that does not lead to the very same file from
    the target's directory (symbolic links on the way), cannot be a reference; nor can
    the target itself, which the save is about to replace.
    """
    if is_url(target) or is_url(held):
        return _object_reference_path(target, held)
    here = os.path.dirname(os.path.abspath(target))
    rel = os.path.relpath(held, here)
    if fmt.REF_PATH_RE.fullmatch(rel) is None or os.path.abspath(target) == held:
        return None
    try:
        if not os.path.samefile(os.path.join(here, rel), held):
            return None
        if os.path.exists(target) and os.path.samefile(target, held):
            return None
    except OSError:
        return None
    return rel


def _object_reference_path(target: str, held: str) -> str | None:
    """_reference_path between two objects: of one bucket, resolved as storage.references
    resolves it (no links on a store)."""
    if not (is_url(target) and is_url(held)):
        return None
    t, h = parse_url(target), parse_url(held)
    if (t.scheme, t.bucket, t.host) != (h.scheme, h.bucket, h.host) or t.key == h.key:
        return None
    rel = posixpath.relpath("/" + h.key, posixpath.dirname("/" + t.key))
    return rel if fmt.REF_PATH_RE.fullmatch(rel) is not None else None


def _referenced_path(f: CheckpointFile, rel: str) -> str:
    """Where reference `rel` of the open file `f` leads: a normalised path or URL."""
    if f.remote:
        prefix = parse_url(f.path.rsplit("/", 1)[0], need_key=False)
        return str(references.resolve(prefix, rel))
    return os.path.abspath(os.path.join(os.path.dirname(f.path), rel))


class ContentIndex:
    """The chunks an incremental save may refer to, by (raw length, content digest).

    This is the writer's `dedup` (writer.Dedup): for each chunk being saved it records
    the digest and either finds where the same bytes already lie or asks for a write.
    """

    def __init__(
        self,
        target: str,
        base: str | None,
        min_reference_bytes: int = 0,
        decrypt: Any = None,
        storage_options: dict[str, Any] | None = None,
        within: CheckpointDir | None = None,
        sealing: encryption.Key | None = None,
    ) -> None:
        """`decrypt`: the key of an encrypted save: the base is read with it, and referred to
        only when it is encrypted too, under `sealing`, the key the new file is encrypted
        under: a reader with that key must unwrap every file it refers to (spec 17.9).  `storage_options`: for a base on a store.
        `within`: the open directory the new file is written beneath: a local base is then
        opened through it by its reference path, never by resolving its path again (a step
        directory swapped for a link meanwhile is refused, not followed)."""
        self.min_reference_bytes = min_reference_bytes
        self.decrypt = decrypt
        self.storage_options = storage_options
        self.within = within
        self.sealing = sealing
        self.files: list[_Candidate] = []
        self.held: dict[tuple[int, bytes], _Held] = {}
        self.entries: dict[int, int] = {}  # candidate file -> its entry in `externals`
        self.digests: list[bytes] = []  # per chunk of the new file
        self.refs: dict[int, tuple[int, int]] = {}  # chunk -> (externals entry, chunk number there)
        self.base_chunk_size: int | None = None
        self._keys: list[tuple[int, bytes]] = []  # held_keys(), as a forked writer was given them
        #: what held_keys() kept from the writer: (held, digest) by base chunk
        self._withheld: dict[int, tuple[_Held, bytes]] = {}
        #: the base, open while chunks may be referred to: their stored bytes are checked
        #: through it before the first reference (files/basecheck.py)
        self._base: CheckpointFile | None = None
        # close() may come from another thread than a check's (a reader is not closed under
        # a read); once closed, nothing found is referred to (no check can vouch for it)
        self._lock = threading.RLock()
        self._closed = False
        #: a writer that closes this once its save is over, on whatever thread, took it
        self.claimed = False
        self._target, self._base_path = target, base
        if base is not None:
            self._add_base(target, base)

    def _add_base(self, target: str, base: str) -> None:
        opened = self._open_beneath(target, base)
        fd, holder = opened if opened is not None else (None, None)
        try:
            encrypted = _is_encrypted(base, self.storage_options, fd)
        except BaseException:
            _close(fd, holder)
            raise
        if encrypted and self.decrypt is None:
            _close(fd, holder)
            warnings.warn(
                f"{target} cannot refer to {base}: one of the two is encrypted and the other is not; "
                "every chunk is written",
                CheckpointWarning,
                stacklevel=5,
            )
            return
        try:
            base_file = CheckpointFile(
                base,
                fd=fd,  # owned by the file from here on
                within=holder,
                decrypt_with=self.decrypt if encrypted else None,
                storage_options=self.storage_options,
            )
        finally:
            _close(None, holder)
        try:
            self._index_base(target, base, fd is not None, base_file)
        except BaseException:
            base_file.close()
            raise
        if not self.held:
            base_file.close()
            return
        # open while chunks may be referred to; closed once the save is over (externals()),
        # or when this index goes
        self._base = base_file
        weakref.finalize(self, base_file.close)

    def _index_base(self, target: str, base: str, beneath: bool, f: CheckpointFile) -> None:
        """Index the chunks of the open base `f` (and of the files it refers to) that the new
        file may refer to; none, with a warning, where it cannot refer to `f`."""
        _refuse_replacing_a_source(target, base, f)
        self.base_chunk_size = f.chunk_size
        # opened beneath `within` by its reference path: that path is the reference (no
        # name is resolved again); else the path that leads to the same file, if any
        rel = (
            _lexical_reference(target, base)
            if beneath
            else _reference_path(target, base if is_url(base) else os.path.abspath(base))
        )
        crossing = f.encrypted != (self.decrypt is not None)
        foreign = (
            f.encrypted
            and self.sealing is not None
            and f.index.encryption is not None
            and not encryption.unwraps(self.sealing, f.index.encryption)
        )
        if not f.has_digests or rel is None or crossing or foreign:
            # still a correct save, only not an incremental one; the next save can refer to it
            why = (
                "it was written without content digests (by ckptfmt.save)"
                if not f.has_digests
                else "one of the two is encrypted and the other is not"
                if crossing
                else "it is encrypted under another key than the new file, whose key would not "
                "read the chunks it refers to"
                if foreign
                else "a reference is NAME, DIR/NAME, ../NAME or ../DIR/NAME from the new file's "
                "directory, each name without a leading dot, and not the file being written"
            )
            warnings.warn(
                f"{target} cannot refer to {base}: {why}; every chunk is written",
                CheckpointWarning,
                stacklevel=5,
            )
            return
        own = self._add_file(rel, f.prologue.file_id, f.prologue.file_length, basecheck.base_holder(f))
        # base's referenced files: usable only where they still are the recorded
        # files and can be referred to from the new file's directory
        reachable = {
            e: _reference_path(target, _referenced_path(f, ext.rel)) for e, ext in enumerate(f.externals)
        }
        theirs: dict[int, int | None] = {}  # external -> candidate file (None: not referred to)
        for k, ch in enumerate(f.chunks):
            record = (ch.offset, ch.stored_len, ch.raw_len, ch.codec, ch.filter, ch.width, ch.checksum)
            if ch.source < 0:
                self.held.setdefault((ch.raw_len, ch.digest), _Held(own, k, record, k))
            elif reachable[ch.source] is not None and f.external_problem(k) is None:  # opens its file
                if ch.source not in theirs:  # known once opened: an object's version
                    theirs[ch.source] = self._add_referenced(f, ch.source, reachable[ch.source])
                if (candidate := theirs[ch.source]) is not None:
                    held = _Held(candidate, ch.number, record, k)
                    self.held.setdefault((ch.raw_len, ch.digest), held)

    def _open_beneath(self, target: str, base: str) -> tuple[int, CheckpointDir] | None:
        """The local base opened beneath `within` by its reference path from `target` (each
        directory on the way without following a link), with the directory holding it; None
        where there is no `within`, the base is on a store, or it is out of a reference's
        reach (then opened by its path, and refused as a base below)."""
        if self.within is None or is_url(base):
            return None
        rel = _lexical_reference(target, base)
        if rel is None:
            return None
        holder, name = self.within.walk(rel)
        try:
            return holder.open_file(name), holder
        except BaseException:
            holder.close()
            raise

    def _add_referenced(self, f: CheckpointFile, e: int, rel: str | None) -> int | None:
        """The candidate file for external `e` of the open base `f`, which its reader has
        opened, reached from the new file by `rel`; None where it cannot be referred to."""
        ext = f.externals[e]
        who = basecheck.referenced_holder(f, e, _referenced_path(f, ext.rel), ext.file_id, ext.length)
        if rel is None or who is None:
            return None
        return self._add_file(rel, ext.file_id, ext.length, who)

    def _add_file(self, rel: str, file_id: bytes, length: int, holder: basecheck.Holder) -> int:
        self.files.append(_Candidate(rel, file_id, length, holder))
        return len(self.files) - 1

    def _pick(self, held: _Held, digest: bytes) -> basecheck.Pick:
        return basecheck.Pick(held.chunk, self.files[held.file].holder, held.number, held.record, digest)

    def _damaged(self, found: list[tuple[_Held, bytes]]) -> dict[int, basecheck.Damage] | None:
        """Of the chunks found, those whose stored bytes fail the reader's checks (by their
        number in the base), each read once per process (files/basecheck.py); None once
        closed: none of them can be checked, so none may be referred to."""
        if not found:
            return {}
        with self._lock:
            if self._closed or self._base is None:
                return None
            return basecheck.check(self._base, [self._pick(h, d) for h, d in found])

    def _where(self, held: _Held) -> str:
        """Chunk `held` as a message names it: in the base, and in the file that holds it."""
        rec = held.record
        own = f"chunk {held.chunk} of {self._base_path}"
        if held.file == 0:
            return f"{own} (offset {rec[0]})"
        return f"{own} (chunk {held.number} at offset {rec[0]} of {self.files[held.file].holder[0]})"

    def _warn(self, damaged: dict[int, basecheck.Damage], found: dict[int, tuple[_Held, bytes]]) -> None:
        """A warning for each damaged chunk of `found` (by base chunk) this process has not
        warned about: saves against one damaged base say it once, not at every save."""
        for chunk, why in damaged.items():
            held, digest = found[chunk]
            if basecheck.first_report(self._pick(held, digest), why):
                # the save heals itself: these bytes are written here, as the process holds them
                log.warning(
                    "%s: %s fails its check (%s); written again instead of referred to",
                    self._target,
                    self._where(held),
                    why.reason,
                )

    # -- writer.Dedup ---------------------------------------------------------

    @property
    def can_refer(self) -> bool:
        return bool(self.held)

    def written(self, first_index: int, digests: list[bytes]) -> None:
        if len(self.digests) != first_index:
            raise RuntimeError(f"chunks written out of order: {first_index} after {len(self.digests)}")
        self.digests.extend(digests)

    def classify(
        self, first_index: int, pieces: list[tuple[memoryview, int]], engine: str, threads: int
    ) -> list[ChunkRecord | None]:
        views = [v for v, _ in pieces]
        if engine == "c":
            digests = _native.content_digests(views, threads)  # in parallel, without the GIL
        else:
            digests = [fmt.content_digest(v) for v in views]
        if len(self.digests) != first_index:
            raise RuntimeError(f"chunks classified out of order: {first_index} after {len(self.digests)}")
        self.digests.extend(digests)
        found = [
            self.held.get((len(view), digest)) if len(view) >= self.min_reference_bytes else None
            for view, digest in zip(views, digests)
        ]
        damaged = self._damaged([(h, d) for h, d in zip(found, digests) if h is not None])
        if damaged is None:  # closed: every chunk is written here
            return [None] * len(found)
        self._warn(damaged, {h.chunk: (h, d) for h, d in zip(found, digests) if h is not None})
        out: list[ChunkRecord | None] = []
        for i, held in enumerate(found):
            if (
                held is None
                or held.chunk in damaged
                or (held.file not in self.entries and len(self.entries) >= fmt.Limits.MAX_EXTERNALS)
            ):
                out.append(None)
                continue
            entry = self.entries.setdefault(held.file, len(self.entries))
            self.refs[first_index + i] = (entry, held.number)
            out.append(held.record)
        return out

    def held_keys(self) -> list[tuple[int, bytes]]:
        # a chunk is referred to only from the first MAX_EXTERNALS candidate files, so no
        # choice of matches can name more files than an index may list (classify counts them
        # as it goes instead); short chunks are written, as classify writes them
        # a chunk found damaged before in this process is written (no read here: the
        # others are checked once the writer says which it refers to, in adopt)
        referable = [
            key
            for key, held in self.held.items()
            if key[0] >= self.min_reference_bytes and held.file < fmt.Limits.MAX_EXTERNALS
        ]
        known = {key for key in referable if basecheck.known_damaged(self._pick(self.held[key], key[1]))}
        self._keys = sorted(key for key in referable if key not in known)
        # those are written; the ones that could not be read are read again once the save is
        # committed (recheck), when due
        self._withheld = {self.held[key].chunk: (self.held[key], key[1]) for key in known}
        return self._keys

    def adopt(self, digests: list[bytes], matches: list[int]) -> list[ChunkRecord | None]:
        if self.digests:
            raise RuntimeError(f"a forked writer's findings after {len(self.digests)} chunks were classified")
        found = [
            (self.held[self._keys[m]], digest) if m >= 0 else None for digest, m in zip(digests, matches)
        ]
        damaged = self._damaged([f for f in found if f is not None])
        if damaged is None:  # closed before the writer's findings came: none of them is checked
            raise CheckpointError(
                f"cannot refer to chunks of {self._base_path}: the save's base was closed before "
                "they were checked; nothing was committed",
                path=self._target,
            )
        if damaged:  # the writer left these chunks unwritten: this file cannot be made whole
            held = next(f[0] for f in found if f is not None and f[0].chunk in damaged)
            why = damaged[held.chunk]
            # the next forked save leaves it out (basecheck.known_damaged) and writes it
            raise (CorruptError if why.kept else CheckpointError)(
                f"cannot refer to {self._where(held)}: {why.reason}; nothing was committed "
                "(the next save in this process writes the chunk again)",
                path=self._target,
            )
        out: list[ChunkRecord | None] = []
        for k, (digest, m) in enumerate(zip(digests, matches, strict=True)):
            self.digests.append(digest)
            if m < 0:
                out.append(None)
                continue
            held = self.held[self._keys[m]]
            entry = self.entries.setdefault(held.file, len(self.entries))
            self.refs[k] = (entry, held.number)
            out.append(held.record)
        return out

    def recheck(self) -> None:
        # after the commit: what a forked save wrote because it could not be read before is
        # read again within basecheck's budget, to be referred to by the next save
        with self._lock:
            if self._closed or self._base is None or not self._withheld:
                return
            try:
                again = basecheck.retry(self._base, [self._pick(h, d) for h, d in self._withheld.values()])
                self._warn(again, self._withheld)
            except Exception as e:  # the save is committed: a later save tries again
                log.warning("%s: reading chunks of %s again failed: %s", self._target, self._base_path, e)

    def claim(self) -> None:
        self.claimed = True

    def externals(self) -> list[list[Any]]:
        if not self._withheld:  # asked for last, once every chunk is placed
            self.close()  # (a forked save's withheld chunks are read again after its commit)
        order = sorted(self.entries, key=self.entries.__getitem__)
        return [[self.files[f].rel, self.files[f].file_id.hex(), self.files[f].length] for f in order]

    def close(self) -> None:
        with self._lock:  # waits for a check under way on another thread
            self._closed = True
            base, self._base = self._base, None
            if base is not None:
                base.close()

    def record(self, k: int, rec: ChunkRecord) -> list[Any]:
        o, s, r, c, f, w, h = rec
        out: list[Any] = [o, s, r, c, f, w, f"{h:016x}", self.digests[k].hex()]
        if k in self.refs:
            out.extend(self.refs[k])
        return out


def _refuse_replacing_a_source(target: str, base: str, f: CheckpointFile) -> None:
    """Refuse a save over a file its base reads chunks from: the base would go on naming the
    replaced file, and every chunk it keeps there would be lost (UnsupportedError)."""
    for ext in f.externals:
        if _same_file(target, _referenced_path(f, ext.rel)):
            raise UnsupportedError(
                f"cannot be saved against {base}: that file reads chunks from this one ({ext.rel}), "
                "which the save would replace",
                path=target,
            )


def _same_file(target: str, held: str) -> bool:
    """Whether `held` (a path or URL a reference leads to) is the file `target` names."""
    if is_url(target) or is_url(held):
        if not (is_url(target) and is_url(held)):
            return False
        t, h = parse_url(target), parse_url(held)
        return (t.scheme, t.bucket, t.host, t.key) == (h.scheme, h.bucket, h.host, h.key)
    try:
        return os.path.samefile(target, held)
    except OSError:  # either is not there: nothing of the one is replaced by the other
        return False


def _close(fd: int | None, holder: CheckpointDir | None) -> None:
    if fd is not None:
        os.close(fd)
    if holder is not None:
        holder.close()


def _is_encrypted(path: str, storage_options: dict[str, Any] | None = None, fd: int | None = None) -> bool:
    """Whether the ckptfmt file at `path` (or object, with `storage_options`; or open as `fd`)
    says it is encrypted (its prologue's bit 2; the file is checked in full when it is opened)."""
    if fd is not None:
        head = pread_exact(fd, 0, fmt.PROLOGUE_SIZE)
    elif is_url(path):
        remote = RemoteObject(path, check_options(storage_options), fetch_index=False)
        try:
            remote.fetch([(0, min(remote.size, fmt.PROLOGUE_SIZE))])
            head = pread_exact(remote.fd, 0, min(remote.size, fmt.PROLOGUE_SIZE))
        finally:
            remote.close()
    else:
        fd = open_regular(path)
        try:
            head = pread_exact(fd, 0, fmt.PROLOGUE_SIZE)
        finally:
            os.close(fd)
    return len(head) == fmt.PROLOGUE_SIZE and bool(
        int.from_bytes(head[40:48], "little") & fmt.FEATURE_ENCRYPTED
    )


def save(
    state: object,
    path: str | os.PathLike[str],
    *,
    base: str | os.PathLike[str] | None = None,
    compression: str | None = None,
    level: int | None = None,
    metadata: dict[str, str] | None = None,
    blocking: bool = True,
    snapshot: str = "copy",
    chunk_size: int | None = None,
    min_reference_bytes: int = 0,
    within: CheckpointDir | None = None,
    encrypt_with: Any = None,
    decrypt_with: Any = None,
    storage_options: dict[str, Any] | None = None,
    create_only: bool = False,
) -> SaveHandle | None:
    """Write `state` to `path` with content digests (feature bit 0).

    Chunks whose (raw length, digest) are already stored in `base` (a file written by
    this function) or in a file that `base` refers to are not written again: the
    record refers to where the bytes physically lie.  base=None writes every chunk;
    so does a base that cannot be referred to (written by ckptfmt.save, or out of
    reach of a reference path), with a CheckpointWarning.  A missing or unreadable
    base raises (OSError, CheckpointError).
    Without `chunk_size`, a save against a base uses the base's chunk size, so the
    chunks of unchanged tensors line up.  blocking=False returns a SaveHandle once the
    state is snapshotted (`snapshot` as for ckptfmt.save); the digests are computed from
    the snapshot by the writer (for snapshot="fork", by the child, which writes only the
    chunks it does not find in the base or the files it refers to).
    Chunks shorter than `min_reference_bytes` are always written here.
    `within`: the open directory that holds `path` (files.save.save's _within).
    `encrypt_with`: the file is encrypted (spec 17.9): its external chunks lie in encrypted
    files whose data keys the same key unwraps; `decrypt_with` reads the base (default
    `encrypt_with`, except a key service's wrapping callable).
    An object-store URL `path` (with `storage_options`) refers to objects of its bucket;
    `create_only`: an object-store URL is created only if absent (files.save.write_state).
    """
    encrypt_with, decrypt_with = save_and_read_keys(encrypt_with, decrypt_with)
    # every keyword checked once, as save() checks them, before any file is read
    options = writer.save_options(
        compression=compression,
        level=level,
        metadata=metadata,
        blocking=blocking,
        chunk_size=chunk_size,
        snapshot=snapshot,
        storage_options=storage_options,
        encrypt_with=encrypt_with,
    )
    return save_checked(
        state,
        path,
        options,
        base=base,
        base_chunks=chunk_size is None,
        min_reference_bytes=min_reference_bytes,
        within=within,
        decrypt_with=decrypt_with,
        create_only=create_only,
    )


def save_checked(
    state: object,
    path: str | os.PathLike[str],
    options: writer.FileSaveOptions,
    *,
    base: str | os.PathLike[str] | None = None,
    base_chunks: bool = True,
    min_reference_bytes: int = 0,
    within: CheckpointDir | None = None,
    decrypt_with: Any = None,
    create_only: bool = False,
) -> SaveHandle | None:
    """save() for ckptfmt's own callers, its keywords already checked into `options` (a fork
    snapshot taken earlier in options.staged: files.save.staged_by).  `base_chunks`: the save
    takes its base's chunk size (save() was given no chunk_size); `decrypt_with`: the key the
    base is read with (save_and_read_keys's)."""
    target = os.fspath(path)
    here = os.path.dirname(os.path.abspath(target))
    if not is_url(target) and not os.path.isdir(here):  # before the references, relative to it
        raise FileNotFoundError(errno.ENOENT, "no such directory", here)
    inflight.raise_unobserved()
    inflight.wait_for_path(target)
    base_path = None if base is None else os.fspath(base)
    if base_path is not None:
        inflight.wait_for_path(base_path)  # a non-blocking save of the base may still run
    index = ContentIndex(
        target,
        base_path,
        min_reference_bytes,
        decrypt_with if options.write.seal is not None else None,
        options.storage_options,
        within,
        options.write.seal.key if isinstance(options.write.seal, encryption.FileSealer) else None,
    )
    write = dataclasses.replace(options.write, dedup=index)
    if base_chunks and index.base_chunk_size is not None and not os.environ.get("CKPTFMT_CHUNK_SIZE"):
        write = dataclasses.replace(write, chunk_size=writer.check_chunk_size(index.base_chunk_size))
    options = dataclasses.replace(options, write=write)
    try:
        result: SaveHandle | None = writer.write_state(
            state, target, options, within=within, create_only=create_only
        )
    except BaseException:
        # not left to the error's traceback, which holds this frame; a writer that took the
        # index (a background save still running, even past an interrupt) closes it itself
        if not index.claimed:
            index.close()
        raise
    return result


def referenced_files(path: str | os.PathLike[str], *, decrypt_with: Any = None) -> list[str]:
    """Absolute paths of the files whose chunks `path` refers to (empty when self-contained);
    `decrypt_with`: the key of an encrypted file (its index lists them)."""
    inflight.wait_for_path(path)
    with CheckpointFile(path, decrypt_with=decrypt_with) as f:
        return [os.path.abspath(ext.path) for ext in f.externals]
