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
track of, and a later plan leaves them out: a reader that will read the whole object
(``read_ahead``) fetches the first cell and the last ones, whose prologue, footer and index
it needs at once, and the chunk reads then reuse their data instead of asking again (on
some servers every request costs a pass over the whole object).  A reader of one key pays
for it: its first reads are up to a few cells, not a few bytes, so it is not the default.
Such a reader also has the cells after the first (up to READ_AHEAD_BYTES) asked for at once,
beside the first and the last, rather than once the index is parsed: a load's requests then
go out in one wave, as a plain download's do.  A load under max_bytes reads no cell ahead:
the bytes the spool holds (``occupied``) count against that bound with the tensors, which
only the parsed index tells.  A range asked for while it is in flight is
not asked for again: its fetch is waited for.
Ranges given back have their pages freed on a thread of their own (freeing costs about as
much as filling them), so the reader goes on to its next window meanwhile; a fetch into
pages still being freed waits for that first.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ..engine.fetchplan import paged_bytes
from ..errors import CheckpointError, LimitError, StorageError
from ..format import layout as fmt
from . import client as s3
from .backends import store_for
from .spool import PAGE, Spool
from .store import Store
from .urls import ObjectURL, parse_url

MiB = 1 << 20
#: the tail fetched with the footer: most indexes lie within it
TAIL_BYTES = 1 * MiB
#: one request asks for at most this much (storage option request_size): larger ranges are
#: split so they run in parallel; 8-16 MiB is the usual advice for S3, and every request
#: costs a round trip (and, on some servers, a pass over the whole object)
REQUEST_BYTES = 16 * MiB
#: adjacent ranges closer than this are fetched in one request
MERGE_GAP = 64 * 1024
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


def plan_requests(
    ranges: Sequence[Range], max_bytes: int = REQUEST_BYTES, gap: int = MERGE_GAP
) -> list[Range]:
    """The requests that fetch `ranges` (half-open): sorted, near neighbours merged, long
    stretches cut at the multiples of `max_bytes` (the grid), so none crosses a cell."""
    out: list[Range] = []
    for lo, hi in merge_ranges(ranges, gap):
        edges = [lo, *range((lo // max_bytes + 1) * max_bytes, hi, max_bytes), hi]
        out.extend(zip(edges, edges[1:]))
    return out


def merge_ranges(ranges: Sequence[Range], gap: int = 0) -> list[Range]:
    """`ranges` sorted, empty ones dropped, those overlapping or closer than `gap` joined."""
    merged: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if merged and lo <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def subtract_ranges(ranges: Sequence[Range], held: Sequence[Range]) -> list[Range]:
    """The parts of `ranges` outside `held` (sorted and disjoint, as merge_ranges gives)."""
    out: list[Range] = []
    for lo, hi in merge_ranges(ranges):
        i = max(0, bisect.bisect_right(held, (lo, lo)) - 1)
        while lo < hi and i < len(held) and held[i][0] < hi:
            a, b = held[i]
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
            i += 1
        if lo < hi:
            out.append((lo, hi))
    return out


def _overlaps(ranges: Sequence[Range], r: Range) -> bool:
    """Whether `r` overlaps any of `ranges` (sorted and disjoint, as merge_ranges gives)."""
    i = bisect.bisect_left(ranges, (r[1], r[1]))  # the first range starting at or after r's end
    return i > 0 and ranges[i - 1][1] > r[0]


def _page_edges(r: Range, taken: Sequence[Range], size: int) -> Range:
    """Range `r` given back, widened to the edges of the pages it ends in where nothing else
    of those pages is held or in flight (`taken`, sorted and disjoint): the spool frees only
    whole pages, and a page two ranges share would otherwise stay once both are given back."""
    lo, hi = r
    floor, ceil = grid_cells(lo, hi, PAGE, size)
    if floor < lo and not _overlaps(taken, (floor, lo)):
        lo = floor
    if hi < ceil and not _overlaps(taken, (hi, ceil)):
        hi = ceil
    return lo, hi


def grid_cells(lo: int, hi: int, cell: int, size: int) -> Range:
    """[lo, hi) widened to the edges of the grid cells it touches, within [0, size)."""
    return lo // cell * cell, min(size, -(-hi // cell) * cell)


def head(url: ObjectURL, options: dict[str, Any]) -> tuple[int, str]:
    """The object's size and version (S3's ETag, GCS's generation), checked (one request;
    FileNotFoundError when absent)."""
    store = store_for(url, options)
    size, etag = s3.request(str(url), "look up", lambda: store.head(url), options)
    if type(size) is not int or size < 0 or not isinstance(etag, str) or not etag:
        raise StorageError(
            f"the store's answer lacks the object's size or {store.version_name}", path=str(url)
        )
    if size > MAX_OBJECT_BYTES:
        raise LimitError(f"the object is {size} bytes, above the limit {MAX_OBJECT_BYTES}", path=str(url))
    return size, etag


def _tag_value(etag: object) -> object:
    """An ETag as compared between answers: a weak marker and the quotes, which a proxy may
    add or drop, set aside."""
    if not isinstance(etag, str):
        return etag
    return etag.removeprefix("W/").strip('"')


class RemoteObject:
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
        read_ahead: the caller will read all of the object: the first reads take whole grid
        cells, whose data the chunk reads then reuse (fewer requests in all)."""
        self.path = url
        self.url: ObjectURL = parse_url(url)
        self.options = options
        self._store: Store = store_for(self.url, options)
        self._request_bytes = int(options.get("request_size", REQUEST_BYTES))
        self._timeout = float(options.get("request_timeout", REQUEST_TIMEOUT))
        self._pool = ThreadPoolExecutor(s3.concurrency(options), thread_name_prefix="ckptfmt-download")
        self.spool: Spool | None = None
        # the ranges fetched and not given back since (sorted, disjoint), and those being
        # fetched (each request's range and its future): plans leave both out
        self._held: list[Range] = []
        self._in_flight: dict[Range, Future[None]] = {}
        self._held_lock = threading.Lock()
        # ranges given back whose pages are still being freed (on their own thread, so that
        # the reader goes on to its next window meanwhile): a fetch into one waits for them
        self._freeing: list[tuple[Range, Future[None]]] = []
        self._freer = ThreadPoolExecutor(1, thread_name_prefix="ckptfmt-free-spool")
        #: the memory a load may take (its max_bytes), which the chunk reader's fetches keep
        #: within, with what the load allocates besides; None: unbounded
        self.max_bytes = max_bytes
        #: the most bytes of the spool occupied at once (occupied()), kept as ranges are asked for
        self.peak_bytes = 0
        try:
            self.size, self.etag = self._head()
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
    def fd(self) -> int:
        assert self.spool is not None
        return self.spool.fd

    def _head(self) -> tuple[int, str]:
        return head(self.url, self.options)

    def _fetch_index(self, max_bytes: int | None, read_ahead: bool) -> None:
        """Fetch the prologue and the tail; then the rest of the index if it starts before the
        tail (unless that is more than `max_bytes`: the index parser then refuses it).  With
        read_ahead, whole grid cells: the first one and those the tail and the index lie in, and
        those after the first asked for meanwhile (READ_AHEAD_BYTES).  Not under `max_bytes`:
        what the load allocates is known only once the index is parsed, and the chunk reader
        fits its fetches into what the bound leaves then (engine/fetchread.py)."""
        read_ahead = read_ahead and max_bytes is None
        tail = self._fetch_ends(read_ahead)
        footer = self._footer()
        if footer is None:
            return  # the parser, reading the spool, says what is wrong
        start = footer.index_offset
        if start < tail and (max_bytes is None or tail - start <= max_bytes):
            if read_ahead:
                start = grid_cells(start, tail, self._request_bytes, self.size)[0]
            self.fetch([(start, tail)])

    def _fetch_ends(self, read_ahead: bool = False) -> int:
        """Fetch the prologue and the last TAIL_BYTES (with read_ahead: the grid cells they lie
        in, and READ_AHEAD_BYTES of cells after the first asked for meanwhile) in parallel; where
        the tail fetched begins."""
        size = self.size
        head = (0, min(size, fmt.PROLOGUE_SIZE))
        tail = (max(0, size - TAIL_BYTES), size)
        if read_ahead:
            head = grid_cells(*head, self._request_bytes, size)
            tail = grid_cells(*tail, self._request_bytes, size)
        ends = self.start([head, tail])
        if read_ahead:
            self._read_ahead(tail[0], READ_AHEAD_BYTES)
        self.wait(ends)
        return tail[0]

    def _read_ahead(self, tail: int, ahead: int) -> None:
        """Ask for the whole cells between the first and the tail (`ahead` bytes at most) without
        waiting for them: the chunk reads wait for them as they would for their own requests."""
        cell = self._request_bytes
        start = min(cell, tail)
        self.start([(start, min(tail, start + ahead // cell * cell))])

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

    def plan(self, ranges: Sequence[Range], cell: int | None = None, gap: int | None = None) -> list[Range]:
        """The requests `ranges` waits for, sorted: those in flight that overlap them, and those
        that would fetch the rest (the bytes held left out, merged and cut at the grid:
        plan_requests; `cell` and `gap` as there, default the object's request_size and
        MERGE_GAP)."""
        with self._held_lock:
            waited, missing = self._requests_for(ranges, cell, gap)
        return sorted([r for r, _ in waited] + missing)

    def _requests_for(
        self, ranges: Sequence[Range], cell: int | None, gap: int | None
    ) -> tuple[list[tuple[Range, Future[None]]], list[Range]]:
        """What `ranges` needs, under _held_lock: the requests in flight that overlap them (with
        their futures), and the requests that would fetch the rest (plan_requests of what is
        neither held nor in flight)."""
        wanted = merge_ranges(ranges)
        waited = [(r, f) for r, f in self._in_flight.items() if _overlaps(wanted, r)]
        missing = subtract_ranges(wanted, self._taken())
        return waited, plan_requests(missing, cell or self._request_bytes, MERGE_GAP if gap is None else gap)

    def _taken(self) -> list[Range]:
        """The ranges held or in flight (sorted, disjoint); under _held_lock."""
        if not self._in_flight:
            return self._held
        return merge_ranges([*self._held, *self._in_flight])

    def start(
        self, ranges: Sequence[Range], cell: int | None = None, gap: int | None = None
    ) -> list[Future[None]]:
        """Begin fetching `ranges` into the spool (those bytes not held or in flight already;
        `cell` and `gap` as for plan); the futures finish when all of `ranges` is there: those
        of the requests made here, and those of requests in flight that overlap them."""
        with self._held_lock:
            waited, missing = self._requests_for(ranges, cell, gap)
            started = []
            for lo, hi in missing:
                future = self._pool.submit(self._get, lo, hi)
                self._in_flight[(lo, hi)] = future  # before _get can end: it takes the lock
                started.append(future)
            self._note_occupied()
        return [f for _, f in waited] + started

    def occupied(self) -> int:
        """Bytes of the spool held, being fetched, or given back and not yet freed, in the
        whole pages they touch (a page two ranges share counted once): the memory this object
        takes now."""
        with self._held_lock:
            return self._occupied()

    def _occupied(self) -> int:
        """occupied(), under _held_lock (finished frees dropped from the list)."""
        self._freeing = [(r, f) for r, f in self._freeing if not f.done()]
        return paged_bytes([*self._taken(), *(r for r, _ in self._freeing)])

    def _note_occupied(self) -> None:
        """Keep the most bytes occupied at once (peak_bytes), under _held_lock: after ranges
        are asked for, which is when the spool's part grows."""
        self.peak_bytes = max(self.peak_bytes, self._occupied())

    @staticmethod
    def wait(futures: Sequence[Future[None]]) -> None:
        """Wait for fetches begun by `start`; the first failure is raised once all are done."""
        first: BaseException | None = None
        for f in futures:
            e = f.exception()
            if e is not None and first is None:
                first = e
        if first is not None:
            raise first

    @staticmethod
    def wait_quietly(futures: Sequence[Future[None]]) -> None:
        """Wait for fetches whose result no longer matters (a read that failed already)."""
        for f in futures:
            f.exception()

    def fetch(self, ranges: Sequence[Range]) -> None:
        self.wait(self.start(ranges))

    def release(self, ranges: Sequence[Range], wait: bool = False) -> None:
        """Give back the memory of ranges already read (fetched again if asked for again), its
        pages freed on the freeing thread; `wait`: return once they are freed (a reader within
        a memory bound asks for more only then), within the deadline (_wait_freed)."""
        spool = self.spool
        if spool is None:
            return
        with self._held_lock:
            self._held = subtract_ranges(self._held, ranges)
            taken = self._taken()
            pages = [_page_edges(r, taken, self.size) for r in merge_ranges(ranges)]
            self._freeing.extend((r, self._freer.submit(spool.release, *r)) for r in pages)
        if wait and pages:
            self._wait_freed(pages[0][0], pages[-1][1], s3.Budget(self.options), "give back")

    def _wait_freed(self, lo: int, hi: int, budget: s3.Budget, doing: str = "read") -> None:
        """Wait until the pages of ranges given back that overlap [lo, hi) are freed, so that
        freeing them cannot wipe what a fetch is about to write there (or, `doing` "give back",
        so that a reader within a bound asks for more only then); StorageError naming the URL
        where that takes longer than what remains of `budget`'s deadline."""
        with self._held_lock:
            self._freeing = [(r, f) for r, f in self._freeing if not f.done()]
            pending = [f for (a, b), f in self._freeing if a < hi and lo < b]
        for f in pending:
            try:
                f.result(timeout=budget.remaining())
            except FutureTimeout:
                raise StorageError(
                    f"{doing} bytes {lo}-{hi - 1}: the pages given back there were not freed within "
                    f"{budget.deadline:g} s (storage option deadline)",
                    path=self.path,
                ) from None

    def _landed(self, lo: int, hi: int, fetched: bool) -> None:
        """The request for [lo, hi) is over: held where it `fetched` the bytes, else asked for
        again by the next plan that needs them."""
        with self._held_lock:
            self._in_flight.pop((lo, hi), None)
            if fetched:
                self._held = merge_ranges([*self._held, (lo, hi)])

    def _get(self, lo: int, hi: int) -> None:
        """Fetch [lo, hi) into the spool (a request start made: held once over, else no longer
        in flight)."""
        fetched = False
        try:
            self._get_range(lo, hi)
            fetched = True
        finally:
            self._landed(lo, hi, fetched)

    def _get_range(self, lo: int, hi: int) -> None:
        """Fetch [lo, hi) into the spool, resuming after a dropped connection or a body cut at
        its deadline from the byte it reached, within one Budget (attempts and deadline)."""
        assert self.spool is not None
        budget = s3.Budget(self.options)
        self._wait_freed(lo, hi, budget)
        view = self.spool.view(lo, hi)
        what = f"read bytes {lo}-{hi - 1}"
        got = 0
        while True:
            try:
                got += self._get_once(lo + got, hi, view[got:], budget)
                return
            except s3.transfer_errors() as e:
                got += getattr(e, "ckptfmt_got", 0)
                if isinstance(e, CheckpointError):  # an answer refused here: tried again
                    if not budget.retry():
                        raise
                elif not s3.retryable(e) or not budget.retry():
                    raise s3.translate(e, self.path, what, budget) from s3.cause(e)

    def _get_once(self, lo: int, hi: int, view: memoryview, budget: s3.Budget) -> int:
        what = f"read bytes {lo}-{hi - 1}"
        with s3.carrying(budget):
            reply = self._store.get(self.url, (lo, hi), self.etag)
        expected = f"bytes {lo}-{hi - 1}/{self.size}"
        if reply.content_range != expected or reply.length != hi - lo:
            reply.body.close()
            raise StorageError(
                f"{what}: the store answered {reply.content_range!r} for {expected!r}", path=self.path
            )
        served = self.etag if reply.version is None else reply.version
        if _tag_value(served) != _tag_value(self.etag):
            # a store that ignores If-Match (some S3-compatible ones do) serves the new version
            reply.body.close()
            raise StorageError(f"{what}: the object changed while it was being read", path=self.path)
        timeout, option = _body_deadline(self._timeout, budget)
        got, cut = read_body(reply.body, view, timeout)
        if got != len(view):
            why = (
                f"the answer {s3.missed_deadline(timeout, option, f'; {got} of its bytes came')}"
                if cut
                else f"the body ended after {got} bytes"
            )
            short = StorageError(f"{what}: {why}", path=self.path)
            short.ckptfmt_got = got  # type: ignore[attr-defined]
            raise short
        return got

    def sha256(self) -> bytes:
        """SHA-256 of the object's whole bytes, fetched window by window (the next one while
        this one is hashed, each given back once hashed: memory holds two windows)."""
        windows = [(lo, min(lo + HASH_WINDOW, self.size)) for lo in range(0, self.size, HASH_WINDOW)]
        digest = hashlib.sha256()
        assert self.spool is not None
        pending = self.start(windows[:1])
        try:
            for i, (lo, hi) in enumerate(windows):
                self.wait(pending)
                pending = self.start(windows[i + 1 : i + 2])
                with self.spool.view(lo, hi) as window:
                    digest.update(window)
                self.release([(lo, hi)])
        finally:
            self.wait_quietly(pending)
        return digest.digest()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # read-ahead no one waits for
        if self.spool is not None:
            # the spool's pages are freed on the freeing thread, after the ranges given back
            # (spool.close): the caller goes on meanwhile, as it did after each window
            self.spool.close(free_on=self._freer)
            self.spool = None
        self._freer.shutdown(wait=False)


def fetch_whole(url: str, options: dict[str, Any], limit: int, what: str = "the object") -> Spool:
    """The object `url` read whole by one GET into a spool: for a small object read in full
    (a commit record), where a HEAD and ranged GETs would cost more requests than its bytes.
    LimitError (naming it `what`) before its body is read when it is over `limit` bytes;
    FileNotFoundError when absent; a dropped connection, an error the store may not make
    again or a body that misses its deadline (storage option request_timeout) is tried
    again, within one Budget (attempts and deadline)."""
    u = parse_url(url)
    store = store_for(u, options)
    timeout = float(options.get("request_timeout", REQUEST_TIMEOUT))
    budget = s3.Budget(options)
    while True:
        try:
            with s3.carrying(budget):
                return _fetch_whole_once(store, u, url, limit, what, _body_deadline(timeout, budget))
        except StorageError as e:
            if not getattr(e, "ckptfmt_short", False) or not budget.retry():
                raise
        except (CheckpointError, FileNotFoundError):
            raise
        except s3.transfer_errors() as e:
            if not s3.retryable(e) or not budget.retry():
                raise s3.translate(e, url, "read", budget) from s3.cause(e)


def _body_deadline(request_timeout: float, budget: s3.Budget) -> tuple[float, str]:
    """How long an answer's body may take, and the storage option that says so: the request's
    own deadline, or what remains of the operation's where that is sooner."""
    remaining = budget.remaining()
    if request_timeout <= remaining:
        return request_timeout, "request_timeout"
    return max(remaining, 0.001), "deadline"


def _fetch_whole_once(
    store: Store, u: ObjectURL, url: str, limit: int, what: str, deadline: tuple[float, str]
) -> Spool:
    reply = store.get(u, None, None)
    body = reply.body
    timeout, option = deadline
    try:
        size = reply.length
        if type(size) is not int or size < 0:
            raise StorageError("the store's answer lacks the object's size", path=url)
        if size > limit:
            raise LimitError(f"{what} is {size} bytes, above the limit {limit}", path=url)
        spool = Spool(u.key.rsplit("/", 1)[-1], size)
        try:
            with spool.view(0, size) as view:
                got, cut = read_body(body, view, timeout) if size else (0, False)
            if got != size:
                why = s3.missed_deadline(timeout, option) if cut else "ended"
                short = StorageError(f"read: the body {why} after {got} of {size} bytes", path=url)
                short.ckptfmt_short = True  # type: ignore[attr-defined]
                raise short
        except BaseException:
            spool.close()
            raise
        return spool
    finally:
        body.close()


def read_body(body: Any, view: memoryview, timeout: float) -> tuple[int, bool]:
    """Read an answer's `body` into `view` until it is full or the body ends, within `timeout`
    seconds: how many bytes came, and whether the deadline cut the connection.  readinto
    blocks until its buffer is full, and a body that trickles in (a byte every few seconds)
    never trips the client's read timeout, so a watchdog shuts the connection down at the
    deadline and the read returns (or fails: either way, what came and True).  Another
    exception raised meanwhile carries ckptfmt_got, the bytes that came."""
    got = 0
    raw = getattr(body, "_raw_stream", body)
    with s3.Watchdog(raw, timeout) as dog:
        try:
            while got < len(view):
                n = body.readinto(view[got:])
                if not n:
                    break
                got += n
        except Exception as e:
            if not dog.fired.is_set():
                e.ckptfmt_got = got  # type: ignore[attr-defined]
                raise
        finally:
            body.close()
    return got, dog.fired.is_set()
