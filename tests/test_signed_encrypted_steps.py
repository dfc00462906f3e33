"""Signed encrypted multi-file checkpoints (spec/FORMAT.md 16.7 and 17.8): with trusted keys
the signed commit record, and every file's SHA-256 against it, are checked before any file is
read with the key, so a changed byte anywhere a signature covers is a SignatureError: never a
DecryptionError from a wrapped key or tag met first, nor a CorruptError from a structure.

Each case changes one bit of one file of a checkpoint (its commit record, its state or rank
file, or an earlier step's file an incremental step reads chunks from) and checks that load,
load_into (targets unchanged) and verify all refuse it with SignatureError (LimitError where
the bit makes a length exceed a reader's limit before anything can be hashed).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ed25519
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_signed_encryption import pytestmark  # noqa: F401 (its skip)

from ckptfmt import CheckpointManager, LimitError, SignatureError
from ckptfmt import dcp as cdcp
from ckptfmt.files import recordsign
from ckptfmt.runs.stepcheck import verify_step

KEY = bytes.fromhex("5f" * 32)
PRIV = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
PUB = PRIV.public_key()
REFUSED = (SignatureError, LimitError)
#: shared by both steps of the incremental run: step 2 reads it from step 1's file
FROZEN = torch.arange(1 << 15, dtype=torch.float32)


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((512,), float(step)), "frozen": FROZEN, "step": step}


def _zeros() -> dict[str, object]:
    return {"w": torch.zeros(512), "frozen": torch.zeros(1 << 15), "step": 0}


_BUILT: dict[str, str] = {}


def _pristine(tmp_path_factory: pytest.TempPathFactory, kind: str) -> str:
    """A signed encrypted checkpoint of `kind`, made once per session and copied per example."""
    if kind not in _BUILT:
        where = str(tmp_path_factory.mktemp(kind) / kind)
        if kind == "dcp":
            cdcp.save(_state(2), where, sign_with=PRIV, encrypt_with=KEY)
        else:
            m = CheckpointManager(where, sign_with=PRIV, encrypt_with=KEY, incremental=kind == "incremental")
            for step in (1, 2):
                m.save(step, _state(step))
            m.wait()
        _BUILT[kind] = where
    return _BUILT[kind]


def _files(kind: str) -> list[str]:
    """The files of the checkpoint (step 2 of a run) that a signature covers."""
    if kind == "dcp":
        return ["COMMIT", "rank-00000.ckpt"]
    step2 = ["step-000000002/COMMIT", "step-000000002/state.ckpt"]
    return step2 + (["step-000000001/state.ckpt"] if kind == "incremental" else [])


def _flip(path: str, bit: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(bit // 8)
        byte = fh.read(1)[0]
        fh.seek(bit // 8)
        fh.write(bytes([byte ^ (1 << (bit % 8))]))


def _tampered(tmp_path_factory: pytest.TempPathFactory, kind: str, data: st.DataObject) -> str:
    """A copy of the checkpoint with one bit of one signed file flipped (drawn)."""
    where = str(tmp_path_factory.mktemp("case") / kind)
    shutil.copytree(_pristine(tmp_path_factory, kind), where)
    name = data.draw(st.sampled_from(_files(kind)), label="file")
    size = os.path.getsize(os.path.join(where, name))
    _flip(os.path.join(where, name), data.draw(st.integers(0, 8 * size - 1), label="bit"))
    return where


def _assert_step_refused(run: str) -> None:
    m = CheckpointManager(run, trusted_keys=[PUB], decrypt_with=KEY)
    with pytest.raises(REFUSED):
        m.load(step=2)
    target = _zeros()
    with pytest.raises(REFUSED):
        m.load_into(target, step=2, restore_rng=False)
    assert not target["w"].any() and not target["frozen"].any()  # type: ignore[union-attr]
    try:
        report = m.verify(step=2)
    except REFUSED:
        return
    assert not report.ok and report.problems[0].kind in ("signature", "limit"), report.problems


@pytest.mark.parametrize("kind", ["run", "incremental"])
def test_pristine_steps_load(tmp_path_factory, kind):
    m = CheckpointManager(_pristine(tmp_path_factory, kind), trusted_keys=[PUB], decrypt_with=KEY)
    assert m.latest().step == 2 and m.verify(step=2).ok
    target = _zeros()
    m.load_into(target, step=2, restore_rng=False)
    assert torch.equal(target["frozen"], FROZEN) and target["step"] == 2  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("kind", ["run", "incremental"])
def test_any_flipped_bit_of_a_signed_encrypted_step_is_a_signature_error(tmp_path_factory, kind, data):
    _assert_step_refused(_tampered(tmp_path_factory, kind, data))


def test_a_changed_wrapped_key_is_a_signature_error(tmp_path_factory):
    """The case first met as a DecryptionError: the wrapped data key's nonce, which no checksum
    covers, changed in a state file (its identity in the record unchanged)."""
    run = str(tmp_path_factory.mktemp("wrapped") / "run")
    shutil.copytree(_pristine(tmp_path_factory, "run"), run)
    state = os.path.join(run, "step-000000002", "state.ckpt")
    with open(state, "rb") as fh:
        data = fh.read()
    footer = len(data) - 64
    ioff, ilen = (
        int.from_bytes(data[footer : footer + 8], "little"),
        int.from_bytes(data[footer + 8 : footer + 16], "little"),
    )
    _flip(state, 8 * ((ioff + ilen + 63) // 64 * 64 + 64))  # the encryption block's wrapped key
    _assert_step_refused(run)
    assert CheckpointManager(run, trusted_keys=[PUB], decrypt_with=KEY).latest().step == 1


def test_pristine_dcp_loads(tmp_path_factory):
    target = _zeros()
    cdcp.load(target, _pristine(tmp_path_factory, "dcp"), trusted_keys=[PUB], decrypt_with=KEY)
    assert torch.equal(target["frozen"], FROZEN) and target["step"] == 2  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_bit_of_a_signed_encrypted_dcp_save_is_a_signature_error(tmp_path_factory, data):
    path = _tampered(tmp_path_factory, "dcp", data)
    target = _zeros()
    with pytest.raises(REFUSED):
        cdcp.load(target, path, trusted_keys=[PUB], decrypt_with=KEY)
    assert not target["w"].any() and not target["frozen"].any()  # type: ignore[union-attr]
    report = verify_step(path, None, recordsign.public_keys([PUB]), KEY)  # ckptfmt verify DIR
    assert not report.ok and report.problems[0].kind in ("signature", "limit"), report.problems


def test_a_trusting_manager_never_deletes_a_step_whose_digest_fails(tmp_path_factory):
    """Reads refuse an older step whose state file changed (a SignatureError, the scan's), but
    a save's cleanup and rotation judge steps without signatures: the step stays on disk."""
    run = str(tmp_path_factory.mktemp("keep") / "run")
    shutil.copytree(_pristine(tmp_path_factory, "run"), run)
    state1 = os.path.join(run, "step-000000001", "state.ckpt")
    _flip(state1, 8 * 100)  # a chunk's byte: its identity in the record unchanged
    m = CheckpointManager(run, sign_with=PRIV, encrypt_with=KEY, trusted_keys=[PUB])
    with pytest.raises(SignatureError, match="SHA-256"):
        m.load(step=1)
    m.save(3, _state(3))
    m.wait()
    assert os.path.exists(state1) and m.latest().step == 3
    assert [c.step for c in m.checkpoints()] == [2, 3]
