"""Attacks on object-store saves whose answer is lost after the store carried the request out
(the fault proxy resets the connection once the store has answered), or comes after the
save's deadline (the proxy holds the request and forwards it once the client has given up):
the client cannot tell whether the write happened.

A create-only write (If-None-Match: *, ifGenerationMatch=0) retried so finds the object its
own first attempt made, and is refused as though another writer had made it: a save that
was carried out whole fails on one lost answer, which every other request of a save
survives by its retries.  A save that gives up on its commit record's PUT deletes its state
object, and the record lands after all, naming it."""

from __future__ import annotations

import time

import pytest
import torch

from ckptfmt import CheckpointManager
from ckptfmt.errors import StorageError

SMALL = torch.arange(1000, dtype=torch.float32)  # one PUT
LARGE = torch.arange(5 << 20, dtype=torch.float32)  # 20 MiB: an upload in parts


def _save_and_load(faults, weights: torch.Tensor) -> None:
    url = faults.new_root() + "/run"
    manager = CheckpointManager(url, storage_options=faults.options)
    manager.save(5, {"w": weights})
    manager.wait()
    faults.clear_rules()
    got = CheckpointManager(url, storage_options=faults.options).load(5)
    assert torch.equal(got["w"], weights)


def test_a_state_object_put_whose_answer_is_lost_still_saves_the_step(store_faults):
    method, target = store_faults.op("write", "step-000000005/state.")
    store_faults.reset_on(method, target, answered=True)
    _save_and_load(store_faults, SMALL)


@pytest.mark.parametrize("store_faults", ["az"], indirect=True)
def test_a_state_object_block_list_whose_answer_is_lost_still_saves_the_step(store_faults):
    """Azure's Put Block List (the request that makes an upload in parts appear) is
    create-only too; S3's CompleteMultipartUpload retried is answered as the first was."""
    method, target = store_faults.op("complete")
    store_faults.reset_on(method, target, answered=True)
    _save_and_load(store_faults, LARGE)


def test_a_commit_record_put_whose_answer_is_lost_still_saves_the_step(store_faults):
    method, target = store_faults.op("write", "step-000000005/COMMIT")
    store_faults.reset_on(method, target, answered=True)
    _save_and_load(store_faults, SMALL)


def test_a_commit_record_landing_after_its_deadline_never_names_a_deleted_object(store_faults):
    """The store receives the record's PUT whole and answers it after the save's deadline
    (the proxy holds the request 9 s and forwards it, the client gone): the save fails, and
    then its record appears.  The step must then be a checkpoint, or the record must name
    nothing that is gone."""
    url = store_faults.new_root() + "/run"
    manager = CheckpointManager(url, storage_options=store_faults.options | {"deadline": 4})
    manager.save(1, {"w": SMALL})
    method, target = store_faults.op("write", "step-000000002/COMMIT")
    store_faults.delay(method, target, seconds=9, count=1)
    with pytest.raises(StorageError):
        manager.save(2, {"w": SMALL * 2})
    deadline = time.monotonic() + 30
    while "step-000000002/COMMIT" not in store_faults.keys(url) and time.monotonic() < deadline:
        time.sleep(0.2)  # the held PUT goes on to the store
    assert "step-000000002/COMMIT" in store_faults.keys(url)
    got = CheckpointManager(url, storage_options=store_faults.options).load(2)  # IncompleteError
    assert torch.equal(got["w"], SMALL * 2)


def test_an_archive_copys_record_landing_after_its_deadline_never_names_a_deleted_object(
    store_faults, tmp_path
):
    """An archive copy that writes the step's files under names of its own (the prefix held a
    leftover) and whose record's PUT lands after the copy's deadline: the failed copy must not
    delete what that record names."""
    from ckptfmt.storage.upload import upload_bytes

    url = store_faults.new_root() + "/archive"
    options = store_faults.options | {"deadline": 4}
    upload_bytes(b"what a copy cut short left", f"{url}/step-000000002/state.ckpt", options)
    manager = CheckpointManager(tmp_path / "run", archive=url, storage_options=options)
    method, target = store_faults.op("write", "step-000000002/COMMIT")
    store_faults.delay(method, target, seconds=9, count=1)
    manager.save(2, {"w": SMALL * 2})
    try:
        manager.wait()
    except StorageError:
        pass
    deadline = time.monotonic() + 30
    while "step-000000002/COMMIT" not in store_faults.keys(url) and time.monotonic() < deadline:
        time.sleep(0.2)  # the held PUT goes on to the store
    if "step-000000002/COMMIT" not in store_faults.keys(url):
        pytest.skip("the held record never reached the store")
    got = CheckpointManager(url, storage_options=store_faults.options).load(2)
    assert torch.equal(got["w"], SMALL * 2)
