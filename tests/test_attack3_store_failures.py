"""Attacks on reading a run from a store that fails for a while (503 SlowDown on the GETs of
one object, each attempt of its operation refused): a store that fails is not a step that is
damaged.  A resume that cannot read the newest step's commit record must fail (and may be
tried again), never resume from an older step as though the newest did not exist: that
forks the run, and the newer step's work is trained again over it."""

from __future__ import annotations

import warnings

import pytest
import torch

from ckptfmt import CheckpointManager
from ckptfmt.errors import StorageError

#: each operation tried twice: the rule below refuses every attempt of the record's read
OPTIONS = {"max_attempts": 2}

OLDER_STEP = (
    "a StorageError reading the newest step's commit record makes the step 'damaged' "
    "(runs/objectrun.py ObjectRun.status_of catches CheckpointError, StorageError included), "
    "and latest()/load() go on to an older step"
)


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((10,), float(step)), "step": step}


def _newest_or_an_error(manager: CheckpointManager) -> None:
    """`manager.load()` (fallback off: the default) gives step 2, or raises StorageError;
    never step 1."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            got = manager.load()
        except StorageError:
            return
    assert got["step"] == 2, f"resumed from step {got['step']} while step 2 is in the run"


def test_a_store_refusing_the_newest_record_never_resumes_an_object_run_from_an_older_step(store_faults):
    url = store_faults.new_root() + "/run"
    options = store_faults.options | OPTIONS
    manager = CheckpointManager(url, storage_options=options)
    for step in (1, 2):
        manager.save(step, _state(step))
    manager.wait()
    method, target = store_faults.op("read", "step-000000002/COMMIT")
    store_faults.fail_next(method, target, status=503, count=100)
    _newest_or_an_error(CheckpointManager(url, storage_options=options))


@pytest.mark.parametrize("store_faults", ["s3", "gs", "az"], indirect=True)
def test_a_new_node_never_resumes_from_an_older_archived_step_while_the_store_fails(store_faults, tmp_path):
    url = store_faults.new_root() + "/run"
    options = store_faults.options | OPTIONS
    first = CheckpointManager(tmp_path / "first", archive=url, storage_options=options)
    for step in (1, 2):
        first.save(step, _state(step))
    first.wait()
    assert not first.archive_failures()
    method, target = store_faults.op("read", "step-000000002/COMMIT")
    store_faults.fail_next(method, target, status=503, count=100)
    _newest_or_an_error(CheckpointManager(tmp_path / "new-node", archive=url, storage_options=options))
