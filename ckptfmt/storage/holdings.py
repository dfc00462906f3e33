"""What one object's spool holds, what is on its way into it, and which reads use it.

Several reads of one object (a Reader's gets on several threads) share its spool: a range
one read fetched serves another that needs it, and a request in flight is waited for, not
made again.  So a read says which ranges it reads from the spool (`use`) when it asks for
them, and gives each back once read (`give_back`): a range's bytes are freed once no read
uses them and no request is bringing them in; one fetched for two reads is fetched once
and freed after both.

Each request in flight is a `Request` of its own (two may span the same bytes: one into a
read's tensors, one into the spool), with the parts of it that go to the spool: a read that
needs bytes in the spool waits only for requests that bring them there.  `Holdings` keeps
no lock: its owner (download.RemoteObject) calls it under its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future

from ..engine.fetchplan import paged_bytes
from .ranges import merge_ranges, overlaps, page_edges, subtract_ranges
from .readahead import Deferred

Range = tuple[int, int]


class Fetch(Future[None]):
    """The future of a request, which knows it: a read that waits for a request another read
    made, and finds it never sent (cancelled), asks for the bytes it needed there itself."""

    def __init__(self, request: Request) -> None:
        super().__init__()
        self.request = request


class Started(list[Future[None]]):
    """The futures of one start (RemoteObject.start), with what that read asked for: the
    ranges it needs in the spool (`needs`) and the grid and gap it asked by, so that a wait
    for them that finds another read's request never sent asks for only those bytes again,
    as that read asked for them (none of the other read's bytes held by no read)."""

    def __init__(
        self, futures: Sequence[Future[None]], needs: list[Range], cell: int | None, gap: int | None
    ) -> None:
        super().__init__(futures)
        self.needs = needs
        self.cell = cell
        self.gap = gap


class Request:
    """A request in flight: its range, the future that ends once it is over, and the parts of
    it whose bytes go to the spool (for one of the read-ahead wave not claimed yet, `deferred`,
    all of it: a claim for the spool takes them all)."""

    __slots__ = ("range", "future", "spooled", "deferred")

    def __init__(self, r: Range, spooled: list[Range], deferred: Deferred | None = None) -> None:
        self.range = r
        self.future: Future[None] = Fetch(self)
        self.spooled = spooled
        self.deferred = deferred


class Holdings:
    """The bytes of one object's spool: held, being fetched, used by reads, being freed."""

    def __init__(self, size: int) -> None:
        self.size = size
        #: the ranges in the spool (sorted, disjoint)
        self.held: list[Range] = []
        #: the requests in flight, in the order made
        self.requests: list[Request] = []
        #: how many reads use each range they asked for (`use`), until each gives it back
        self.uses: Counter[Range] = Counter()
        #: ranges given back whose pages are being freed, each with the future of its freeing
        self.freeing: list[tuple[Range, Future[None]]] = []

    def live(self) -> list[Request]:
        """The requests in flight, less those cancelled (never sent: each leaves the books
        just after, from its future's callback), which bring nothing in."""
        return [q for q in self.requests if not q.future.cancelled()]

    def spooling(self) -> list[Range]:
        """The bytes requests in flight bring into the spool (sorted, disjoint)."""
        return merge_ranges([p for q in self.live() for p in q.spooled])

    def taken(self) -> list[Range]:
        """The bytes held or on their way into the spool (sorted, disjoint)."""
        if not self.requests:
            return self.held
        return merge_ranges([*self.held, *self.spooling()])

    def requests_for(self, ranges: Sequence[Range]) -> tuple[list[Request], list[Range]]:
        """What `ranges` needs in the spool: the requests in flight that bring some of its bytes
        there, and its bytes neither held nor on their way (sorted, disjoint)."""
        wanted = merge_ranges(ranges)
        waited = [q for q in self.live() if any(overlaps(wanted, p) for p in q.spooled)]
        return waited, subtract_ranges(wanted, self.taken())

    def deferred_within(self, ranges: Sequence[Range]) -> list[Request]:
        """The read-ahead requests not claimed yet that overlap `ranges`."""
        wanted = merge_ranges(ranges)
        return [q for q in self.requests if q.deferred is not None and overlaps(wanted, q.range)]

    def make(self, requests: Sequence[Range], targets: Sequence[Range] = ()) -> list[Request]:
        """`requests` in flight from now, each bringing into the spool its bytes outside
        `targets` (sorted, disjoint: memory of a read's own they go to instead)."""
        made = [Request(r, subtract_ranges([r], targets)) for r in requests]
        self.requests.extend(made)
        return made

    def over(self, request: Request, held: Sequence[Range]) -> None:
        """`request` is over: `held`, the parts of it now in the spool (none where it failed:
        asked for again by the next read that needs them)."""
        if request in self.requests:
            self.requests.remove(request)
        if held:
            self.held = merge_ranges([*self.held, *held])

    def use(self, ranges: Sequence[Range]) -> None:
        """A read reads `ranges` from the spool until it gives each back."""
        self.uses.update(ranges)

    def give_back(self, ranges: Sequence[Range]) -> list[Range]:
        """A read is done with `ranges`: one use of each given back (a range no read uses is
        given back as it is).  The bytes of them no read uses still and no request brings in
        are no longer held; returns the ranges whose whole pages the spool may free (widened
        to the pages they end in where nothing else of those pages is held, used or coming)."""
        for r in ranges:
            if self.uses[r] > 0:
                self.uses[r] -= 1
                if not self.uses[r]:
                    del self.uses[r]
        busy = merge_ranges([*self.uses, *self.spooling()])
        gone = subtract_ranges(merge_ranges(ranges), busy)
        if not gone:
            return []
        self.held = subtract_ranges(self.held, gone)
        kept = merge_ranges([*self.held, *busy])
        return [page_edges(r, kept, self.size) for r in gone]

    def freeing_within(self, lo: int, hi: int) -> list[Future[None]]:
        """The freeings not over whose pages overlap [lo, hi) (those over dropped)."""
        self.freeing = [(r, f) for r, f in self.freeing if not f.done()]
        return [f for (a, b), f in self.freeing if a < hi and lo < b]

    def idle(self) -> int:
        """The bytes held that no read uses and no request brings in: what reads left (the
        index's tail, the gaps between their ranges), in the whole pages they touch.  Pages
        being freed are the reads' that gave them back (one under a bound waits for them)."""
        return paged_bytes(subtract_ranges(self.held, merge_ranges([*self.uses, *self.spooling()])))

    def occupied(self) -> int:
        """Bytes of the spool held, on their way, or given back and not yet freed, in the whole
        pages they touch (a page two ranges share counted once)."""
        self.freeing = [(r, f) for r, f in self.freeing if not f.done()]
        return paged_bytes([*self.taken(), *(r for r, _ in self.freeing)])
