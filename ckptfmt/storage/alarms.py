"""Alarms at deadlines, all kept by one thread: what cuts a request whose answer misses its
deadline (client.Watchdog, http.HeadWatch).

Every ranged GET of a load sets two alarms (its answer's head, then its body) and almost
never lets one ring.  A ``threading.Timer`` each started a thread per alarm (about 0.1 ms,
and a thread for the GIL to be handed to, per request); here one thread keeps a heap of
deadlines and sleeps until the nearest.  It is started by the first alarm set and ends once
none has been pending for IDLE_SECONDS, so no thread outlives a process's use of the
stores by more than that; the next alarm starts it again.

An alarm's action runs on that thread: it must be short and must not block (shutting a
socket down is what they do), or it would hold back the alarms due after it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

#: how long the thread waits for another alarm once none is pending, before it ends
IDLE_SECONDS = 0.5
THREAD_NAME = "ckptfmt-deadlines"


class Alarm:
    """An action due at a time on the monotonic clock; cancel() before then stops it."""

    __slots__ = ("due", "_action", "_clock", "_state")

    def __init__(self, due: float, action: Callable[[], None], clock: _Clock) -> None:
        self.due = due
        self._action = action
        self._clock = clock
        self._state = "pending"  # then "cancelled" or "rung", changed under the clock's lock

    def cancel(self) -> bool:
        """Stop the alarm; False where it has rung already (its action has run or is running)."""
        return self._clock.cancel(self)


class _Clock:
    """The heap of pending alarms and the one thread that rings them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self._heap: list[tuple[float, int, Alarm]] = []
        self._order = itertools.count()  # ties broken by the order alarms were set
        self._thread: threading.Thread | None = None
        self.cancelled = 0  # cancelled alarms still in the heap

    def set(self, seconds: float, action: Callable[[], None]) -> Alarm:
        alarm = Alarm(time.monotonic() + seconds, action, self)
        with self.lock:
            if self._thread is None:
                # kept only once started (it waits for this lock): a start that fails leaves
                # no alarm set and no thread taken as running, and the next set starts one
                thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                thread.start()
                self._thread = thread
            heapq.heappush(self._heap, (alarm.due, next(self._order), alarm))
            self._compact()
            if self._heap[0][2] is alarm:
                self._changed.notify()  # sooner than what the thread sleeps until
        return alarm

    def cancel(self, alarm: Alarm) -> bool:
        with self.lock:
            if alarm._state == "pending":
                alarm._state = "cancelled"
                self.cancelled += 1
                if self.cancelled == len(self._heap):
                    self._changed.notify()  # none pending: the thread need not sleep till one was due
            return alarm._state == "cancelled"

    def _compact(self) -> None:
        """Drop cancelled alarms once they are most of the heap (alarms are usually cancelled
        long before they are due, so the heap would otherwise grow with every request)."""
        if self.cancelled > 64 and self.cancelled * 2 > len(self._heap):
            self._heap = [entry for entry in self._heap if entry[2]._state == "pending"]
            heapq.heapify(self._heap)
            self.cancelled = 0

    def _next_due(self) -> Alarm | None:
        """The pending alarm due first, once it is due (waiting for it, and for new alarms);
        None once none has been pending for IDLE_SECONDS: the thread then ends."""
        idle_since: float | None = None
        while True:
            while self._heap and self._heap[0][2]._state != "pending":
                heapq.heappop(self._heap)
                self.cancelled -= 1
            now = time.monotonic()
            if not self._heap:
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= IDLE_SECONDS:
                    self._thread = None
                    return None
                self._changed.wait(IDLE_SECONDS - (now - idle_since))
                continue
            idle_since = None
            due = self._heap[0][0]
            if due <= now:
                alarm = heapq.heappop(self._heap)[2]
                alarm._state = "rung"
                return alarm
            self._changed.wait(due - now)

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    alarm = self._next_due()
                if alarm is None:
                    return
                try:
                    alarm._action()
                except Exception:  # one alarm's failure must not stop the others from ringing
                    logging.getLogger("ckptfmt").warning("an alarm's action failed", exc_info=True)
        finally:  # ended by a BaseException too: the next alarm set starts another thread
            with self.lock:
                if self._thread is threading.current_thread():
                    self._thread = None


_clock = _Clock()


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: it starts with no alarm and no thread."""
    global _clock
    _clock = _Clock()


os.register_at_fork(after_in_child=_forget_in_child)


def set_alarm(seconds: float, action: Callable[[], None]) -> Alarm:
    """Run `action` (short, never blocking) on the alarms' thread in `seconds`, unless the
    Alarm returned is cancelled first."""
    return _clock.set(seconds, action)
