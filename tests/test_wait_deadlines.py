"""Every wait for work running in the background ends by a deadline: SaveHandle.wait() and
exception() with no timeout, the wait of a load (or save, or removal) for the save in flight
on its path, and a checkpoint manager's wait for its commits end by twice inflight.DEADLINE
(made short here) with a DeadlineError naming what was waited for; the work goes on.

The save that does not end is a real non-blocking save to a real local S3 server whose upload
the fault proxy (tests/s3_faults.py) holds; each wait runs on a thread the test bounds, so a
wait without a deadline fails the test instead of hanging it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ckptfmt
from ckptfmt.background import inflight
from ckptfmt.errors import CheckpointError, DeadlineError

#: seconds a bounded wait may take here: twice DEADLINE (1 s) and a busy 2-core machine's margin
BOUND = 20.0


def _ends_within(seconds: float, call: Callable[[], Any]) -> BaseException | None:
    """Run `call` on a thread; the error it ended with (None: it returned).  Fails the test when
    it is still waiting after `seconds`."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), (
        f"still waiting after {time.monotonic() - started:.1f} s: the wait has no deadline"
    )
    return out[0]


@pytest.fixture
def held_upload(s3_faults, monkeypatch) -> Iterator[tuple[str, dict[str, Any], threading.Event]]:
    """A bucket behind the proxy whose next PUT of a ``.ckpt`` object is held until the event is
    set (set at the end, whatever happens), and inflight.DEADLINE of 1 s: (the bucket's
    s3:// URL, storage options, the event)."""
    monkeypatch.setattr(inflight, "DEADLINE", 1.0)
    released = s3_faults.hold("PUT", ".ckpt")
    try:
        yield f"s3://{s3_faults.new_bucket()}", s3_faults.storage_options(), released
    finally:
        released.set()


def test_a_save_handles_waits_end_by_the_deadline(held_upload):
    root, options, released = held_upload
    url = f"{root}/x.ckpt"
    state = {"w": torch.arange(1000.0)}
    handle = ckptfmt.save(state, url, blocking=False, storage_options=options)
    for wait in (handle.wait, handle.exception):
        e = _ends_within(BOUND, wait)
        assert isinstance(e, DeadlineError) and isinstance(e, TimeoutError), e
        assert e.path == url and "still running after 2 s" in str(e) and "DEADLINE" in str(e), e
    # a timeout given is that wait's own bound, said so
    e = _ends_within(BOUND, lambda: handle.wait(timeout=0.2))
    assert isinstance(e, DeadlineError) and "0.2 s (the wait's timeout)" in str(e), e
    # the save went on: once its upload goes through it commits as usual
    released.set()
    handle.wait(timeout=60)
    assert torch.equal(ckptfmt.load(url, storage_options=options)["w"], state["w"])


def test_a_load_waits_for_the_save_in_flight_on_its_path_until_the_deadline(held_upload):
    root, options, released = held_upload
    url = f"{root}/x.ckpt"
    handle = ckptfmt.save({"w": torch.ones(100)}, url, blocking=False, storage_options=options)
    for call in (
        lambda: ckptfmt.load(url, storage_options=options),
        lambda: ckptfmt.verify(url, storage_options=options),
        lambda: ckptfmt.save({"w": torch.zeros(1)}, url, storage_options=options),
    ):
        e = _ends_within(BOUND, call)
        assert isinstance(e, DeadlineError), e
        assert e.path == url and "the non-blocking save in flight on it is still running" in str(e), e
    released.set()
    handle.wait(timeout=60)
    assert torch.equal(ckptfmt.load(url, storage_options=options)["w"], torch.ones(100))


def test_a_managers_wait_for_its_commits_ends_by_the_deadline(held_upload):
    """A store run's non-blocking save whose upload never ends: wait() raises within the
    deadline, naming the step, instead of waiting for the upload."""
    root, options, released = held_upload
    m = ckptfmt.CheckpointManager(f"{root}/run", blocking=False, storage_options=options)
    m.save(1, {"w": torch.ones(100)})
    e = _ends_within(BOUND, m.wait)
    assert isinstance(e, CheckpointError) and "step 1" in str(e), e
    assert isinstance(e.__cause__, DeadlineError) or isinstance(e, DeadlineError), e
    released.set()  # the upload goes on and ends; nothing commits step 1
    inflight.DEADLINE = 60.0  # (monkeypatched: restored after the test)
    inflight.wait_for_path(f"{root}/run/step-000000001/state.ckpt")
    assert m.checkpoints() == []
