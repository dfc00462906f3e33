"""Attacks on removing a step of a tiered run (a local CheckpointManager with an archive on a
store) while the archive fails: remove(step) is the rollback ("so that neither tier resumes
from it"), and deletes the local copy before it asks the archive anything.  An archive that
refuses for a while makes remove raise with the local copy gone and the archived one whole:
once the archive answers again, latest() and load() resume from the very step removed (a
new node too), and nothing on local disk says it was ever removed."""

from __future__ import annotations

import warnings

import pytest
import torch

from ckptfmt import CheckpointManager
from ckptfmt.errors import StorageError


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((8,), float(step)), "step": step}


def test_a_remove_the_archive_refuses_never_resurrects_the_step_from_the_archive(tmp_path, s3_faults):
    url = f"s3://{s3_faults.new_bucket()}/run"
    options = s3_faults.storage_options() | {"max_attempts": 2}
    run = tmp_path / "run"
    manager = CheckpointManager(run, archive=url, storage_options=options)
    for step in (1, 2):
        manager.save(step, _state(step))
    manager.wait()
    assert not manager.archive_failures()
    s3_faults.fail_next(None, "", status=503, count=1000)  # the archive is down
    with pytest.raises(StorageError):
        manager.remove(2)  # step 2 turned out bad: roll back to step 1
    s3_faults.clear_rules()  # the archive is back
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = CheckpointManager(run, archive=url, storage_options=options).load()["step"]
    if resumed == 2:  # a remove that failed may have left the step whole, in both tiers
        assert (run / "step-000000002").is_dir(), "step 2 was removed locally, then resumed from the archive"
