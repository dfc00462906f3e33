"""GCS part objects whose delete is refused every time: the save succeeds, each such part is
logged by name, and it stays listed as an upload, which a run's cleanup (or a person, as
docs/object-stores.md says) finds and deletes."""

from __future__ import annotations

import logging

import pytest
import torch

import ckptfmt

LARGE = torch.arange(5 << 20, dtype=torch.float32)  # 20 MiB: three parts of 8 MiB


@pytest.mark.parametrize("store_faults", ["gs"], indirect=True)
def test_a_part_object_that_cannot_be_deleted_is_named_in_a_warning_and_stays_listed(store_faults, caplog):
    url = store_faults.new_root() + "/model.ckpt"
    options = store_faults.options | {"part_size": 8 << 20, "max_attempts": 2}
    store_faults.fail_next("DELETE", ".ckptfmt-part-", status=503, count=6)  # each of 3 parts, both attempts
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        ckptfmt.save({"w": LARGE}, url, storage_options=options)
    store_faults.clear_rules()
    left = [r.getMessage() for r in caplog.records if "part object is left" in r.getMessage()]
    assert len(left) == 3 and all(".ckptfmt-part-" in m for m in left), left
    assert store_faults.uploads(url) == ["model.ckpt"]  # listed as an upload, by its target
    assert torch.equal(ckptfmt.load(url, storage_options=store_faults.options)["w"], LARGE)
