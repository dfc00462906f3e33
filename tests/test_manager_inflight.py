"""A run's non-blocking steps as saves in flight: the exit waits for their commits, a failed
commit is raised by the manager (not by an unrelated plain save), a commit thread that cannot
start fails the save at once, and a forked child's exit waits for none of the parent's."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from ckptfmt import CheckpointManager
from ckptfmt.background import inflight
from ckptfmt.errors import CheckpointError
from ckptfmt.runs.manager import CheckpointManager as Manager


def _failing_commit(monkeypatch, step: int, delay: float = 0.5) -> None:
    real = Manager._commit

    def commit(self, job):
        if job.step == step:
            time.sleep(delay)
            raise CheckpointError("record refused (test)", path=job.path)
        return real(self, job)

    monkeypatch.setattr(Manager, "_commit", commit)


def test_a_failed_commit_is_raised_by_the_manager_and_the_next_step_is_saved(tmp_path, monkeypatch):
    """An incremental run waits for the earlier step within its next save: step 1's failure
    is not raised there by the state file's own save (as an unrelated plain save's would be),
    step 2 is saved, and the manager raises step 1's failure next."""
    _failing_commit(monkeypatch, step=1)
    m = CheckpointManager(str(tmp_path / "run"), blocking=False, incremental=True)
    m.save(1, {"w": torch.ones(1000)})
    m.save(2, {"w": torch.ones(1000) * 2}).wait()
    with pytest.raises(CheckpointError, match="an earlier save of step 1 failed"):
        m.wait()
    assert [c.step for c in m.checkpoints()] == [2]


def test_a_commit_thread_that_cannot_start_fails_the_save_and_blocks_nothing(tmp_path, monkeypatch):
    real_start = threading.Thread.start

    def start(self):
        if self.name.startswith("ckptfmt-commit-"):
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    m = CheckpointManager(str(tmp_path / "run"), blocking=False)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        m.save(1, {"w": torch.ones(10)})
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert not [h for h in inflight._in_flight.values() if not h.done()]
    assert m.checkpoints() == []
    m.save(2, {"w": torch.ones(10)}).wait()
    assert [c.step for c in m.checkpoints()] == [2]


def _nothing() -> None:
    pass


def test_a_forked_childs_exit_waits_for_none_of_the_parents_commits(tmp_path, monkeypatch):
    real = Manager._commit

    def slow(self, job):
        time.sleep(6)
        return real(self, job)

    monkeypatch.setattr(Manager, "_commit", slow)
    monkeypatch.setattr(inflight, "DEADLINE", 3.0)  # a child that waits would take 6 s
    m = CheckpointManager(str(tmp_path / "run"), blocking=False)
    handle = m.save(1, {"w": torch.ones(10)})
    time.sleep(1.0)  # the state file written, the commit in flight
    child = multiprocessing.get_context("fork").Process(target=_nothing)
    began = time.monotonic()
    child.start()
    child.join(30)
    took = time.monotonic() - began
    handle.wait()
    assert child.exitcode == 0 and took < 2.5, took
