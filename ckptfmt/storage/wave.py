"""A load's read-ahead wave (storage/download.py's RemoteObject, which it is a part of): the
requests a reader of the whole object sends with the tail, before the index says where their
bytes go, each holding its answer's body unread until the chunk reader claims it.

The first request of the wave reads the prologue into the spool at once; the others' answers
wait, their heads checked, until a reader claims them (`_claim`: the parts of a chunk reader's
tensors within them, the rest to the spool; nowhere, when the object is closed first).  They
go out in a `SendOrder`: the index's two ends first, the others once the ends' first attempts
are over, none once the load is lost.  The classes of the requests themselves (Deferred,
SendOrder) are readahead.py's; the spool's books holdings.py's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from functools import partial
from typing import Any

from . import client as s3
from .holdings import Holdings, Request
from .pools import run_into
from .rangedgets import RangedGets, Where
from .ranges import merge_ranges, plan_requests, routed, views_after
from .readahead import Abandoned, Deferred, SendOrder

Range = tuple[int, int]


class ReadAheadWave:
    """The read-ahead wave's part of a RemoteObject: what it sends, claims and reads.  The
    state and the fetches it uses are the object's (download.py), declared here."""

    path: str
    options: dict[str, Any]
    _request_bytes: int
    _gets: RangedGets
    _pool: Executor
    _book: Holdings
    _held_lock: threading.Lock

    def _made(self, requests: list[Request]) -> list[Request]:
        raise NotImplementedError

    def _hand_over(self, made: list[Request], send: Callable[[Request], None]) -> None:
        raise NotImplementedError

    def _get(self, request: Request, failed: Callable[[], None] | None = None) -> None:
        raise NotImplementedError

    def _get_range(
        self, lo: int, hi: int, where: Where | None = None, failed: Callable[[], None] | None = None
    ) -> None:
        raise NotImplementedError

    def _spool_view(self, lo: int, hi: int) -> memoryview:
        raise NotImplementedError

    def _landed(self, request: Request, held: Sequence[Range]) -> None:
        raise NotImplementedError

    def _wave(self, tail: int, ahead: int) -> list[Range]:
        """The requests of a read-ahead wave: the bytes before `tail`, `ahead` at most, cut at
        the grid, no more than leave the tail's request a thread (a deferred request holds its
        thread); none where the tail's request would have no thread left."""
        concurrency = s3.concurrency(self.options)
        return plan_requests([(0, min(tail, ahead))], self._request_bytes)[: concurrency - 1]

    def _get_tail(self, request: Request, order: SendOrder) -> None:
        """_get of the tail, an end of the wave's `order`: the others go once its request is
        written or an attempt of it failed (not after its retries); its failure for good fails
        the order (the load is lost: the others never go)."""
        with order.sending(order.tail) as failed:
            self._get(request, failed)

    def _read_ahead(self, requests: Sequence[Range], prologue: int, order: SendOrder) -> Future[None]:
        """Ask for `requests` (_wave) without waiting for their bodies, but for the first
        `prologue` bytes (in the spool at once): the rest of each waits for a reader to claim it
        (`_claim`), which says where its bytes go (a chunk reader's tensors, start_into, or the
        spool: a plan that needs them, or close); sent in `order`.  The index is not parsed
        yet, so no tensor exists; the answers are on their way meanwhile, as a plain parallel
        download's are.  The future that ends once the prologue is in."""
        deferred = [Deferred(prologue if i == 0 else r[0], order) for i, r in enumerate(requests)]
        made = [Request(r, [r], d) for r, d in zip(requests, deferred)]
        with self._held_lock:
            self._book.requests.extend(self._made(made))

        def send(q: Request) -> None:
            # refused (the exit began since _fetch_ends): claimed for the spool, then run here
            here = partial(self._claim_for_spool, q)
            run_into(self._pool, q.future, self._get_deferred, q, q.deferred, here=here)

        self._hand_over(made, send)
        return deferred[0].prefix

    def _claim_for_spool(self, request: Request) -> None:
        with self._held_lock:
            self._claim(request, ())

    def _claim(
        self,
        request: Request,
        targets: Sequence[tuple[int, memoryview]] | None,
        landed: Callable[[Range], None] | None = None,
    ) -> None:
        """Tell `request`, if it is one of the read-ahead wave not yet claimed, where its body
        goes, under _held_lock: the parts of `targets` within it, the rest to the spool (held
        once in); targets None: nowhere (the object is being closed: the body is left unread)."""
        deferred = request.deferred
        if deferred is None:
            return
        request.deferred = None
        lo, hi = request.range
        r = (deferred.start, hi)
        prefix = [(lo, deferred.start)] if deferred.start > lo else []
        if targets is not None:
            deferred.views, deferred.spooled = routed(r, targets, self._spool_view)
            deferred.landed = landed if deferred.spooled != [r] else None
        request.spooled = [*prefix, *deferred.spooled]
        deferred.ready.set()

    def _get_deferred(self, request: Request, deferred: Deferred) -> None:
        """The deferred `request`: its answer's head checked and its prologue read,
        then, once claimed (waited for within the operation's deadline, outside the body's and
        any retry: an abandoned request is never asked for again), its body read where the
        claim says, under a deadline and retries of its own (_read_claimed)."""
        held: list[Range] = []
        start = deferred.start
        lo, hi = request.range
        try:
            body = self._open_deferred(lo, hi, deferred)
            try:
                views = deferred.wait(s3.Budget(self.options), self.path, start, hi)
            except BaseException:
                if body is not None:
                    body.close()
                raise
            self._read_claimed(body, start, hi, views)
            held = deferred.spooled
            if deferred.landed is not None:
                deferred.landed((lo, hi))
        except BaseException as e:
            if not deferred.prefix.done():  # the prologue never came (or the load was lost already)
                deferred.order.fail()
                deferred.prefix.set_exception(e)
            raise
        finally:
            self._landed(request, held)

    def _open_deferred(self, lo: int, hi: int, deferred: Deferred) -> Any:
        """The deferred request's answer, its head checked and its bytes before `start` read
        into the spool (held), its body left open; None where its one attempt failed (the
        prologue then fetched again on its own, the rest fetched once claimed).  The first
        request is an end of the wave's order; the others go once both ends' are written, and
        never where the load is lost or the object closed meanwhile (Abandoned)."""
        budget = s3.Budget(self.options)
        order = deferred.order
        if lo == 0:
            with order.sending(order.first):
                body = self._try_open(lo, hi, deferred, budget)
        elif order.wait(budget.remaining()) and not deferred.abandoned:
            body = self._try_open(lo, hi, deferred, budget)
        else:
            raise Abandoned
        if body is None and deferred.start > lo:
            self._get_range(lo, deferred.start)
        self._prefix_in(lo, deferred)
        return body

    def _try_open(self, lo: int, hi: int, deferred: Deferred, budget: s3.Budget) -> Any:
        """One attempt at the deferred request's answer, its bytes before `start` read into the
        spool; its body left open, or None where the attempt failed."""
        start = deferred.start
        try:
            with s3.carrying(budget):
                reply = self._gets.open(lo, hi)
            try:
                if start > lo:
                    self._gets.read(reply.body, lo, start, [self._spool_view(lo, start)], budget, False)
            except BaseException:
                reply.body.close()
                raise
            return reply.body
        except s3.transfer_errors():
            return None

    def _read_claimed(self, body: Any, lo: int, hi: int, views: list[memoryview]) -> None:
        """Read [lo, hi) of a claimed answer's open `body` (None: none) into `views`, under a
        fresh request deadline; a body cut or failed is resumed from the byte it reached."""
        got = 0
        if body is not None:
            try:
                got = self._gets.read(body, lo, hi, views, s3.Budget(self.options))
            except s3.transfer_errors() as e:
                got = getattr(e, "ckptfmt_got", 0)
        if got < hi - lo:
            self._get_range(lo + got, hi, lambda skip: views_after(views, got + skip))

    def _prefix_in(self, lo: int, deferred: Deferred) -> None:
        """The bytes of a deferred request before its `start` are in the spool: held."""
        if not deferred.prefix.done():
            with self._held_lock:
                self._book.held = merge_ranges([*self._book.held, (lo, deferred.start)])
            deferred.prefix.set_result(None)
