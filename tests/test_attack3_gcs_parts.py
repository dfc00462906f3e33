"""Attacks on GCS uploads in parts: each part is an object of its own
(``KEY.ckptfmt-part-ID-NNNNN``), composed into the object and then deleted.  Those deletes
were sent once each and their failures swallowed: one 503 on one of them, which any other
request of a save survives by its retries, left a part (8 MiB or more) in the bucket.  They
are retried within the operation's deadline now."""

from __future__ import annotations

import pytest
import torch

import ckptfmt

LARGE = torch.arange(5 << 20, dtype=torch.float32)  # 20 MiB: three parts of 8 MiB


@pytest.mark.parametrize("store_faults", ["gs"], indirect=True)
def test_one_refused_delete_of_a_composed_part_leaves_no_part_behind(store_faults):
    url = store_faults.new_root() + "/model.ckpt"
    options = store_faults.options | {"part_size": 8 << 20}
    store_faults.fail_next("DELETE", ".ckptfmt-part-", status=503, count=1)
    ckptfmt.save({"w": LARGE}, url, storage_options=options)
    assert torch.equal(ckptfmt.load(url, storage_options=options)["w"], LARGE)
    assert store_faults.uploads(url) == []


@pytest.mark.parametrize("store_faults", ["gs"], indirect=True)
def test_one_refused_delete_of_an_aborted_uploads_part_leaves_no_part_behind(store_faults):
    url = store_faults.new_root() + "/model.ckpt"
    options = store_faults.options | {"part_size": 8 << 20}
    method, target = store_faults.op("complete")
    store_faults.fail_next(method, target, status=400)  # the save fails: its upload is aborted
    store_faults.fail_next("DELETE", ".ckptfmt-part-", status=503, count=1)
    with pytest.raises(ckptfmt.errors.StorageError):
        ckptfmt.save({"w": LARGE}, url, storage_options=options)
    assert store_faults.uploads(url) == []
