"""Encrypted runs: CheckpointManager(encrypt_with=key) encrypts every step's state file
(spec section 17), latest(), load, load_into and verify read with the key, a tiered run's
archive and a run on a store hold the encrypted bytes, and a wrong or missing key is a
DecryptionError, never data."""

from __future__ import annotations

import warnings

import pytest
import torch

import ckptfmt
from ckptfmt.cli import main

KEY = bytes(range(32))


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((2000,), float(step)), "step": step}


def test_an_encrypted_run_saves_resumes_and_verifies(tmp_path):
    m = ckptfmt.CheckpointManager(tmp_path / "run", keep_last=2, encrypt_with=KEY)
    for step in (1, 2, 3):
        m.save(step, _state(step))
    assert [c.step for c in m.checkpoints()] == [2, 3]
    assert m.latest().step == 3 and m.load()["step"] == 3
    target = {"w": torch.zeros(2000), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)  # no data position saved
        assert m.load_into(target).step == 3
    assert torch.equal(target["w"], torch.full((2000,), 3.0))
    assert m.verify().ok
    data = (tmp_path / "run" / "step-000000003" / "state.ckpt").read_bytes()
    assert torch.full((2000,), 3.0).numpy().tobytes()[:64] not in data  # no tensor bytes in clear
    with pytest.raises(ckptfmt.DecryptionError):
        ckptfmt.load(tmp_path / "run" / "step-000000003" / "state.ckpt")


def test_without_the_key_no_step_is_complete_and_a_wrong_key_is_refused(tmp_path):
    m = ckptfmt.CheckpointManager(tmp_path / "run", encrypt_with=KEY)
    m.save(1, _state(1))
    with pytest.warns(ckptfmt.CheckpointWarning):
        assert ckptfmt.CheckpointManager(tmp_path / "run").latest() is None
    wrong = ckptfmt.CheckpointManager(tmp_path / "run", decrypt_with=bytes(32))
    with pytest.warns(ckptfmt.CheckpointWarning, match="key"):
        assert wrong.latest() is None


def test_refused_combinations(tmp_path):
    with pytest.raises(ValueError, match="incremental"):
        ckptfmt.CheckpointManager(tmp_path / "a", encrypt_with=KEY, incremental=True)
    pytest.importorskip("cryptography")
    assert main(["keygen", str(tmp_path / "k")]) == 0
    with pytest.raises(ValueError, match="together"):
        ckptfmt.CheckpointManager(tmp_path / "b", encrypt_with=KEY, sign_with=tmp_path / "k")
    with pytest.raises(ValueError, match="callable that unwraps"):
        ckptfmt.CheckpointManager(tmp_path / "c", encrypt_with=lambda data_key: data_key)


def test_encrypted_tiers_and_store_runs(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    m = ckptfmt.CheckpointManager(
        tmp_path / "run", archive=f"s3://{bucket}/t", storage_options=options, encrypt_with=KEY
    )
    m.save(5, _state(5))
    m.wait()
    assert m.archive_failures() == {}
    fresh = ckptfmt.CheckpointManager(
        tmp_path / "node-2", archive=f"s3://{bucket}/t", storage_options=options, encrypt_with=KEY
    )
    assert fresh.load()["step"] == 5
    with pytest.raises(ckptfmt.DecryptionError):
        ckptfmt.load(f"s3://{bucket}/t/step-000000005/state.ckpt", storage_options=options)
    remote = ckptfmt.CheckpointManager(f"s3://{bucket}/r", storage_options=options, encrypt_with=KEY)
    remote.save(1, _state(1))
    assert remote.load()["step"] == 1 and remote.verify().ok
