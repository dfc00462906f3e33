"""The deadlines of a store's requests are kept by one thread (storage/alarms.py): alarms ring
at their time and in their order, a cancelled one never does, one that fails does not stop
the others, the thread ends once none is pending and starts again for the next, a forked
child gets its own; and a load of many ranged GETs no longer starts a thread per request."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from helpers import assert_same

import ckptfmt
from ckptfmt.storage import alarms

MiB = 1 << 20


def _deadline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == alarms.THREAD_NAME]


def _until(condition, seconds: float = 30.0) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return bool(condition())


def test_alarms_ring_in_order_and_cancelled_ones_never():
    rang: list[str] = []
    done = threading.Event()
    late = alarms.set_alarm(0.3, lambda: (rang.append("late"), done.set()))
    cancelled = alarms.set_alarm(0.1, lambda: rang.append("cancelled"))
    soon = alarms.set_alarm(0.05, lambda: rang.append("soon"))  # sooner than the thread sleeps till
    assert cancelled.cancel()
    assert done.wait(30)
    assert rang == ["soon", "late"]
    assert not late.cancel()  # it has rung
    assert soon.due < late.due


def test_an_alarm_that_fails_leaves_the_others_ringing(caplog):
    rang = threading.Event()

    def fail() -> None:
        raise OSError("the socket is gone")

    alarms.set_alarm(0.01, fail)
    alarms.set_alarm(0.05, rang.set)
    assert rang.wait(30)
    assert "an alarm's action failed" in caplog.text


def test_the_thread_ends_once_no_alarm_is_pending_and_comes_back_for_the_next():
    many = [alarms.set_alarm(3600, lambda: None) for _ in range(1000)]
    assert len(_deadline_threads()) == 1
    for alarm in many:
        alarm.cancel()
    # not an hour: ends about IDLE_SECONDS after the last one was cancelled
    assert _until(lambda: not _deadline_threads())
    rang = threading.Event()
    alarms.set_alarm(0.01, rang.set)
    assert rang.wait(30)
    assert _until(lambda: not _deadline_threads())


def test_a_thread_that_failed_to_start_is_started_by_the_next_alarm(monkeypatch):
    monkeypatch.setattr(alarms, "_clock", alarms._Clock())
    start = threading.Thread.start
    refused: list[threading.Thread] = []

    def start_refused_once(thread: threading.Thread) -> None:
        if thread.name == alarms.THREAD_NAME and not refused:
            refused.append(thread)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_refused_once)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        alarms.set_alarm(0.01, lambda: None)
    rang = threading.Event()
    alarms.set_alarm(0.01, rang.set)
    assert rang.wait(30)


def test_an_action_that_ends_the_thread_leaves_later_alarms_ringing(monkeypatch):
    """A BaseException (not an Exception: not caught there) ends the thread; the next alarm
    starts another."""
    monkeypatch.setattr(alarms, "_clock", alarms._Clock())
    ended: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: ended.append(args.exc_value))

    class Stop(BaseException):
        pass

    def stop() -> None:
        raise Stop

    alarms.set_alarm(0.01, stop)
    thread = alarms._clock._thread
    assert thread is not None
    thread.join(30)
    assert not thread.is_alive() and len(ended) == 1 and isinstance(ended[0], Stop)
    rang = threading.Event()
    alarms.set_alarm(0.01, rang.set)
    assert rang.wait(30)


def test_a_forked_child_rings_its_own_alarms():
    alarms.set_alarm(3600, lambda: None).cancel()  # the parent's thread is running
    pid = os.fork()
    if pid == 0:  # the child: no thread of the parent's came along
        rang = threading.Event()
        alarms.set_alarm(0.01, rang.set)
        os._exit(0 if rang.wait(30) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_load_of_many_ranged_gets_starts_no_thread_per_request(s3_bucket, monkeypatch):
    """Each ranged GET used to start two timer threads (its head's deadline and its body's)."""
    bucket, options = s3_bucket
    options = {**options, "request_size": MiB}
    url = f"s3://{bucket}/alarms/model.ckpt"
    state = {"w": torch.randn(4 * MiB, generator=torch.Generator().manual_seed(5))}  # 16 MiB: 16 GETs
    ckptfmt.save(state, url, storage_options=options)
    started: list[str] = []
    start = threading.Thread.start

    def counted(self: threading.Thread) -> None:
        started.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    assert_same(state, ckptfmt.load(url, storage_options=options))
    # the fetch pool's threads, the one keeping deadlines, the one freeing pages
    assert len(started) <= 12, started
