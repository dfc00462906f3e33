"""Non-blocking saves by fork: a copy-on-write snapshot, written by a child process.

A copying snapshot (copysave.py) makes the caller wait while the whole state is
copied into staging memory: about 0.1 s per GiB at memory speed.  On Linux,
fork() gives a child process this process's memory as it is at that instant
without copying it: the kernel shares every page and copies one only when this
process writes to it.  The caller then waits only for fork() itself (it copies
page tables: tens of milliseconds per GiB of resident memory) and goes on
training; the child writes every chunk from its unchanging view with the C
engine (csrc/snapshot.c: C only, since a forked child of a threaded process
must not run the interpreter) and exits.  A thread here waits for it, then writes
the index, footer and prologue and commits exactly as a blocking save does.

``save(..., blocking=False, snapshot="fork")`` asks for it; what fork cannot
snapshot is refused with a ValueError saying why (see `why_not`): storages on an
accelerator or in pinned memory (a driver may keep its mappings out of a child),
memory shared with other processes (``share_memory_()``, a MAP_SHARED numpy
memmap: later writes would reach the child) and builds without the C engine.  The
child does in C what the writer thread of a copy snapshot does: it encrypts each chunk
with the file's data key, takes each chunk's SHA-256 for a signed file, and for an
incremental save digests every chunk and writes only those the base does not hold
(the parent gives it the base's (length, digest) table and records the references
afterwards).  To an object store, the child writes the whole file into the upload's
spool (memory) and this process uploads it once the child is done.

The cost moves rather than vanishes, which is why this is not the default: each
4 KiB page of the process written while the child runs is copied then, by a page
fault.  A training step that rewrites the whole state before the child is done pays
several times what the up-front copy costs (bench/engine.py measures both); one
that only reads it meanwhile (forward and backward passes) pays for the pages it
does write (activations, allocator churn), not for the state.  Memory grows by the
same pages, for as long as the child runs; no staging pool is kept afterwards.

Memory the kernel keeps out of a child (MADV_DONTFORK, as RDMA registration sets)
makes the child fail, which fails the save; memory marked MADV_WIPEONFORK would be
read as zeros.  Neither is checked here (it would take reading /proc/self/smaps):
tensors do not live in such memory unless a library put them there.

The child exits as soon as this process is gone (a pipe whose write end only this
process holds reaches end-of-file), and keeps no descriptor of ours but the file.

Every wait here has a deadline, inflight.DEADLINE seconds (an hour, as the archive's wait):
a child that has not said it is done by then (stopped, or stuck writing) is killed and
reaped, and the save fails with a SnapshotError naming its pid and the deadline (its temp
file removed, nothing committed); a staged child whose job has not come by then exits
(csrc/snapshot.c), and the save that hands it one later fails the same way.
"""

from __future__ import annotations

import bisect
import os
import select
import signal
import socket
import sys
import threading
from typing import Any

import numpy as np
import torch

from ..engine import children, chunkwrite
from ..engine import native as _native
from ..engine.ckptdir import CheckpointDir
from ..engine.commit import AtomicFile
from ..engine.writeoptions import ChunkRecord, Dedup, WriteOptions
from ..errors import SnapshotError
from ..format import layout as fmt
from ..format.encode import Encoded
from . import inflight
from .inflight import SaveHandle


def _shared_mappings() -> list[tuple[int, int]]:
    """This process's MAP_SHARED address ranges, sorted: [start, end) pairs."""
    spans = []
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            fields = line.split(b" ", 2)
            if len(fields) > 1 and fields[1][3:4] == b"s":
                lo, _, hi = fields[0].partition(b"-")
                spans.append((int(lo, 16), int(hi, 16)))
    spans.sort()
    return spans


def _overlaps(spans: list[tuple[int, int]], starts: list[int], lo: int, hi: int) -> bool:
    i = bisect.bisect_left(starts, hi) - 1  # the last mapping that starts before hi
    return i >= 0 and spans[i][1] > lo


def why_not(encoded: Encoded) -> str | None:
    """Why `encoded` cannot be saved from a fork snapshot, or None if it can."""
    return why_not_sources([(plan.key, plan.source, plan.nbytes) for plan in encoded.storages])


def why_not_sources(sources: list[tuple[str, Any, int]]) -> str | None:
    """Why memory (key, storage or array, bytes) cannot be written from a fork snapshot, or None."""
    if not sys.platform.startswith("linux"):
        return "fork snapshots need Linux"
    if not _native.available():
        return "fork snapshots need the C engine"
    spans = _shared_mappings()
    starts = [s for s, _ in spans]
    for key, src, nbytes in sources:
        if isinstance(src, torch.UntypedStorage):
            if src.device.type != "cpu":
                return f"{key} is on {src.device}"
            if src.is_shared():
                return f"{key} is in memory shared with other processes"
            if src.is_pinned():
                return f"{key} is in pinned memory"
        elif not isinstance(src, np.ndarray):
            return f"{key} is not host memory"
        start = _address(src)
        if nbytes and _overlaps(spans, starts, start, start + nbytes):
            return f"{key} is in a shared mapping"
    return None


def _address(src: torch.UntypedStorage | np.ndarray) -> int:
    """Where a host storage's bytes (or a contiguous array's) start."""
    if isinstance(src, torch.UntypedStorage):
        return int(src.data_ptr())
    return int(src.__array_interface__["data"][0])


class ForkSnapshot:
    """A child process that holds this process's memory as it was when `take_snapshot` forked
    it, waiting to be told which of it to write: one file, by save_forked(..., staged=this).

    This is how a save whose plan is made after its snapshot (DCP's: the ranks agree on the
    plan while training goes on) snapshots by fork: the child is forked when the save is
    called, the plan is made from the staged state (the same addresses), and the child, still
    running only C code, receives the job (csrc/snapshot.c, ckf_fork_stage).  `discard` kills
    a child that was never handed a job (the save failed first, or had nothing to write)."""

    def __init__(
        self,
        pid: int,
        sock: socket.socket,
        ready: int,
        alive_w: int,
        held: list[tuple[int, int, Any]],
        job_wait: float,
    ) -> None:
        self.pid = pid
        self.job_wait = job_wait  # seconds after the fork the child waits for its job, then exits
        self._sock: socket.socket | None = sock
        self._ready, self._alive_w = ready, alive_w
        # (start, end, source) of the memory snapshotted, sorted: the sources stay referenced, so
        # no address of the staged state is freed and reused while the save plans
        self._held = held
        self._starts = [lo for lo, _, _ in held]
        self._lock = threading.Lock()

    def spent(self) -> bool:
        """Whether the child was handed its file already, or discarded."""
        return self._sock is None

    def covers(self, start: int, nbytes: int) -> bool:
        """Whether [start, start + nbytes) lies within one piece of the memory snapshotted."""
        i = bisect.bisect_right(self._starts, start) - 1
        return nbytes == 0 or (i >= 0 and start + nbytes <= self._held[i][1])

    def _hand(
        self,
        fd: int,
        file_id: bytes,
        pieces: list[tuple[Any, int]],
        options: WriteOptions,
        path: str,
    ) -> tuple[_native.ForkedWrite, int, int]:
        """Give the child its job; return it with the read end of its ready pipe and the write
        end of its parent pipe, both now the caller's to close."""
        with self._lock:
            if self._sock is None:
                raise SnapshotError("this fork snapshot was used or discarded already", path=path)
            sock, self._sock = self._sock, None
        try:
            held = None if options.dedup is None else options.dedup.held_keys()
            child = _native.hand_job(
                self.pid,
                sock,
                fd,
                file_id,
                fmt.PROLOGUE_SIZE,
                pieces,
                options,
                _native.default_threads(),
                held=held,
            )
        except ConnectionError as e:  # the child is gone (its end closed): say how it ended
            sock.close()
            status = self._end()
            raise SnapshotError(
                f"the process holding this save's fork snapshot (pid {self.pid}) could not be handed "
                f"its job ({e.strerror}): it {_how_it_ended(status, self.job_wait)}; nothing was written",
                path=path,
            ) from e
        except BaseException:
            sock.close()
            self._end()
            raise
        # the job went over in one message the socket's buffer took whole: no wait for the child
        sock.close()  # the child has its job: it reads no more
        ready, alive_w, self._ready, self._alive_w = self._ready, self._alive_w, -1, -1
        self._held, self._starts = [], []
        return child, ready, alive_w

    def discard(self) -> None:
        """Kill and reap the child unless it was handed a job (then the save's thread waits for
        it); idempotent.  SIGKILL rather than closing its socket: a process forked here
        meanwhile may hold our end of it too."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            self._end()

    def _end(self) -> int | None:
        """Kill and reap the child, close our ends of its pipes: its wait status (None: unknown)."""
        status = children.stop_child(self.pid)
        for fd in (self._ready, self._alive_w):
            if fd >= 0:
                os.close(fd)
        self._ready = self._alive_w = -1
        self._held, self._starts = [], []
        return status


def take_snapshot(sources: list[tuple[str, Any]]) -> ForkSnapshot:
    """Fork a child that holds this process's memory as it is now, for a save of `sources`
    ((key, host storage or array) pairs, the memory the save may write) planned later.
    ValueError where fork cannot snapshot them (see why_not), OSError where fork() fails.
    The child waits inflight.DEADLINE seconds for its job, then exits."""
    items = [(key, src, _nbytes(src)) for key, src in sources]
    job_wait = inflight.DEADLINE
    reason = why_not_sources(items)
    if reason is not None:
        raise ValueError(f"snapshot='fork' is not possible: {reason}")
    held = sorted((_address(src), _address(src) + n, src) for _, src, n in items if n)
    own: list[int] = []
    pair: tuple[socket.socket, socket.socket] | None = None
    try:
        ready, ready_w = _pipe(own)
        alive, alive_w = _pipe(own)
        pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = _native.fork_stage(pair[1].fileno(), ready_w, alive, job_wait)
    except BaseException:
        for fd in own:
            os.close(fd)
        for end in pair or ():
            end.close()
        raise
    pair[1].close()
    os.close(ready_w)
    os.close(alive)
    return ForkSnapshot(pid, pair[0], ready, alive_w, held, job_wait)


def _nbytes(src: torch.UntypedStorage | np.ndarray) -> int:
    return int(src.nbytes()) if isinstance(src, torch.UntypedStorage) else int(src.nbytes)


def save_forked(
    encoded: Encoded,
    path: str,
    options: WriteOptions,
    *,
    within: CheckpointDir | None = None,
    output: Any = None,
    staged: ForkSnapshot | None = None,
) -> SaveHandle:
    """Fork a child that writes `encoded`'s chunks to a temp file as `options` say; return
    once it runs.  Encrypted (options.seal), the child encrypts each chunk with the file's data key (the engine's
    AES-256-GCM, in C) and leaves its tag where this process reads it; the index is sealed
    here, once the child is done.  Signed (options.sign), the child takes each chunk's
    SHA-256 the same way.  Incremental (options.dedup), the child digests every chunk,
    looks it up among the chunks the base holds (dedup.held_keys) and writes only those not
    found; this process then records the others as references (dedup.adopt).

    output: an object upload (storage/upload.py's ObjectFile, not yet entered) instead of
    an AtomicFile of `path` beneath `within`: the child writes the whole file into its spool
    (memory, until the upload), which this process's waiting thread uploads and commits.

    staged: a child forked earlier (take_snapshot) writes the chunks instead of one forked
    now; every storage of `encoded` must lie in the memory it snapshotted (SnapshotError).

    The child has inflight.DEADLINE seconds from now to say it is done; past them it is
    killed and the save fails (SnapshotError naming its pid and the deadline).

    A failure here (fork() refused, no descriptors left, an interrupt) leaves nothing
    behind: no temp file, no descriptor, no child, no save in flight."""
    if staged is not None:
        _check_covered(staged, encoded, path)
    handle = SaveHandle(path)
    handle.snapshot = "fork"
    deadline = inflight.Deadline(inflight.DEADLINE)  # when the child must be done by
    atomic = AtomicFile(path, within) if output is None else output
    atomic.__enter__()  # creation errors (missing directory, permissions) are raised now
    file_id = chunkwrite.new_file_id()
    own: list[int] = []  # descriptors this call closes if it fails
    child: _native.ForkedWrite | None = None
    # Whoever takes this cleans up: the waiter thread once it runs, or this call when it
    # fails before that (an interrupt can land in Thread.start() after the thread began).
    owner = threading.Lock()
    try:
        if options.dedup is not None:  # closed by this call's cleanup or by the waiter's
            options.dedup.claim()
        pieces = [c for plan in encoded.storages for c in chunkwrite.storage_chunks(plan, options.chunk_size)]
        if staged is not None:
            child, ready, alive_w = staged._hand(atomic.fd, file_id, pieces, options, path)
            own += [ready, alive_w]
        else:
            ready, ready_w = _pipe(own)  # the child writes a byte when it is done
            alive, alive_w = _pipe(own)  # the child exits when this reads end-of-file: we are gone
            child = _native.fork_write(
                atomic.fd,
                file_id,
                fmt.PROLOGUE_SIZE,
                pieces,
                options,
                _native.default_threads(),
                ready_w,
                alive,
                held=None if options.dedup is None else options.dedup.held_keys(),
            )
            for fd in (ready_w, alive):  # the child's ends
                own.remove(fd)
                os.close(fd)
        handle._pid = child.pid
        thread = threading.Thread(
            target=_finish,
            args=(handle, atomic, child, ready, alive_w, file_id, encoded, options, owner, deadline),
            name=f"ckptfmt-save-{os.path.basename(path)}",
            daemon=False,
        )
        handle._thread = thread
        inflight.begin(handle)
        thread.start()
    except BaseException as e:
        if not owner.acquire(blocking=False):
            # interrupted in start() after the waiter began: the save is its to finish, and
            # its error, if any, is raised by the next save like any unwatched one
            inflight.watch(handle)
            raise
        inflight.end(handle)
        if child is not None:
            _kill(child)
        for fd in own:
            os.close(fd)
        if options.dedup is not None:
            options.dedup.close()
        atomic.__exit__(None, None, None)
        if isinstance(e, OSError) and e.filename is None:
            raise type(e)(e.errno, f"cannot take a fork snapshot: {e.strerror}", path) from e
        raise
    inflight.watch(handle)
    return handle


def _check_covered(staged: ForkSnapshot, encoded: Encoded, path: str) -> None:
    """Every storage of `encoded` lies in memory `staged` snapshotted: one made after it (a
    copy the planner made) would be read by the child at an address it never held."""
    if staged.spent():
        raise SnapshotError("this fork snapshot was used or discarded already", path=path)
    for plan in encoded.storages:
        src = plan.source
        if not isinstance(src, (torch.UntypedStorage, np.ndarray)) or not staged.covers(
            _address(src), plan.nbytes
        ):
            staged.discard()
            raise SnapshotError(
                f"{plan.key or 'a storage'} is not in the memory the fork snapshot holds "
                "(made after the snapshot was taken); nothing was written",
                path=path,
            )


def _pipe(own: list[int]) -> tuple[int, int]:
    r, w = os.pipe()
    own += [r, w]
    return r, w


def _kill(child: _native.ForkedWrite) -> None:
    """Stop a child this process will not wait for, and reap it."""
    children.stop_child(child.pid)
    child.close()


#: while the child has not said it is done, check this often whether it died
_POLL_MS = 100


#: how _await's wait ended: the child said it is done, it ended, it was late (killed and reaped)
_DONE, _ENDED, _LATE = "done", "ended", "late"


def _await(pid: int, ready: int, deadline: inflight.Deadline) -> tuple[str, int | None]:
    """Wait until the child says it is done (a byte on `ready`) or has exited, until `deadline`.

    Returns how it ended (_DONE, _ENDED, _LATE) and its wait status: a child found dead
    is reaped here; one that wrote its byte (or whose end of the pipe closed) is reaped
    later, after the commit, as its exit unmaps its memory, which takes a while; one still
    at it past the deadline (stopped, or stuck writing) is killed and reaped.  A status of
    None: something else reaped it (SIGCHLD ignored, or a handler that waits for any child).
    The pipe alone would do where no other process holds its write end; polling
    waitpid covers a process forked elsewhere in the moment that end was open."""
    poller = select.poll()
    poller.register(ready, select.POLLIN)
    while not poller.poll(max(0, min(_POLL_MS, int(deadline.left() * 1000)))):
        ended, status = children.wait_child(pid, 0)  # one look, no wait
        if ended:
            return _ENDED, status
        if deadline.left() <= 0:
            return _LATE, children.stop_child(pid)
    return _DONE, None


def _reap(pid: int, deadline: inflight.Deadline) -> int | None:
    """Wait for a child that said it is done to exit (what is left of the deadline, and at
    least KILL_GRACE: its exit unmaps its memory), else kill it: its wait status, or None
    where something else reaped it."""
    reaped, status = children.wait_child(pid, max(deadline.left(), children.KILL_GRACE))
    return status if reaped else children.stop_child(pid)


def _how_it_ended(status: int | None, job_wait: float | None = None) -> str:
    """How a child ended, from its wait status; `job_wait`: a staged child's deadline for its job."""
    if status is None:
        return "ended"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == _native.NO_JOB_STATUS:
        within = "its deadline" if job_wait is None else f"its deadline of {job_wait:g} s"
        return f"exited with status {_native.NO_JOB_STATUS} (its job did not come within {within})"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"was killed by signal {sig} ({name})"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _check_report(
    records: list[ChunkRecord],
    end: int,
    encoded: Encoded,
    chunk_size: int,
    child: _native.ForkedWrite,
    findings: tuple[list[bytes], list[int]] | None,
    path: str,
) -> None:
    """SnapshotError unless the records the child reported (through memory it shares with this
    process) describe the chunks it was given as the writer lays them out: each written chunk
    of its piece's length, stored raw or smaller compressed, back to back from the prologue on,
    the last one ending where the child says the chunks end; and each chunk an incremental
    child says it found (`findings`) one of the held table it was given, of that length and
    digest.  A file is committed only when it is: an index built from garbage would replace
    the previous file with one no load can read, or refer to other bytes than the state's."""
    pos, k, pid = fmt.PROLOGUE_SIZE, 0, child.pid
    given = sum(-(-plan.nbytes // chunk_size) for plan in encoded.storages)
    if len(records) != given:
        raise SnapshotError(
            f"the process writing this save's snapshot (pid {pid}) reported {len(records)} chunks, "
            f"not the {given} it was given; nothing was committed",
            path=path,
        )
    digests, matches = findings if findings is not None else ([], [])
    held = child.held or []
    for plan in encoded.storages:
        for start in range(0, plan.nbytes, chunk_size):
            raw = min(chunk_size, plan.nbytes - start)
            offset, stored, raw_len, codec = records[k][:4]
            m = matches[k] if findings is not None else -1
            if m >= 0:
                if m >= len(held) or held[m] != (raw, digests[k]):
                    raise SnapshotError(
                        f"the process writing this save's snapshot (pid {pid}) reported chunk {k} found "
                        f"as held chunk {m}, which holds other bytes; nothing was committed",
                        path=path,
                    )
            else:
                sized = (
                    stored == raw if codec == fmt.CODEC_RAW else codec == fmt.CODEC_ZSTD and 0 < stored < raw
                )
                if offset != pos or raw_len != raw or not sized:
                    raise SnapshotError(
                        f"the process writing this save's snapshot (pid {pid}) reported chunk {k} at offset "
                        f"{offset}, {stored} of {raw_len} bytes stored, codec {codec}: not the chunk of "
                        f"{raw} bytes at {pos} it was given; nothing was committed",
                        path=path,
                    )
                pos = fmt.align_up(pos + stored)
            k += 1
    if end != pos:
        raise SnapshotError(
            f"the process writing this save's snapshot (pid {pid}) reported its chunks ending at {end}, "
            f"not at {pos}; nothing was committed",
            path=path,
        )


def _with_references(
    dedup: Dedup,
    findings: tuple[list[bytes], list[int]],
    records: list[ChunkRecord],
    tags: list[bytes] | None,
) -> list[ChunkRecord]:
    """The file's chunk records once an incremental child is done: the record of each chunk it
    found in an earlier file in place of the (unwritten) one it left; an encrypted file's tag
    of such a chunk is in the file that holds it (spec 17.9), zero here as ChunkWriter leaves it."""
    found = dedup.adopt(*findings)
    for k, held in enumerate(found):
        if held is not None:
            records[k] = held
            if tags is not None:
                tags[k] = bytes(len(tags[k]))
    return records


def _finish(
    handle: SaveHandle,
    atomic: AtomicFile,
    child: _native.ForkedWrite,
    ready: int,
    alive_w: int,
    file_id: bytes,
    encoded: Encoded,
    options: WriteOptions,
    owner: threading.Lock,
    deadline: inflight.Deadline,
) -> None:
    """Wait for the child (until `deadline`), then write the index, footer and prologue and commit."""
    if not owner.acquire(blocking=False):
        return  # save_forked failed first and has cleaned up
    exc: BaseException | None = None
    replaced: list[int] = []
    reaped = False
    try:
        how, status = _await(child.pid, ready, deadline)
        reaped = how != _DONE
        if how == _LATE:
            raise SnapshotError(
                f"the process writing this save's snapshot (pid {child.pid}) was not done within "
                f"the deadline of {deadline.seconds:g} s; it was killed and nothing was committed",
                path=handle.path,
            )
        written = child.outcome(handle.path)
        if written is None:
            if not reaped:  # its end closed the pipe
                status, reaped = _reap(child.pid, deadline), True
            raise SnapshotError(
                f"the process writing this save's snapshot (pid {child.pid}) {_how_it_ended(status)} "
                "before it finished; nothing was committed",
                path=handle.path,
            )
        records, end = written
        findings = child.findings() if options.dedup is not None else None
        _check_report(records, end, encoded, options.chunk_size, child, findings, handle.path)
        tags = child.tags() if options.seal is not None else None
        shas = child.shas() if options.sign is not None else None
        if options.dedup is not None and findings is not None:
            records = _with_references(options.dedup, findings, records, tags)
        length = chunkwrite.finish_file(atomic.fd, file_id, encoded, records, end, options, shas, tags)
        atomic.commit(free_replaced=replaced.append)
        handle.version = getattr(atomic, "etag", None)  # an object upload's
        handle._durable_now(length)
        if options.dedup is not None:  # off the commit's path: the file is durable already
            options.dedup.recheck()
    except BaseException as e:
        exc = e
    finally:
        os.close(ready)
        os.close(alive_w)
        child.close()
        if options.dedup is not None:  # its base: not left open by a failure's traceback
            options.dedup.close()
        try:
            inflight.close_then_settle(handle, lambda: atomic.__exit__(None, None, None), exc, replaced)
        finally:
            if not reaped:
                _reap(child.pid, deadline)
