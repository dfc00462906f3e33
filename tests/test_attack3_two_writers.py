"""Attacks by a second writer of one run on a store (a restarted job while the old one still
runs): one writer's rotation against the other's incremental save.

An incremental save checks that the objects it refers to are there (a HEAD each) before it
puts its commit record; nothing stops another writer's rotation from deleting them between
that check and the record's PUT.  The rotation asks whether a commit-less step has a record
(a HEAD) and, finding none yet, deletes what that step is about to refer to: the record then
lands naming objects that are gone, and the step never loads."""

from __future__ import annotations

import threading
import time
import warnings

import torch

from ckptfmt import CheckpointManager

W = torch.arange(1 << 17, dtype=torch.float32)  # 512 KiB: above MIN_REFERENCE_BYTES


def _state(step: int, scale: float = 1.0) -> dict[str, object]:
    return {"w": W * scale, "step": step}  # the same weights: an incremental save refers to them


def test_another_writers_rotation_never_deletes_what_a_step_committed_meanwhile_refers_to(store_faults):
    url = store_faults.new_root() + "/run"
    options = store_faults.options
    old_job = CheckpointManager(url, storage_options=options, keep_last=1, incremental=True)
    old_job.save(10, _state(10))
    new_job = CheckpointManager(url, storage_options=options, incremental=True)
    method, target = store_faults.op("write", "step-000000011/COMMIT")
    release = store_faults.hold(method, target)
    failure: list[BaseException] = []

    def save_11() -> None:
        try:
            new_job.save(11, _state(11))  # refers to step 10's state object
        except BaseException as e:
            failure.append(e)

    saving = threading.Thread(target=save_11, daemon=True)
    saving.start()
    deadline = time.monotonic() + 60
    while store_faults.pending_rules() and time.monotonic() < deadline:  # its record's PUT is held
        time.sleep(0.02)
    assert not store_faults.pending_rules()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old_job.save(12, _state(12, 2.0))  # other weights, referring to nothing; keep_last=1: step 10 goes
    release.set()
    saving.join(60)
    assert not saving.is_alive()
    reader = CheckpointManager(url, storage_options=options)
    if failure:  # a save that says it failed has lost nothing
        assert 11 not in [c.step for c in reader.checkpoints()]
        return
    assert torch.equal(reader.load(11)["w"], W)  # IncompleteError: step 10's object is gone
