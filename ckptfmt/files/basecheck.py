"""The chunks of a base that an incremental save refers to, checked once per process.

A save refers to a chunk of its base when the live bytes' (length, content digest) equal
those the base's index records; the bytes the base stores are another matter.  A chunk
damaged on disk after its own save (bit rot, a torn write) would be referred to by every
later save although the saving process holds the right bytes each time: a run's every kept
step would then name the damaged chunk.  So the stored bytes are read and checked by the
reader itself (checksum, decryption, decoding, content digest: `CheckpointFile.read_into`)
before a new file first names them.

Verdicts are kept for the life of the process by the identity of the file that holds each
chunk (its location, file id and length; a local file's device, inode, modification and
change times and size; an object's version where the reader knows it) and the record
checked, so a run whose base does not change (frozen weights under LoRA) reads it once per
process, not per save.  An object the base refers to is known by the version the base's
reader opened it at (a request the reader makes anyway, before any chunk is referred to):
replaced since its check, its chunks are checked again.  A read that failed for
a reason other than the bytes (an I/O or store error) is tried again by the next save that
can still write the chunk; a forked save's writer, which decides before the check, writes it,
and the save reads it again once RETRY_SECONDS have passed, after its commit and within a
budget (RETRY_BYTES, RETRY_BUDGET_SECONDS): a passing error does not cost a rewrite of the
chunk at every save against a fixed base, nor a throttled store the save's durability.

The bounds forget fail-safe: a file whose damaged or unreadable chunks were forgotten (to
keep memory bounded) is `forgotten`, and a forked save's writer is given none of its chunks
not judged sound (they are written, then read again after the commit), never a chunk whose
check would fail the save.

The cost: the first incremental save in a process reads and decodes every base chunk it
refers to (a resumed run on an object store downloads them once).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..engine.writeoptions import ChunkRecord
from ..errors import CheckpointError
from ..fileio import file_stamp
from .reader import CheckpointFile

#: files whose verdicts are kept (least recently used dropped first)
MAX_FILES = 64
#: at most this many chunks remembered as unreadable
MAX_UNREADABLE = 100_000
#: at most this many files remembered as forgotten (then every file counts as one)
MAX_FORGOTTEN = 1024
#: seconds after a check could not read a chunk before it is read again for a forked save,
#: whose writer, deciding before any check, writes the chunk meanwhile
RETRY_SECONDS = 60.0
#: raw bytes one check reads at a time (or the largest chunk, when larger)
WINDOW_BYTES = 64 << 20
#: a forked save reads again at most this many raw bytes after its commit (at least one chunk)
RETRY_BYTES = 256 << 20
#: and starts no read of another window after this many seconds: a throttled store delays
#: the end of the save by about one window, and the rest waits for the next save
RETRY_BUDGET_SECONDS = 5.0

log = logging.getLogger("ckptfmt")

#: a file that holds chunks: (location, file id, length, stamp)
Holder = tuple[str, bytes, int, Any]
#: a chunk as judged: (its number in the holder, the record checked, its content digest)
_Judged = tuple[int, ChunkRecord, bytes]

_lock = threading.Lock()
#: holder -> judged chunk -> None (sound) or why it is damaged
_verdicts: OrderedDict[Holder, dict[_Judged, str | None]] = OrderedDict()
#: chunks whose last check could not read them (a disk's or a store's failure, not the bytes),
#: with when they may be read again (time.monotonic): checked again by a save that can still
#: write them; never referred to by a forked save's writer, which decides before they are
#: checked (held_keys), but read again once due by a forked save that wrote them (retry)
_unreadable: dict[tuple[Holder, _Judged], float] = {}
#: files some of whose damaged or unreadable chunks were forgotten (the bounds above): their
#: chunks not judged sound are withheld from a forked writer (and read again after its commit)
_forgotten: set[Holder] = set()
#: so many files were forgotten that every file counts as one
_forgot_all = False
#: chunks a save was told about (whether kept damaged): saves against one base (a fixed base=)
#: write such a chunk again each time and warn once
_reported: set[tuple[Holder, _Judged, bool]] = set()


def _reset_in_child() -> None:
    # a thread of the parent's may have held the lock at the fork; the verdicts stay true
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_in_child)


@dataclass(frozen=True)
class Pick:
    """A chunk a save would refer to: its number in the base (read through the base's
    index), the file that holds it, its number and record there, its content digest."""

    chunk: int
    holder: Holder
    number: int
    record: ChunkRecord
    digest: bytes

    @property
    def judged(self) -> _Judged:
        return (self.number, self.record, self.digest)


@dataclass(frozen=True)
class Damage:
    """Why a picked chunk cannot be referred to; `kept`: the verdict is kept (the bytes are bad)."""

    reason: str
    kept: bool


def base_holder(f: CheckpointFile) -> Holder:
    """The identity of the open base `f` itself."""
    if f.remote:
        return (f.path, f.prologue.file_id, f.prologue.file_length, f.etag)
    stamp = file_stamp(os.fstat(f.chunk_reader.fd))
    return (os.path.abspath(f.path), f.prologue.file_id, f.prologue.file_length, stamp)


def referenced_holder(f: CheckpointFile, e: int, location: str, file_id: bytes, length: int) -> Holder | None:
    """The identity of the file that reference `e` of the open base `f` names, at `location`
    (a path or URL), as `f`'s reader opened it: an object by the version it is read at, a local
    file by the stamp of the descriptor it is read through (no request or look-up of its own:
    the reader refuses the file opened again as another); None where the reader has not opened
    it (its chunks are then not referred to)."""
    stamp = f.reference_version(f.externals[e].rel) if f.remote else f.chunk_reader.external_stamp(e)
    return None if stamp is None else (location, file_id, length, stamp)


_UNJUDGED = object()


def known_damaged(pick: Pick) -> bool:
    """Whether a forked writer must not be given `pick`: found damaged, or could not be read,
    before in this process, or not judged sound in a file whose verdicts were forgotten
    (nothing is read)."""
    with _lock:
        if (pick.holder, pick.judged) in _unreadable:
            return True
        verdicts = _verdicts.get(pick.holder)
        verdict = _UNJUDGED if verdicts is None else verdicts.get(pick.judged, _UNJUDGED)
        if verdict is _UNJUDGED:
            return _forgot_all or pick.holder in _forgotten
        return verdict is not None


def retry(f: CheckpointFile, picks: list[Pick]) -> dict[int, Damage]:
    """Check again, through the open base `f`, those of `picks` (which a forked save wrote)
    whose last check could not read them and RETRY_SECONDS have passed since, and those of a
    forgotten file not judged yet: a chunk that reads now can be referred to by the next save.
    At most RETRY_BYTES, no window started after RETRY_BUDGET_SECONDS; the rest waits for a
    later save.  The damaged ones, as check(); a failure to read is logged, never raised."""
    now = time.monotonic()
    with _lock:
        due = [p for p in sorted(picks, key=lambda p: p.chunk) if _due(p, now)]
    chosen: list[Pick] = []
    size = 0
    for p in due:
        if chosen and size + p.record[2] > RETRY_BYTES:
            break
        chosen.append(p)
        size += p.record[2]
    if not chosen:
        return {}
    try:
        found = _read_checked(f, chosen, now + RETRY_BUDGET_SECONDS)
    except Exception as e:  # tried again by a later save; this one is committed already
        log.warning("%s: reading base chunks again failed (%s); a later save tries again", f.path, e)
        return {}
    return {p.chunk: hit for p in chosen if (hit := found.get((p.holder, p.judged))) is not None}


def _due(p: Pick, now: float) -> bool:
    """Whether `p` is to be read again now (under _lock)."""
    when = _unreadable.get((p.holder, p.judged))
    if when is not None:
        return when <= now
    verdicts = _verdicts.get(p.holder)
    return (_forgot_all or p.holder in _forgotten) and (verdicts is None or p.judged not in verdicts)


def first_report(pick: Pick, damage: Damage) -> bool:
    """Whether `damage` of `pick` is news to this process: true once per chunk and kind of
    damage (a chunk that could not be read and reads again is news when it fails again)."""
    key = (pick.holder, pick.judged, damage.kept)
    with _lock:
        if key in _reported:
            return False
        if len(_reported) >= MAX_UNREADABLE:
            _reported.clear()  # bounded: forgetting one only warns about it again
        _reported.add(key)
        return True


def check(f: CheckpointFile, picks: list[Pick]) -> dict[int, Damage]:
    """The picks (by their chunk number in the open base `f`) that cannot be referred to:
    those found damaged before, and those not judged yet whose bytes now fail the reader's
    checks (each read once, in windows; a window that fails is checked again in halves down
    to single chunks)."""
    damaged: dict[int, Damage] = {}
    unjudged: dict[tuple[Holder, _Judged], Pick] = {}
    with _lock:
        for p in picks:
            verdicts = _verdicts.get(p.holder)
            if verdicts is not None:
                _verdicts.move_to_end(p.holder)
            if verdicts is None or p.judged not in verdicts:
                unjudged.setdefault((p.holder, p.judged), p)
            elif (reason := verdicts[p.judged]) is not None:
                damaged[p.chunk] = Damage(reason, True)
    if unjudged:
        found = _read_checked(f, list(unjudged.values()))
        for p in picks:
            if p.chunk not in damaged and (hit := found.get((p.holder, p.judged))) is not None:
                damaged[p.chunk] = hit
    return damaged


def _read_checked(
    f: CheckpointFile, picks: list[Pick], deadline: float | None = None
) -> dict[tuple[Holder, _Judged], Damage]:
    """Read and check `picks` through `f`, keep the verdicts; the damaged ones.  Past
    `deadline` (time.monotonic) no window is started: the picks left are neither read nor
    judged (for retry alone)."""
    largest = max(p.record[2] for p in picks)
    window = min(max(WINDOW_BYTES, largest), sum(p.record[2] for p in picks))
    # an anonymous mapping: pages on first touch, no torch needed
    view = memoryview(mmap.mmap(-1, max(1, window)))
    damaged: dict[tuple[Holder, _Judged], Damage] = {}
    group: list[Pick] = []
    pos = 0
    for p in sorted(picks, key=lambda p: p.chunk):
        if group and pos + p.record[2] > window:
            _halving(f, group, view, damaged)
            group, pos = [], 0
            if deadline is not None and time.monotonic() >= deadline:
                return damaged
        group.append(p)
        pos += p.record[2]
    if group:
        _halving(f, group, view, damaged)
    return damaged


def _halving(
    f: CheckpointFile, group: list[Pick], view: memoryview, damaged: dict[tuple[Holder, _Judged], Damage]
) -> None:
    items, pos = [], 0
    for p in group:
        items.append((p.chunk, view[pos : pos + p.record[2]]))
        pos += p.record[2]
    try:
        f.read_into(items, True, check_only=True)
    except OSError as e:  # not the bytes (a store's or the disk's failure): not kept
        again = time.monotonic() + RETRY_SECONDS
        with _lock:
            _unreadable.update(((p.holder, p.judged), again) for p in group)
            if len(_unreadable) > MAX_UNREADABLE:
                _forget_unreadable()
        for p in group:
            damaged[(p.holder, p.judged)] = Damage(f"could not be read: {e}", False)
        return
    except CheckpointError as e:
        if len(group) == 1:
            _keep(group, e.reason)
            damaged[(group[0].holder, group[0].judged)] = Damage(e.reason, True)
            return
        half = len(group) // 2
        _halving(f, group[:half], view, damaged)
        _halving(f, group[half:], view, damaged)
        return
    _keep(group, None)


def _keep(group: list[Pick], reason: str | None) -> None:
    with _lock:
        for p in group:
            _unreadable.pop((p.holder, p.judged), None)
            _reported.discard((p.holder, p.judged, False))
            if reason is None and p.holder[3] is None:
                continue  # an object known by no version: replaced, its bytes would pass for these
            verdicts = _verdicts.setdefault(p.holder, {})
            _verdicts.move_to_end(p.holder)
            verdicts[p.judged] = reason
        while len(_verdicts) > MAX_FILES:
            holder, dropped = _verdicts.popitem(last=False)
            if any(reason is not None for reason in dropped.values()):
                _forget(holder)  # a damaged chunk forgotten must not be handed to a forked writer


def _forget_unreadable() -> None:
    """Bound _unreadable (under _lock): its files are forgotten, so that a forked writer is
    not given one of their chunks whose check could fail its save."""
    for holder, _ in _unreadable:
        _forget(holder)
    _unreadable.clear()


def _forget(holder: Holder) -> None:
    global _forgot_all
    if _forgot_all:
        return
    _forgotten.add(holder)
    if len(_forgotten) > MAX_FORGOTTEN:  # bounded too: every file then counts as forgotten
        _forgotten.clear()
        _forgot_all = True
