"""The object-store guarantees on every store ckptfmt serves, one test body run on each: s3://
(moto), gs:// (fake-gcs-server) and az:// (Azurite), each emulator reached the way its cloud's
own tools reach it.  What one emulator cannot check is said where it matters."""

from __future__ import annotations

import datetime

import pytest
import torch
from helpers import assert_same

import ckptfmt
from ckptfmt import CheckpointManager
from ckptfmt.runs.objectrun import ObjectRun
from ckptfmt.storage import listing
from ckptfmt.storage.urls import parse_url

FROZEN = torch.randn(300_000, generator=torch.Generator().manual_seed(1))


def _state(step: int) -> dict[str, object]:
    return {"frozen": FROZEN, "head": torch.full((1000,), float(step)), "step": step}


def test_an_incremental_run_rotates_keeping_what_later_steps_read(store):
    root, options = store
    url = f"{root}/inc"
    m = CheckpointManager(url, incremental=True, keep_last=1, storage_options=options)
    for step in (1, 2, 3):
        m.save(step, _state(step))
    objects = listing.objects(parse_url(url, need_key=False), options)
    assert "step-000000001/state.ckpt" in objects and "step-000000001/COMMIT" not in objects
    assert objects["step-000000003/state.ckpt"][0] < FROZEN.nbytes // 8  # the changed chunks only
    assert not any(k.startswith("step-000000002/") for k in objects)
    fresh = CheckpointManager(url, incremental=True, storage_options=options)
    assert [c.step for c in fresh.checkpoints()] == [3]
    assert_same(_state(3), fresh.load())
    assert fresh.verify().ok


def test_a_signed_run_is_read_only_where_the_trusted_key_signed_it(store):
    ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
    key, other = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    root, options = store
    url = f"{root}/signed"
    m = CheckpointManager(url, incremental=True, sign_with=key, storage_options=options)
    m.save(1, _state(1))
    m.save(2, _state(2))
    reader = CheckpointManager(url, trusted_keys=[key.public_key()], storage_options=options)
    assert_same(_state(2), reader.load())
    stranger = CheckpointManager(url, trusted_keys=[other.public_key()], storage_options=options)
    with pytest.raises(ckptfmt.SignatureError):
        stranger.load(2)


def test_non_blocking_saves_commit_in_order_and_a_step_without_its_record_is_never_latest(store):
    root, options = store
    url = f"{root}/nb"
    m = CheckpointManager(url, blocking=False, storage_options=options)
    for step in (1, 2, 3):
        m.save(step, _state(step))
    m.wait()
    assert [c.step for c in m.checkpoints()] == [1, 2, 3]
    # a step without its record (a saver that died before its commit), and another program's
    # object beside it
    ckptfmt.save(_state(4), f"{url}/step-000000004/state.ckpt", storage_options=options)
    ckptfmt.save({"x": 1}, f"{url}/step-000000004/notes.bin", storage_options=options)
    fresh = CheckpointManager(url, storage_options=options)
    with pytest.warns(ckptfmt.CheckpointWarning, match="no commit record"):
        assert fresh.latest().step == 3
    ObjectRun(url, options).cleanup(older_than=datetime.timedelta(0))
    left = listing.objects(parse_url(url, need_key=False), options)
    assert "step-000000004/state.ckpt" not in left and "step-000000004/notes.bin" in left
