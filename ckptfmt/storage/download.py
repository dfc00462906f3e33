"""Reading one object: its bytes fetched by ranged GETs into a Spool just before the engine
reads them.

``RemoteObject`` asks the store for the object's size and version (S3's ETag, GCS's
generation) once, then fetches its prologue, footer and index (the tail, in one request
where it is small), so the index parser reads the spool as it reads a local file.  Chunk
data is fetched by the chunk reader, window by window (``plan`` then ``start``), in
parallel requests, each pinned to the first version (S3's ``If-Match``, GCS's
``generation=``): an object replaced while it is read fails the request (StorageError)
instead of mixing two versions' bytes.  Every range is checked to be the one asked for; a connection
that drops mid-body is resumed from the byte it reached, a bounded number of times with
backoff, and a body that trickles in is cut off at a deadline per request.

Requests follow a grid: the object is cut into cells of ``request_size`` bytes from its
start, and no request crosses a cell's edge, so a load's requests are the cells it touches,
as a plain parallel download's are.  The bytes fetched and not yet given back are kept
track of, and a later plan leaves them out; a range asked for while it is in flight is not
asked for again: its fetch is waited for.  Several reads of the object at once (a Reader's
gets on several threads) share the spool: each says which ranges it reads from there until it
gives them back, and a range's pages are freed once no read uses them (holdings.py).  A
reader that will read the whole object (``read_ahead``) sends its requests in one wave, as a
plain download does: the tail, and the cells before it (up to READ_AHEAD_BYTES) at once,
the first of which reads the prologue into the spool; the others' answers wait, unread,
until the index is parsed and the chunk reader claims them (``start_into``): their bodies
then go straight into the tensors (the spool where a chunk needs it: engine/directread.py);
that wave is wave.py's.
A load under max_bytes reads nothing ahead: the bytes the spool holds (``occupied``) count
against that bound with the tensors, which only the parsed index tells.
Ranges given back have their pages freed on a thread of their own (it costs about as much
as filling them): the reader goes on meanwhile; a fetch into pages being freed waits first.
In a forked child its first use makes a spool, threads and books of its own (inherited.py).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any

from ..errors import CheckpointError, LimitError, StorageError
from ..format import layout as fmt
from . import client as s3
from .backends import store_for
from .holdings import Fetch, Holdings, Request, Started
from .inherited import Inherited, renewed_in_child
from .pools import pools_refuse_work, run_into, submit_or_run, wait_all, wait_quietly
from .rangedgets import RangedGets, Where
from .ranges import (
    MERGE_GAP,
    REQUEST_BYTES,
    merge_ranges,
    overlaps,
    plan_requests,
    routed,
    subtract_ranges,
    views_after,
)
from .readahead import SendOrder
from .spool import Spool
from .store import Store
from .urls import ObjectURL, parse_url
from .wave import ReadAheadWave

MiB = 1 << 20
#: the tail fetched with the footer: most indexes lie within it
TAIL_BYTES = 1 * MiB
#: objects larger than this are refused before anything is allocated: the spool maps the
#: whole object (sparse), and 16 TiB of address space is what a process can always map
MAX_OBJECT_BYTES = 1 << 44

#: what a reader of the whole object (read_ahead) asks for beyond the first cell before the
#: index is parsed: the chunk reader's requests in flight (fetchplan's FETCH_WINDOW x
#: FETCH_AHEAD) hold as much
READ_AHEAD_BYTES = 128 * MiB
#: bytes hashed per step when an object is read whole (sha256): several requests in parallel
HASH_WINDOW = 64 * MiB
#: seconds one ranged GET may take from its answer's head to its last byte (storage option
#: request_timeout): a body that trickles in (a byte every few seconds keeps read_timeout,
#: which bounds each wait for a byte, from ever firing) is cut off and the request retried
REQUEST_TIMEOUT = 120.0
#: what a reader of another object's chunks may fetch of that object's blocks between its
#: index and footer (the encryption block's tag table, 16 bytes a chunk: 4M chunks)
MAX_REFERENCE_BLOCKS = 64 * MiB

Range = tuple[int, int]


def head(url: ObjectURL, options: dict[str, Any]) -> tuple[int, str]:
    """The object's size and version (S3's ETag, GCS's generation), checked (one request;
    FileNotFoundError when absent)."""
    store = store_for(url, options)
    size, etag, _ = s3.request(str(url), "look up", lambda: store.head(url), options)
    if type(size) is not int or size < 0 or not isinstance(etag, str) or not etag:
        raise StorageError(
            f"the store's answer lacks the object's size or {store.version_name}", path=str(url)
        )
    if size > MAX_OBJECT_BYTES:
        raise LimitError(f"the object is {size} bytes, above the limit {MAX_OBJECT_BYTES}", path=str(url))
    return size, etag


class RemoteObject(Inherited, ReadAheadWave):
    """One object being read: its size and ETag, and a Spool holding the bytes fetched so far."""

    def __init__(
        self,
        url: str,
        options: dict[str, Any],
        *,
        max_bytes: int | None = None,
        etag: str | None = None,
        fetch_index: bool = True,
        read_ahead: bool = False,
    ) -> None:
        """`etag`: the version the caller checked before: another one is refused (StorageError);
        fetch_index=False: nothing is fetched until asked (for reading the object whole).
        read_ahead: the caller will read all of the object: its requests go out at once, their
        bodies read where the chunk reader says (_read_ahead)."""
        super().__init__()
        #: closed: the reads in progress fail with a CheckpointError saying so (_closed_error)
        self.closed = False
        self.path = url
        self.url: ObjectURL = parse_url(url)
        self.options = options
        self._store: Store = store_for(self.url, options)
        self._request_bytes = int(options.get("request_size", REQUEST_BYTES))
        self.spool: Spool | None = None
        self._own_state(0)
        #: the memory a load may take (its max_bytes), which the chunk reader's fetches keep
        #: within, with what the load allocates besides; None: unbounded
        self.max_bytes = max_bytes
        try:
            self.size, self.etag = self._head()
            self._book.size = self.size
            timeout = float(options.get("request_timeout", REQUEST_TIMEOUT))
            self._gets = RangedGets(self._store, self.url, url, self.size, self.etag, timeout)
            if etag is not None and self.etag != etag:
                raise StorageError(
                    f"the object was replaced after it was checked ({self._store.version_name} "
                    f"{etag}, now {self.etag})",
                    path=url,
                )
            try:
                self.spool = Spool(self.url.key.rsplit("/", 1)[-1], self.size)
            except OSError as e:
                raise LimitError(
                    f"cannot map an object of {self.size} bytes: {e.strerror}", path=url
                ) from None
            if fetch_index:
                self._fetch_index(max_bytes, read_ahead)
        except BaseException:
            self.close()
            raise

    @property
    @renewed_in_child
    def fd(self) -> int:
        if self.spool is None:
            raise self._closed_error()
        return self.spool.fd

    @renewed_in_child
    def dup_fd(self) -> int:
        """A descriptor of the spool for a reader, which closes it (a forked child's: spool.in_child)."""
        if self.spool is None:
            raise self._closed_error()
        return self.spool.dup()

    def _renew(self) -> None:
        """In a forked child, at its first use: a store, spool, threads, lock and books of its own,
        pinned to the version the parent opened; the spool empty (fetched again where needed)."""
        assert self.spool is not None  # one closed is no longer live (_disown)
        was, store = self._gets, store_for(self.url, self.options)  # the backends forgot the parent's
        gets = RangedGets(store, was.url, was.path, was.size, was.etag, was.timeout)
        try:
            spool = self.spool.in_child()
        except OSError as e:
            raise LimitError(f"cannot map a forked child's spool: {e.strerror}", path=self.path) from None
        self._store, self._gets, self.spool = store, gets, spool
        self._own_state(self.size)

    def _let_go(self) -> None:
        if self.spool is not None:
            self.spool.close()  # the child's descriptor and mapping: the pages stay the parent's
            self.spool = None

    def _own_state(self, size: int) -> None:
        """This process's threads, lock and books: what the spool holds, the requests in flight
        (the read-ahead wave's waiting to be told where their bodies go: _claim), the ranges reads
        use, and those given back whose pages are being freed (on a thread of their own, so that
        a reader goes on meanwhile: a fetch into them waits for that); all under _held_lock."""
        self._pool = ThreadPoolExecutor(s3.concurrency(self.options), thread_name_prefix="ckptfmt-download")
        self._book = Holdings(size)
        self._held_lock = threading.Lock()
        self._freer = ThreadPoolExecutor(1, thread_name_prefix="ckptfmt-free-spool")
        #: the most bytes of the spool occupied at once (occupied()), kept as ranges are asked for
        #: under a bound (max_bytes): summing the pages costs a pass over the ranges per fetch
        self.peak_bytes = 0

    def _head(self) -> tuple[int, str]:
        return head(self.url, self.options)

    def _fetch_index(self, max_bytes: int | None, read_ahead: bool) -> None:
        """Fetch the prologue and the tail; then the rest of the index if it starts before the
        tail (unless that is more than `max_bytes`: the index parser then refuses it).  With
        read_ahead, the bytes between them are asked for meanwhile, their bodies read once a
        reader says where they go (_read_ahead).  Not under `max_bytes`: what the load
        allocates is known only once the index is parsed, and the chunk reader fits its
        fetches into what the bound leaves then (engine/fetchread.py)."""
        tail = self._fetch_ends(read_ahead and max_bytes is None)
        footer = self._footer()
        if footer is None:
            return  # the parser, reading the spool, says what is wrong
        start = footer.index_offset
        if start < tail and (max_bytes is None or tail - start <= max_bytes):
            self.fetch([(start, tail)])

    def _fetch_ends(self, read_ahead: bool = False) -> int:
        """Fetch the prologue and the last TAIL_BYTES in parallel (with read_ahead, the bytes
        between them asked for meanwhile: _read_ahead); where the tail fetched begins."""
        size = self.size
        head = (0, min(size, fmt.PROLOGUE_SIZE))
        tail = (max(head[1], size - TAIL_BYTES), size)
        # at exit (pools refuse work: requests run on this thread, in turn) no wave: a deferred
        # request run here would wait for a claim only this thread could make
        ahead = read_ahead and tail[0] > head[1] and not pools_refuse_work()
        wave = self._wave(tail[0], READ_AHEAD_BYTES) if ahead else []
        if not wave:
            self.fetch([head, tail])
            return tail[0]
        order = SendOrder()
        with self._held_lock:
            (ends,) = self._made(self._book.make([tail]))
        self._hand_over([ends], lambda q: run_into(self._pool, q.future, self._get_tail, q, order))
        first = self._read_ahead(wave, head[1], order)
        self.wait([ends.future, first])
        return tail[0]

    def _footer(self) -> fmt.Footer | None:
        """The footer the fetched prologue and tail hold, checked; None if they hold none."""
        assert self.spool is not None
        try:
            head = bytes(self.spool.view(0, min(self.size, fmt.PROLOGUE_SIZE)))
            prologue = fmt.parse_prologue(head, self.size, self.path)
            at = prologue.file_length - fmt.FOOTER_SIZE
            return fmt.parse_footer(bytes(self.spool.view(at, at + fmt.FOOTER_SIZE)), prologue, self.path)
        except (CheckpointError, ValueError):
            return None

    @renewed_in_child
    def fetch_structure(self, *, tag_table: bool = False, max_blocks: int = MAX_REFERENCE_BLOCKS) -> None:
        """Fetch the prologue and the footer (with the tail they lie in), never the index,
        whatever size the footer gives it: what identifies the object (its length, file id
        and index checksum).  tag_table: also an encrypted object's blocks between its index
        and its footer, which a reader of its chunks from another file's index needs (spec
        17.9), at most `max_blocks` bytes (LimitError)."""
        tail = self._fetch_ends()
        footer = self._footer()
        assert self.spool is not None
        if footer is None or not tag_table:
            return  # a reader of the spool says what is wrong
        features = int.from_bytes(self.spool.view(40, 48), "little")
        blocks = fmt.align_up(footer.index_offset + footer.index_length)
        if not features & fmt.FEATURE_ENCRYPTED or blocks >= tail:
            return
        if self.size - blocks > max_blocks:
            raise LimitError(
                f"its encryption block and the blocks after it are {self.size - blocks} bytes, "
                f"above the limit {max_blocks} for a referenced object",
                path=self.path,
            )
        self.fetch([(blocks, tail)])

    # -- data ---------------------------------------------------------------

    @renewed_in_child
    def plan(self, ranges: Sequence[Range], cut: bool = True) -> list[Range]:
        """The requests `ranges` waits for, sorted: those in flight that overlap them, and those
        that would fetch the rest (the bytes held left out, near neighbours merged and cut at
        the object's grid: plan_requests).  cut=False: the rest as each stretch neither held
        nor being fetched, whole (no gap merged, no cut): what a read under a memory bound
        counts its windows by, then cuts at their grid."""
        with self._held_lock:
            waited, missing = self._book.requests_for(ranges)
        rest = plan_requests(missing, self._request_bytes) if cut else missing
        return sorted([q.range for q in waited] + rest)

    @renewed_in_child
    def start(
        self,
        ranges: Sequence[Range],
        cell: int | None = None,
        gap: int | None = None,
        uses: Sequence[Range] = (),
    ) -> Started:
        """Begin fetching `ranges` and `uses` into the spool (those bytes not held or on their
        way already, merged and cut by plan_requests: `cell` and `gap` there, default the
        object's request_size and MERGE_GAP); a request of the read-ahead wave among those in
        flight is claimed for the spool.  `uses`: the ranges the caller reads from the spool,
        each kept there until it gives it back (release), whatever other reads give back.  The
        futures finish when all of them is there: those of the requests made here, and those of
        requests in flight that bring some of their bytes (with what was asked for: wait)."""
        with self._held_lock:
            waited, missing = self._book.requests_for([*ranges, *uses])
            for q in waited:
                self._claim(q, ())  # a request of the read-ahead wave: its bytes to the spool
            self._book.use(uses)
            cut = cell or self._request_bytes
            made = self._made(self._book.make(plan_requests(missing, cut, MERGE_GAP if gap is None else gap)))
            if self.max_bytes is not None:  # the figure a bound is kept by (tests read it)
                self._note_occupied()
        # outside the lock, which _get takes (at exit it runs here)
        self._hand_over(made, lambda q: run_into(self._pool, q.future, self._get, q))
        asked = merge_ranges([*ranges, *uses])
        return Started([q.future for q in waited] + [q.future for q in made], asked, cell, gap)

    def _hand_over(self, made: list[Request], send: Callable[[Request], None]) -> None:
        """`send` each request registered as in flight; where one cannot be sent (no thread
        could start, an interrupt), it and those after it are cancelled before the error is
        raised (each leaves flight as it is cancelled: _made), else every later read of their
        bytes waits for them."""
        for i, q in enumerate(made):
            try:
                send(q)
            except BaseException as e:
                for q2 in made[i:]:
                    q2.future.cancel()  # never sent: never will be (one that started ends itself)
                if self.closed and isinstance(e, RuntimeError):  # the pool, shut down by close
                    raise self._closed_error() from None
                raise

    def _made(self, requests: list[Request]) -> list[Request]:
        """`requests`, registered in flight under _held_lock, each taken out of flight should
        it be cancelled before it starts (never sent, or its pool shut down): its fetch, which
        takes it out once over, never runs."""
        for q in requests:
            q.future.add_done_callback(partial(self._if_cancelled, q))
        return requests

    def _if_cancelled(self, request: Request, future: Future[None]) -> None:
        if future.cancelled():
            self._landed(request, ())

    @renewed_in_child
    def occupied(self) -> int:
        """Bytes of the spool held, on their way, or given back and not yet freed, in the
        whole pages they touch (a page two ranges share counted once): the memory this object
        takes now."""
        with self._held_lock:
            return self._book.occupied()

    @renewed_in_child
    def idle(self) -> int:
        """Bytes of the spool held that no read uses and no request brings in, in the whole
        pages they touch: what a read under a bound counts beside its own."""
        with self._held_lock:
            return self._book.idle()

    def _note_occupied(self) -> None:
        """Keep the most bytes occupied at once (peak_bytes), under _held_lock: after ranges
        are asked for, which is when the spool's part grows."""
        self.peak_bytes = max(self.peak_bytes, self._book.occupied())

    def wait(
        self,
        futures: Sequence[Future[None]],
        needs: Sequence[Range] | None = None,
        cell: int | None = None,
        gap: int | None = None,
        into: Sequence[Range] = (),
    ) -> None:
        """Wait for fetches `start` or `start_into` began (each ends within its Budget once it
        runs, a deferred one within its claim's and its body's, `concurrency` at a time); the
        first failure raised once all are over.  A request of another read's that was never
        sent (its hand-over to a thread failed: that read's failure, raised there) is asked for
        again here, within the storage deadline: the bytes of it this read `needs` in the spool
        (those its start asked for, where `futures` is what start returned; None: all its
        spool's bytes), by `cell` and `gap` as start takes them; a failure to send that is this
        read's own.  One never sent that was to bring bytes of `into` (this read's memory,
        start_into's targets) straight there is a StorageError: no spool holds them.
        Cancelled by close: CheckpointError saying so."""
        if isinstance(futures, Started):
            needs = futures.needs if needs is None else needs
            cell = futures.cell if cell is None else cell
            gap = futures.gap if gap is None else gap
        budget = s3.Budget(self.options)
        while True:
            wait_quietly(futures)
            unsent = [f.request for f in futures if isinstance(f, Fetch) and f.cancelled()]
            if unsent and self.closed:
                raise self._closed_error()
            wait_all([f for f in futures if not (isinstance(f, Fetch) and f.cancelled())])
            self._refuse_unsent_into(unsent, into)
            again = merge_ranges([p for q in unsent for p in q.spooled])
            if needs is not None:  # what of them this read needs, nothing more held for no read
                again = subtract_ranges(again, subtract_ranges(again, merge_ranges(needs)))
            if not again:
                return
            if budget.remaining() <= 0:
                lo, hi = again[0]
                raise StorageError(
                    f"read bytes {lo}-{hi - 1}: other reads' requests for them were never sent, "
                    f"again and again for {budget.deadline:g} s (storage option deadline)",
                    path=self.path,
                )
            futures = self.start(again, cell, gap)

    def _refuse_unsent_into(self, unsent: Sequence[Request], into: Sequence[Range]) -> None:
        """StorageError where a request never sent was to bring bytes of `into` (a read's own
        memory) straight there: asking for its spool's part alone would leave them missing."""
        mine = merge_ranges(into)
        for q in unsent:
            for lo, hi in subtract_ranges([q.range], q.spooled):
                if overlaps(mine, (lo, hi)):
                    raise StorageError(
                        f"read bytes {lo}-{hi - 1}: the request that was to bring them straight "
                        "into memory was never sent",
                        path=self.path,
                    )

    #: fetches whose outcome no longer matters waited for (a read that failed already): pools.py
    wait_quietly = staticmethod(wait_quietly)

    def fetch(self, ranges: Sequence[Range]) -> None:
        self.wait(self.start(ranges))

    @renewed_in_child
    def held_within(self, ranges: Sequence[Range]) -> list[list[Range] | None]:
        """For each of `ranges`: None where a request bringing bytes into the spool overlaps it
        (its bytes are read from there once in), else the parts of it the spool holds, sorted
        (none: it is untouched).  A reader may fetch such a range into memory of its own
        (start_into) without asking for any byte twice, the parts held copied out (copy_held):
        the index's tail, fetched before the index told where the chunks lie, holds the end of
        the last."""
        with self._held_lock:
            book = self._book
            fetching = merge_ranges([p for q in book.requests if q.deferred is None for p in q.spooled])
            return [
                None if overlaps(fetching, r) else subtract_ranges([r], subtract_ranges([r], book.held))
                for r in ranges
            ]

    @renewed_in_child
    def copy_held(self, targets: Sequence[tuple[int, memoryview]]) -> list[Range]:
        """Copy the bytes of `targets` ((offset in the object, the memory they go to)) that the
        spool holds into that memory, and give them back (freed where no other read uses them);
        the ranges copied."""
        with self._held_lock:
            copied = []
            for at, view in targets:
                r = (at, at + len(view))
                for lo, hi in subtract_ranges([r], subtract_ranges([r], self._book.held)):
                    with self._spool_view(lo, hi) as held:
                        view[lo - at : hi - at] = held
                    copied.append((lo, hi))
            self._book.use(copied)  # this read's own: giving back another read's use frees its pages
            self._give_back(copied)
        return copied

    @renewed_in_child
    def start_into(
        self,
        targets: Sequence[tuple[int, memoryview]],
        landed: Callable[[Range], None],
        spooled: Sequence[Range] = (),
        futures: list[Future[None]] | None = None,
        copied: Sequence[Range] = (),
    ) -> list[Future[None]]:
        """Begin fetching `targets` ((offset in the object, the memory its bytes go to), sorted,
        disjoint; less the `copied` ranges, in them already: copy_held) straight into that
        memory, and the `spooled` ranges into the spool: one plan for both (plan_requests: near
        neighbours merged, cut at the grid), each request's bytes going to the targets within
        it and its gaps to the spool (held once in), with the checks, retries and deadlines of
        a fetch into the spool; requests of the read-ahead wave are claimed so.  A target's
        bytes another read fetches meanwhile go to that read's memory or to the spool, never
        here: they are asked for again.  `landed` is called with each request's range on the
        thread that fetched it once all its bytes are in; the futures end after it (an
        exception it raises is theirs), appended to `futures` as the requests are made or
        claimed.  The caller keeps the memory alive until every future is done (wait or
        wait_quietly) and asks for none of the targets' bytes through the spool."""
        wanted = merge_ranges([(at, at + len(v)) for at, v in targets])
        with self._held_lock:
            book = self._book
            waited, missing = book.requests_for(spooled)
            claimed = book.deferred_within([*wanted, *spooled])
            for q in claimed:
                self._claim(q, targets, landed)
            fetch = subtract_ranges(wanted, merge_ranges([*copied, *(q.range for q in claimed)]))
            made = self._made(book.make(plan_requests([*fetch, *missing], self._request_bytes), wanted))
            futures = [] if futures is None else futures
            futures.extend(q.future for q in dict.fromkeys([*waited, *claimed]))
            futures.extend(q.future for q in made)

        def send(q: Request) -> None:  # outside the lock, which _get_into takes
            views, _ = routed(q.range, targets, self._spool_view)
            run_into(self._pool, q.future, self._get_into, q, views, landed)

        self._hand_over(made, send)
        return futures

    def _get_into(self, request: Request, views: list[memoryview], landed: Callable[[Range], None]) -> None:
        """A request start_into made: its bytes into `views`, the parts of them that go to the
        spool held once in, then `landed`."""
        held: list[Range] = []
        try:
            self._get_range(*request.range, lambda skip: views_after(views, skip))
            held = request.spooled
            landed(request.range)
        finally:
            self._landed(request, held)

    def _spool_view(self, lo: int, hi: int) -> memoryview:
        if self.spool is None:
            raise self._closed_error()
        return self.spool.view(lo, hi)

    def _closed_error(self) -> CheckpointError:
        """What a read of the object closed meanwhile (or before it) fails with: never a bare
        assertion, a closed descriptor's EBADF or a cancelled fetch."""
        return CheckpointError("the object was closed while a read of it was in progress", path=self.path)

    @renewed_in_child
    def release(self, ranges: Sequence[Range], wait: bool = False) -> None:
        """Give back ranges already read, one use of each (start's `uses`): the memory of those
        no other read uses and no request brings in (fetched again if asked for again), its
        pages freed on the freeing thread; `wait`: return once they are freed (a reader within
        a memory bound asks for more only then), within the deadline (_wait_freed)."""
        with self._held_lock:
            pages = self._give_back(ranges)
        if wait and pages:
            self._wait_freed(pages[0][0], pages[-1][1], s3.Budget(self.options), "give back")

    def _give_back(self, ranges: Sequence[Range]) -> list[Range]:
        """release's bookkeeping, under _held_lock: the ranges whose pages are being freed."""
        spool = self.spool
        if spool is None:
            return []
        pages = self._book.give_back(ranges)
        self._book.freeing.extend((r, submit_or_run(self._freer, spool.release, *r)) for r in pages)
        return pages

    def _wait_freed(self, lo: int, hi: int, budget: s3.Budget, doing: str = "read") -> None:
        """Wait until the pages of ranges given back that overlap [lo, hi) are freed, so that
        freeing them cannot wipe what a fetch is about to write there (or, `doing` "give back",
        so that a reader within a bound asks for more only then); StorageError naming the URL
        where that takes longer than what remains of `budget`'s deadline."""
        with self._held_lock:
            pending = self._book.freeing_within(lo, hi)
        for f in pending:
            try:
                f.result(timeout=budget.remaining())
            except FutureTimeout:
                raise StorageError(
                    f"{doing} bytes {lo}-{hi - 1}: the pages given back there were not freed within "
                    f"{budget.deadline:g} s (storage option deadline)",
                    path=self.path,
                ) from None

    def _landed(self, request: Request, held: Sequence[Range]) -> None:
        """`request` is over: the `held` parts of it are in the spool (none where it failed:
        asked for again by the next plan that needs them)."""
        with self._held_lock:
            self._book.over(request, held)

    def _get(self, request: Request, failed: Callable[[], None] | None = None) -> None:
        """Fetch `request`'s range into the spool (a request start made: held once over, else
        no longer in flight); `failed` called as each failed attempt ends."""
        held: list[Range] = []
        try:
            self._get_range(*request.range, failed=failed)
            held = [request.range]
        finally:
            self._landed(request, held)

    def _get_range(
        self, lo: int, hi: int, where: Where | None = None, failed: Callable[[], None] | None = None
    ) -> None:
        """Fetch [lo, hi) into the spool (or where `where` says once an answer's head is in:
        views that hold its bytes from a given one on, in order), resuming after a dropped
        connection or a body cut at its deadline from the byte it reached, within one Budget
        (attempts and deadline); `failed` called as each failed attempt ends."""
        budget = s3.Budget(self.options)
        self._wait_freed(lo, hi, budget)
        spooled: Where = lambda got: [self._spool_view(lo + got, hi)]  # noqa: E731
        self._gets.get(lo, hi, where or spooled, budget, failed)

    @renewed_in_child
    def sha256(self) -> bytes:
        """SHA-256 of the object's whole bytes, fetched window by window (the next one while
        this one is hashed, each given back once hashed, or once the hash failed)."""
        windows = [(lo, min(lo + HASH_WINDOW, self.size)) for lo in range(0, self.size, HASH_WINDOW)]
        digest, using = hashlib.sha256(), windows[:1]
        pending: list[Future[None]] = []
        assert self.spool is not None
        try:
            pending = self.start((), uses=using)
            for i, (lo, hi) in enumerate(windows):
                self.wait(pending)
                using = windows[i : i + 2]
                pending = self.start((), uses=windows[i + 1 : i + 2])
                with self.spool.view(lo, hi) as window:
                    digest.update(window)
                using = windows[i + 1 : i + 2]
                self.release([(lo, hi)])
        finally:
            self.wait_quietly(pending)
            self.release(using)
        return digest.digest()

    def close(self) -> None:
        """Close the spool and end the fetches: those not begun are cancelled (a read waiting
        for them fails with a CheckpointError saying the object was closed), those begun end
        first; a read that goes on with the object after this fails so too."""
        self.closed = True
        if self._disown():
            return  # a forked child's that never used it: the parent's threads and books untouched
        with self._held_lock:
            for q in self._book.requests:
                if q.deferred is not None:
                    q.deferred.order.fail()  # read-ahead not sent yet never is
                    self._claim(q, None)  # read-ahead no one claimed: its body is left unread
        self._pool.shutdown(wait=True, cancel_futures=True)  # read-ahead no one waits for
        if self.spool is not None:
            # its pages freed on the freeing thread after the ranges given back: the caller goes on
            self.spool.close(free_on=self._freer)
            self.spool = None
        self._freer.shutdown(wait=False)
