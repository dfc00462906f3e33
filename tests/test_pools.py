"""storage/pools.py in a running process (tests/test_store_exit.py runs it at exit): a batch
that stops at its first failure, and work cancelled in a pool's queue that cancels its
future instead of leaving a waiter for ever."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import pytest

from ckptfmt.storage.pools import run_each, run_into, submit_or_run


def test_run_each_returns_the_results_in_order():
    assert run_each(lambda x: x * x, range(20), 4, "test-each") == [x * x for x in range(20)]
    assert run_each(lambda x: x, [], 4, "test-each") == []


def test_run_each_starts_no_call_after_the_first_failure_and_raises_it():
    """Two threads: item 0 fails, item 1 may have started beside it, no other starts."""
    started: list[int] = []
    lock = threading.Lock()

    def call(x: int) -> int:
        with lock:
            started.append(x)
        if x == 0:
            raise ValueError("item 0 refused")
        return x

    with pytest.raises(ValueError, match="item 0 refused"):
        run_each(call, range(50), 2, "test-each")
    assert 0 in started and set(started) <= {0, 1}, started


def test_work_cancelled_in_the_queue_cancels_its_future():
    """A pool shut down with cancel_futures drops its queued work: the future run_into was
    given is cancelled with it, so whoever waits for it is woken."""
    pool = ThreadPoolExecutor(1)
    gate = threading.Event()
    first = submit_or_run(pool, gate.wait, 10)
    queued: Future[None] = Future()
    run_into(pool, queued, lambda: None)
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    first.result(timeout=10)
    with pytest.raises(CancelledError):
        queued.result(timeout=10)


class _Refusing(ThreadPoolExecutor):
    """A pool that cannot start a thread for its work (what a process at its thread limit gets)."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("can't start new thread")


def test_work_a_pool_refuses_cancels_its_future():
    """A submit that fails while the interpreter runs on (no thread could start) is raised, and
    the future run_into was given, which a waiter may hold already, is cancelled with it: the
    waiter is told at once, not left waiting for work no thread will run."""
    done: Future[None] = Future()
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            done.result(timeout=60)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    pool = _Refusing(1)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        run_into(pool, done, lambda: None)
    t.join(10)
    assert not t.is_alive() and done.cancelled() and isinstance(outcome[0], CancelledError)
    pool.shutdown()


def test_run_each_raises_the_earliest_items_failure_whichever_failed_first():
    def call(i: int) -> int:
        if i == 1:
            time.sleep(0.3)  # fails last
            raise ValueError("item 1")
        if i == 3:
            raise ValueError("item 3")
        return i

    with pytest.raises(ValueError, match="item 1"):
        run_each(call, range(4), 4, "test-each")
