"""Attacks on runs kept on an object store by two writers of one prefix, on the real local S3
server: what a save deletes in a step once it has committed it must never be what another
step's checkpoint reads (spec 13.7)."""

from __future__ import annotations

import threading

import torch

from ckptfmt import CheckpointManager

WEIGHTS = torch.arange(1 << 14, dtype=torch.float32)


def _state(step: int) -> dict[str, object]:
    return {"w": WEIGHTS.clone(), "step": step}


def _paused_before_commit(manager, step: int, state: dict[str, object]):
    """Start `manager`'s save of `step` on a thread; return once it has uploaded its state
    object and waits to commit: (the thread, its failures, the event that lets it commit)."""
    uploaded, go = threading.Event(), threading.Event()
    failure: list[BaseException] = []
    commit = manager._commit

    def commit_when_told(job):
        uploaded.set()
        assert go.wait(60)
        return commit(job)

    manager._commit = commit_when_told

    def save() -> None:
        try:
            manager.save(step, state)
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=save, daemon=True)
    t.start()
    assert uploaded.wait(60)
    return t, failure, go


def _finish(t: threading.Thread, go: threading.Event) -> None:
    go.set()
    t.join(60)
    assert not t.is_alive()


def test_a_late_commit_never_sweeps_the_object_a_later_step_reads(s3_bucket):
    """Job a (incremental, keep_last=1) and job b save step 1 at once: b finds a's state object
    there, so writes one of its own name and waits to commit.  a commits step 1, saves step 2
    (which reads its chunks from a's step-1 object) and retires step 1 (its record deleted,
    the object kept for step 2).  b then commits step 1 (no record is there any more) and
    sweeps what its record does not name: it must leave a's object, which step 2 reads."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    a = CheckpointManager(url, storage_options=options, incremental=True, keep_last=1)
    b = CheckpointManager(url, storage_options=options)
    ta, fa, go_a = _paused_before_commit(a, 1, _state(1))
    tb, fb, go_b = _paused_before_commit(b, 1, _state(-1))
    _finish(ta, go_a)
    assert not fa, fa
    a._commit = type(a)._commit.__get__(a)
    a.save(2, _state(2))
    assert CheckpointManager(url, storage_options=options).checkpoints()[-1].references  # reads step 1
    _finish(tb, go_b)
    fresh = CheckpointManager(url, storage_options=options)
    assert fresh.verify(2).ok
    got = fresh.load(2)
    assert got["step"] == 2 and torch.equal(got["w"], WEIGHTS)
