"""Signed runs on an object store (spec 16.7 with 13.7): CheckpointManager("s3://...",
sign_with=, trusted_keys=) and a signed local run with an archive.  A reader trusting a key
reads a step only when that key signed its commit record, and hashes every object it reads
against the record (pinned to the version hashed) before any chunk is used: a changed byte is
a SignatureError before anything is returned, with load_into targets unchanged."""

from __future__ import annotations

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ed25519
from test_signing import pytestmark  # noqa: F401 (its skip)

import ckptfmt
from ckptfmt import CheckpointManager, CheckpointWarning, SignatureError
from ckptfmt.files import multifile
from ckptfmt.files.reader import CheckpointFile

KEY = ed25519.Ed25519PrivateKey.generate()
OTHER = ed25519.Ed25519PrivateKey.generate()
PUB = KEY.public_key()


def _state(step: int) -> dict[str, object]:
    return {"w": torch.arange(20000, dtype=torch.float32) * step, "step": step}


def _zeros() -> dict[str, object]:
    return {"w": torch.zeros(20000), "step": 0}


def _flip_object_byte(server, bucket: str, key: str, at: int = 100) -> None:
    """Change one byte of a chunk of an object, its prologue and footer (its identity in the
    commit record) kept: only the chunk checksum and the signed SHA-256 can see it."""
    client = server.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[at] ^= 0x40
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def _assert_refused(m: CheckpointManager, step: int) -> None:
    with pytest.raises(SignatureError):
        m.load(step)
    target = _zeros()
    with pytest.raises(SignatureError):
        m.load_into(target, step, restore_rng=False)
    assert not target["w"].any() and target["step"] == 0
    assert not m.verify(step).ok


def test_a_signed_run_on_the_store(s3_server, s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/signed"
    m = CheckpointManager(url, sign_with=KEY, storage_options=options)
    for step in (1, 2):
        m.save(step, _state(step))
    # the record is a signed file whose entries carry each object's SHA-256
    with CheckpointFile(f"{url}/step-000000002/COMMIT", trusted_keys=[PUB], storage_options=options) as f:
        record = multifile.record_from(f)
    assert record.files[0].sha256 is not None and len(record.files[0].sha256) == 32

    reader = CheckpointManager(url, trusted_keys=[PUB], storage_options=options)
    target = _zeros()
    assert reader.load_into(target, restore_rng=False).step == 2
    assert torch.equal(target["w"], _state(2)["w"]) and target["step"] == 2
    assert reader.verify().ok and reader.verify(1).ok

    # a newer step nobody trusted signed is skipped by latest() and refused by name
    CheckpointManager(url, storage_options=options).save(3, _state(3))
    with pytest.warns(CheckpointWarning, match="step-000000003.*not signed"):
        assert reader.latest().step == 2
    _assert_refused(reader, 3)

    # another key's reader trusts none of them
    stranger = CheckpointManager(url, trusted_keys=[OTHER.public_key()], storage_options=options)
    with pytest.warns(CheckpointWarning):
        assert stranger.latest() is None
    with pytest.raises(SignatureError):
        stranger.load(2)

    # a changed byte of a signed step's object: refused before any tensor is returned
    _flip_object_byte(s3_server, bucket, "signed/step-000000002/state.ckpt")
    _assert_refused(reader, 2)
    assert reader.load(1)["step"] == 1


def test_a_signed_local_run_archives_and_a_new_node_resumes_trusting_its_key(tmp_path, s3_server, s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/archive"
    m = CheckpointManager(
        tmp_path / "run", sign_with=KEY, archive=url, storage_options=options, blocking=False
    )
    for step in (1, 2):
        m.save(step, _state(step))
    m.wait()
    assert m.archive_failures() == {}

    node = CheckpointManager(tmp_path / "new-node", archive=url, trusted_keys=[PUB], storage_options=options)
    latest = node.latest()
    assert latest is not None and latest.step == 2 and latest.path.startswith("s3://")
    target = _zeros()
    assert node.load_into(target, restore_rng=False).step == 2
    assert torch.equal(target["w"], _state(2)["w"])
    assert node.verify(2).ok
    # the archive read as a run of its own, with the same checks
    assert CheckpointManager(url, trusted_keys=[PUB], storage_options=options).load()["step"] == 2

    _flip_object_byte(s3_server, bucket, "archive/step-000000002/state.ckpt")
    _assert_refused(node, 2)


def test_a_signed_encrypted_run_on_the_store(s3_bucket):
    """Both together: the state objects encrypted, the records signed over the ciphertext's
    digests; a reader needs the public key and the data key, and refuses without either."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/sealed"
    data_key = bytes(range(32))
    m = CheckpointManager(url, sign_with=KEY, encrypt_with=data_key, storage_options=options)
    m.save(1, _state(1))
    reader = CheckpointManager(url, trusted_keys=[PUB], decrypt_with=data_key, storage_options=options)
    target = _zeros()
    assert reader.load_into(target, restore_rng=False).step == 1
    assert torch.equal(target["w"], _state(1)["w"])
    assert reader.verify(1).ok
    with pytest.raises(ckptfmt.DecryptionError):
        CheckpointManager(url, trusted_keys=[PUB], storage_options=options).load(1)
    with pytest.raises(SignatureError):
        CheckpointManager(
            url, trusted_keys=[OTHER.public_key()], decrypt_with=data_key, storage_options=options
        ).load(1)


def test_a_changed_wrapped_key_on_the_store_is_a_signature_error(s3_server, s3_bucket):
    """A state object's wrapped data key changed (no checksum covers it, its identity in the
    record unchanged): the object is hashed against the signed record before it is opened with
    the key, so the reader says SignatureError, not the wrapped key's GCM failure."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/wrapped"
    data_key = bytes(range(32))
    CheckpointManager(url, sign_with=KEY, encrypt_with=data_key, storage_options=options).save(1, _state(1))
    key = next(
        o["Key"]
        for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]
        if o["Key"].endswith("/state.ckpt")
    )
    data = s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    ioff, ilen = (int.from_bytes(data[len(data) - 64 + i : len(data) - 56 + i], "little") for i in (0, 8))
    _flip_object_byte(s3_server, bucket, key, at=(ioff + ilen + 63) // 64 * 64 + 64)
    _assert_refused(
        CheckpointManager(url, trusted_keys=[PUB], decrypt_with=data_key, storage_options=options), 1
    )


def test_a_run_on_the_store_builds_its_record_options_once(s3_bucket, monkeypatch):
    """The commit records' options (the signer, the storage options) are checked once, when the
    manager is made, not again at every commit: each save signs with the signer built then."""
    from ckptfmt.files import save as writer

    made = []
    real = writer.signer
    # signers made with the run's key (the state objects themselves are not signed: sign_with=None)
    monkeypatch.setattr(writer, "signer", lambda key: (key is not None and made.append(key)) or real(key))
    bucket, options = s3_bucket
    url = f"s3://{bucket}/signed-once"
    m = CheckpointManager(url, sign_with=KEY, storage_options=options)
    built = len(made)
    for step in (1, 2, 3):
        m.save(step, _state(step))
    assert len(made) == built, "a commit built its save options again"
    reader = CheckpointManager(url, trusted_keys=[PUB], storage_options=options)
    assert reader.latest().step == 3 and reader.verify(3).ok
