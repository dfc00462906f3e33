"""Attacks on an ObjectRun's cache of commit records, which knows a record by (step, size,
Last-Modified as listed): a store that stamps objects to the second (Azure's Last-Modified is
an HTTP-date, S3 lists whole seconds; Azurite and moto do so too) lists a step removed and
saved again within that second, by a record of the same size, exactly as it listed the old
one, and the cache answers with the old record: the old save's metrics and creation time.
Retention by a metric (keep_best) then judges the new save by the old one's value."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from ckptfmt import CheckpointManager

STALE = (
    "ObjectRun.listed_record (runs/objectrun.py) knows a record by (step, size, Last-Modified): "
    "a step removed and saved again within the store's second is read as the removed save"
)


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((4,), float(step)), "step": step}


def _commit_stamp(faults, url: str, step: int) -> object:
    from ckptfmt.runs.objectrun import ObjectRun

    return ObjectRun(url, faults.options).listing()[step]["COMMIT"].modified


def _saved_again_within_one_second(faults, manager: CheckpointManager, url: str, loss: float) -> bool:
    """Save step 5 (loss 5.0), read the run, remove step 5 and save it again with `loss`;
    whether the store stamped both records with the same Last-Modified (not when the second
    turned between them)."""
    while time.time() % 1.0 > 0.2:  # the start of a second: the four requests fit in it
        time.sleep(0.01)
    manager.save(5, _state(5), metrics={"loss": 5.0})
    old = _commit_stamp(faults, url, 5)
    assert manager.checkpoints()[-1].metrics == {"loss": 5.0}  # the run's statuses read the record
    manager.remove(5)
    manager.save(5, _state(5), metrics={"loss": loss})
    return _commit_stamp(faults, url, 5) == old


@pytest.mark.parametrize("store_faults", ["s3", "az"], indirect=True)
def test_a_step_saved_again_is_never_described_by_the_record_it_replaced(store_faults):
    for _ in range(5):
        url = store_faults.new_root() + "/run"
        manager = CheckpointManager(url, storage_options=store_faults.options)
        if _saved_again_within_one_second(store_faults, manager, url, loss=0.5):
            break
    else:
        pytest.skip("the store's second turned between the two saves five times")
    assert manager.latest().metrics == {"loss": 0.5}


@pytest.mark.parametrize("store_faults", ["s3", "az"], indirect=True)
def test_keep_best_never_deletes_the_best_step_for_the_metric_of_a_removed_save(store_faults):
    for _ in range(5):
        url = store_faults.new_root() + "/run"
        manager = CheckpointManager(url, storage_options=store_faults.options, keep_best="loss")
        manager.save(3, _state(3), metrics={"loss": 1.0})
        if _saved_again_within_one_second(store_faults, manager, url, loss=0.5):
            break
    else:
        pytest.skip("the store's second turned between the two saves five times")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.save(7, _state(7), metrics={"loss": 2.0})  # rotation: the newest, and the best
    kept = {
        c.step: c.metrics["loss"]
        for c in CheckpointManager(url, storage_options=store_faults.options).checkpoints()
    }
    assert 5 in kept, f"the best step (5, loss 0.5) was deleted; kept {kept}"
