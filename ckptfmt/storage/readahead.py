"""The requests of a load's read-ahead wave (storage/download.py): sent with the tail, before
the index says where their bytes go, their answers' bodies read once a reader claims them."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from ..errors import StorageError
from . import client as s3
from . import http

Range = tuple[int, int]


class Abandoned(Exception):
    """A deferred request's body no one will read (its object was closed first)."""


class SendOrder:
    """The order the read-ahead wave's requests go out in: its ends first, the tail (footer
    and index) and the first cell (prologue), which the index waits for; the others once both
    ends' first attempts are over, written or failed (`sending`).  Sent all at once, the
    ends' answers came after most of the others' (bench/store_timeline.py: Azurite answered
    the first request last in 3 rounds of 5, moto the tail after the cells whose work it
    shares), and every body waited unread until the index was parsed.  `failed`: the load is
    lost (an end failed for good, or the object was closed): the others are never sent."""

    def __init__(self) -> None:
        self.tail = threading.Event()
        self.first = threading.Event()
        self.failed = False

    @contextlib.contextmanager
    def sending(self, sent: threading.Event) -> Iterator[Callable[[], None]]:
        """An end's request made within the block: `sent` (tail or first) set once a request
        of it is written (http.telling_sent), once its caller says an attempt failed (the
        call the block gives: its retries and their backoff hold no other request up), or
        once the block ends, whatever became of it; a failure out of the block fails the
        order first."""
        try:
            with http.telling_sent(sent.set):
                yield sent.set
        except BaseException:
            self.fail()
            raise
        finally:
            sent.set()

    def fail(self) -> None:
        """The load is lost: the requests not sent yet never are, and none waits any longer."""
        self.failed = True
        self.tail.set()
        self.first.set()

    def wait(self, timeout: float) -> bool:
        """Wait until both ends' first attempts are over, `timeout` seconds at most (then go
        on regardless: the order only speeds the load up); whether to send (the order not
        failed)."""
        end = time.monotonic() + timeout
        for sent in (self.tail, self.first):
            sent.wait(max(0.0, end - time.monotonic()))
        return not self.failed


class Deferred:
    """A request of the read-ahead wave, sent before anyone knows where its bytes go: its
    answer's body from `start` on is read once claimed (views: where those bytes go, in order;
    None: nowhere), `spooled` the parts of it that go to the spool, `landed` called once it is
    in.  The bytes before `start` (the prologue, in the first request) go to the spool at
    once: `prefix` ends once they are in (or the request failed)."""

    def __init__(self, start: int, order: SendOrder) -> None:
        self.start = start
        #: the wave's order: the first request (start > 0: the prologue before it) is an end
        self.order = order
        self.prefix: Future[None] = Future()
        self.ready = threading.Event()
        self.views: list[memoryview] | None = None
        self.spooled: list[Range] = []
        self.landed: Callable[[Range], None] | None = None

    def wait(self, budget: s3.Budget, path: str, lo: int, hi: int) -> list[memoryview]:
        """Where the body goes, once claimed, within what remains of `budget`'s deadline."""
        if not self.ready.wait(budget.remaining()):
            raise StorageError(
                f"read bytes {lo}-{hi - 1}: asked for ahead, and not claimed by a reader within "
                f"{budget.deadline:g} s (storage option deadline)",
                path=path,
            )
        if self.views is None:
            raise Abandoned
        return self.views

    @property
    def abandoned(self) -> bool:
        """Whether the object was closed before this request was claimed: its body goes nowhere."""
        return self.ready.is_set() and self.views is None
