"""Writing one object the way AtomicFile writes one file: all of it, or nothing visible.

The engine writes the file into a Spool at its final offsets.  Each time it reports how far
it has written (``written(pos)``), every part wholly below that position is handed to a pool
of upload threads and released from the spool once stored; the writer waits only when more
than a bounded number of bytes are still in flight.  Part 1 holds the prologue, which the
engine writes last, so it is uploaded last, by its number: S3 assembles parts by number, not
by arrival (GCS composes its parts by the order named).  ``commit`` uploads what is left and
completes the upload (one request when the whole object fits in one part); the object appears
at once, whole, as a rename makes a file appear.  Any failure aborts the upload, so no parts
are left behind to pay for and nothing is committed.  The requests are the store's
(storage/store.py: S3's multipart upload, GCS's parts composed), the order, bounds and
retries are written here once.
"""

from __future__ import annotations

import functools
import os
import secrets
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import TracebackType
from typing import Any

from ..errors import CheckpointError, ObjectExistsError, StorageError
from . import client as s3
from . import lost_answer
from .backends import store_for
from .pools import submit_or_run
from .spool import Spool
from .store import Store
from .urls import ObjectURL, parse_url

MiB = 1 << 20
MIN_PART = 8 * MiB  # S3's minimum is 5 MiB for every part but the last
MAX_PARTS = 10_000  # S3's maximum part count
COMPLETE = "complete multipart upload"


#: the uploads in parts this process has begun and not yet ended, by upload id: never a crashed
#: writer's leftover, whatever a store stamps as their start (moto stamps every upload 2010)
_live_uploads: set[str] = set()
_live_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child writes none of its parent's uploads (its lock may have been held)."""
    global _live_lock
    _live_lock = threading.Lock()
    _live_uploads.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def uploading(upload_id: str) -> bool:
    """Whether this process is writing the upload in parts `upload_id` now."""
    with _live_lock:
        return upload_id in _live_uploads


def part_size_for(estimate: int, requested: int | None = None) -> int:
    """Parts of `requested` bytes (MiB multiples, at least 8 MiB), grown so that an object of up
    to `estimate` bytes needs no more than S3's 10,000 parts."""
    size = max(MIN_PART, requested or 16 * MiB)
    need = -(-estimate // (MAX_PARTS - 1))
    size = max(size, need)
    return -(-size // MiB) * MiB


class ObjectFile:
    """An object being written through a Spool; committed by `commit`, else aborted on exit.

    `capacity`: an upper bound of the object's length (the spool is that large, sparse).
    """

    def __init__(self, url: str, options: dict[str, Any], capacity: int, *, if_absent: bool = False) -> None:
        self.path = url
        self.url: ObjectURL = parse_url(url)
        self.options = options
        self.if_absent = if_absent
        #: drawn for this write alone and stored with its object, where it is created only if
        #: absent: what tells the object this write made from another writer's when an
        #: answer is lost (lost_answer.made_by); its bytes may be another writer's too
        self.token: str | None = secrets.token_hex(16) if if_absent else None
        self.part_size = part_size_for(capacity, options.get("part_size"))
        self._capacity = capacity
        self._threads = s3.concurrency(options)
        self._max_in_flight = self._threads * self.part_size
        self.spool: Spool | None = None
        self.fd = -1
        self._store: Store | None = None
        #: the request that begins the upload in parts, sent on the pool once the object is
        #: known to need more than one part (its answer, the upload's id, awaited by each part)
        self._started: Future[str] | None = None
        self._upload_id: str | None = None  # in _live_uploads until close()
        self._next_part = 2  # part 1 (the prologue's) goes last
        self._done: dict[int, str] = {}  # part number -> what completing the upload names
        #: the requests on the pool that have not ended, each with the spool's bytes it holds
        #: (0 for the one that begins the upload), under _cond: what bounds the bytes in
        #: flight, and what commit and abort wait for.  A request drops out as it ends, so
        #: there are never more than the pool's threads and the one waiting (a save of 400 GiB
        #: sends 25,000 parts).
        self._in_flight: dict[Future[Any], int] = {}
        #: the first failure of a request on the pool, set under _cond: what written() raises,
        #: looked at in O(1) every 16 MiB rather than by scanning every request made
        self._failure: BaseException | None = None
        self._failure_raised = False
        self._cond = threading.Condition()
        self._pool: ThreadPoolExecutor | None = None
        self._committed = False
        #: the version the store gave the object once committed (S3's ETag, GCS's generation;
        #: None before, or if it gave none): what this writer, and no other, wrote at the URL
        #: (what a conditional delete names)
        self.etag: str | None = None

    def __enter__(self) -> ObjectFile:
        self._store = store_for(self.url, self.options)
        self.spool = Spool(self.url.key.rsplit("/", 1)[-1], self._capacity)
        self.fd = self.spool.fd
        return self

    # -- parts as the writer goes ------------------------------------------

    def written(self, pos: int) -> None:
        """The writer has written every byte below `pos`: upload the parts that are complete
        (never part 1), waiting while too many bytes are in flight.  The upload in parts is
        begun as soon as the object has more than one part's bytes, while the writer goes on
        (a request of 6-16 ms on moto that the first part waited for)."""
        if pos > self.part_size:
            self._begin_parts()
        while self._next_part * self.part_size <= pos:
            # looked at before each part, not once per report: a threaded or compressed save
            # reports every few chunks, and parts sent after a failure are paid for and waited on
            self._raise_failed()
            self._submit(self._next_part, pos)
            self._next_part += 1
        self._raise_failed()

    def _begin_parts(self) -> None:
        """Make the pool of upload threads and send the request that begins the upload in
        parts on it, once: the parts wait on it there, not the writer."""
        if self._started is not None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="ckptfmt-upload")
        self._started = self._send(0, self._create_multipart)

    def _submit(self, number: int, length: int) -> None:
        start = (number - 1) * self.part_size
        end = min(number * self.part_size, length)
        self._send(end - start, self._upload_part, number, start, end)

    def _send(self, nbytes: int, request: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run `request(*args)` on the pool, holding `nbytes` of the spool until it ends: first
        wait while the bytes in flight would go over the bound.  Called by the writer's thread
        alone, so the room waited for is still there when the request is counted in."""
        assert self._pool is not None
        with self._cond:
            # bounded by the requests' deadlines: at most `threads` parts are in flight, each
            # running (or queued behind the upload's start alone) and ending, notified, within
            # the start's Budget and its own
            while (held := sum(self._in_flight.values())) and held + nbytes > self._max_in_flight:
                self._cond.wait()
        future = submit_or_run(self._pool, self._kept, request, *args)
        with self._cond:
            self._in_flight[future] = nbytes
        future.add_done_callback(self._ended)  # at once where it has ended already
        return future

    def _kept(self, request: Callable[..., Any], *args: Any) -> Any:
        """`request(*args)`, run on the pool; its failure kept as the upload's (the first
        one only), its frames' locals let go of (see _drop_locals), and raised again: the
        future's outcome."""
        outer = sys.exc_info()[1]  # at exit this runs on the caller's thread
        try:
            return request(*args)
        except BaseException as e:
            _drop_locals(e, outer)
            with self._cond:
                if self._failure is None:
                    self._failure = e
            raise

    def _ended(self, future: Future[Any]) -> None:
        with self._cond:
            self._in_flight.pop(future, None)
            self._cond.notify_all()

    def _create_multipart(self) -> str:
        store, u = self._store, self.url
        assert store is not None
        upload_id = s3.request(
            str(u), "start multipart upload", lambda: store.start_upload(u, self.token), self.options
        )
        with _live_lock:
            _live_uploads.add(upload_id)
        self._upload_id = upload_id
        return upload_id

    def _upload_part(self, number: int, start: int, end: int) -> None:
        assert self.spool is not None and self._store is not None and self._started is not None
        store, u = self._store, self.url
        if self._started.exception() is not None:  # waits; its failure is kept, not raised again
            return
        upload_id = self._started.result()
        # each attempt sends all of the part; held by `send` alone, let go of below: a
        # failure kept to be raised later must not pin the spool through this frame
        send = functools.partial(store.put_part, u, upload_id, number, self.spool.view(start, end))
        what = f"upload part {number} (bytes {start}-{end - 1})"
        try:
            self._done[number] = s3.request(str(u), what, send, self.options)
        except FileNotFoundError as e:  # the store's "no such upload": not a missing object
            raise StorageError(
                f"{what}: the upload in parts, or its bucket, is gone (aborted by a lifecycle "
                "rule or another program's cleanup?)",
                path=self.path,
            ) from e
        finally:
            del send
        if number != 1:
            self.spool.release(start, end)

    def _raise_failed(self) -> None:
        """Raise the first failure of a request on the pool, if one has failed: itself the
        first time, a StorageError naming it after that (each raise of one exception object
        adds the frames it passes through to its traceback, and sets its context anew)."""
        with self._cond:
            failure, raised = self._failure, self._failure_raised
            self._failure_raised = failure is not None
        if failure is None:
            return
        if not raised:
            raise failure
        why = failure.reason if isinstance(failure, CheckpointError) else repr(failure)
        raise StorageError(f"the upload failed earlier: {why}", path=self.path) from failure

    def _wait_in_flight(self) -> None:
        """Wait for every request on the pool to end (each within its own deadline; a
        failure is kept in _failure)."""
        with self._cond:
            pending = list(self._in_flight)
        wait(pending)

    def _wait_all(self) -> None:
        self._wait_in_flight()
        self._raise_failed()

    # -- the end -----------------------------------------------------------

    def commit(self, *, free_replaced: Callable[[int], None] | None = None) -> None:
        """Upload what is left and make the object appear, whole (StorageError on failure,
        FileExistsError where `if_absent` and the object exists).  `free_replaced` is
        AtomicFile's: an object replaced in the store holds nothing open here."""
        assert self.spool is not None
        length = os.fstat(self.fd).st_size
        if self._started is None and length <= self.part_size:
            self._put_whole(length)
        else:
            self.written(length)
            if (self._next_part - 1) * self.part_size < length:  # the last, shorter part
                self._submit(self._next_part, length)
            self._submit(1, length)
            self._wait_all()
            self._complete(length)
        self._committed = True

    def _put_whole(self, length: int) -> None:
        assert self.spool is not None and self._store is not None
        # the view held by `put` alone, let go of below: an error the caller keeps must not
        # pin the spool through this frame (as _upload_part's)
        body = self.spool.view(0, length) if length else memoryview(b"")  # an empty spool maps nothing
        put = functools.partial(self._store.put, self.url, body, if_absent=self.if_absent, token=self.token)
        del body
        outer = sys.exc_info()[1]
        try:
            self._creating("upload", put, length)
        except BaseException as e:
            _drop_locals(e, outer)
            raise
        finally:
            del put

    def _complete(self, length: int) -> None:
        assert self._store is not None and self._started is not None
        store, u, upload_id, parts = self._store, self.url, self._started.result(), dict(self._done)
        count = -(-length // self.part_size)
        if sorted(parts) != list(range(1, count + 1)):
            # every part that failed set _failure before its request ended; this guards that
            # rule: an upload is never completed with a part missing
            raise StorageError(
                f"complete multipart upload: {len(parts)} of its {count} parts stored", path=self.path
            )
        made_earlier = self._creating(
            COMPLETE,
            lambda: store.complete_upload(u, upload_id, parts, if_absent=self.if_absent, token=self.token),
            length,
        )
        if made_earlier and store.parts_outlive_completion:
            # the attempt that made the object left what a successful completion clears (GCS's
            # part objects) to the retry that was refused: cleared here, best effort (S3's and
            # Azure's completion leaves nothing to abort)
            self._abort_started()
        self._started = None

    def _creating(self, operation: str, call: Callable[[], str | None], length: int) -> bool:
        """The request that makes the object appear, its version kept; where `if_absent`, an
        object already there is ObjectExistsError (a FileExistsError; a store without
        conditional writes replaces it), unless an earlier attempt of this request got no
        definite answer and the object there is the one it made (lost_answer.made_by): a
        retry refused by the object its own first attempt made.  Whether that was so."""
        unanswered = False
        budget = s3.Budget(self.options)
        attempts: list[BaseException] = []

        def failed(e: BaseException) -> None:
            nonlocal unanswered
            unanswered = unanswered or lost_answer.outcome_unknown(e)
            attempts.append(e)

        try:
            self.etag = budget.run(str(self.url), operation, call, failed=failed)
            return False
        except (StorageError, FileNotFoundError) as e:
            lost_answer.note_attempts(e, attempts)  # the commit's judge of a record that may land
            if not self.if_absent:
                raise
            lost = unanswered and lost_answer.refused_as_made(e, completing=operation == COMPLETE)
            if not lost and not lost_answer.refused_as_made(e, completing=False):
                raise
            version = self._made_earlier(budget, operation, length) if lost else None
            if version is None and isinstance(e, FileNotFoundError):
                raise  # the upload is gone, and no object of this write's is there
        if version is None:
            raise ObjectExistsError(
                f"{operation}: the object exists already (written only if absent: another writer created it)",
                path=str(self.url),
            ) from None
        self.etag = version
        return True

    def _made_earlier(self, budget: s3.Budget, operation: str, length: int) -> str | None:
        """The version of the object at the URL where an earlier attempt of this write made
        it (lost_answer.made_by, within what is left of the write's `budget`); None where it
        is another writer's."""
        assert self._store is not None and self.token is not None
        held = self._held(length)
        try:
            return lost_answer.made_by(
                self._store, self.url, self.options, budget, operation, length, held, self.token
            )
        finally:
            held.release()

    def _held(self, length: int) -> memoryview:
        """What the spool still holds of the object from its start: all of it where written
        by one request, else part 1 (never released before close)."""
        assert self.spool is not None
        held = min(length, self.part_size)
        return self.spool.view(0, held) if held else memoryview(b"")

    def abort(self) -> None:
        """Stop: wait for parts in flight, abort the multipart upload (best effort: a store
        that cannot be reached leaves it to the bucket's lifecycle rule and `cleanup`)."""
        self._wait_in_flight()  # failures are the reason we are here
        self._abort_started()

    def _abort_started(self) -> None:
        """Abort the upload in parts begun, if one was (best effort)."""
        started, self._started = self._started, None
        if started is not None and started.exception() is None and self._store is not None:
            store, u, upload_id = self._store, self.url, started.result()
            try:
                s3.request(
                    str(u), "abort multipart upload", lambda: store.abort_upload(u, upload_id), self.options
                )
            except Exception:  # best effort: the save's own error, if any, is what counts
                pass

    def close(self) -> None:
        """Close the spool; the pages it still holds (the prologue's part, never released) are
        freed by the upload pool's last task, after the save returns: freeing them took 4-13 ms
        of a 64 MiB save, after its object had appeared."""
        pool, self._pool = self._pool, None
        if self._upload_id is not None:
            with _live_lock:
                _live_uploads.discard(self._upload_id)
            self._upload_id = None
        if self.spool is not None:
            self.spool.close(free_on=pool)  # None: here
            self.spool = None
            self.fd = -1
        if pool is not None:
            pool.shutdown(wait=False)  # its threads end once the queued freeing is done

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if not self._committed:
                self.abort()
        finally:
            self.close()


def _drop_locals(error: BaseException, outer: BaseException | None = None) -> None:
    """Clear the locals of the finished frames in `error`'s tracebacks (its causes' too): the
    requests' frames hold the part's view of the spool, and a failure kept to be raised later
    would keep the spool's mapping, and all its pages, alive with it.  The walk stops at
    `outer`, the exception the caller was handling when the request began (a save made in an
    `except` block): its frames are the caller's, kept whole for its debugging."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen and e is not outer:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


def upload_file(fd: int, url: str, options: dict[str, Any], *, if_absent: bool = False) -> int:
    """Copy the local file open as `fd` to the object `url`, part by part through a spool (its
    memory bounded by the parts in flight); committed whole or not at all.  Returns its length."""
    length = os.fstat(fd).st_size
    with ObjectFile(url, options, length, if_absent=if_absent) as out:
        assert out.spool is not None
        pos = 0
        while pos < length:
            n = min(out.part_size, length - pos)
            _read_part(fd, out.spool.view(pos, pos + n), pos, url)
            pos += n
            out.written(pos)
        out.commit()
    return length


def _read_part(fd: int, view: memoryview, pos: int, url: str) -> None:
    """Fill `view` from `fd` at `pos` (OSError where the file ends first).  A function of its
    own so that no frame an upload's error passes through holds the spool's view."""
    try:
        got = 0
        while got < len(view):
            k = os.preadv(fd, [view[got:]], pos + got)
            if not k:
                raise OSError(5, "the file shrank while it was uploaded", url)
            got += k
    finally:
        del view  # an error raised here keeps this frame


def upload_bytes(data: bytes, url: str, options: dict[str, Any]) -> None:
    """Write the small object `url` holding `data` (not empty), whole, in one request."""
    with ObjectFile(url, options, len(data)) as out:
        assert out.spool is not None
        out.spool.view(0, len(data))[:] = data
        out.commit()
